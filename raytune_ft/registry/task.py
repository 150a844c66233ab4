"""The entry after `fit`: register the final checkpoint in a Ray task of its own, bounded in time.

The task has its own CPUs and memory (never a training worker's) and no GPU. The driver waits at most
registry.timeout_s plus a grace; the task stops itself at timeout_s, and one that cannot (stuck in C
code, its node lost) is killed when the grace is spent. Whatever goes wrong comes back as an outcome
with ok=False, never as an exception: the run is trained either way.
"""
from __future__ import annotations

import functools
from typing import Any

from raytune_ft.env import redact_exception
from raytune_ft.recipe.recipe import RegistryConfig
from raytune_ft.registry.base import RegistrationError, RegistrationOutcome, RegistrationResult, RegistryTarget, logger
from raytune_ft.registry.mlflow_model import register_checkpoint
from raytune_ft.registry.outcome import record_failure

_KILL_GRACE_S = 30.0  # run_registration kills the task this long after its own deadline


@functools.cache
def register_task():
    """register_checkpoint as a Ray remote function, made on first use so that the command line does not
    pay for importing Ray. Use `.options(num_cpus=..., memory=...).remote(...)`."""
    import ray

    # max_calls=1: a deadline that went off (SIGALRM, see mlflow_model._deadline) may leave MLflow's client
    # state half-changed in that process, so no later task runs there
    return ray.remote(max_retries=0, max_calls=1)(register_checkpoint)


def run_registration(checkpoint_path: str, registry_cfg: RegistryConfig, tracking_uri: str, *,
                     metadata: dict | None = None, run_id: str | None = None) -> RegistrationOutcome:
    """Register a finished run's checkpoint in a Ray task; wait at most registry_cfg.timeout_s.

    Never raises for a registry problem: a failed, refused or timed-out registration returns
    ok=False with the error and the retry command, the checkpoint left as it was.
    """
    if not registry_cfg.enabled:
        return RegistrationOutcome(ok=True, skipped=True)
    import ray
    from ray.exceptions import GetTimeoutError, RayTaskError

    options: dict[str, Any] = {"num_cpus": registry_cfg.num_cpus, "num_gpus": 0}
    if registry_cfg.memory_gb:
        options["memory"] = int(registry_cfg.memory_gb * (1 << 30))
    error: str
    failed_run_id = run_id
    ref = None
    try:
        ref = register_task().options(**options).remote(
            checkpoint_path, registry_cfg.name, RegistryTarget(tracking_uri, registry_cfg.registry_uri, run_id=run_id),
            timeout_s=registry_cfg.timeout_s, metadata=metadata)
        result: RegistrationResult = ray.get(ref, timeout=registry_cfg.timeout_s + _KILL_GRACE_S)
        logger.info("registered %s version %s (%s)", result.name, result.version, result.model_uri)
        return RegistrationOutcome(ok=True, result=result)
    except GetTimeoutError:
        if ref is not None:
            ray.cancel(ref, force=True)
        error = (f"registration did not finish within registry.timeout_s={registry_cfg.timeout_s:g}s "
                 f"(task killed after a further {_KILL_GRACE_S:g}s)")
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, RegistrationError) and cause.run_id:
            failed_run_id = cause.run_id
        error = str(cause) if isinstance(cause, RegistrationError) else redact_exception(cause)
    except Exception as e:  # scheduling problems, a lost worker, a dead node
        error = redact_exception(e)
    return record_failure(checkpoint_path, registry_cfg.name, tracking_uri, registry_cfg.registry_uri,
                          failed_run_id, error)
