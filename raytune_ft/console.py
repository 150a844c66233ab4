"""What a run prints: the project's own lines and errors; the libraries' progress chatter stays in Ray's
log files (`<RAY_TMPDIR or /tmp/ray>/session_latest/logs`).

Most of that chatter is not printed by the driver but by Ray's own actors (the Train controller, its
workers, Ray Data's coordinators, the registration task) and by the libraries they import, and Ray
forwards every line of theirs to the driver's console. So the switches are set twice: as environment
variables before Ray starts (the local Ray's processes inherit them; on a cluster they travel in the
workers' runtime_env) and as logger levels and warning filters in every Ray worker process, through
Ray's worker setup hook (`quiet_process`), since a logger level cannot be set from outside a process.
"""
from __future__ import annotations

import logging
import os
import warnings

# Read by Ray and the libraries when their processes start: kept quiet, errors still shown.
QUIET_ENV = {
    "RAY_DATA_LOG_LEVEL": "WARNING",        # "Starting execution of Dataset ...", execution plans, timings
    "MLFLOW_LOGGING_LEVEL": "WARNING",      # "Creating initial MLflow database tables...", "Created version"
    "TORCH_CPP_LOG_LEVEL": "ERROR",         # c10d's C++ warnings ("ProcessGroupNCCL ... destroy_process_group")
}

# Off a terminal (a pipe, a file, `ray job submit`'s log): no colour codes, no redrawn progress bars.
# Ray's log deduplication is off there too: its "[repeated Nx across cluster]" note is always coloured.
PLAIN_ENV = {
    "NO_COLOR": "1",
    "RAY_COLOR_PREFIX": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
}

# Loggers of the libraries whose warnings a user cannot act on, at the level they are shown from.
QUIET_LOGGERS = {
    "torchao": logging.ERROR,               # "Failed to load ..._C_cutlass_90a.so" on a machine without that GPU
    "torch.utils._pytree": logging.ERROR,   # torchao's Enum registration, deprecated upstream
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": logging.ERROR,
    "ray._private.authentication.authentication_token_setup": logging.ERROR,
    "ray.data._internal.progress": logging.ERROR,   # "Progress bars disabled ..." where we turned them off
}
# torchao's source files: the module a compile-time warning names is its file's path less ".py"
TORCHAO_SOURCES = r".*[/\\]torchao[/\\]"

# A Ray the job starts itself. Its raylet starts one idle Python worker per logical CPU when the first
# driver connects; none is ever used (a job with a runtime_env, as every run has, and Ray Train's actors,
# with env_vars of their own, need workers of their own), and on a GPU node they are dozens of Python
# start-ups competing with the run's own for the first seconds (bench/NOTES.md, start-up).
OWN_RAY_ENV = {"RAY_prestart_worker_first_driver": "0"}


def own_ray_env(local_cpus: int | None = None) -> dict[str, str]:
    """Variables the raylet of a Ray this job starts reads when it starts. `local_cpus`, for --local runs
    on CPU (that many logical CPUs): nothing preempts the workers of a local Ray (Ray Train's watcher for
    that logs an error line from its actor's constructor), and it starts more worker processes than it
    has cores (Ray Data's operators, the controller), which its raylet warns about at 4x the core count."""
    env = dict(OWN_RAY_ENV)
    if local_cpus is not None:
        env |= {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_worker_maximum_startup_concurrency": str(local_cpus)}
    return env


def _ray_report_logger() -> str | None:
    """Ray Train's per-report "Reporting training result ... TrainingReport(...)" logger, which is named
    after its file rather than its module (so no `ray.train` level reaches it)."""
    try:
        import ray
    except ImportError:
        return None
    return os.path.join(os.path.dirname(ray.__file__), "train", "v2", "_internal", "execution", "context.py")


def quiet_process() -> None:
    """Logger levels and warning filters of one process (the driver, or a Ray worker process through the
    runtime_env's worker_process_setup_hook). Cheap: imports nothing but Ray, already loaded there."""
    _pin_ray_address()
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    report = _ray_report_logger()
    if report:
        logging.getLogger(report).setLevel(logging.WARNING)
    # Ray's own APIs calling its deprecated ones (Ray Data's ExecutionOptions from Ray Train): nothing to fix here
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"ray\.")
    # torchao's sources compiled on first import ("invalid escape sequence": a SyntaxWarning from Python 3.12)
    for category in (SyntaxWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=TORCHAO_SOURCES)


def _pin_ray_address() -> None:
    """In a Ray worker process, RAY_ADDRESS names its own cluster. Ray Train's placement-group cleaner
    looks its controller up by address "auto", which fails with a traceback ("Found multiple active Ray
    instances") whenever a second Ray runs on the machine; nothing else in the job reads it."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or os.environ.get("RAY_ADDRESS") or not ray.is_initialized():
        return
    try:
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a quieter console is not worth a failed worker
        pass


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def quiet_env(terminal: bool) -> dict[str, str]:
    """The environment variables of a quiet run (`terminal`: whether the driver's stdout is a terminal);
    a variable the user set keeps the user's value."""
    wanted = {**QUIET_ENV, **({} if terminal else PLAIN_ENV)}
    return {k: os.environ.get(k, v) for k, v in wanted.items()}


def setup_driver(terminal: bool) -> dict[str, str]:
    """Set the quiet environment in this process (before Ray is imported: some of it is read at import)
    and the logger levels; returns the variables, for the workers' runtime_env."""
    env = quiet_env(terminal)
    os.environ.update(env)
    quiet_process()
    return env


WORKER_SETUP_HOOK = "raytune_ft.console.quiet_process"
