"""The start-up kernel check's verdicts, kept beside the JIT caches so that a node with the same toolchain
skips the check's runs.

A check that every kernel passed is a fact about the GPU model, its driver, the kernel libraries' versions
and the model's widths: exactly what names the JIT cache's folder (train/jit_fingerprint.py). So a passing
check is written into that folder (`kernel_check/<key>.json`, the variable below points there), travels with
the folder's tar through the run's storage, and a later start on a node of the same fingerprint takes it
instead of running the kernels again. The key inside the folder adds what the fingerprint does not hold:
the compute dtype, Liger, the context-parallel forms, the paths and candidates checked, their tolerances, the
check's inputs, this package's version and a digest of the check's own code. Anything else is a different key, so the check runs.

Only an all-pass check is kept: a kernel that failed (or raised, perhaps for a passing reason such as memory
taken by another process) is checked again on the next start, never switched off from a file. The ranks
recall only when every rank holds a verdict (kernel_check.py), so the check's collectives match.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time

VERDICTS_ENV = "RAYTUNE_KERNEL_VERDICTS"      # set by train/jit_cache.py to `<cache folder>/kernel_check`


def key_of(use, paths) -> dict:
    """What a verdict holds for, beyond the cache folder's fingerprint."""
    import raytune_ft
    from raytune_ft.models.fast_paths import CHECK_LENS, TOLERANCE

    return {"dtype": str(use.dtype), "liger": bool(use.liger), "context_parallel": bool(use.context_parallel),
            "paths": [[p.name, [k.name for k in p.candidates], TOLERANCE[p.name][use.dtype]] for p in paths],
            "check_lens": list(CHECK_LENS), "raytune_ft": getattr(raytune_ft, "__version__", "unknown"),
            "code": _code_digest()}


def _code_digest() -> str:
    """The check's own code and the kernels' call wrappers: an edit of either is a new key."""
    h = hashlib.sha256()
    for name in ("fast_paths.py", "kernel_check.py"):       # read as files: kernel_check imports this module
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _file(folder: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(folder, f"{digest}.json")


def load(folder: str | None, use, paths) -> dict | None:
    """The kept record of an all-pass check of `paths` for `use` ({"errors": {"path/kernel": worst}, "checked_at",
    "seconds"}), or None: no folder, no record, another key, or an unreadable file."""
    if not folder:
        return None
    key = key_of(use, paths)
    try:
        with open(_file(folder, key)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    names = {f"{p.name}/{k.name}" for p in paths for k in p.candidates}
    if rec.get("key") != key or set(rec.get("errors", {})) != names:
        return None
    return rec


def save(folder: str | None, use, paths, errors: dict[str, float], seconds: float) -> None:
    """Keep an all-pass check (written whole or not at all; any failure to write is ignored)."""
    if not folder:
        return
    key = key_of(use, paths)
    rec = {"key": key, "errors": {k: float(v) for k, v in errors.items()}, "seconds": round(seconds, 2),
           "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, _file(folder, key))

