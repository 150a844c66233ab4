"""The driver's start-up parts that hide its latency (lifecycle.RunLifecycle runs them in order): Ray started
or joined, the driver's imports and tokenizer loaded beside it, what Ray Train waits for started early."""
from __future__ import annotations

import os
import sys

from raytune_ft import compat
from raytune_ft.recipe.recipe import Recipe


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
    get_or_create_autoscaling_coordinator = compat.RAY_AUTOSCALING_COORDINATOR.load()
    try:
        get_or_create_autoscaling_coordinator()
    except Exception as e:  # noqa: BLE001 - a head start only: the controller creates it otherwise
        print(f"[raytune_ft] could not start Ray Data's autoscaling coordinator ahead: {type(e).__name__}")


def submitted_at() -> float | None:
    """When Ray accepted this job's submission (epoch seconds), for a driver started by `ray job submit`
    and connected to its cluster; else None. The time between it and this process's start (Ray's job
    supervisor, the working directory's upload and unpacking, the job's process) is part of the wait."""
    from raytune_ft.storage.lease import job_id

    submission = job_id()
    return compat.ray_job_started_at(submission) if submission else None


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
    workers only (driver/launch.loop_function), and torch by neither (train/backend.py)."""
    import mlflow  # noqa: F401 - the end of the run uses it (plots, the registry): imported while Ray starts
    import ray.train.v2.api.data_parallel_trainer  # noqa: F401

    from raytune_ft.data import pipeline  # noqa: F401
    from raytune_ft.models.tokenizer import load_once
    from raytune_ft.driver import launch  # noqa: F401

    load_once(recipe.model, tokenizer_memo(recipe))
