"""The tests' fault plan, installed inside the training workers through the loops' hook points
(raytune_ft/train/hooks.py): the package holds no fault code, loads no plugin and reads no test setting.

How a plan reaches the workers, all of it the tests' own: the Rays the tests start (conftest's `ray_local`,
test_s3_runs' `s3_ray`) pass `RUNTIME_ENV`, whose `worker_process_setup_hook` (`attach_handlers`) attaches
a dispatcher to every hook point in each process of the job, and whose PYTHONPATH lets a worker started
from another folder import this module. A test names the faults of its next run with `fault_plan(...)`,
which writes them to a file in this process's temporary folder (its path travels in RUNTIME_ENV); the
dispatcher reads that file when a point fires, so a worker process started before the plan was written
follows it too, and one with no plan on file does nothing. The faults, each "STEP:RANK" (that rank, at that
step):

    exit_after_upload    the FSDP2 loop: the process exits once its part of the step's checkpoint is on the
                         run's storage, before its report reaches Ray (a worker dying in the checkpoint window)
    exit_after_write     the FSDP2 loop: the process exits once the step's checkpoint files are written
                         locally, before the upload, and once Ray has registered an earlier checkpoint of the
                         run ("STEP:RANK:after=PREV": step PREV's); once per run, so the restarted attempt runs
                         on (with train.async_checkpoint on: in the writer thread, while the loop trains on: a
                         worker dying during a background save)
    fail_after_write     the FSDP2 loop: the save raises an OSError there instead (a background save failing)
    kill_at_step         the TRL loop: SIGKILL at the end of optimizer step STEP, in an attempt that did not
                         resume, once Ray has registered a checkpoint of the run (its controller takes reports
                         in asynchronously: a worker dying right after reporting can lose that report, as a
                         real crash would); "STEP:RANK:saved": once step STEP's own checkpoint is registered
    take_lease           with kill_at_step, "1": before the kill, the run folder's lease is written as another
                         job's (a stale heartbeat, so that a later job takes it over): as if the job's heartbeat
                         had gone stale and another job had taken the folder; the next attempt must stop
    free_bytes           "BYTES" or "BYTES@STEP": the checkpoint guard reads BYTES free (from step STEP on),
                         as on a filesystem that small
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from typing import Any, Callable

from raytune_ft.train import hooks

FAULTS = ("exit_after_upload", "exit_after_write", "fail_after_write", "kill_at_step", "take_lease", "free_bytes")
# the variable only this module reads: where the plan of the next run lies (set by RUNTIME_ENV in the workers)
PLAN_FILE_ENV = "RAYTUNE_TEST_FAULT_PLAN"
_PLAN_FILE = os.environ.get(PLAN_FILE_ENV) or os.path.join(tempfile.gettempdir(),
                                                           f"raytune_test_fault_plan_{os.getpid()}.json")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Ray's runtime environment of the tests' own Rays: every process of their jobs attaches the dispatcher
RUNTIME_ENV = {"worker_process_setup_hook": f"{__name__}.attach_handlers",
               "env_vars": {PLAN_FILE_ENV: _PLAN_FILE,
                            "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}}
_POINTS = ("checkpoint.written", "checkpoint.uploaded", "trl.step_end", "trl.saved")


@contextlib.contextmanager
def fault_plan(**plan: str):
    """The faults of the runs started inside the block (see the module's docstring)."""
    unknown = set(plan) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults: {sorted(unknown)}")
    with open(_PLAN_FILE, "w") as f:
        json.dump(plan, f)
    try:
        yield plan
    finally:
        os.remove(_PLAN_FILE)


def job_env(folder: str, **plan: str) -> dict[str, str]:
    """The environment of a job run in a process of its own (a `--local` job, which starts its own Ray) whose
    workers follow `plan`: the plan is written to a file in `folder`, and Ray's own `RAY_RUNTIME_ENV_HOOK`,
    which `ray.init` calls with the job's runtime environment, adds RUNTIME_ENV's setup hook and variables to
    it (`with_runtime_env`). The package is not told: it starts its Ray as for any user."""
    unknown = set(plan) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults: {sorted(unknown)}")
    path = os.path.join(folder, "fault_plan.json")
    with open(path, "w") as f:
        json.dump(plan, f)
    return {"RAY_RUNTIME_ENV_HOOK": f"{__name__}.with_runtime_env", PLAN_FILE_ENV: path,
            "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}


# the job's own worker_process_setup_hook (the console's), which attach_handlers calls first where
# with_runtime_env put its own in its place
_JOB_SETUP_HOOK_ENV = "RAYTUNE_TEST_JOB_SETUP_HOOK"


def with_runtime_env(runtime_env: dict | None) -> dict:
    """Ray's runtime-environment hook (job_env): the job's runtime environment with RUNTIME_ENV's added. The
    job's own setup hook still runs in every process (attach_handlers calls it), as it does for a user:
    without it the workers printed the libraries' lines a user never sees."""
    env = dict(runtime_env or {})
    job_hook = env.get("worker_process_setup_hook")
    if job_hook is not None and not isinstance(job_hook, str):
        raise TypeError(f"the job's worker_process_setup_hook is not a module path: {job_hook!r}")
    env["worker_process_setup_hook"] = RUNTIME_ENV["worker_process_setup_hook"]
    env["env_vars"] = {**(env.get("env_vars") or {}), **RUNTIME_ENV["env_vars"],
                       **({_JOB_SETUP_HOOK_ENV: job_hook} if job_hook else {})}
    return env


def attach_handlers() -> None:
    """Ray's worker_process_setup_hook (RUNTIME_ENV): the job's own setup hook first (with_runtime_env), then
    each hook point calls the plan on file when it fires."""
    job_hook = os.environ.get(_JOB_SETUP_HOOK_ENV)
    if job_hook:
        import importlib

        module, _, name = job_hook.rpartition(".")
        getattr(importlib.import_module(module), name)()
    for point in _POINTS:
        hooks.attach(point, lambda _point=point, **info: [h(**info) for h in _handlers_now().get(_point, ())])
    hooks.attach("storage.free_bytes", lambda free, **info: _free_bytes(_plan_now(), free, **info))


_cache: dict[str, Any] = {"raw": None, "handlers": {}}


def _plan_now() -> dict:
    try:
        with open(_PLAN_FILE) as f:
            return json.loads(f.read() or "{}")
    except FileNotFoundError:
        return {}


def _handlers_now() -> dict[str, list[Callable[..., None]]]:
    """The handlers of the plan on file now, built once per plan (a plan's handlers keep state across fires)."""
    plan = _plan_now()
    if plan != _cache["raw"]:
        _cache["raw"], _cache["handlers"] = plan, handlers(plan)
    return _cache["handlers"]


def handlers(plan: dict) -> dict[str, list[Callable[..., None]]]:
    """The handlers of `plan` by hook point (free_bytes apart: `_free_bytes`)."""
    out: dict[str, list[Callable[..., None]]] = {}
    if "exit_after_upload" in plan:
        out.setdefault("checkpoint.uploaded", []).append(_exit_at(plan["exit_after_upload"], "after uploading"))
    if "exit_after_write" in plan:
        out.setdefault("checkpoint.written", []).append(
            _exit_at(plan["exit_after_write"], "after writing, before the upload of", once_registered=True))
    if "fail_after_write" in plan:
        out.setdefault("checkpoint.written", []).append(_fail_at(plan["fail_after_write"]))
    if "kill_at_step" in plan:
        spec = plan["kill_at_step"]
        out.setdefault("trl.saved" if spec.endswith(":saved") else "trl.step_end", []).append(
            _kill_at(spec, take_lease=plan.get("take_lease") == "1"))
    return out


def _free_bytes(plan: dict, free, step: int):
    if "free_bytes" not in plan:
        return free
    value, _, from_step = str(plan["free_bytes"]).partition("@")
    return int(value) if not from_step or step >= int(from_step) else free


def _exit_at(spec: str, when: str, *, once_registered: bool = False):
    target, _, after = spec.partition(":after=")

    def handler(step: int, rank: int) -> None:
        if target == f"{step}:{rank}":
            if once_registered:
                if not _first_time(f"exit_after_write-{target}"):
                    return
                _wait_registered(lambda reported: bool(reported) and (
                    not after or any(m.get("step") == int(after) for m in reported.metrics.values())))
            print(f"[raytune_ft] test fault: rank {rank} exiting {when} the step-{step} checkpoint", flush=True)
            os._exit(1)
    return handler


def _fail_at(spec: str):
    def handler(step: int, rank: int) -> None:
        if spec == f"{step}:{rank}":
            raise OSError(f"test fault: rank {rank} could not write the step-{step} checkpoint")
    return handler


def _first_time(name: str) -> bool:
    """True the first time a worker of the run asks for `name` (a marker file in the run's folder)."""
    from raytune_ft.storage import fs as storage
    from raytune_ft.train.ckpt_storage import run_location

    fs, run_path = run_location()
    marker = f"{run_path}/test_fault_{name.replace(':', '_')}"
    if storage.exists(fs, marker):
        return False
    storage.write_bytes(fs, marker, b"")
    return True


def _wait_registered(done, timeout_s: float = 120) -> None:
    """Wait until `done(Ray's record of the run's registered checkpoints)` holds (or the timeout)."""
    from raytune_ft.storage import fs as storage
    from raytune_ft.train.ckpt_storage import run_location

    fs, run_path = run_location()          # local or object storage alike
    deadline = time.time() + timeout_s
    while not done(storage.reported_checkpoints(fs, run_path)) and time.time() < deadline:
        time.sleep(0.1)


def _kill_at(spec: str, *, take_lease: bool = False):
    saved = spec.endswith(":saved")
    target = spec.removesuffix(":saved")

    def handler(step: int, rank: int, output_dir: str, resumed: bool) -> None:
        if not resumed and target == f"{step}:{rank}":
            if take_lease:
                _lease_to_another_job()
            _die(rank, step, output_dir, saved=saved)
    return handler


def _lease_to_another_job() -> None:
    """The run folder's lease written as another job's, its heartbeat long stale (a later job takes it over)."""
    from dataclasses import asdict

    from raytune_ft.storage import lease

    from raytune_ft.storage import fs as storage
    from raytune_ft.train.ckpt_storage import run_location

    fs, run_path = run_location()
    long_ago = time.time() - 10 * 86400
    record = lease.LeaseRecord(token="test-fault-another-job", job_id="raysubmit_test_fault", host="another-host",
                               pid=1, started=long_ago, heartbeat=long_ago)
    storage.write_json(fs, f"{run_path}/{lease.LEASE_FILE}", asdict(record))


def _die(rank: int, step: int, output_dir: str, *, saved: bool) -> None:
    """SIGKILL this worker once Ray has registered a checkpoint of the run (`saved`: step `step`'s), its
    local Hugging Face folders removed first, as a restart on another node finds them."""
    import shutil

    _wait_registered(lambda reported: bool(reported) and (
        not saved or any(m.get("step") == step for m in reported.metrics.values())))
    shutil.rmtree(output_dir, ignore_errors=True)
    print(f"[raytune_ft] test fault: killing rank {rank} at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
