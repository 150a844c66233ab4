"""How a run that does not finish ends (issue 37): its MLflow run closed as FAILED or KILLED with a one-line
reason, the run folder's lease given back, one line saying where it stopped and how to resume; a finished run
re-submitted answers from its folder without Ray. Real MLflow (sqlite) stores and run folders throughout."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
from mlflow import MlflowClient

from raytune_ft.cli import _job_recipe
from raytune_ft.driver.endings import Stopped, ending_line, exit_code, sigterm_raises
from raytune_ft.storage.lease import LEASE_FILE
from raytune_ft.recipe.recipe import RecipeError
from raytune_ft.tracking.mlflow_run import FINAL_CHECKPOINT_TAG, RunEnd, end_run, start_run


def _recipe(tmp_path, *overrides):
    return _job_recipe("qwen27b_b300", True, [f"tracking.storage_path={tmp_path / 'runs'}", *overrides])


def _run_folder(recipe):
    return os.path.join(recipe.tracking.storage_path, recipe.tracking.run_name)


def test_unreachable_hub_stops_in_one_line_before_ray_and_gives_the_lease_back(tmp_path, monkeypatch):
    import ray

    from raytune_ft.driver.run import run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("RAYTUNE_HF_ROOT", raising=False)
    recipe = _recipe(tmp_path, "data.source=hf://HuggingFaceH4/ultrachat_200k")
    t0 = time.time()
    with pytest.raises(RecipeError, match="HF_HUB_OFFLINE") as caught:
        run(recipe, local=True)
    assert time.time() - t0 < 30 and "\n" not in str(caught.value)
    assert not ray.is_initialized()
    assert not os.path.exists(os.path.join(_run_folder(recipe), LEASE_FILE))
    assert not os.path.exists(recipe.tracking_uri[len("sqlite:///"):])     # no MLflow run left RUNNING


def test_gpu_recipe_on_a_machine_without_gpus_stops_in_one_line(tmp_path, monkeypatch):
    import ray

    from raytune_ft.driver.run import run

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")     # this machine's GPUs, if any, hidden from the run
    recipe = _recipe(tmp_path, "scaling.use_gpu=true", "scaling.backend=auto")
    with pytest.raises(RecipeError, match="GPU workers and this machine has 0 GPUs"):
        run(recipe)
    assert not ray.is_initialized()
    assert not os.path.exists(os.path.join(_run_folder(recipe), LEASE_FILE))


def test_cluster_without_the_cpus_the_run_needs_stops_instead_of_hanging(tmp_path):
    from raytune_ft.driver.preflight import check_resources

    recipe = _recipe(tmp_path)          # the --local job: 2 workers of 1 CPU, Ray Data's tasks beside them
    with pytest.raises(RecipeError, match="needs 2.75 CPUs at once .* has 2"):
        check_resources(recipe, {"CPU": 2.0}, "the Ray cluster it joined")
    # the README's CPU form for a 2-CPU head fits
    check_resources(_recipe(tmp_path, "scaling.cpus_per_worker=0.5"), {"CPU": 2.0}, "the Ray cluster it joined")


def test_preflight_counts_the_tokenizing_processes_as_launch_does(tmp_path):
    from raytune_ft.driver.preflight import tokenize_processes as ours
    from raytune_ft.driver.launch import tokenize_processes

    for extra in ([], ["data.tokenize_workers=5"], ["scaling.num_workers=1"]):
        recipe = _recipe(tmp_path, *extra)
        assert ours(recipe) == tokenize_processes(recipe)


def test_a_run_folder_in_rays_package_copy_is_refused(tmp_path):
    from raytune_ft.driver.run import run

    pkg = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    pkg.mkdir(parents=True)
    recipe = _recipe(tmp_path, f"tracking.storage_path={pkg / 'runs'}")
    with pytest.raises(RecipeError, match="tracking.storage_path: .* Ray's temporary copy"):
        run(recipe, local=True)
    assert not (pkg / "runs").exists()


def test_sigterm_raises_stopped_and_exits_143():
    with sigterm_raises(), pytest.raises(Stopped) as caught:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert exit_code(caught.value) == 143 and exit_code(KeyboardInterrupt()) == 130
    assert signal.getsignal(signal.SIGTERM) is not None and exit_code(RuntimeError()) == 1


@pytest.mark.parametrize("exc, status, ended_by, line", [
    (Stopped(signal.SIGTERM), "KILLED", "interrupt",
     "interrupted at step 7; the checkpoint at step 5 is kept; run the same command to resume"),
    (KeyboardInterrupt(), "KILLED", "interrupt",
     "interrupted at step 7; the checkpoint at step 5 is kept; run the same command to resume"),
    (RuntimeError("disk\non fire"), "FAILED", "RuntimeError",
     "failed at step 7 (RuntimeError: disk on fire); the checkpoint at step 5 is kept; fix the cause and run the "
     "same command to resume"),
])
def test_an_ending_says_how_the_run_ended_and_how_to_resume(exc, status, ended_by, line):
    """Ctrl-C and `ray job stop` (SIGTERM) are the user's choice: one line, "interrupted", KILLED with
    raytune.ended_by=interrupt; an error is FAILED with its type and says to fix the cause."""
    from raytune_ft.driver.endings import ending_text, mlflow_ending

    got_status, tags = mlflow_ending(exc)
    assert (got_status, tags["raytune.ended_by"]) == (status, ended_by) and "\n" not in tags["raytune.error"]
    assert ending_text(exc, 7, 5) == line


@pytest.mark.slow          # an opener process
@pytest.mark.timeout(120)
def test_an_ending_closes_the_run_with_its_reason_through_the_opener(tmp_path):
    """The lifecycle's ending on a real opener process and run folder: the MLflow run KILLED with its reason,
    the line from the run's last logged step and the folder's latest checkpoint, the lease given back; the
    run resumed and finished carries nothing of the ending."""
    from raytune_ft.storage import fs as storage
    from raytune_ft.driver.lifecycle import RunLifecycle

    recipe = _recipe(tmp_path)
    folder = _run_folder(recipe)
    # what Ray Train's checkpoint manager records in a run folder: the latest checkpoint and its metrics
    os.makedirs(os.path.join(folder, "checkpoint_1"), exist_ok=True)
    with open(os.path.join(folder, storage.SNAPSHOT_FILE), "w") as f:
        json.dump({"checkpoint_results": [], "latest_checkpoint_result": {
            "checkpoint_dir_name": "checkpoint_1", "metrics": {"step": 5}}}, f)
    client = MlflowClient(recipe.tracking_uri)
    with pytest.raises(Stopped) as caught, RunLifecycle(recipe, local=True) as life:
        life.hold_folder(storage.for_recipe(recipe), folder)
        life.open_run()
        run_id = life.run_id()
        client.log_metric(run_id, "train/loss", 1.0, step=7)
        raise Stopped(signal.SIGTERM)
    assert ending_line(caught.value) == ("interrupted at step 7; the checkpoint at step 5 is kept; "
                                         "run the same command to resume")
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["raytune.ended_by"] == "interrupt"
    assert not os.path.exists(os.path.join(folder, LEASE_FILE))
    # the run resumed and finished: nothing of the ending stays on it
    end_run(recipe, start_run(recipe), RunEnd(tags={"raytune.status": "trained"}))
    assert "raytune.error" not in client.get_run(run_id).data.tags
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_finished_run_resubmitted_answers_without_ray_and_leaves_its_mlflow_run_alone(tmp_path, capsys):
    import ray

    from raytune_ft.driver.run import run

    recipe = _recipe(tmp_path)
    run_id = start_run(recipe)
    client = MlflowClient(recipe.tracking_uri)
    client.log_metric(run_id, "train/loss", 0.5, step=20)
    end_run(recipe, run_id, RunEnd(tags={"raytune.status": "registered", "raytune.checkpoint": "/x/checkpoint_2",
                                         FINAL_CHECKPOINT_TAG: "true"}, metrics={"final_loss": 0.5}))
    before = client.get_run(run_id)
    # what run() writes at the end of a run it trained and registered
    summary = {"job": recipe.job, "run_name": recipe.tracking.run_name, "status": "registered", "steps": 20,
               "checkpoint": "/x/checkpoint_2", "registered_name": recipe.registry.name, "registered_version": "1",
               "mlflow_run_id": run_id, "tracking_uri": recipe.tracking_uri, "final_loss": 0.5}
    with open(os.path.join(_run_folder(recipe), "summary.json"), "w") as f:
        json.dump(summary, f)
    t0 = time.time()
    got = run(recipe, local=True)
    assert time.time() - t0 < 10
    assert not ray.is_initialized()
    assert (got.status, got.steps, got.registered_version, got.mlflow_run_id) == ("registered", 20, "1", run_id)
    after = client.get_run(run_id)
    assert (after.info.status, after.info.end_time, after.data.metrics) == ("FINISHED", before.info.end_time,
                                                                            before.data.metrics)
    assert "nothing is trained" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(_run_folder(recipe), LEASE_FILE))


def test_attempts_sharing_a_first_step_log_their_start_up_under_names_of_their_own(tmp_path):
    """Two attempts with the same first step (a re-run killed before its first checkpoint: both start at step
    1; two jobs resuming one checkpoint: both at step 11, each its job's attempt 1) used to log the same
    startup.* names: MLflow refused the second batch and the run's breakdown read the older attempt. Each
    WorkerLog names its attempt; a real store takes every attempt's, and the breakdown reads the latest."""
    import io

    import torch

    from raytune_ft.train.common import WorkerLog
    from raytune_ft.train.startup_clock import JobStart
    from mlflow.entities import Param

    from raytune_ft.tracking.mlflow_run import startup_from_params, startup_params

    recipe = _recipe(tmp_path)
    run_id = start_run(recipe)
    client = MlflowClient(recipe.tracking_uri)
    logged = []
    for first_step in (1, 1, 11, 11):     # each: a job's first attempt (the same job_start label)
        # what rank 0's first_step_done logs (its MLflow sender's process is left out: a second each)
        log = WorkerLog(0, recipe, None, stream=io.StringIO(), job=JobStart(time.time() - first_step))
        logged.append(log.first_step_done(first_step, torch.device("cpu")))
        client.log_batch(run_id, params=[Param(k, v) for k, v in startup_params(logged[-1], log.attempt_id).items()])
        time.sleep(0.01)                  # attempts start at least a millisecond apart
    params = client.get_run(run_id).data.params
    assert len({k for k in params if k.startswith("startup.") and k.endswith(".total_s")}) == 4, params
    assert startup_from_params(params)["total_s"] == pytest.approx(logged[-1]["startup/total_s"], abs=1e-3)
