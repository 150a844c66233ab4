"""The driver's start-up with its latency hidden: Ray started or joined, and what the run needs later (its
MLflow run, the driver's imports and tokenizer, the tokenizing processes) started early beside it."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import time

from raytune_ft.env import process_start
from raytune_ft.recipe import Recipe, check_tracking_store


def local_cpus(local: bool) -> int | None:
    """The logical CPUs of the Ray a --local job starts (None: Ray's own count, the cores). More than the
    cores: Ray Data operators inside the trainer must not starve."""
    return max(8, 2 * (os.cpu_count() or 2)) if local else None


def ensure_ray(local: bool) -> None:
    """Join the cluster when RAY_ADDRESS is set (as under `ray job submit`), else start a local Ray.

    A bare `ray.init()` would join whatever /tmp/ray/ray_current_cluster names, even a dead cluster.
    """
    import logging

    import ray

    from raytune_ft.console import WORKER_SETUP_HOOK, is_terminal, own_ray_env, quiet_env
    from raytune_ft.env import bytecode_env

    if ray.is_initialized():
        return
    # every process of the job (Train controller and workers, Ray Data's actors, the registration task)
    # runs the console's setup hook: they print most of what reaches the driver's console
    quiet = {"worker_process_setup_hook": WORKER_SETUP_HOOK,
             "env_vars": {**quiet_env(is_terminal(sys.stdout)), **bytecode_env()}}
    if os.environ.get("RAY_ADDRESS"):
        try:
            ray.init(runtime_env=quiet, logging_level=logging.WARNING)
        except ValueError:  # the submitted job's runtime_env sets the same fields: it wins
            ray.init(logging_level=logging.WARNING)
        return
    ncpu = local_cpus(local)
    for k, v in own_ray_env(ncpu).items():
        os.environ.setdefault(k, v)
    ray.init(address="local", num_cpus=ncpu, include_dashboard=False, runtime_env=quiet,
             logging_level=logging.WARNING)


def start_train_helpers() -> None:
    """Start the actor Ray Train's controller waits for when it starts: Ray Data's autoscaling coordinator,
    asked for the workers' resources (a detached actor, created on first use: a new Python process).
    Created as soon as Ray is up, it starts beside the MLflow run and the datasets. A Ray without it
    (another version) leaves the controller to create it."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator)
    except ImportError:
        return
    try:
        get_or_create_autoscaling_coordinator()
    except Exception as e:  # noqa: BLE001 - a head start only: the controller creates it otherwise
        print(f"[raytune_ft] could not start Ray Data's autoscaling coordinator ahead: {type(e).__name__}")


def submitted_at() -> float | None:
    """When Ray accepted this job's submission (epoch seconds), for a driver started by `ray job submit`
    and connected to its cluster; else None. The time between it and this process's start (Ray's job
    supervisor, the working directory's upload and unpacking, the job's process) is part of the wait."""
    from raytune_ft.lease import job_id

    submission = job_id()
    if not submission:
        return None
    try:   # Ray's own job table in the cluster's key-value store: private names, so any failure is None
        import json

        from ray.dashboard.modules.job.common import JobInfoStorageClient
        from ray.experimental.internal_kv import _internal_kv_get
        from ray._private import ray_constants

        raw = _internal_kv_get(JobInfoStorageClient.JOB_DATA_KEY.format(job_id=submission),
                               namespace=ray_constants.KV_NAMESPACE_JOB)
        start_ms = (json.loads(raw) if raw else {}).get("start_time")
        return float(start_ms) / 1000.0 if start_ms else None
    except Exception:  # noqa: BLE001 - the breakdown then counts from the job's process, as without Ray
        return None


def tokenizer_memo(recipe: Recipe) -> str:
    """The file that remembers which class AutoTokenizer chose for a tokenizer (models/tokenizer.load_once):
    beside the JIT caches, `train.cache_dir` or the per-user default."""
    from raytune_ft.models.tokenizer import MEMO_NAME
    from raytune_ft.train.jit_cache import cache_root

    return os.path.join(cache_root(recipe), MEMO_NAME)


def prepare_driver(recipe: Recipe) -> None:
    """The driver's slow imports (Ray Train's trainer, Ray Data's pipeline) and the recipe's tokenizer,
    in a thread beside Ray's start: a tokenizer that cannot load fails the job here, in the driver's
    words, before any Ray process tries it. A tokenizer an earlier run loaded from the same files is not
    loaded again: its class is remembered (through AutoTokenizer, the load imports torch, which under `ray
    job submit` nothing hides). The training loop's own modules (the model code) are imported by the
    workers only (train/launch.loop_function), and torch by neither (train/backend.py)."""
    import mlflow  # noqa: F401 - ending a stopped run must fit in the 3 s `ray job stop` leaves it
    import ray.train.v2.api.data_parallel_trainer  # noqa: F401

    from raytune_ft.data import pipeline  # noqa: F401
    from raytune_ft.models.tokenizer import load_once
    from raytune_ft.train import launch  # noqa: F401

    load_once(recipe.model, tokenizer_memo(recipe))


class StartAhead:
    """The start-up's latency hiding: what `_run` needs later, started early so that it overlaps Ray's start.

    Before Ray starts: the driver's imports and the tokenizer (a thread, `_prepare_driver`) and, on a Ray this
    job starts (one node: the node check cannot fail), the MLflow run (its own process: run_opening.RunOpening).
    A cluster joined is checked before the run opens. Once Ray is up: Ray Data's coordinator and the
    tokenizing processes. The run id reaches rank 0 one way, through Ray's key-value store
    (run_opening.RunIdHandoff), so the trainer never waits for the run to open. `marks` are the driver's side of
    the start-up breakdown (train/common.DRIVER_MARKS). A context manager: however the run ends, the opening's
    process and file, the thread and the handed-over key are left behind."""

    def __init__(self, recipe: Recipe, ending, *, local: bool, joins: bool, t0: float):
        from raytune_ft import run_opening

        self.recipe, self.local, self.joins, self._ending = recipe, local, joins, ending
        self.marks, self.job_start = {"driver": t0}, min(process_start() or t0, t0)
        self._held = contextlib.ExitStack()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raytune-start")
        self._held.callback(pool.shutdown, wait=False)   # a stopped run ends without waiting for imports
        self._prepared = pool.submit(prepare_driver, recipe)
        self.opened = None if joins else self._open(run_opening.RunOpening(recipe))

    def _open(self, opened):
        self._ending.opened = self._held.enter_context(opened)
        return opened

    def __enter__(self) -> "StartAhead":
        return self

    def __exit__(self, *exc) -> None:
        self._held.close()

    def start_ray(self) -> None:
        """Ray up (started or joined) and checked; the MLflow run opening; the driver's imports done."""
        from raytune_ft import preflight, run_opening

        ensure_ray(self.local)
        self.marks["ray_start"] = time.time()
        submitted = submitted_at() if self.joins else None
        if submitted is not None:   # `ray job submit`: the wait starts at the submission (the process's start
            # time has a resolution of 10 ms: a driver Ray started at once may seem to start before it)
            self.marks["process"], self.job_start = self.job_start, min(submitted, self.job_start)
        check_tracking_store(self.recipe, preflight.cluster_nodes(), "nodes of the Ray cluster it joined")
        if self.joins:
            import ray

            preflight.check_resources(self.recipe, ray.cluster_resources(), "the Ray cluster it joined")
        self.opened = self.opened or self._open(run_opening.RunOpening(self.recipe))
        start_train_helpers()
        self._prepared.result()
        from raytune_ft.train.launch import start_tokenizing

        # beside Ray Train's start, with the tokenizer loaded (the driver's choice of class) by the first read
        start_tokenizing(self.recipe)

    def datasets(self):
        """The datasets, built while the MLflow run opens in its own process."""
        from raytune_ft.train.launch import build_datasets

        out = build_datasets(self.recipe)
        self.marks["datasets"] = time.time()
        return out

    def run_key(self, token: str) -> str:
        """Where rank 0 finds the run id: handed over once the run is open (at once if it is; a run that
        failed to open and is done raises here, in the driver)."""
        from raytune_ft import run_opening

        if self.opened.done():
            self.opened.result()
        handoff = self._held.enter_context(run_opening.RunIdHandoff(self.opened, token))
        self.marks["tracking"] = time.time()
        return handoff.key

    def run_id(self) -> str:
        return self.opened.result()
