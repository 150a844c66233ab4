"""Runs whose storage is object storage: tracking.storage_path=s3://... on the SeaweedFS S3 server on loopback
(tests/s3_server.py), real local Ray, the jobs' --local recipes; and a storage too small for the next checkpoint.

27B recipe (FSDP2, 2 workers, 10 steps, checkpoints at 4 and 8, final at 10, keep_checkpoints=2; no held-out
loss or samples, which other modules check):
1. rank 1 exits right after uploading its part of the final checkpoint, before reporting it, on every attempt
   (tests/faults.py exit_after_upload=10:1, max_failures=1): both attempts die in the checkpoint window, Ray
   restarting the worker group after the first. Every restart removes the folder the dead attempt left; a watcher
   listing the bucket all along never sees more than keep_checkpoints + 1 checkpoint folders. The first
   attempt's orphan holds the per-step losses of an uninterrupted run (every rank keeps the all-reduced
   history); the restarted attempt, resumed from step 8 off S3, must reproduce them.
2. The fault stops; the same job re-submitted finishes (resumes from step 8), exports, and its registration
   cannot run (registry.num_cpus=512: no node of this local Ray can take the task, which is killed after
   registry.timeout_s=2 and a 1 s grace): the summary prints a retry command naming the s3:// checkpoint.
3. That command, run as printed, registers version 1.
4. The finished run submitted again ends at once: no training, no new checkpoint, the same version returned.
Nothing of the run is written under the local storage default (./runs of the launch folder).

TRL 4B recipe (1 worker, two epochs of 2 steps, a checkpoint and an evaluation at the end of each: the setting of
tests/train/test_trl_resume_edges.py, whose other edges run on local storage): a straight reference, submitted again
once finished (nothing trained); then the same run with its worker SIGKILLing itself at the end of step 4
(tests/faults.py kill_at_step). Ray restarts it, it rebuilds the trainer from the epoch-boundary checkpoint of
step 2 read from S3 and trains epoch 2 exactly as the reference did: step 3, trained by both attempts, logs the
same loss twice; the evaluations, the best loss and the final weights are the reference's. Registration cannot
run either; the retry command works.

27B recipe with checkpoints written in the background (train.async_checkpoint=on), on S3 too: rank 1 exits in
the writer thread during the step-8 save, its files written locally but not uploaded, while the loop trains
on (exit_after_write, max_failures=1): the next attempt resumes from step 4, the last complete checkpoint, and
ends with the uninterrupted run's losses and data counters. Then rank 1's background save of step 4 raises
instead (fail_after_write, max_failures=0): the run stops with that error at the next step boundary, and
no checkpoint is registered.

A worker SIGKILLed from outside (no fault hook), its group restarted and resumed from S3: tests/driver/test_multinode.py,
on two nodes.

Small storage: the free-space probe is patched (tests/faults.py free_bytes, in the workers; no filesystem
of a few kB can be mounted portably here) to report 1000 bytes from step 8: the step-4 checkpoint is written,
the step-8 one is refused before anything is written, the run stops with an error naming the storage path,
the bytes needed and the bytes free, and the step-4 checkpoint is intact and still Ray's latest. Ray does not
retry it (max_failures=1 would allow one): a retry would train to the same save again. The TRL recipe on a
storage reporting 1000 bytes free stops at the start of its first attempt, before any step.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time

import pytest

from raytune_ft.storage import fs as storage
from raytune_ft.env import scoped_env
from tests.conftest import run_with_fault
from tests.faults import RUNTIME_ENV, fault_plan
from tests.train.test_fault_tolerance import STATE_TRACKING_ENV, STEPS, _assert_history_matches, run_attempts
from tests.train.test_trl_resume_edges import EPOCH_STEPS, EPOCH_TWO, _history, _weights

EVERY = 4
REL_TOL = 1e-5
# the post-fit registration task asks for more CPUs than this local Ray has: it never starts, and is given up
NO_ROOM_TO_REGISTER = ("registry.num_cpus=512", "registry.timeout_s=2")
# the 27B runs here check faults, storage and resume, not the held-out loss or the samples (tests/train/test_eval_samples.py,
# tests/driver/test_local_job.py): off, each attempt starts a few seconds sooner (no held-out pipeline, no generation)
NO_EVAL_OR_SAMPLES = ("train.eval_every=0", "train.sample_prompts=0")


def _recipe(job: str, storage_path: str, run_name: str, *sets: str):
    from raytune_ft.cli import _job_recipe

    plain = NO_EVAL_OR_SAMPLES if job == "qwen27b_b300" else ()
    return _job_recipe(job, True, [f"tracking.storage_path={storage_path}", f"tracking.run_name={run_name}", *plain,
                                   *sets])


class FolderWatcher(threading.Thread):
    """Lists the run folder on storage every 0.2 s: the most checkpoint folders seen at once, and rank 1's
    train state of every checkpoint folder that reached the final step (read as soon as it is there)."""

    def __init__(self, fs, run_path: str):
        super().__init__(daemon=True)
        self.fs, self.run_path = fs, run_path
        self.max_folders, self.seen = 0, set()
        self.final_states: dict[str, dict] = {}
        self.stop = threading.Event()
        self.error: str | None = None

    def run(self):
        while not self.stop.is_set():
            try:
                names = storage.checkpoint_dirs(self.fs, self.run_path)
                self.max_folders = max(self.max_folders, len(names))
                self.seen.update(names)
                for n in names:
                    if n not in self.final_states:
                        st = storage.read_json(self.fs, f"{self.run_path}/{n}/train_state/rank1.json")
                        if st and st.get("step") == STEPS:
                            self.final_states[n] = st
            except (OSError, ValueError) as e:   # a folder deleted while listed: look again
                self.error = f"{type(e).__name__}: {e}"
            time.sleep(0.2)


def _run_cli(cmd: str, env: dict, cwd) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    assert argv[:2] == ["raytune-ft", "register"], cmd
    script = os.path.join(os.path.dirname(sys.executable), "raytune-ft")
    argv = [script, *argv[1:]] if os.path.exists(script) else [sys.executable, "-m", "raytune_ft.cli", *argv[1:]]
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def _losses(summary) -> list[tuple[int, float]]:
    import mlflow

    history = mlflow.MlflowClient(summary.tracking_uri).get_metric_history(summary.mlflow_run_id, "train/loss")
    return sorted((m.step, m.value) for m in history)


@pytest.fixture(scope="module")
def s3_ray(s3_server, tmp_path_factory):
    """One local Ray for the module's runs, started with the S3 server's AWS_* variables in place (its
    workers and tasks reach S3 the way a node does) and Ray Train's state actor on (attempts and worker
    PIDs); the launch folder is a fresh one, where ./runs, the local default, would appear."""
    import ray

    from raytune_ft.registry import task as registry_task

    work = tmp_path_factory.mktemp("s3_launch")
    saved_grace, registry_task._KILL_GRACE_S = registry_task._KILL_GRACE_S, 1.0
    saved_cwd = os.getcwd()
    with scoped_env({**s3_server.env(), "RAYTUNE_TRACKING_HOME": str(work / "tracking_home"),
                     STATE_TRACKING_ENV: "1"}, keep=("RAYTUNE_LOCAL_STORAGE",)):
        os.environ.pop("RAYTUNE_LOCAL_STORAGE", None)
        os.chdir(work)
        ray.init(address="local", num_cpus=8, include_dashboard=False, runtime_env=RUNTIME_ENV)
        try:
            yield work
        finally:
            ray.shutdown()
            registry_task._KILL_GRACE_S = saved_grace
            os.chdir(saved_cwd)


@pytest.fixture(scope="module")
def s3_runs(s3_server, s3_ray):
    from raytune_ft.driver.run import run

    work = s3_ray
    bucket = s3_server.bucket()
    root = f"s3://{bucket}/runs"
    fs = s3_server.filesystem()
    out: dict = {"work": work, "root": root, "fs": fs, "bucket": bucket}
    # ---- 27B recipe
    r27 = _recipe("qwen27b_b300", root, "s3-27b", f"train.max_steps={STEPS}",
                  f"train.checkpoint_every={EVERY}", "scaling.max_failures=1", *NO_ROOM_TO_REGISTER,
                  "registry.name=main.default.s3_27b")
    out["r27"] = r27
    watcher = FolderWatcher(fs, f"{bucket}/runs/s3-27b")
    watcher.start()
    out["faulty_error"] = run_with_fault(r27, dict(exit_after_upload=f"{STEPS}:1"))   # every attempt dies
    out["after_faulty"] = storage.checkpoint_dirs(fs, f"{bucket}/runs/s3-27b")
    out["finished"] = run(r27, local=True)
    watcher.stop.set()
    watcher.join(timeout=10)
    out["watcher"] = watcher
    cmd = out["finished"].retry_command
    out["retry"] = _run_cli(cmd, dict(os.environ), work) if cmd else None
    out["folders_before_again"] = storage.checkpoint_dirs(fs, f"{bucket}/runs/s3-27b")
    out["losses_before_again"] = _losses(out["finished"])
    out["attempts_before_again"] = len(run_attempts("s3-27b"))
    out["again"] = run(r27, local=True)
    out["attempts_after_again"] = len(run_attempts("s3-27b"))
    out["folders_after_again"] = storage.checkpoint_dirs(fs, f"{bucket}/runs/s3-27b")

    # ---- TRL 4B recipe, two epochs: a straight reference, the same killed at the end of step 4 and resumed from
    # the epoch-boundary checkpoint on S3 (tests/train/test_trl_resume_edges.py's other edges run on local storage)
    out["r4_ref"] = _recipe("qwen3_4b_full", root, "s3-4b-ref", *EPOCH_TWO, "scaling.max_failures=0",
                            "registry.enabled=false")
    out["trl_ref"] = run(out["r4_ref"], local=True)
    out["trl_again"] = run(out["r4_ref"], local=True)      # the finished reference submitted again
    r4 = _recipe("qwen3_4b_full", root, "s3-4b", *EPOCH_TWO, "scaling.max_failures=1", *NO_ROOM_TO_REGISTER,
                 "registry.name=main.default.s3_4b")
    out["r4"] = r4
    with fault_plan(kill_at_step="4:0"):
        out["trl"] = run(r4, local=True)
        out["trl_ended"] = time.time()
    cmd = out["trl"].retry_command
    out["trl_retry"] = _run_cli(cmd, dict(os.environ), work) if cmd else None
    return out


@pytest.fixture(scope="module")
def s3_background(s3_runs):
    """The 27B recipe on S3 with background checkpoints: a worker dying during a background save, then a
    background save failing."""
    root = s3_runs["root"]
    out: dict = {}
    common = (f"train.max_steps={STEPS}", f"train.checkpoint_every={EVERY}", "registry.enabled=false",
              "train.async_checkpoint=on", "train.read_ahead=on")     # both GPU defaults; off on CPU
    out["background"] = _recipe("qwen27b_b300", root, "s3-background", "scaling.max_failures=1", *common)
    out["background_error"] = run_with_fault(out["background"], dict(exit_after_write="8:1"))
    out["failing"] = _recipe("qwen27b_b300", root, "s3-failing", "scaling.max_failures=0", *common)
    out["failing_error"] = run_with_fault(out["failing"], dict(fail_after_write=f"{EVERY}:1"))
    return out


@pytest.fixture(scope="module")
def small_storage(s3_ray):
    """Runs on a storage too small for a checkpoint (a local folder, the free-space probe patched), both with
    scaling.max_failures=1: the 27B recipe's step-8 checkpoint does not fit, the TRL recipe's first does not."""
    work = s3_ray
    out: dict = {}
    common = ("scaling.max_failures=1", "registry.enabled=false",
              f"tracking.tracking_uri=sqlite:///{work / 'small_mlflow.db'}")
    out["recipe"] = _recipe("qwen27b_b300", str(work / "small_storage"), "small", f"train.max_steps={STEPS}",
                            f"train.checkpoint_every={EVERY}", *common)
    out["error"] = run_with_fault(out["recipe"], dict(free_bytes="1000@8"))   # meant to stop
    out["attempts"] = len(run_attempts("small"))
    out["folders"] = storage.checkpoint_dirs(storage.resolve(out["recipe"].run_dir).fs, out["recipe"].run_dir)
    # re-submitted with a packing window under the recipe's first one (256 conversations), so that the first
    # blocks differ, and room enough: resuming from step 4 must not go on with other data
    out["changed"] = _recipe("qwen27b_b300", str(work / "small_storage"), "small", f"train.max_steps={STEPS}",
                             f"train.checkpoint_every={EVERY}", *common, "data.pack_window=16",
                             "scaling.max_failures=0")
    out["changed_error"] = run_with_fault(out["changed"], {})
    out["trl_recipe"] = _recipe("qwen3_4b_full", str(work / "small_storage"), "small-trl", "train.max_steps=8",
                                "train.checkpoint_every=4", "train.eval_every=4", "train.log_every=1", *common)
    t = time.time()
    out["trl_error"] = run_with_fault(out["trl_recipe"], dict(free_bytes="1000"))
    out["trl_s"] = time.time() - t
    out["trl_attempts"] = len(run_attempts("small-trl"))
    return out


@pytest.mark.timeout(1500)
def test_27b_on_s3_dies_in_checkpoint_window_every_attempt_storage_stays_bounded(s3_runs):
    err, w = s3_runs["faulty_error"], s3_runs["watcher"]
    assert err is not None, "every attempt was meant to die in the checkpoint window"
    keep = s3_runs["r27"].train.keep_checkpoints
    # three final-step folders were uploaded: two by the dying attempts, never reported, then the re-submit's
    # own, which is; each attempt removed the one the attempt before it left
    orphans = [n for n, st in w.final_states.items() if n not in s3_runs["folders_before_again"]]
    assert len(orphans) == 2, (sorted(w.final_states), s3_runs["folders_before_again"])
    # the second one was still there when the run failed, and went when the re-submit began
    assert sorted(orphans)[-1] in s3_runs["after_faulty"] and len(s3_runs["after_faulty"]) == keep + 1
    assert w.max_folders <= keep + 1, (w.max_folders, sorted(w.seen))
    # the first attempt's orphan is the uninterrupted reference; the restarted one resumed from step 8
    first, *restarted = sorted(orphans)
    assert restarted
    reference = w.final_states[first]
    assert "resumed_from" not in reference or reference["resumed_from"] == []
    for name in restarted:
        st = w.final_states[name]
        assert st["resumed_from"] == [8], st.get("resumed_from")
        _assert_history_matches(st["history"], reference["history"])


@pytest.mark.timeout(1500)
def test_27b_on_s3_finishes_once_the_fault_stops_exports_and_retry_registers(s3_runs):
    import mlflow

    s, fs = s3_runs["finished"], s3_runs["fs"]
    assert s.steps == STEPS and s.checkpoint.startswith(f"s3://{s3_runs['bucket']}/runs/s3-27b/checkpoint_")
    ckpt = s.checkpoint[len("s3://"):]
    ref = _reference(s3_runs)
    for rank in (0, 1):
        st = storage.read_json(fs, f"{ckpt}/train_state/rank{rank}.json")
        assert st["resumed_from"] == [8] and st["step"] == STEPS
        _assert_history_matches(st["history"], ref["history"])
    # rank 1 consumed exactly the blocks, and counted exactly the rows, of the uninterrupted run
    assert st["blocks_consumed"] == ref["blocks_consumed"] and st["counters"] == ref["counters"]
    # tokens/s of a resumed run: this attempt's tokens (steps 9-10) over its own seconds, not the run's tokens
    assert s.tokens > s.attempt_tokens > 0 and s.tokens >= st["tokens_total"]
    assert s.tokens_per_s == pytest.approx(s.attempt_tokens / s.attempt_seconds)
    assert s.tokens_per_s != pytest.approx(s.tokens / s.attempt_seconds)          # the old, inflated figure
    assert s.run_seconds > s.attempt_seconds                                       # the dead attempts' too
    assert s.run_tokens_per_s == pytest.approx(s.tokens / s.run_seconds)
    assert any("this attempt" in line for line in s.lines())
    # the re-submit reopened the job's MLflow run instead of starting another one
    client = mlflow.MlflowClient(s.tracking_uri)
    exp = client.get_experiment_by_name(s3_runs["r27"].tracking.experiment)
    found = client.search_runs([exp.experiment_id], filter_string="tags.`raytune.run_name` = 's3-27b'")
    assert len(found) == 1 and found[0].info.run_id == s.mlflow_run_id
    assert found[0].data.tags.get("raytune.resubmitted") == "true" and found[0].info.status == "FINISHED"
    assert storage.exists(fs, f"{ckpt}/hf/config.json") and storage.exists(fs, f"{ckpt}/dcp/.metadata")
    # the summary and plots are in the run folder on S3; MLflow's artifacts (the logged model) too
    summary = storage.read_json(fs, f"{s3_runs['bucket']}/runs/s3-27b/summary.json")
    assert summary["checkpoint"] == s.checkpoint
    assert s.plots and all(p.startswith("s3://") for p in s.plots)
    # registration timed out; the retry command names the checkpoint's URI, and it works as printed
    assert s.status == "trained_not_registered" and "within" in s.registration_error
    assert f"raytune-ft register {s.checkpoint} --name main.default.s3_27b" in s.retry_command
    done = s3_runs["retry"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "registered main.default.s3_27b version 1" in done.stdout
    client = mlflow.MlflowClient(s.tracking_uri)
    assert [str(v.version) for v in client.search_model_versions("name = 'main.default.s3_27b'")] == ["1"]
    arts = storage.list_files(fs, f"{s3_runs['bucket']}/runs/s3-27b/mlartifacts")
    assert any(i.path.endswith(".safetensors") for i in arts)
    # nothing under the local storage default, and the tracking store where the README says it is
    assert not (s3_runs["work"] / "runs").exists()
    assert s.tracking_uri.startswith(f"sqlite:///{s3_runs['work'] / 'tracking_home'}")
    assert storage.exists(fs, f"{s3_runs['bucket']}/runs/s3-27b/mlflow.db")   # its copy, in the run folder


@pytest.mark.timeout(1500)
def test_finished_fsdp_run_submitted_again_ends_at_once_with_one_version(s3_runs):
    import mlflow

    first, again = s3_runs["finished"], s3_runs["again"]
    assert again.checkpoint == first.checkpoint and again.steps == STEPS
    assert s3_runs["folders_after_again"] == s3_runs["folders_before_again"]      # nothing written
    assert again.status == "registered" and again.registered_version == "1"
    client = mlflow.MlflowClient(again.tracking_uri)
    assert [str(v.version) for v in client.search_model_versions("name = 'main.default.s3_27b'")] == ["1"]
    # the re-submit names the run's MLflow run, and trains no step: not one loss more there
    assert again.mlflow_run_id == first.mlflow_run_id
    assert _losses(again) == s3_runs["losses_before_again"]
    # and starts no Ray Train run: no attempt more (a time against the finished run's, which trained no step
    # either, only measured the machine's load: 28.1 s against 27.6 s at load 7)
    assert s3_runs["attempts_after_again"] == s3_runs["attempts_before_again"] > 0


@pytest.mark.timeout(1500)
def test_trl_4b_on_s3_killed_at_an_epoch_boundary_trains_the_next_epoch_exactly_and_registers_by_retry(s3_runs):
    """Killed at the end of step 4 (before its log and save), Ray restarts the worker, which rebuilds the trainer
    from the epoch-boundary checkpoint of step 2 read from S3 and must train epoch 2 exactly as the straight
    run did: step 3 is logged by both attempts with the same loss, the evaluations, the best loss and the final
    weights equal the reference's. Registration cannot run; the retry command works."""
    import mlflow
    import torch

    s, ref, fs = s3_runs["trl"], s3_runs["trl_ref"], s3_runs["fs"]
    assert ref.steps == s.steps == 2 * EPOCH_STEPS
    assert s.checkpoint.startswith(f"s3://{s3_runs['bucket']}/runs/s3-4b/checkpoint_")
    r4, r4_ref = s3_runs["r4"], s3_runs["r4_ref"]
    losses, ref_losses = _history(r4, s.mlflow_run_id, "train/loss"), _history(r4_ref, ref.mlflow_run_id, "train/loss")
    assert {k: len(v) for k, v in losses.items()} == {1: 1, 2: 1, 3: 2, 4: 1}
    for step, values in losses.items():
        for value in values:
            assert value == pytest.approx(ref_losses[step][0], rel=REL_TOL), (step, values, ref_losses[step])
    evals, ref_evals = _history(r4, s.mlflow_run_id, "eval_loss"), _history(r4_ref, ref.mlflow_run_id, "eval_loss")
    assert sorted(evals) == sorted(ref_evals) == [EPOCH_STEPS, 2 * EPOCH_STEPS]
    assert evals[2 * EPOCH_STEPS][-1] == pytest.approx(ref_evals[2 * EPOCH_STEPS][0], rel=REL_TOL)
    assert s.best_loss == pytest.approx(ref.best_loss, rel=REL_TOL)
    assert storage.read_json(fs, f"{s.checkpoint[len('s3://'):]}/train_state/rank0.json")["epoch"] == 1
    # Ray Train's controller noted when it asked for the restarted attempt's workers (launch.NoteWorkersAsked):
    # after the first attempt logged its first step, so the restart's workers count their set-up from then
    from raytune_ft.env import process_start
    from raytune_ft.train.job_attempts import workers_asked_at

    asked = workers_asked_at("s3-4b", process_start())       # an in-process job starts with this process
    history = mlflow.MlflowClient(s.tracking_uri).get_metric_history(s.mlflow_run_id, "train/loss")
    first_step = min(m.timestamp for m in history if m.step == 1) / 1000
    assert asked is not None and first_step < asked < s3_runs["trl_ended"], (asked, first_step)
    weights, ref_weights = (_weights(c[len("s3://"):], fs) for c in (s.checkpoint, ref.checkpoint))
    assert weights.keys() == ref_weights.keys() and weights
    for name in ref_weights:        # fp32 on CPU: within rounding
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=1e-5, atol=1e-6, msg=name)
    assert s.status == "trained_not_registered" and s.checkpoint in s.retry_command
    done = s3_runs["trl_retry"]
    assert done.returncode == 0, done.stderr[-3000:]
    client = mlflow.MlflowClient(s.tracking_uri)
    assert [str(v.version) for v in client.search_model_versions("name = 'main.default.s3_4b'")] == ["1"]
    assert not (s3_runs["work"] / "runs").exists()


@pytest.mark.timeout(1500)
def test_finished_trl_run_submitted_again_trains_nothing(s3_runs):
    """Its final checkpoint is the latest: the submission returns that checkpoint as the result (no second
    pass, no second MLflow run, no training loss added to its history)."""
    import mlflow

    ref, again = s3_runs["trl_ref"], s3_runs["trl_again"]
    # a run of one attempt: its tokens/s is the run's
    assert ref.attempt_tokens == ref.tokens > 0 and ref.tokens_per_s == pytest.approx(ref.tokens / ref.attempt_seconds)
    assert again.checkpoint == ref.checkpoint and again.steps == 2 * EPOCH_STEPS
    assert again.final_loss == pytest.approx(ref.final_loss)
    assert again.mlflow_run_id == ref.mlflow_run_id
    history = mlflow.MlflowClient(ref.tracking_uri).get_metric_history(ref.mlflow_run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 2 * EPOCH_STEPS + 1))


def _reference(s3_runs) -> dict:
    """Rank 1's train state of the uninterrupted run: the first orphan of the fault case (every rank keeps the
    whole loss history; rank 1 its own data counters)."""
    w = s3_runs["watcher"]
    return w.final_states[min(n for n in w.final_states if n not in s3_runs["folders_before_again"])]


@pytest.mark.timeout(1500)
def test_a_worker_dying_during_a_background_save_on_s3_resumes_from_the_last_complete_checkpoint(s3_runs,
                                                                                                s3_background):
    from raytune_ft.train.checkpoint import read_meta_at

    assert s3_background["background_error"] is None, repr(s3_background["background_error"])
    fs, run_path = s3_runs["fs"], f"{s3_runs['bucket']}/runs/s3-background"
    final = [n for n in storage.checkpoint_dirs(fs, run_path) if read_meta_at(fs, f"{run_path}/{n}").get("final")]
    assert len(final) == 1, storage.checkpoint_dirs(fs, run_path)
    ref = _reference(s3_runs)
    for rank in (0, 1):
        st = storage.read_json(fs, f"{run_path}/{final[0]}/train_state/rank{rank}.json")
        # the step-8 save never completed: the restart came from step 4's
        assert st["resumed_from"] == [EVERY], st.get("resumed_from")
        _assert_history_matches(st["history"], ref["history"])
        if rank == 1:
            assert st["blocks_consumed"] == ref["blocks_consumed"] and st["counters"] == ref["counters"]


@pytest.mark.timeout(1500)
def test_a_failed_background_save_on_s3_stops_the_run_and_registers_nothing(s3_runs, s3_background):
    err = s3_background["failing_error"]
    assert err is not None and "could not write the step-4 checkpoint" in str(err), repr(err)
    reported = storage.reported_checkpoints(s3_runs["fs"], f"{s3_runs['bucket']}/runs/s3-failing")
    assert reported is None or not reported.kept, reported


@pytest.mark.timeout(900)
def test_storage_too_small_for_the_next_checkpoint_stops_clearly_keeping_the_last_good_one(small_storage):
    err, rs = small_storage["error"], small_storage["recipe"]
    assert isinstance(err, storage.StorageFullError), repr(err)
    # no retry: a second attempt would only train to the same save again (max_failures=1 allowed one)
    assert small_storage["attempts"] == 1
    msg = str(err)
    assert f"storage {rs.tracking.storage_path}/small is full" in msg, msg
    assert "1,000 bytes" in msg and f"{err.needed:,} bytes" in msg and err.needed > 1000
    assert "last good checkpoint is kept" in msg
    run_path = os.path.join(rs.tracking.storage_path, "small")
    fs = storage.resolve(run_path).fs
    reported = storage.reported_checkpoints(fs, run_path)
    assert reported is not None and reported.latest is not None
    latest = os.path.join(run_path, reported.latest)
    with open(os.path.join(latest, "raytune_meta.json")) as f:
        assert json.load(f)["step"] == 4
    assert os.path.isfile(os.path.join(latest, "dcp", ".metadata"))
    assert small_storage["folders"] == [reported.latest]        # nothing half-written beside it


@pytest.mark.timeout(900)
def test_a_resubmit_whose_data_lays_out_other_blocks_stops_instead_of_resuming(small_storage):
    """The stopped run (its latest checkpoint at step 4) re-submitted with a smaller packing window: the blocks
    replayed on resume are not those the checkpoint trained on, and the run stops saying so. (The fingerprint
    compares the blocks themselves, not the settings: a window that lays out the same first blocks resumes.)"""
    err = small_storage["changed_error"]
    assert err is not None and "fingerprint mismatch" in str(err), repr(err)
    rs = small_storage["changed"]
    fs = storage.resolve(rs.run_dir).fs
    reported = storage.reported_checkpoints(fs, rs.run_dir)
    assert reported.latest == small_storage["folders"][-1]          # the step-4 checkpoint is still the latest


@pytest.mark.timeout(900)
def test_trl_run_that_cannot_save_its_first_checkpoint_stops_before_training(small_storage):
    import mlflow

    err, rs = small_storage["trl_error"], small_storage["trl_recipe"]
    assert isinstance(err, storage.StorageFullError), repr(err)
    msg = str(err)
    assert f"storage {rs.tracking.storage_path}/small-trl is full" in msg and "1,000 bytes" in msg, msg
    assert "the step-4 checkpoint" in msg and "last good checkpoint is kept" in msg
    assert small_storage["trl_attempts"] == 1
    # refused at the start of the attempt: no step trained, nothing written
    client = mlflow.MlflowClient(rs.tracking_uri)
    exp = client.get_experiment_by_name(rs.tracking.experiment)
    found = client.search_runs([exp.experiment_id], filter_string="tags.`raytune.run_name` = 'small-trl'")
    assert len(found) == 1 and found[0].info.status == "FAILED"
    assert "is full" in found[0].data.tags["raytune.error"]
    assert client.get_metric_history(found[0].info.run_id, "train/loss") == []
    run_path = os.path.join(rs.tracking.storage_path, "small-trl")
    assert storage.checkpoint_dirs(storage.resolve(run_path).fs, run_path) == []
