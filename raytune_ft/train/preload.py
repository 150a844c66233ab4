"""The training loop's imports, started in a thread as a Ray Train worker's process starts.

A worker's process spends its first seconds in Ray's start-up and Ray Train's worker set-up (the actor,
its train context, the process group), partly waiting on the controller; the loop then imports torch's
distributed code, transformers' modelling and the GPU kernels: seconds of one CPU core each on a GPU
node (bench/NOTES.md, start-up). `launch.build_trainer` names `begin` as Ray's worker-process set-up
hook in the train workers' runtime environment and lists the modules in `PRELOAD_ENV`; Ray calls
`begin` in each new process of that runtime environment, before the process takes its first task or
actor. `begin` runs the console's hook, returns, and its thread imports the modules once the process is known to host an
actor (a task submitted from a train worker inherits the runtime environment, and a task's process has
no use for them). The loop's entry point calls `wait()` before its own imports, so past that point no
two threads import at once. Before it, Ray Train's worker code imports torch in the main thread while
this thread may too; neither holds a lock the other's chain needs (torch imports no Ray module, and
the modules listed import nothing of Ray Train's worker).

Light to import: the standard library only (it runs before anything else in the process); `begin`
imports the console's module, which imports nothing but Ray, already loaded there.
"""
from __future__ import annotations

import importlib
import os
import threading
import time

PRELOAD_ENV = "RAYTUNE_PRELOAD"          # comma-separated module names, imported in order
_ACTOR_WAIT_S = 120.0                    # a process that hosts no actor by then is not a train worker's
_WAIT_S = 600.0                          # the loop waits at most this long for the thread (a hung import)

_thread: threading.Thread | None = None
_done: dict = {}                         # what the thread did: modules, imported, failed, seconds


def begin() -> None:
    """Ray's worker-process set-up hook of the train workers: the job's console hook, which every other
    process of the job runs (console.quiet_process), then the imports of `PRELOAD_ENV` in a thread."""
    global _thread
    from raytune_ft.console import quiet_process

    quiet_process()
    names = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
    if names and _thread is None:
        _thread = threading.Thread(target=_run, args=(names,), name="raytune-preload", daemon=True)
        _thread.start()


def _hosts_actor() -> bool:
    """Whether this worker process runs an actor: waits for its first task or actor to start."""
    import ray

    ctx = ray.get_runtime_context()
    deadline, task_seen = time.monotonic() + _ACTOR_WAIT_S, None
    while time.monotonic() < deadline:
        if ctx.get_actor_id() is not None:
            return True
        if ctx.get_task_id() is not None:       # a plain task: give an actor's creation a moment to show
            task_seen = task_seen or time.monotonic()
            if time.monotonic() - task_seen > 1.0:
                return False
        time.sleep(0.02)
    return False


def _run(names: list[str]) -> None:
    t0 = time.time()
    imported, failed = [], []
    try:
        if not _hosts_actor():
            return
        for name in names:
            try:
                importlib.import_module(name)
                imported.append(name)
            except Exception:  # noqa: BLE001 - the loop's own import of it raises it, with its traceback
                failed.append(name)
    finally:
        _done.update(modules=len(names), imported=imported, failed=failed, seconds=time.time() - t0)


def wait() -> dict:
    """Wait for the thread's imports (no-op where `begin` started none); what it did, {} if nothing."""
    if _thread is not None:
        _thread.join(_WAIT_S)
    return dict(_done) if _done.get("imported") else {}


def modules_for(recipe) -> list[str]:
    """The modules the recipe's training loop imports before its first step, heaviest chains first where
    the order does not matter: torch, the loop, the model code, transformers' modelling of the recipe's
    family, and on GPU workers the kernels the loop selects there."""
    names = ["torch", "torch.distributed"]
    if recipe.train.loop == "fsdp2":
        names += ["raytune_ft.train.fsdp_loop", "raytune_ft.models.tokenizer", "raytune_ft.models.build",
                  "raytune_ft.models.kernel_check"]
    else:
        names += ["raytune_ft.train.trl.loop", "raytune_ft.models.tokenizer", "raytune_ft.models.build"]
    if not recipe.model.trust_remote_code:
        family = recipe.model.family
        names.append(f"transformers.models.{family}.modeling_{family}")
    if recipe.scaling.use_gpu:
        if recipe.model.family == "qwen3_5":
            names.append("fla.ops.gated_delta_rule")      # gated_delta's chunked recurrence
        if recipe.train.use_liger:
            names.append("liger_kernel.transformers")
    return names


def runtime_env_vars(recipe, job_hook: str | None) -> dict[str, str]:
    """The env vars that make Ray run `begin` in the train workers' processes, in place of `job_hook`,
    the job's worker set-up hook (Ray keeps it in an env var of the job's; the train workers' runtime
    environment overrides it). {} where Ray has no such variable or the hook is the user's own (theirs
    stays, and the loop imports everything itself, as without this module)."""
    from raytune_ft.console import WORKER_SETUP_HOOK

    try:
        from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR as hook_env
    except ImportError:
        return {}
    if job_hook not in (None, "", WORKER_SETUP_HOOK):
        return {}
    return {hook_env: f"{__name__}.begin", PRELOAD_ENV: ",".join(modules_for(recipe))}

