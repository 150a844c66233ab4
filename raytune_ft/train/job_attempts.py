"""A job's attempts in Ray's key-value store (namespace raytune_ft), keyed by the run's name and the job's start:
which attempt rank 0 runs, and when Ray Train's controller last asked for the job's workers. Labels and
diagnoses of the start-up breakdown (train/common.StartupClock); outside Ray they fall back to defaults."""
from __future__ import annotations

_NAMESPACE = "raytune_ft"


def _key(kind: str, run_name: str, job_start: float) -> str:
    return f"raytune-{kind}:{run_name}:{job_start:.3f}"


def attempt_of_job(run_name: str, job_start: float) -> int:
    """Which of this job's attempts rank 0 runs (1, 2, ...), counted in Ray's key-value store; 1 outside Ray."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

        key = _key("attempt", run_name, job_start)
        n = int(_internal_kv_get(key, namespace=_NAMESPACE) or 0) + 1
        _internal_kv_put(key, str(n), overwrite=True, namespace=_NAMESPACE)
        return n
    except Exception:  # noqa: BLE001 - a label of the start-up line only
        return 1


def workers_asked_key(run_name: str, job_start: float) -> str:
    """The key in Ray's key-value store (namespace raytune_ft) under which Ray Train's controller notes when it
    last asked for this job's workers (launch.NoteWorkersAsked): the attempt's workers read it at their start."""
    return _key("workers-asked", run_name, job_start)


def workers_asked_at(run_name: str, job_start: float) -> float | None:
    """When Ray Train's controller last asked for this job's workers (epoch seconds); None outside Ray or
    where it did not note it."""
    try:
        from ray.experimental.internal_kv import _internal_kv_get

        value = _internal_kv_get(workers_asked_key(run_name, job_start), namespace=_NAMESPACE)
        return float(value) if value else None
    except Exception:  # noqa: BLE001 - a diagnosis only: the parts then count from the process's start
        return None


def note_workers_asked(key: str) -> None:
    """In Ray Train's controller, as it asks for an attempt's workers: now, under `key` (workers_asked_key)."""
    import time

    try:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, repr(time.time()), overwrite=True, namespace=_NAMESPACE)
    except Exception:  # noqa: BLE001 - a diagnosis only: the breakdown then counts from the process's start
        pass
