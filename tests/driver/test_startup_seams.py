"""The driver's start-up seams (issues 38, 53): the MLflow run id handed to rank 0 one way, a key-value write
that fails said at once, and the run's opening process gone however `run()` ends. Real MLflow (sqlite)
stores, real child processes."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from raytune_ft.cli import _job_recipe


def _recipe(tmp_path, *overrides):
    return _job_recipe("qwen27b_b300", True, [f"tracking.storage_path={tmp_path / 'runs'}", *overrides])


def _openers() -> list[psutil.Process]:
    """This process's children that open an MLflow run (run_opening.RunOpening's)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any("raytune_ft.tracking.opening" in part for part in child.cmdline()):
                out.append(child)
        except psutil.Error:
            pass
    return out


@pytest.fixture
def own_tempdir(tmp_path, monkeypatch):
    """tempfile's folder for the test alone, so that a file left behind is this test's."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.timeout(120)
def test_a_key_value_store_that_cannot_be_written_fails_the_handoff_at_once(tmp_path, own_tempdir):
    """Ray not started: the first write to its key-value store fails. The driver says so in one line at once,
    instead of rank 0 waiting for an id that never comes (await_run_id's 600 s)."""
    import ray

    from raytune_ft.tracking.opening import RunIdHandoff, RunIdHandoffError, RunOpening

    assert not ray.is_initialized()
    with RunOpening(_recipe(tmp_path)) as opening:
        t0 = time.time()
        with pytest.raises(RunIdHandoffError, match="could not hand the MLflow run id") as caught:
            RunIdHandoff(opening, "token-x")
        assert time.time() - t0 < 5 and "\n" not in str(caught.value)
        assert opening.result()          # the run opened all the same: the lifecycle ends it
    assert not _openers() and not list(own_tempdir.iterdir())


@pytest.mark.timeout(120)
def test_closing_an_opening_still_running_ends_its_process(tmp_path, own_tempdir):
    from raytune_ft.tracking.opening import RunOpening

    opening = RunOpening(_recipe(tmp_path))
    assert not opening.done() and len(_openers()) == 1
    opening.close(timeout=0)
    assert opening.done() and not _openers() and not list(own_tempdir.iterdir())
    with pytest.raises(RuntimeError, match="abandoned"):
        opening.result()


@pytest.mark.slow          # starts the opening process
@pytest.mark.timeout(300)
def test_a_run_failing_early_leaves_no_opening_process_or_file(tmp_path, own_tempdir, monkeypatch):
    """`run()` failing right after the MLflow run began to open (here Ray's start, made to fail: Ray cannot
    be made to fail to start for real in a test) leaves no opening process and no RUNNING run, and gives the
    run folder's lease back."""
    from raytune_ft.driver import start_ahead
    from raytune_ft.storage.lease import LEASE_FILE
    from raytune_ft.recipe.recipe import RecipeError
    from raytune_ft.driver.run import run

    def ray_does_not_start(local):
        raise RecipeError("Ray did not start")

    monkeypatch.setattr(start_ahead, "ensure_ray", ray_does_not_start)
    recipe = _recipe(tmp_path)
    with pytest.raises(RecipeError, match="Ray did not start"):
        run(recipe, local=True)
    assert not _openers()
    from mlflow import MlflowClient

    runs = MlflowClient(recipe.tracking_uri).search_runs(
        [e.experiment_id for e in MlflowClient(recipe.tracking_uri).search_experiments()])
    # the run the opener had opened ended FAILED (or none, where the opener was killed before it opened one)
    assert [r.info.status for r in runs] in ([], ["FAILED"])
    assert not os.path.exists(os.path.join(recipe.tracking.storage_path, recipe.tracking.run_name, LEASE_FILE))


def test_the_run_id_reaches_rank_0_one_way():
    """No environment variable carries the run id; run() builds its trainer with the handed-over key only."""
    import ast

    import raytune_ft

    root = Path(raytune_ft.__file__).parent
    assert not [p for p in root.rglob("*.py") if "RAYTUNE_MLFLOW_RUN_ID" in p.read_text()]
    tree = ast.parse((root / "driver" / "run.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "build_trainer"]
    assert len(calls) == 1 and {k.arg for k in calls[0].keywords} >= {"mlflow_run_key"}
    # no second path: no trainer built with an id, no worker reading one from its config or a module global
    import inspect

    from raytune_ft.train import common
    from raytune_ft.driver import launch

    assert "mlflow_run_id" not in inspect.signature(launch.build_trainer).parameters
    assert not hasattr(common, "mlflow_run_of") and not hasattr(common, "_run_key")
    assert "mlflow_run_id" not in (root / "driver" / "launch.py").read_text()
