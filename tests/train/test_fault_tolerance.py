"""Fault tolerance of the 27B recipe's --local job on a real local Ray: the errors a retry cannot fix, and a
second job on a live run folder; the helpers the fault scenarios share (a worker killed from outside by
PID, the attempts Ray's state actor records, the per-step loss comparison).

The worker-death scenarios themselves run once, on object storage, in tests/driver/test_s3_runs.py (a rank dying
in the checkpoint window on every attempt, the re-submit that resumes from the last registered checkpoint,
a worker SIGKILLed from outside, a worker dying during a background save, a background save failing):
what they check does not depend on where the run folder is, and S3 is the harder storage.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time

import pytest

from raytune_ft.storage import fs as storage
from tests.conftest import REPO

STEPS, EVERY = 10, 4
SNAPSHOT = "checkpoint_manager_snapshot.json"
REL_TOL = 1e-5
STATE_TRACKING_ENV = "RAY_TRAIN_ENABLE_STATE_TRACKING"


def _job():
    spec = importlib.util.spec_from_file_location("job27b_ft", REPO / "jobs" / "qwen27b_b300.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def _recipe(storage, run_name: str, max_failures: int, *sets: str):
    from raytune_ft.cli import resolve

    job = _job()
    return resolve(job.recipe, job.local, local=True, overrides=[
        f"tracking.storage_path={storage}", f"tracking.run_name={run_name}",
        f"train.max_steps={STEPS}", f"train.checkpoint_every={EVERY}",
        f"scaling.max_failures={max_failures}", "registry.enabled=false", *sets])


def run_attempts(run_name: str) -> list:
    """Every attempt of the Ray Train runs named `run_name` in this Ray, as Ray's state actor records them
    (on when RAY_TRAIN_ENABLE_STATE_TRACKING=1 before Ray starts)."""
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    if actor is None:
        return []
    run_ids = [r.id for r in ray.get(actor.get_train_runs.remote()).values() if r.name == run_name]
    attempts = ray.get(actor.get_train_run_attempts.remote())
    return [a for rid in run_ids for a in attempts.get(rid, {}).values()]


def worker_pids(run_name: str) -> dict[int, int]:
    """{world rank: pid} of the running attempt of the Ray Train run `run_name`."""
    running = [a for a in run_attempts(run_name) if a.end_time_ns is None and a.workers]
    latest = max(running, key=lambda a: a.start_time_ns, default=None)
    return {w.world_rank: w.pid for w in latest.workers} if latest else {}


class RankKiller(threading.Thread):
    """SIGKILLs the training worker of `rank` once `run_dir` has a registered checkpoint.

    `pick_rank`, when given, is called to choose the rank at kill time (e.g. the one on a node); `fs`: the
    filesystem `run_dir` is on (default local; an S3 one for a run on object storage); `when`, when given,
    is asked once a checkpoint is registered, and the kill waits until it says yes.
    """

    def __init__(self, run_dir: str, run_name: str, rank: int = 1, timeout_s: float = 600, pick_rank=None,
                 fs=None, when=None):
        import pyarrow.fs as pafs

        super().__init__(daemon=True)
        self.run_dir, self.run_name, self.rank, self.timeout_s = str(run_dir), run_name, rank, timeout_s
        self.pick_rank, self.when = pick_rank, when
        self.fs = fs or pafs.LocalFileSystem()
        self.killed_pid: int | None = None
        self.cmdline: str = ""
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self):
        import psutil

        deadline = time.time() + self.timeout_s
        try:
            # Find the worker while the run starts (the state actor can be slow on a busy host),
            # then kill it the moment Ray registers the first checkpoint: Ray writes the snapshot
            # only then, once every rank has reported.
            pid = None
            while not (pid and storage.exists(self.fs, f"{self.run_dir}/{SNAPSHOT}")
                       and (self.when is None or self.when())):
                if self.stop.is_set() or time.time() > deadline:
                    self.error = (f"no checkpoint registered, no worker of rank {self.rank} found"
                                  f"{'' if self.when is None else ', or the kill condition never held'}")
                    return
                if not pid:
                    if self.pick_rank is not None:
                        self.rank = self.pick_rank()
                    pid = worker_pids(self.run_name).get(self.rank)
                time.sleep(0.02 if pid else 0.2)
            proc = psutil.Process(pid)
            self.cmdline = " ".join(proc.cmdline())
            if "RayTrainWorker" not in self.cmdline:
                self.error = f"pid {pid} is not a RayTrainWorker: {self.cmdline!r}"
                return
            proc.send_signal(signal.SIGKILL)
            self.killed_pid = pid
        except Exception as e:  # reported by the test
            self.error = f"{type(e).__name__}: {e}"


def _assert_history_matches(history: list[dict], reference: list[dict]) -> None:
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["step"] for h in reference] == list(range(1, STEPS + 1))
    for h, r in zip(history, reference):
        assert h["loss"] == pytest.approx(r["loss"], rel=REL_TOL), (h, r)
        assert h["lr"] == pytest.approx(r["lr"], rel=1e-12), (h, r)


def _unfixable_errors():
    from raytune_ft.models.kernel_check import KernelCheckError
    from raytune_ft.recipe.recipe import RecipeError
    from raytune_ft.train.batch import DataOrderChanged

    return [storage.StorageFullError("/mnt/runs/r", 4000, 10), RecipeError("train.lr: must be > 0"),
            DataOrderChanged("block 3 differs"), KernelCheckError("train.kernels=strict: fla failed"),
            storage.FileTooLargeError("s3://b/r", "the step-4 checkpoint", "S3 takes at most 5 GB", "EntityTooLarge")]


@pytest.mark.parametrize("index", range(5))
def test_an_error_a_retry_cannot_fix_is_raised_at_once_other_errors_are_retried(index):
    """Ray Train's own failure policy classes and error wrapping, as the controller sees a worker's error
    (pickled across processes); no Ray is started: the policy is a plain object."""
    import pickle

    import ray.train
    from ray.exceptions import RayActorError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from raytune_ft.driver.launch import RaiseUnfixable, unfixable_error

    policy = RaiseUnfixable(ray.train.FailureConfig(max_failures=3))
    err = _unfixable_errors()[index]
    group = WorkerGroupError("rank 1 failed", {0: RayActorError(), 1: UserExceptionWithTraceback(err, "tb")})
    group = pickle.loads(pickle.dumps(group))
    assert policy.make_decision(group) == FailureDecision.RAISE
    assert type(unfixable_error(group)) is type(err) and str(unfixable_error(group)) == str(err)
    # a worker lost or a plain error: retried, up to max_failures
    plain = WorkerGroupError("rank 0 died", {0: RayActorError(), 1: UserExceptionWithTraceback(RuntimeError("x"), "")})
    assert unfixable_error(plain) is None
    assert [policy.make_decision(plain) for _ in range(4)] == [FailureDecision.RETRY] * 3 + [FailureDecision.RAISE]


class LeaseWatcher(threading.Thread):
    """Reads the run folder's lease every 0.05 s: every (token, heartbeat) it held."""

    def __init__(self, fs, run_path: str):
        super().__init__(daemon=True)
        self.fs, self.run_path = fs, run_path
        self.seen: list = []
        self.stop = threading.Event()

    def run(self):
        from raytune_ft.storage import lease
        while not self.stop.wait(0.05):
            rec = lease.read(self.fs, self.run_path)
            if rec is not None and (not self.seen or self.seen[-1] != rec):
                self.seen.append(rec)


@pytest.mark.timeout(900)
def test_a_second_job_on_a_live_run_folder_stops_at_once_and_deletes_nothing(ray_local, tmp_path):
    """Job A holds the run folder (its lease, its heartbeat thread, here in the test process) and has uploaded
    a checkpoint it has not reported yet; job B on the same run name stops before it opens an MLflow run or
    removes anything. Once A is gone, B runs: its driver refreshes the lease while fit runs and gives it
    back at the end, and the folder A left is an orphan of a dead job's attempt, which B removes."""
    import mlflow

    from raytune_ft.storage import lease
    from raytune_ft.env import scoped_env
    from raytune_ft.driver.run import run

    recipe = _recipe(tmp_path, "shared", 0, "train.max_steps=2", "train.checkpoint_every=2")
    st, run_path = storage.run_storage(recipe)
    job_a = lease.hold(st, run_path)
    unreported = f"{run_path}/checkpoint_2026-11-30_10-00-00.000000"
    storage.write_bytes(st.fs, f"{unreported}/dcp/__0_0.distcp", b"x" * 1000)
    t = time.time()
    with pytest.raises(lease.RunFolderInUse) as e:
        run(recipe, local=True)
    assert time.time() - t < 60, "refused at once, not after training"
    assert f"run folder {run_path} is in use by process {os.getpid()} on host " in str(e.value)
    assert storage.tree_bytes(st.fs, unreported) == 1000
    assert lease.read(st.fs, run_path).token == job_a.token
    if os.path.exists(recipe.tracking_uri[len("sqlite:///"):]):
        client = mlflow.MlflowClient(recipe.tracking_uri)
        assert not [r for x in client.search_experiments() for r in client.search_runs(
            [x.experiment_id], filter_string="tags.`raytune.run_name` = 'shared'")]

    job_a.release()
    watcher = LeaseWatcher(st.fs, run_path)
    watcher.start()
    try:
        with scoped_env({lease.HEARTBEAT_ENV: "0.2"}):
            summary = run(recipe, local=True)
    finally:
        watcher.stop.set()
        watcher.join(timeout=10)
    assert summary.steps == 2
    tokens = {r.token for r in watcher.seen}
    assert len(tokens) == 1 and job_a.token not in tokens, watcher.seen
    assert len({r.heartbeat for r in watcher.seen}) >= 3 and {r.pid for r in watcher.seen} == {os.getpid()}
    assert lease.read(st.fs, run_path) is None               # given back at the end
    assert not storage.exists(st.fs, unreported)
