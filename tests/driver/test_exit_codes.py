"""Exit codes by phase (issue 57 item 7): exit 2 ("nothing started") only for an input error found before
training began; the same kind of error raised by a worker mid-run (a RecipeError, a lost run folder) exits 1
with the line that says which checkpoint is kept; a refused run leaves no run folder behind. Before, a
worker's RunFolderInUse mid-run exited 2 as if nothing had started, though a checkpoint existed. The same
error from a real TRL run that has a checkpoint: tests/train/test_trl_resume_edges.py."""
from __future__ import annotations

import pytest


def _recipe(tmp_path):
    from raytune_ft.cli import _job_recipe

    return _job_recipe("qwen27b_b300", True, [f"tracking.storage_path={tmp_path / 'runs'}",
                                               "tracking.run_name=phases"])


def test_a_run_folder_the_lease_made_goes_when_given_back_empty(tmp_path):
    from raytune_ft.storage import fs as storage
    from raytune_ft.storage.lease import hold

    st = storage.resolve(str(tmp_path))
    hold(st, st.path("fresh")).release()
    assert not (tmp_path / "fresh").exists()          # made by the lease, nothing written: gone
    (tmp_path / "earlier").mkdir()
    hold(st, st.path("earlier")).release()
    assert (tmp_path / "earlier").is_dir()            # there before the lease: kept
    with hold(st, st.path("written")):
        (tmp_path / "written" / "checkpoint_1").mkdir()
    assert (tmp_path / "written" / "checkpoint_1").is_dir()    # something written: kept


class _WorkerFails:
    """A trainer whose fit raises what a Ray Train worker raised (the driver's `_fit` raises the worker's own
    error: launch.unfixable_error)."""

    def __init__(self, error: BaseException):
        self.error = error

    def fit(self):
        raise self.error


def test_an_input_error_exits_2_before_training_and_1_with_the_kept_checkpoint_once_a_worker_raises_it(tmp_path):
    from raytune_ft.driver.endings import ending_line
    from raytune_ft.driver.lifecycle import RunLifecycle
    from raytune_ft.recipe.values import RecipeError
    from raytune_ft.storage import fs as storage
    from raytune_ft.storage.lease import RunFolderInUse

    recipe = _recipe(tmp_path)
    with pytest.raises(RecipeError) as refused, RunLifecycle(recipe, local=True) as life:
        life.hold_folder(*storage.run_storage(recipe))
        raise RecipeError("data.source: refused by a check before Ray")
    assert ending_line(refused.value) is None
    assert not (tmp_path / "runs" / "phases").exists()      # a refused run leaves no folder behind

    lost = RunFolderInUse("run folder runs/phases is now held by job other, not by this job")
    with pytest.raises(RunFolderInUse) as stopped, RunLifecycle(recipe, local=True) as life:
        life.hold_folder(*storage.run_storage(recipe))
        life.fit(_WorkerFails(lost))
    assert ending_line(stopped.value) is not None          # the run had begun: its ending is said
    from raytune_ft.driver.endings import exit_lines

    assert exit_lines(refused.value) == (2, ["error: data.source: refused by a check before Ray"])
    code, lines = exit_lines(stopped.value)
    assert code == 1 and lines[0] == f"error: {lost}" and "Traceback" not in "\n".join(lines)
    assert lines[1].startswith("[raytune_ft] failed before the first step (RunFolderInUse: run folder")
    assert lines[1].endswith("no checkpoint was written; fix the cause and run the same command to start again")
    # an error of another kind keeps its trace above the line; one outside any run is raised as it is
    with pytest.raises(RuntimeError) as crashed, RunLifecycle(recipe, local=True) as life:
        life.hold_folder(*storage.run_storage(recipe))
        life.fit(_WorkerFails(RuntimeError("disk on fire")))
    code, lines = exit_lines(crashed.value)
    assert code == 1 and "Traceback" in lines[0] and "disk on fire" in lines[1]
    assert exit_lines(RuntimeError("outside")) is None


@pytest.mark.timeout(900)
def test_a_worker_finding_its_run_folder_taken_mid_run_exits_1_naming_the_kept_checkpoint(ray_local, tmp_path):
    """The real case: the TRL --local job killed after its step-2 checkpoint, its lease written as another job's
    meanwhile; the retry's worker finds the folder taken and stops the run (RunFolderInUse)."""
    from raytune_ft.driver.endings import exit_lines
    from tests.train.test_trl_resume_edges import COUNTED, EPOCH_STEPS, _recipe as trl_recipe, _run_with_fault

    result, error = _run_with_fault(trl_recipe(tmp_path, "taken", 1, *COUNTED), f"{EPOCH_STEPS}:0:saved",
                                    take_lease="1")
    assert result is None and type(error).__name__ == "RunFolderInUse", repr(error)
    code, lines = exit_lines(error)
    assert code == 1 and lines[0].startswith("error: run folder") and "is now held by job" in lines[0]
    assert lines[-1].startswith(f"[raytune_ft] failed at step {EPOCH_STEPS} (RunFolderInUse: ")
    assert lines[-1].endswith(f"the checkpoint at step {EPOCH_STEPS} is kept; fix the cause and run the same "
                              "command to resume")
