"""The MLflow run of a job against a real sqlite tracking store: a finished run re-submitted is never given a
second, empty run; re-submitted with other training settings it stops naming them."""
from __future__ import annotations

import pytest
from mlflow import MlflowClient

from raytune_ft.cli import _job_recipe
from raytune_ft.recipe.recipe import RecipeError
from raytune_ft.tracking.mlflow_run import RunEnd, end_run, start_run


def _recipe(tmp_path, *overrides):
    return _job_recipe("qwen27b_b300", True, [f"tracking.storage_path={tmp_path / 'runs'}", *overrides])


def _finished(tmp_path) -> tuple[str, MlflowClient]:
    recipe = _recipe(tmp_path)
    run_id = start_run(recipe)
    end_run(recipe, run_id, RunEnd(tags={"raytune.status": "registered", "raytune.checkpoint": "/runs/x/checkpoint_1"}))
    return run_id, MlflowClient(recipe.tracking_uri)


def _runs(client: MlflowClient):
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_resubmitting_a_finished_run_reuses_its_mlflow_run(tmp_path, capsys):
    run_id, client = _finished(tmp_path)
    assert start_run(_recipe(tmp_path)) == run_id
    assert [r.info.run_id for r in _runs(client)] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"          # not reopened as if it trained again
    assert f"finished already (MLflow run {run_id})" in capsys.readouterr().out


def test_finished_run_with_other_training_settings_stops_naming_them(tmp_path):
    run_id, client = _finished(tmp_path)
    with pytest.raises(RecipeError, match=r"train\.max_steps") as caught:
        start_run(_recipe(tmp_path, "train.max_steps=7"))
    assert run_id in str(caught.value) and "tracking.run_name" in str(caught.value)
    assert [r.info.run_id for r in _runs(client)] == [run_id]


def test_finished_run_with_another_registry_name_says_which_weights_it_registers(tmp_path, capsys):
    run_id, client = _finished(tmp_path)
    assert start_run(_recipe(tmp_path, "registry.name=main.default.renamed")) == run_id
    said = capsys.readouterr().out
    assert "/runs/x/checkpoint_1" in said and "main.default.renamed" in said and "nothing is trained" in said
    assert [r.info.run_id for r in _runs(client)] == [run_id]


def test_the_driver_opens_the_run_in_a_process_of_its_own_with_start_runs_answers(tmp_path, capfd):
    """RunOpening: the run id start_run would give, its errors as the same exceptions, and no MLflow in the
    driver's process (a fresh Python that opens a run has not imported it: the GIL stays with the driver)."""
    import json
    import subprocess
    import sys

    from raytune_ft.tracking.opening import RunOpening
    from raytune_ft.tracking.mlflow_run import FinishedRunError

    run_id, client = _finished(tmp_path)
    with RunOpening(_recipe(tmp_path)) as opening:
        assert opening.result() == run_id                              # the finished run's own id, as start_run
    assert f"finished already (MLflow run {run_id})" in capfd.readouterr().out   # its note, on the console
    with RunOpening(_recipe(tmp_path, "train.max_steps=7")) as opening:
        assert isinstance(opening.exception(), FinishedRunError)
        with pytest.raises(FinishedRunError, match=r"train\.max_steps") as caught:
            opening.result()
    assert run_id in str(caught.value)
    assert [r.info.run_id for r in _runs(client)] == [run_id]

    code = ("import json, sys; from raytune_ft.cli import _job_recipe; from raytune_ft.tracking.opening import RunOpening; "
            f"r = _job_recipe('qwen27b_b300', True, ['tracking.storage_path={tmp_path / 'fresh'}']); "
            "o = RunOpening(r); rid = o.result(); o.close(); print(json.dumps([rid, 'mlflow' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rid, driver_imported_mlflow = json.loads(out.stdout.strip().splitlines()[-1])
    assert not driver_imported_mlflow
    fresh = _recipe(tmp_path / "x", f"tracking.storage_path={tmp_path / 'fresh'}")
    assert MlflowClient(fresh.tracking_uri).get_run(rid).info.status == "RUNNING"


@pytest.mark.timeout(240)
def test_a_run_still_opening_reaches_rank_0_through_rays_key_value_store(tmp_path, ray_local):
    """RunIdHandoff: the driver starts the trainer while the run opens; rank 0 (here a task in a Ray worker
    process) waits for the id the driver's RunOpening gets; the words of a run that did not open (a finished
    run re-submitted with other settings) stop rank 0; the key goes at the end."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_get

    from raytune_ft.tracking.opening import RUN_KEY_NAMESPACE, RunIdHandoff, RunNotOpened, RunOpening, await_run_id

    @ray.remote(num_cpus=0.1, max_retries=0)
    def rank_0(key):
        return await_run_id(key)

    with RunOpening(_recipe(tmp_path / "a")) as opening, RunIdHandoff(opening, "token-a") as handoff:
        assert ray.get(rank_0.remote(handoff.key), timeout=120) == opening.result()
        key = handoff.key
    assert _internal_kv_get(key, namespace=RUN_KEY_NAMESPACE) is None

    _finished(tmp_path / "b")
    with RunOpening(_recipe(tmp_path / "b", "train.max_steps=7")) as refused, \
            RunIdHandoff(refused, "token-b") as handoff:
        with pytest.raises(RunNotOpened, match=r"did not open: .*train\.max_steps"):
            ray.get(rank_0.remote(handoff.key), timeout=120)


def test_the_data_params_are_logged_as_the_run_ends_and_a_refused_one_does_not_keep_it_running(tmp_path, capsys):
    """The data's params (data/report.data_params) travel with the run's ending (RunLifecycle.finish), no longer in
    a call of their own after it. MLflow refuses a param logged before with another value: the run is ended
    all the same, and the refusal said."""
    recipe = _recipe(tmp_path)
    client = MlflowClient(recipe.tracking_uri)
    run_id = start_run(recipe)
    end_run(recipe, run_id, RunEnd(params={"data.held_out": "5% of a.jsonl", "data.sources.0.rows_read": "16"}))
    assert client.get_run(run_id).data.params["data.held_out"] == "5% of a.jsonl"

    second = _recipe(tmp_path, "tracking.run_name=other")
    client = MlflowClient(second.tracking_uri)
    other = start_run(second)
    client.log_param(other, "data.held_out", "before")
    end_run(second, other, RunEnd(params={"data.held_out": "after"}))
    run = client.get_run(other)
    assert run.info.status == "FINISHED" and run.data.params["data.held_out"] == "before"
    assert "could not log 1 params to MLflow" in capsys.readouterr().out
