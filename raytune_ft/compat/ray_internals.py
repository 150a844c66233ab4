"""Ray's private names: Ray Train's controller, failure policy, data config and backend, the cluster's
key-value store and job table, the loggers the console quiets."""
from __future__ import annotations

from raytune_ft.compat.core import RAY, CompatError, Internal, PrivateAttr, installed, private_attr

RAY_WORKER_GROUP_CALLBACK = Internal(
    "ray", "ray.train.v2._internal.execution.callback", ("WorkerGroupCallback",), RAY,
    why="to note in the controller when it asks for an attempt's workers (driver/launch.NoteWorkersAsked): "
        "Ray Train's public callbacks see reports and errors only")
RAY_FAILURE_POLICY = Internal(
    "ray", "ray.train.v2._internal.execution.failure_handling",
    ("FailureDecision", "FailurePolicy", "create_failure_policy"), RAY,
    why="to end a run at once on an error no retry can fix (driver/launch.RaiseUnfixable): FailureConfig "
        "retries every error alike")
RAY_DASHBOARD_URL = Internal(
    "ray", "ray._private.worker", ("get_dashboard_url",), RAY,
    why="to know whether the connected Ray serves a dashboard, without which Ray Train's placement-group "
        "cleaner cannot work (driver/launch.without_blind_callbacks)")
RAY_TORCH_BACKEND = Internal(
    "ray", "ray.train.torch.config", ("_TorchBackend", "_shutdown_torch"), RAY,
    why="as the process-group set-up and shutdown of train/backend.TorchBackend, Ray's own torch backend "
        "imported lazily and stopped within a bound")
RAY_TRAINING_FRAMEWORK = Internal(
    "ray", "ray.train.v2._internal.util", ("TrainingFramework",), RAY,
    why="as the framework train/backend.TorchBackendConfig declares, as Ray's TorchConfig does")
RAY_INTERNAL_KV = Internal(
    "ray", "ray.experimental.internal_kv", ("_internal_kv_get", "_internal_kv_put", "_internal_kv_del"), RAY,
    why="to keep a job's attempt count and the time its workers were asked for in the cluster's key-value "
        "store (train/job_attempts.py): Ray has no public one")
RAY_ACCELERATORS = Internal(
    "ray", "ray._private.accelerators", ("get_accelerator_manager_for_resource",), RAY,
    why="to count the GPUs a local Ray would find before starting it (driver/preflight.local_gpus), as Ray counts "
        "them (CUDA_VISIBLE_DEVICES respected), without importing torch in the driver")
RAY_TRAIN_CONSTANTS = Internal(
    "ray", "ray.train.v2._internal.constants",
    ("get_env_vars_to_propagate", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR",
     "DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE"), RAY,
    why="to start the tokenizer-loading task in the runtime environment of Ray Train's controller "
        "(data/pipeline.py), so that the worker process it warms is one the controller's tasks can reuse")
RAY_AUTOSCALING_COORDINATOR = Internal(
    "ray", "ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator",
    ("get_or_create_autoscaling_coordinator",), RAY,
    why="to start the actor Ray Train's controller waits for as soon as Ray is up (driver/start_ahead), beside the "
        "MLflow run and the datasets")
RAY_JOB_TABLE = Internal(
    "ray", "ray._private.ray_constants", ("KV_NAMESPACE_JOB",), RAY,
    why="to read when a submitted job started from Ray's own job table (driver/start_ahead.submitted_at)")
RAY_JOB_INFO = Internal(
    "ray", "ray.dashboard.modules.job.common", ("JobInfoStorageClient",), RAY,
    why="for the key of a submitted job's record in Ray's job table (its JOB_DATA_KEY): the job "
        "submission client answers over the dashboard's HTTP server, which a job's own driver should not wait on")


def ray_job_started_at(submission_id: str) -> float | None:
    """When Ray accepted the job submission `submission_id` (epoch seconds), read from Ray's own job table in
    the cluster's key-value store; None where the table holds no record of it or no start time yet.
    CompatError where the record is not under the key, or not in the form, it was."""
    import json

    kv_get = RAY_INTERNAL_KV.load()[0]
    key = getattr(RAY_JOB_INFO.load(), "JOB_DATA_KEY", None)
    if not isinstance(key, str) or "{job_id}" not in key:
        raise CompatError(f"{installed('ray')}: JobInfoStorageClient.JOB_DATA_KEY is {key!r}, not a key with a "
                          f"job id; checked on {RAY}. Update raytune_ft/compat/ for this Ray.")
    raw = kv_get(key.format(job_id=submission_id), namespace=RAY_JOB_TABLE.load())
    if raw is None:
        return None
    try:
        start_ms = json.loads(raw).get("start_time")
        return float(start_ms) / 1000.0 if start_ms else None
    except (ValueError, TypeError, AttributeError) as e:
        raise CompatError(f"{installed('ray')}: the job table's record of {submission_id} is not a JSON object "
                          f"with a start_time in ms ({e}); checked on {RAY}. Update raytune_ft/compat/.") from e


RAY_DATA_CONFIG_OPTIONS = PrivateAttr(
    "ray", "ray.train", "DataConfig", "_resolve_execution_options", RAY,
    why="for the execution options Ray Train gives each dataset (data/pipeline.train_data_config): a "
        "DataConfig that splits without dropping rows overrides configure, which has no public helper")
RAY_DATA_CONFIG_SPLIT = PrivateAttr(
    "ray", "ray.train", "DataConfig", "_datasets_to_split", RAY, named_in="__init__",
    why="for the datasets a DataConfig splits across the workers (its constructor's argument, kept privately)")


def ray_data_config() -> type:
    """Ray Train's DataConfig, once the private parts a subclass's configure reads are found on it."""
    RAY_DATA_CONFIG_OPTIONS.check()
    return RAY_DATA_CONFIG_SPLIT.check()


# DataParallelTrainer methods driver/launch's trainer overrides: Ray Train has no public way to pass the
# controller its failure policy or to leave out one of its own callbacks
RAY_TRAINER_INTERNALS = ("_initialize_and_run_controller",)


def check_ray_trainer_internals(trainer_cls: type) -> type:
    """`trainer_cls`, once the DataParallelTrainer methods it overrides are found on it (a renamed one would
    silently stop being called)."""
    missing = [name for name in RAY_TRAINER_INTERNALS if not callable(getattr(trainer_cls, name, None))]
    if missing:
        raise CompatError(f"{installed('ray')}: DataParallelTrainer has no {', '.join(missing)}; the run's trainer "
                          f"overrides them (driver/launch.py); checked on {RAY}.")
    return trainer_cls

# Loggers quieted by console.quiet_process: named after Ray's private modules (and one after its file)
# The attribute of Ray Train's UserExceptionWithTraceback (ray.train.v2._internal.exceptions) that holds a
# worker's own exception: driver/launch.unfixable_error looks through it for an error no retry can fix (Ray
# exposes the wrapper, not what it wraps)
RAY_WRAPPED_ERROR = Internal(
    "ray", "ray.train.v2._internal.exceptions", ("UserExceptionWithTraceback",), RAY,
    why="to find a worker's own error inside Ray Train's wrapping of it (driver/launch.unfixable_error)")


def ray_wrapped_error(e: BaseException) -> BaseException | None:
    """The worker's exception inside Ray Train's UserExceptionWithTraceback `e`; None for another exception.
    CompatError where the wrapper no longer holds it where it did."""
    wrapper = RAY_WRAPPED_ERROR.load()
    if not isinstance(e, wrapper):
        return None
    return private_attr(e, "_base_exc", "ray", RAY)


RAY_QUIET_LOGGERS = ("ray.train.v2._internal.execution.controller.placement_group_cleaner",
                     "ray._private.authentication.authentication_token_setup",
                     "ray.data._internal.progress")
# Ray Train's worker-side logger of "Error in training function:" and the traceback (console.quiet_process
# filters it)
RAY_TRAIN_FN_ERROR_LOGGER = "ray.train.v2._internal.util"
RAY_REPORT_LOGGER_FILE = ("train", "v2", "_internal", "execution", "context.py")   # under ray's package folder
