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

import contextlib
import logging
import os
import warnings

from raytune_ft import compat

# Read by Ray and the libraries when their processes start: kept quiet, errors still shown, in a terminal
# as in a pipe.
QUIET_ENV = {
    "RAY_DATA_LOG_LEVEL": "WARNING",        # "Starting execution of Dataset ...", execution plans, timings
    "MLFLOW_LOGGING_LEVEL": "WARNING",      # "Creating initial MLflow database tables...", "Created version"
    "TORCH_CPP_LOG_LEVEL": "ERROR",         # c10d's C++ warnings ("ProcessGroupNCCL ... destroy_process_group")
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",    # transformers' "Writing model shards" bars, the hub's downloads
    # Ray Data's bars, forwarded from the workers and redrawn around every line the run prints, leave
    # their own blank prefixed lines behind in a terminal
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    # Ray's log deduplication prints a line, then again with "[repeated Nx across cluster]" when more
    # workers print it (numbers do not count: "rank 0 ..." and "rank 1 ..." are one line to it), at
    # times after the run's summary
    "RAY_DEDUP_LOGS": "0",
    # Ray Train's workers send every print() to the root logger (stderr) and, since a Ray worker's sys.stdout
    # is a wrapper of Ray's, to stdout as well: each printed line reached the console twice
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
}

# Off a terminal (a pipe, a file, `ray job submit`'s log): no colour codes.
PLAIN_ENV = {
    "NO_COLOR": "1",
    "RAY_COLOR_PREFIX": "0",
}

# Loggers of the libraries whose warnings a user cannot act on, at the level they are shown from.
QUIET_LOGGERS = {
    "torchao": logging.ERROR,               # "Failed to load ..._C_cutlass_90a.so" on a machine without that GPU
    "torch.utils._pytree": logging.ERROR,   # torchao's Enum registration, deprecated upstream
    # Ray's placement-group cleaner, token set-up and Ray Data's "Progress bars disabled ..." (where we turned
    # them off): loggers named after Ray's private modules (compat.RAY_QUIET_LOGGERS)
    **dict.fromkeys(compat.RAY_QUIET_LOGGERS, logging.ERROR),
}
# torchao's source files: the module a compile-time warning names is its file's path less ".py"
TORCHAO_SOURCES = r".*[/\\]torchao[/\\]"

# A Ray the job starts itself. Its raylet starts one idle Python worker per logical CPU when the first
# driver connects; none is ever used (a job with a runtime_env, as every run has, and Ray Train's actors,
# with env_vars of their own, need workers of their own), and on a GPU node they are dozens of Python
# start-ups competing with the run's own for the first seconds.
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
    return os.path.join(os.path.dirname(ray.__file__), *compat.RAY_REPORT_LOGGER_FILE)


def quiet_process() -> None:
    """Logger levels and warning filters of one process (the driver, or a Ray worker process through the
    runtime_env's worker_process_setup_hook). Cheap: imports nothing but Ray, already loaded there."""
    _pin_ray_address()
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    report = _ray_report_logger()
    if report:
        logging.getLogger(report).setLevel(logging.WARNING)
    errors = logging.getLogger(compat.RAY_TRAIN_FN_ERROR_LOGGER)
    if not any(isinstance(f, TrainFnErrorFilter) for f in errors.filters):
        errors.addFilter(TrainFnErrorFilter())
    # Ray's own APIs calling its deprecated ones (Ray Data's ExecutionOptions from Ray Train): nothing to fix here
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"ray\.")
    # torchao's sources compiled on first import ("invalid escape sequence": a SyntaxWarning from Python 3.12)
    for category in (SyntaxWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=TORCHAO_SOURCES)
    # the rest of the libraries' warnings (transformers' deprecations, ...) into the workers' log file
    libraries_to_file(library_log("workers"))


class TrainFnErrorFilter(logging.Filter):
    """Ray Train's "Error in training function:" record in a worker. None for a worker that stopped because
    another one died (launch.PeerLost: the controller's line names the dead worker, whose own traceback is
    the one to read); otherwise the traceback without its last newline, which the console showed as a
    blank `(RayTrainWorker pid=...)` line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "PeerLost: " in message:
            return False
        record.msg, record.args = message.rstrip("\n"), ()
        return True


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


# Libraries that give their loggers a console handler of their own (and stop them propagating) when imported
_OWN_HANDLERS = ("torch", "transformers", "mlflow", "datasets", "huggingface_hub")
# read by the libraries' progress bars: off where the project's lines are the only ones on the console
# (transformers' "Writing model shards", the hub's downloads, MLflow's uploads; Ray Data's bars are its own)
NO_BARS_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def library_log(command: str, per_call: bool = False) -> str:
    """Where a command run outside Ray keeps the libraries' lines: ~/.cache/raytune_ft/logs/<command>.log, or
    with `per_call` a file of this call's own, <command>-<UTC time to the microsecond>-<pid>.log (commands that may run at once,
    by several users' jobs or a retry beside a run, each keep their lines apart)."""
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    name = f"{command}-{now:%Y%m%d-%H%M%S-%f}-{os.getpid()}" if per_call else command
    return os.path.join(os.path.expanduser("~"), ".cache", "raytune_ft", "logs", f"{name}.log")


def own_lines_only(log_file: str, preload: tuple[str, ...] = ()) -> str:
    """A command run outside Ray (`raytune-ft register`, the kernel check): the project's own log lines on
    stdout, the libraries' warnings, Python's warnings and log lines into `log_file` (appended), no progress
    bars. `preload`: libraries the command imports later, imported now so their own console handlers are
    replaced too. Returns `log_file`."""
    import importlib
    import sys

    os.environ.setdefault("TQDM_DISABLE", "1")     # no other bar either: the command's own lines only
    for name in preload:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    to_file = libraries_to_file(log_file)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(to_file)
    root.setLevel(logging.WARNING)
    own = logging.getLogger("raytune_ft")
    own.setLevel(logging.INFO)
    if not any(getattr(h, "_raytune_console", False) for h in own.handlers):
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        console._raytune_console = True
        own.addHandler(console)
    return log_file


def libraries_to_file(log_file: str) -> logging.Handler:
    """Python's warnings and the log lines of the libraries imported so far that print on their own (torch,
    transformers, MLflow, ...) into `log_file` instead of the console; progress bars off. Called again after
    a library is imported, it moves that one too. Returns the file's handler."""
    import sys

    os.environ.update({k: os.environ.get(k, v) for k, v in NO_BARS_ENV.items()})
    path = os.path.abspath(log_file)
    to_file = _FILE_HANDLERS.get(path)
    if to_file is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        to_file = _FILE_HANDLERS[path] = logging.FileHandler(path)
        to_file.setFormatter(logging.Formatter("%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)       # warnings.warn(...) -> the "py.warnings" logger
    for name in ("py.warnings", *(n for n in _OWN_HANDLERS if n in sys.modules)):
        lib = logging.getLogger(name)
        for h in list(lib.handlers):
            if h is not to_file:
                lib.removeHandler(h)
        if to_file not in lib.handlers:
            lib.addHandler(to_file)
        lib.propagate = False
    if "transformers" in sys.modules:
        with contextlib.suppress(Exception):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
    return to_file


_FILE_HANDLERS: dict[str, logging.Handler] = {}
