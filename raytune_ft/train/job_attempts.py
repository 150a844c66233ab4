"""A job's attempts in Ray's key-value store (namespace raytune_ft), keyed by the run's name and the job's start:
which attempt rank 0 runs, and when Ray Train's controller last asked for the job's workers. Labels and
diagnoses of the start-up breakdown (train/startup_clock.StartupClock); outside Ray they fall back to defaults."""
from __future__ import annotations

from raytune_ft import compat
_NAMESPACE = "raytune_ft"


def _key(kind: str, run_name: str, job_start: float) -> str:
    return f"raytune-{kind}:{run_name}:{job_start:.3f}"


def _store():
    """Ray's key-value store (get, put, delete), or None outside a Ray process (a unit test's WorkerLog)."""
    import ray

    return compat.RAY_INTERNAL_KV.load() if ray.is_initialized() else None


def attempt_of_job(run_name: str, job_start: float) -> int:
    """Which of this job's attempts rank 0 runs (1, 2, ...), counted in Ray's key-value store; 1 outside Ray."""
    store = _store()
    if store is None:
        return 1
    get, put, _ = store
    key = _key("attempt", run_name, job_start)
    n = int(get(key, namespace=_NAMESPACE) or 0) + 1
    put(key, str(n), overwrite=True, namespace=_NAMESPACE)
    return n


def workers_asked_key(run_name: str, job_start: float) -> str:
    """The key in Ray's key-value store (namespace raytune_ft) under which Ray Train's controller notes when it
    last asked for this job's workers (launch.NoteWorkersAsked): the attempt's workers read it at their start."""
    return _key("workers-asked", run_name, job_start)


def workers_asked_at(run_name: str, job_start: float) -> float | None:
    """When Ray Train's controller last asked for this job's workers (epoch seconds); None outside Ray or
    where it did not note it."""
    store = _store()
    if store is None:
        return None
    value = store[0](workers_asked_key(run_name, job_start), namespace=_NAMESPACE)
    return float(value) if value else None


def note_workers_asked(key: str) -> None:
    """In Ray Train's controller, as it asks for an attempt's workers: now, under `key` (workers_asked_key)."""
    import time

    store = _store()
    if store is not None:
        store[1](key, repr(time.time()), overwrite=True, namespace=_NAMESPACE)
