"""The process environment: credentials it holds are never written anywhere, settings borrowed from it go back.

Credentials (Databricks, Hugging Face, MLflow tokens) are read by MLflow and the hub client from the
environment only. Everything the project writes that could carry one (a log line, an exception's text, a
param, a tag, a failure record, a retry command) goes through `redact`, `redact_exception`, `scrub` or
`public_uri` first: they know the values by the variables' names, so no list of tokens is kept anywhere.

`scoped_env` is the one way to set variables for a block and put the previous values back (a Ray worker
process is reused across tasks, and tests share one process).
"""
from __future__ import annotations

import contextlib
import os
import re
import traceback
from typing import Any, Iterable, Iterator

# Names of environment variables whose values are credentials.
SECRET_NAME = re.compile(r"token|secret|password|passwd|credential|api[_-]?key|access[_-]?key", re.IGNORECASE)


# Ray Train's controller polls the workers every 2 s by default, and a worker's checkpoint report waits for
# the next poll: up to 2 s of idle GPUs per save, and as long after the last step before the run ends.
TRAIN_POLL_ENV, TRAIN_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"


# Ray Train starts a preemption watcher actor per attempt, polling the nodes' drain state: a process of its
# own (a Python start-up importing Ray, CPU seconds per attempt) and an ERROR line on the console about its
# constructor arguments. Drained nodes are GPU nodes of a cluster (spot capacity, upgrades); a CPU run (the
# jobs' --local) goes without it.
PREEMPTION_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
_SET_HERE = {"preemption": False}    # whether PREEMPTION_ENV's value is ray_train_defaults' (else the user's)


def ray_train_defaults(*, watch_preemption: bool = True) -> None:
    """The job's defaults for Ray Train's own variables (a value the user set wins). Set before anything
    reads Ray Train's environment: the controller gets the driver's value, and the processes started ahead
    for it (data/pipeline.start_tokenizing_processes) must share its runtime environment to be reused.
    `watch_preemption`: False for a run whose workers use no GPU (Ray Train's preemption watcher off)."""
    os.environ.setdefault(TRAIN_POLL_ENV, TRAIN_POLL_S)
    if PREEMPTION_ENV in os.environ and not _SET_HERE["preemption"]:
        return
    if watch_preemption:
        os.environ.pop(PREEMPTION_ENV, None)
    else:
        os.environ[PREEMPTION_ENV] = "0"
    _SET_HERE["preemption"] = not watch_preemption


def process_start() -> float | None:
    """When this process started (epoch seconds), or None where that cannot be read."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - callers measure from their own start instead
        return None


def environ_snapshot() -> dict[str, str]:
    """A copy of the process environment that another thread changing it cannot break.

    Iterating os.environ looks each key up again, so a variable dropped meanwhile (MLflow's telemetry
    thread sets and drops its own) raises KeyError; copying the underlying dict is one C call, which no
    other Python thread can interleave with."""
    env = os.environ
    raw = getattr(env, "_data", None)
    if isinstance(raw, dict):
        return {env.decodekey(k): env.decodevalue(v) for k, v in raw.copy().items()}
    for _ in range(100):     # another Python without os.environ._data: retry a torn read
        try:
            return dict(env)
        except (KeyError, RuntimeError):
            continue
    return dict(env)


def secret_values() -> list[str]:
    """Values of credential-looking environment variables in this process (long enough to be meaningful)."""
    return [v for k, v in environ_snapshot().items() if SECRET_NAME.search(k) and v and len(v) >= 8]


def redact(text: str) -> str:
    """`text` with every credential value from the environment replaced by ***, and each URI in it in
    its public form (`public_uri`)."""
    for v in sorted(secret_values(), key=len, reverse=True):
        text = text.replace(v, "***")
    return _URI_IN_TEXT.sub(lambda m: _public_form(m.group(0)), text)


def redact_exception(exc: BaseException, *, with_traceback: bool = False) -> str:
    """An exception as text fit for a log, a tag or a file: "Type: message", or the whole traceback
    (chained causes included) with `with_traceback`, redacted either way.

    Logging with exc_info=True would write the raw text; log this instead."""
    if with_traceback:
        return redact("".join(traceback.format_exception(exc)).rstrip())
    return redact(f"{type(exc).__name__}: {exc}")


def scrub(obj: Any) -> Any:
    """User metadata fit to log: secret-looking keys dropped, secret values redacted, at any depth. A number is
    kept whatever its key: a count (`tokens`, `real_tokens`) is no credential."""
    if isinstance(obj, dict):
        return {str(k): scrub(v) for k, v in obj.items()
                if not SECRET_NAME.search(str(k)) or (isinstance(v, (int, float)) and not isinstance(v, bool))}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    if isinstance(obj, str):
        return redact(obj)
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    return redact(str(obj))


# query parameters that name a place or a setting, never a credential: kept in a public URI; every other
# parameter's value is masked (token=, sig=, X-Amz-Signature=, access_key=, secret_key=, ...)
PUBLIC_QUERY_KEYS = frozenset({"endpoint_override", "endpoint", "scheme", "region", "experiment_id", "run_id"})
# a URI inside free text: it ends at whitespace or a quote
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def _public_form(uri: str) -> str:
    """One URI without credentials: the password of user:password@ (or a userinfo that is a bare token)
    masked, each query value outside PUBLIC_QUERY_KEYS masked, the fragment dropped."""
    scheme, rest = uri.split("://", 1)
    rest, _, _ = rest.partition("#")
    before_query, q, query = rest.partition("?")
    # userinfo ends at the last '@' before the query; a secret may hold a '/' that urlsplit would cut at
    userinfo, at, after = before_query.rpartition("@")
    if at and (":" in userinfo or "/" not in userinfo):
        user, colon, _ = userinfo.partition(":")
        # git-style https://<token>@host carries the credential as the user name
        before_query = f"{user}:***@{after}" if colon else f"***@{after}"
    if q:
        pairs = []
        for part in query.split("&"):
            key, eq, _ = part.partition("=")
            if key.lower() not in PUBLIC_QUERY_KEYS:      # a bare value (?<signature>) is masked too
                part = f"{key}=***" if eq else "***"
            pairs.append(part)
        before_query += "?" + "&".join(pairs)
    return f"{scheme}://{before_query}"


def public_uri(uri: str | None) -> str | None:
    """A URI fit to print, write or log: no password or token in its userinfo or its query, no fragment,
    no credential value of the environment. Every URI the project shows goes through here (`redact`
    applies it to each URI inside a text); the URI itself is unchanged for the code that uses it."""
    if not uri:
        return uri
    return redact(str(uri))


# MLflow writes "View run ... at: <tracking URI>/#/..." to stdout when a run on a tracking server ends,
# a password in the URI included: off wherever the project ends an MLflow run (scoped_env(NO_RUN_URL_PRINT))
NO_RUN_URL_PRINT = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


@contextlib.contextmanager
def scoped_env(values: dict[str, str] | None = None, *, keep: Iterable[str] = ()) -> Iterator[None]:
    """Set `values` for the block; afterwards those variables and the ones named in `keep` (which code in
    the block may change) are as they were before it."""
    saved = {k: os.environ.get(k) for k in [*(values or {}), *keep]}
    os.environ.update(values or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def child_python_env() -> dict[str, str]:
    """This process's environment for a child Python that imports raytune_ft: the package's folder first on
    PYTHONPATH (a Ray worker finds it through its working folder, which a child started elsewhere may not)."""
    from pathlib import Path

    package_root = str(Path(__file__).resolve().parents[1])
    env = environ_snapshot()     # another thread (MLflow's telemetry) may set or drop variables meanwhile
    return {**env, "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])}


# Python's bytecode cache: the variables a job sets for every process it starts (bytecode_cache)
BYTECODE_ENV = ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")
# the CUDA allocator's expandable segments for every worker (driver/launch.py): without them a step whose tensors
# change size (the long-context steps' micro-batches) strands GiBs in reserved but free blocks, which ran a CP-8
# rank of the 27B out of memory at 65.5 GiB allocated and 75.9 GiB reserved on an 80 GB GPU; the user's value wins
ALLOC_CONF_ENV, ALLOC_CONF_DEFAULT = "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"


def _bytecode_missing(mode: str) -> bool:
    """Whether this Python compiles its imports from source at every start: it writes no bytecode beside
    the sources (PYTHONDONTWRITEBYTECODE, or torch's package folder, the largest import, read-only) and,
    for mode "auto", torch's bytecode is not there either (an install that compiled none, as uv's)."""
    import importlib.util
    import sys

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    source = spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None
    if not (sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE")
            or (source and not os.access(os.path.dirname(source), os.W_OK))):
        return False
    return mode == "on" or not (source and os.path.exists(importlib.util.cache_from_source(source)))


def keep_bytecode(cache_root: str, mode: str = "auto") -> dict[str, str]:
    """Keep the job's compiled Python modules in `<cache_root>/bytecode` when nothing else would.

    A container image often sets PYTHONDONTWRITEBYTECODE, and an install may compile no bytecode (uv's
    default) or be read-only: then every process of every job compiles torch, transformers, Ray and the
    kernels' Python from source again, a large share of each Ray worker's imports.
    This points this process (from its next import on) and, through the variables it sets, every process
    the job starts at a folder beside the JIT caches; nothing is written beside the sources. `mode` is the
    recipe's `train.bytecode_cache` (recipe.py). A PYTHONPYCACHEPREFIX the user set is left as it is.
    Returns the variables set ({} when none)."""
    import sys

    if mode == "off" or os.environ.get("PYTHONPYCACHEPREFIX") or not _bytecode_missing(mode):
        return {}
    folder = bytecode_folder(cache_root)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:     # only a faster start is lost
        return {}
    env = {"PYTHONPYCACHEPREFIX": folder, "PYTHONDONTWRITEBYTECODE": ""}   # empty: Python's "not set"
    os.environ.update(env)
    sys.pycache_prefix = folder
    sys.dont_write_bytecode = False
    return env


def bytecode_folder(cache_root: str) -> str:
    """The folder keep_bytecode points Python at under a job's cache root."""
    return os.path.join(os.path.abspath(os.path.expanduser(cache_root)), "bytecode")


def bytecode_env() -> dict[str, str]:
    """The bytecode variables of this process, for the runtime_env of the processes a job starts."""
    return {k: os.environ[k] for k in BYTECODE_ENV if k in os.environ}


def package_versions(names, missing: str) -> dict[str, str]:
    """Each installed distribution's version, `missing` for one that is not installed."""
    import importlib.metadata as md

    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = missing
    return out
