"""Fault tolerance of the 27B recipe's --local job on a real local Ray: workers that die mid-run.

Runs of the same recipe (10 steps, checkpoints at 4 and 8, final at 10), sharing one Ray, the faults
planted through the test fault plan (tests/faults.py):

- "window": rank 1 exits right after uploading its part of the final (step-10) checkpoint, before
  its report reaches Ray (exit_after_upload). With max_failures=0 the run fails. Ray must
  not have registered that folder: the latest checkpoint stays step 8's. Rank 1's files in the
  unregistered folder are the reference: its history holds the per-step losses of steps 1..10 of
  an uninterrupted run (every rank keeps the all-reduced loss history).
- "window" re-submitted under the same name: resumes from step 8 and ends at step 10.
- "killed": a watcher thread in this test SIGKILLs rank 1's RayTrainWorker process (found by PID
  through Ray Train's state actor) once the first checkpoint is registered; max_failures=1 lets Ray
  restart the worker group, which resumes from the last registered checkpoint.
- "background": checkpoints written in the background (train.async_checkpoint=on); rank 1 exits in the
  writer thread during the step-8 save, its files written locally but not uploaded, while the loop
  trains on (exit_after_write); max_failures=1: the next attempt resumes from step 4, the last complete
  checkpoint.
- "failing": the same, but rank 1's background save of step 4 raises (fail_after_write), max_failures=0:
  the run stops with that error at the next step boundary, and no checkpoint is registered.

Both resumed runs must reproduce the uninterrupted per-step losses after their resume point, and
their data counters, i.e. the same blocks in the same order on each rank, nothing trained twice.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import signal
import threading
import time

import pytest

from raytune_ft import storage
from tests.conftest import REPO, own_ray, run_with_fault, train_state
from tests.faults import fault_env

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
    filesystem `run_dir` is on (default local; an S3 one for a run on object storage).
    """

    def __init__(self, run_dir: str, run_name: str, rank: int = 1, timeout_s: float = 600, pick_rank=None,
                 fs=None):
        import pyarrow.fs as pafs

        super().__init__(daemon=True)
        self.run_dir, self.run_name, self.rank, self.timeout_s = str(run_dir), run_name, rank, timeout_s
        self.pick_rank = pick_rank
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
            while not (pid and storage.exists(self.fs, f"{self.run_dir}/{SNAPSHOT}")):
                if self.stop.is_set() or time.time() > deadline:
                    self.error = f"no checkpoint registered or no worker of rank {self.rank} found"
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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import ray

    from raytune_ft.run import run

    storage = tmp_path_factory.mktemp("ft_runs")
    out: dict = {"storage": storage}
    # Ray Train's state actor (ranks, PIDs and nodes of each attempt's workers) is opt-in
    os.environ[STATE_TRACKING_ENV] = "1"
    own_ray(address="local", num_cpus=8, include_dashboard=False)
    try:
        # 1. rank 1 dies in the window between uploading the final checkpoint and reporting it
        window = _recipe(storage, "window", max_failures=0)
        out["window_error"] = run_with_fault(window, fault_env(exit_after_upload=f"{STEPS}:1"))
        out["window_dirs"] = sorted(glob.glob(os.path.join(window.run_dir, "checkpoint_*")))
        with open(os.path.join(window.run_dir, SNAPSHOT)) as f:
            out["window_snapshot"] = f.read()
        # read now: the re-submit's checkpoints push the oldest out (keep_checkpoints=2)
        from raytune_ft.train.checkpoint import read_meta

        out["window_steps"] = {os.path.basename(d): read_meta(d).get("step") for d in out["window_dirs"]}
        # rank 1's states and whether each folder held a DCP shard, read before the re-submit removes the orphan
        out["window_rank1"] = {d: train_state(d, 1) for d in out["window_dirs"]
                               if os.path.exists(os.path.join(d, "train_state", "rank1.json"))}
        out["window_has_dcp"] = {d for d in out["window_dirs"] if os.path.isdir(os.path.join(d, "dcp"))}

        # 2. the same job re-submitted under the same name
        out["window_recipe"] = window
        out["resubmitted"] = run(window, local=True)

        # 3. a worker SIGKILLed from outside mid-run; Ray restarts the group (max_failures=1)
        killed = _recipe(storage, "killed", max_failures=1)
        killer = RankKiller(killed.run_dir, "killed")
        killer.start()
        try:
            out["killed"] = run(killed, local=True)
        finally:
            killer.stop.set()
            killer.join(timeout=30)
        out["killer"] = killer
        out["killed_recipe"] = killed

        # 4. a worker dying during a background save; 5. a background save failing
        background = _recipe(storage, "background", 1, "train.async_checkpoint=on")
        out["background_error"] = run_with_fault(background, fault_env(exit_after_write="8:1"))
        out["background_recipe"] = background
        failing = _recipe(storage, "failing", 0, "train.async_checkpoint=on")
        out["failing_error"] = run_with_fault(failing, fault_env(fail_after_write=f"{EVERY}:1"))
        out["failing_recipe"] = failing
    finally:
        os.environ.pop(STATE_TRACKING_ENV, None)
        ray.shutdown()
    return out


def _orphan(runs) -> str:
    """The step-10 folder written by the failed attempt (rank 1's files are complete in it)."""
    found = [d for d, st in runs["window_rank1"].items() if st["step"] == STEPS]
    assert len(found) == 1, runs["window_dirs"]
    return found[0]


def _reference(runs) -> dict:
    return runs["window_rank1"][_orphan(runs)]


def _assert_history_matches(history: list[dict], reference: list[dict]) -> None:
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["step"] for h in reference] == list(range(1, STEPS + 1))
    for h, r in zip(history, reference):
        assert h["loss"] == pytest.approx(r["loss"], rel=REL_TOL), (h, r)
        assert h["lr"] == pytest.approx(r["lr"], rel=1e-12), (h, r)


@pytest.mark.timeout(900)
def test_death_in_checkpoint_window_keeps_previous_checkpoint(runs):
    err = runs["window_error"]
    assert err is not None, "the run was meant to fail: rank 1 exited in the checkpoint window"
    assert "Training" in type(err).__name__ or "Worker" in type(err).__name__, repr(err)
    orphan = _orphan(runs)
    # the folder is on storage, with rank 1's complete shard and train state...
    assert orphan in runs["window_has_dcp"] and runs["window_rank1"][orphan]["step"] == STEPS
    # ...but Ray never registered it: the latest checkpoint is step 8's
    snapshot = runs["window_snapshot"]
    assert os.path.basename(orphan) not in snapshot
    registered = [name for name in runs["window_steps"] if name in snapshot]
    assert sorted(runs["window_steps"][name] for name in registered) == [4, 8], (registered, snapshot)
    # the re-submit removed it when it started (storage cannot fill with such folders)
    assert not os.path.exists(orphan)


@pytest.mark.timeout(900)
def test_resubmit_same_name_resumes_from_last_registered_checkpoint(runs):
    import mlflow

    summary, recipe = runs["resubmitted"], runs["window_recipe"]
    ref = _reference(runs)
    assert summary.steps == STEPS
    assert os.path.basename(summary.checkpoint) not in {os.path.basename(d) for d in runs["window_dirs"]}
    for rank in (0, 1):
        st = train_state(summary.checkpoint, rank)
        assert st["resumed_from"] == [8], st.get("resumed_from")
        assert st["step"] == STEPS
        _assert_history_matches(st["history"], ref["history"])
    # rank 1 consumed exactly the blocks, and counted exactly the rows, of the uninterrupted run
    st1 = train_state(summary.checkpoint, 1)
    assert st1["blocks_consumed"] == ref["blocks_consumed"]
    assert st1["counters"] == ref["counters"]
    # the re-submit reopened the job's MLflow run instead of starting another one
    client = mlflow.MlflowClient(recipe.tracking_uri)
    exp = client.get_experiment_by_name(recipe.tracking.experiment)
    found = client.search_runs([exp.experiment_id], filter_string="tags.`raytune.run_name` = 'window'")
    assert len(found) == 1 and found[0].info.run_id == summary.mlflow_run_id
    assert found[0].data.tags.get("raytune.resubmitted") == "true"
    assert found[0].info.status == "FINISHED"


@pytest.mark.timeout(900)
def test_killed_worker_is_restarted_and_resumes_exactly(runs):
    import psutil

    killer, summary = runs["killer"], runs["killed"]
    assert killer.error is None, killer.error
    assert killer.killed_pid is not None and "RayTrainWorker" in killer.cmdline
    assert not psutil.pid_exists(killer.killed_pid) or psutil.Process(killer.killed_pid).status() == "zombie"
    assert summary.steps == STEPS
    ref = _reference(runs)
    for rank in (0, 1):
        st = train_state(summary.checkpoint, rank)
        # one restart, from a registered checkpoint (step 4, or 8 if the kill came late)
        assert len(st["resumed_from"]) == 1 and st["resumed_from"][0] in (4, 8), st.get("resumed_from")
        _assert_history_matches(st["history"], ref["history"])
    st1 = train_state(summary.checkpoint, 1)
    assert st1["blocks_consumed"] == ref["blocks_consumed"]
    assert st1["counters"] == ref["counters"]


@pytest.mark.timeout(900)
def test_a_worker_dying_during_a_background_save_resumes_from_the_last_complete_checkpoint(runs):
    from raytune_ft.train.checkpoint import read_meta

    assert runs["background_error"] is None, repr(runs["background_error"])
    recipe = runs["background_recipe"]
    final = [d for d in glob.glob(os.path.join(recipe.run_dir, "checkpoint_*")) if read_meta(d).get("final")]
    assert len(final) == 1
    ref = _reference(runs)
    for rank in (0, 1):
        st = train_state(final[0], rank)
        # the step-8 save never completed: the restart came from step 4's
        assert st["resumed_from"] == [EVERY], st.get("resumed_from")
        _assert_history_matches(st["history"], ref["history"])
    st1 = train_state(final[0], 1)
    assert st1["blocks_consumed"] == ref["blocks_consumed"] and st1["counters"] == ref["counters"]


@pytest.mark.timeout(900)
def test_a_failed_background_save_stops_the_run_and_registers_nothing(runs):
    err = runs["failing_error"]
    assert err is not None and "could not write the step-4 checkpoint" in str(err), repr(err)
    import pyarrow.fs as pafs

    reported = storage.reported_checkpoints(pafs.LocalFileSystem(), str(runs["failing_recipe"].run_dir))
    assert reported is None or not reported.kept, reported


def _unfixable_errors():
    from raytune_ft.models.kernel_check import KernelCheckError
    from raytune_ft.recipe import RecipeError
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

    from raytune_ft.train.launch import RaiseUnfixable, unfixable_error

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
        from raytune_ft import lease

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

    from raytune_ft import lease
    from raytune_ft.env import scoped_env
    from raytune_ft.run import run

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
