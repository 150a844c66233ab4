"""The private names of Ray, torch, MLflow, transformers and torchao that the package uses, behind one door.

Each entry says why the public API does not do, and the versions it was checked on. A name that moved or
went away raises `CompatError` where it is first needed (at import for the ones a class is built on, at
the run's start for the rest), naming the installed version: an upgrade breaks here, loudly, never by a
fallback that quietly does less. tests/test_compat.py loads every entry; tests/test_structure.py holds the
rest of the package to importing none of these names itself.

Checked on: Ray 2.60.0, torch 2.13.0 (CPU) and 2.11.0 (GPU), MLflow 3.17.2, transformers 5.25.0 (CPU) and
5.17.0 (GPU), torchao 0.18.0. Public APIs used instead where they exist: Ray Train's
`CheckpointUploadMode.NO_UPLOAD` (the FSDP2 loop reports a checkpoint it uploaded itself,
train/checkpointer.py), DCP's `DefaultStager` with `StagingOptions` (no patch on a torch that keeps its
stager reusable).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

RAY, TORCH, MLFLOW, TRANSFORMERS = "ray 2.60.0", "torch 2.11.0, 2.13.0", "mlflow 3.17.2", "transformers 5.17.0, 5.25.0"
TORCHAO = "torchao 0.18.0"


class CompatError(RuntimeError):
    """A library's internal that raytune_ft relies on is missing or changed in the installed version."""


def installed(package: str) -> str:
    """`package` and its installed version, as an error names them."""
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} (not installed)"


@dataclass(frozen=True)
class Internal:
    """`names` of `module`, a private part of `package`; `known`: the versions it was checked on; `why`:
    what the public API lacks."""

    package: str
    module: str
    names: tuple[str, ...]
    known: str
    why: str

    def load(self) -> Any:
        """The name (one) or a tuple of the names, or CompatError naming the installed version."""
        try:
            mod = importlib.import_module(self.module)
            found = tuple(getattr(mod, n) for n in self.names)
        except (ImportError, AttributeError) as e:
            raise CompatError(
                f"{installed(self.package)}: {self.module}.{'/'.join(self.names)} is not there ({e}). raytune_ft "
                f"uses it {self.why}; checked on {self.known}. Install a checked version, or update "
                "raytune_ft/compat.py for this one.") from e
        return found[0] if len(found) == 1 else found


def private_attr(obj: Any, name: str, package: str, known: str) -> Any:
    """`obj`'s private attribute `name`, or CompatError naming `package`'s installed version."""
    if not hasattr(obj, name):
        raise CompatError(f"{installed(package)}: {type(obj).__name__} has no {name}; checked on {known}. "
                          f"Update raytune_ft/compat.py for this {package}.")
    return getattr(obj, name)


# ---------------------------------------------------------------------------------------------------- Ray

RAY_WORKER_GROUP_CALLBACK = Internal(
    "ray", "ray.train.v2._internal.execution.callback", ("WorkerGroupCallback",), RAY,
    why="to note in the controller when it asks for an attempt's workers (train/launch.NoteWorkersAsked): "
        "Ray Train's public callbacks see reports and errors only")
RAY_FAILURE_POLICY = Internal(
    "ray", "ray.train.v2._internal.execution.failure_handling",
    ("FailureDecision", "FailurePolicy", "create_failure_policy"), RAY,
    why="to end a run at once on an error no retry can fix (train/launch.RaiseUnfixable): FailureConfig "
        "retries every error alike")
RAY_DASHBOARD_URL = Internal(
    "ray", "ray._private.worker", ("get_dashboard_url",), RAY,
    why="to know whether the connected Ray serves a dashboard, without which Ray Train's placement-group "
        "cleaner cannot work (train/launch.without_blind_callbacks)")
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
    why="to count the GPUs a local Ray would find before starting it (preflight.local_gpus), as Ray counts "
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
    why="to start the actor Ray Train's controller waits for as soon as Ray is up (start_ahead), beside the "
        "MLflow run and the datasets")
RAY_JOB_TABLE = Internal(
    "ray", "ray._private.ray_constants", ("KV_NAMESPACE_JOB",), RAY,
    why="to read when a submitted job started from Ray's own job table (start_ahead), with "
        "ray.dashboard.modules.job.common.JobInfoStorageClient.JOB_DATA_KEY")

# Loggers quieted by console.quiet_process: named after Ray's private modules (and one after its file)
# The attribute of Ray Train's UserExceptionWithTraceback (ray.train.v2._internal.exceptions) that holds a
# worker's own exception: train/launch.unfixable_error looks through it for an error no retry can fix (Ray
# exposes the wrapper, not what it wraps)
RAY_WRAPPED_ERROR = Internal(
    "ray", "ray.train.v2._internal.exceptions", ("UserExceptionWithTraceback",), RAY,
    why="to find a worker's own error inside Ray Train's wrapping of it (train/launch.unfixable_error)")


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

# ---------------------------------------------------------------------------------------------------- torch

TORCH_DTENSOR_OFFSETS = Internal(
    "torch", "torch.distributed.tensor._utils", ("compute_local_shape_and_global_offset",), TORCH,
    why="to read each rank's shard of a weight straight from the files (models/build.py): DTensor has no "
        "public way to ask where its local shard starts")
TORCH_DYNAMO_COUNTERS = Internal(
    "torch", "torch._dynamo.utils", ("calculate_time_spent", "counters"), TORCH,
    why="for the start-up breakdown's compile seconds and cache hits (train/common.py): torch.compile "
        "reports neither publicly")

TORCH_INDUCTOR_CACHE_DIR = Internal(
    "torch", "torch._inductor.runtime.cache_dir_utils", ("default_cache_dir",), TORCH,
    why="to tell Inductor's own default cache folder, inherited through TORCHINDUCTOR_CACHE_DIR, from a "
        "user's choice (train/jit_cache.py)")


def _torch_minor() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _stager_closes_copier() -> bool:
    # pytorch#183413: 2.11's DefaultStager._stage closes its state-dict copier at the end of every stage, so a
    # stager is not reusable (the fix, pytorch#183424, is in 2.13); before 2.11 it never did
    return (2, 11) <= _torch_minor() < (2, 13)


def keep_stager_buffers(stager) -> Callable[[], None]:
    """For DCP's `DefaultStager` kept across a run's saves: on a torch that closes the stager's copier after
    every stage, the pinned host buffers would be dropped and pinned again inside every save (while the
    loop waits), and the next save fails with KeyError: <class 'type'>. There the copier's close is held
    back; the returned function closes it (call it after `stager.close()`). Elsewhere: nothing to do."""
    if not _stager_closes_copier():
        return lambda: None
    copier = getattr(stager, "_state_dict_stager", None)
    if copier is None or not callable(getattr(copier, "close", None)):
        raise CompatError(f"{installed('torch')}: DefaultStager has no _state_dict_stager with a close(); "
                          "raytune_ft holds that close back so the stager can be reused across saves "
                          f"(pytorch#183413); checked on {TORCH}. Update raytune_ft/compat.py for this torch.")
    close = copier.close
    copier.close = lambda: None
    return close


@contextlib.contextmanager
def fsdp_kept_unsharded(modules: list) -> Iterator[None]:
    """Inside it, the FSDP2 `modules` keep their parameters unsharded after a forward (FSDP2's public
    `set_reshard_after_forward(False)`); on leaving, each gets back its own setting and is resharded. FSDP2
    has no public getter for a module's setting, and its setter also drops the root's automatic choice: the
    state's `_auto_reshard_after_forward` and each parameter group's `post_forward_mesh_info` are kept and put
    back (torch 2.11 holds one group per state in `_fsdp_param_group`, 2.13 a list in `_fsdp_param_groups`).
    A probe can be the model's first forward (the samples before the first step), where FSDP2's lazy set-up
    makes the root keep its parameters after a forward, where it was left to choose (`_is_root`); the
    setting put back then is that choice, not the one saved before it was made."""
    saved = []
    for m in modules:
        state = private_attr(m, "_get_fsdp_state", "torch", TORCH)()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = private_attr(state, "_fsdp_param_group", "torch", TORCH)
            groups = [one] if one is not None else []
        saved.append((m, state, private_attr(state, "_auto_reshard_after_forward", "torch", TORCH),
                      [(g, private_attr(g, "post_forward_mesh_info", "torch", TORCH)) for g in groups]))
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        yield
    finally:
        for m, state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            root_keeps = auto and private_attr(state, "_is_root", "torch", TORCH) is True
            for g, info in groups:
                g.post_forward_mesh_info = None if root_keeps else info
            m.reshard()


# ---------------------------------------------------------------------------------------------------- MLflow

MLFLOW_CHAT_SIGNATURE = Internal(
    "mlflow", "mlflow.transformers.llm_inference_utils", ("_SIGNATURE_FOR_LLM_INFERENCE_TASK",), MLFLOW,
    why="for the signature MLflow itself gives task llm/v1/chat, passed with a model logged from files")
MLFLOW_REGISTRY_UTILS = Internal(
    "mlflow", "mlflow.tracking._model_registry.utils", ("_get_default_registry_uri_for_tracking_uri",), MLFLOW,
    why="for the registry a tracking URI implies (databricks-uc for databricks), for a client of its own")


@contextlib.contextmanager
def mlflow_target(tracking_uri: str, registry_uri: str | None) -> Iterator[None]:
    """MLflow's fluent API pointed at these stores for the block, the previous ones put back after it
    (a Ray worker process is reused across tasks: an earlier registration's URIs must not leak). MLflow's
    setters cannot put back "none set", which it keeps in private module variables."""
    import mlflow

    reg_utils = Internal("mlflow", "mlflow.tracking._model_registry", ("utils",), MLFLOW,
                         why="to put back the registry URI").load()
    trk_utils = Internal("mlflow", "mlflow.tracking._tracking_service", ("utils",), MLFLOW,
                         why="to put back the tracking URI").load()
    for module, name in ((reg_utils, "_registry_uri"), (trk_utils, "_tracking_uri")):
        if not hasattr(module, name):
            raise CompatError(f"{installed('mlflow')}: {module.__name__}.{name} is not there; raytune_ft "
                              f"saves and puts back MLflow's URIs around a registration; checked on {MLFLOW}.")
    saved_tracking, saved_registry = trk_utils._tracking_uri, reg_utils._registry_uri
    mlflow.set_tracking_uri(tracking_uri)
    # unset registry URI: the tracking store, or databricks-uc when tracking is databricks
    mlflow.set_registry_uri(registry_uri or MLFLOW_REGISTRY_UTILS.load()(tracking_uri))
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved_tracking)
        reg_utils._registry_uri = saved_registry


@contextlib.contextmanager
def mlflow_registration_prints_off() -> Iterator[None]:
    """MLflow prints "Successfully registered model ..." and "Created version ..." whatever its log level
    (through `eprint` of its private registry module); the run's summary says the same."""
    fluent = Internal("mlflow", "mlflow.tracking._model_registry", ("fluent",), MLFLOW,
                      why="to keep its registration prints off the console").load()
    if not callable(getattr(fluent, "eprint", None)):
        raise CompatError(f"{installed('mlflow')}: mlflow.tracking._model_registry.fluent.eprint is not there; "
                          f"checked on {MLFLOW}. Update raytune_ft/compat.py for this MLflow.")
    printed = fluent.eprint
    fluent.eprint = lambda *a, **k: None
    try:
        yield
    finally:
        fluent.eprint = printed


# ---------------------------------------------------------------------------------------------------- torchao

# torchao's float8 training wrappers of a weight (train/fp8.py): eval, samples and checkpoints use the
# high-precision tensor each wraps, which torchao keeps in a private attribute (named by the tensor-subclass
# protocol's __tensor_flatten__, its first inner tensor); torchao has no public unwrap
TORCHAO_WEIGHT_WRAPPERS = (
    Internal("torchao", "torchao.float8.fsdp_utils", ("WeightWithDynamicFloat8CastTensor",), TORCHAO,
             why="to read the high-precision weight inside a float8 linear's FSDP2 weight"),
    Internal("torchao", "torchao.prototype.moe_training.tensor",
             ("MXFP8TrainingWeightWrapperTensor", "Float8TrainingWeightWrapperTensor"), TORCHAO,
             why="to read the high-precision weight inside an MXFP8 linear's weight"),
)


def torchao_weight_wrappers() -> tuple[type, ...]:
    """The classes of torchao's weight wrappers whose modules are imported (a tensor of one can exist only
    then: an fp8 run imports the one its recipe uses), so that asking never imports torchao's prototypes."""
    found: list[type] = []
    for entry in TORCHAO_WEIGHT_WRAPPERS:
        if entry.module not in sys.modules:
            continue
        loaded = entry.load()
        found += loaded if isinstance(loaded, tuple) else [loaded]
    return tuple(found)


def torchao_inner_tensor(t):
    """The high-precision tensor torchao's weight wrapper `t` holds (its first inner tensor)."""
    import torch

    names, _ = t.__tensor_flatten__()
    inner = getattr(t, names[0], None) if names else None
    if not isinstance(inner, torch.Tensor):
        raise CompatError(f"{installed('torchao')}: {type(t).__name__} holds no tensor first ({names}); checked "
                          f"on {TORCHAO}. Update raytune_ft/compat.py for this torchao.")
    return inner


# ---------------------------------------------------------------------------------------------------- transformers

def attn_implementation(config) -> str | None:
    """The attention implementation a built model's `config` says its layers use. transformers keeps it in
    a private attribute (set through the public PreTrainedModel.set_attn_implementation)."""
    return private_attr(config, "_attn_implementation", "transformers", TRANSFORMERS)


# Trainer methods the TRL loop's SFTTrainer subclass overrides (train/trl/trainer.py) and the attributes it
# reads: Hugging Face's Trainer has no public hook for each step's own loss, for where the best model is
# loaded from, or for a check before each save
TRAINER_INTERNALS = ("_maybe_log_save_evaluate", "_load_best_model", "_save_checkpoint", "_get_learning_rate")


def check_trainer_internals(trainer_cls: type) -> type:
    """`trainer_cls`, once the Trainer methods the loop overrides are found on it (a renamed one would
    silently stop being called)."""
    missing = [name for name in TRAINER_INTERNALS if not callable(getattr(trainer_cls, name, None))]
    if missing:
        raise CompatError(f"{installed('transformers')}: Trainer has no {', '.join(missing)}; the TRL loop "
                          f"overrides them (train/trl/trainer.py); checked on {TRANSFORMERS}.")
    return trainer_cls


@contextlib.contextmanager
def transformers_without_torchao(precision: str) -> Iterator[None]:
    """Around the worker's first import of transformers' modelling code: in a bf16 run, transformers' torchao
    check answers False meanwhile, so its quantizers do not import torchao on their way in (a slow import on
    the way to a GPU worker's first step, and torchao's ".so" warnings on a machine without its GPU). A bf16
    run builds its model from a config or bf16/fp32 weights and needs neither a torchao-quantized checkpoint
    nor float8 through transformers; an fp8 run imports torchao itself (train/fp8.convert_to_fp8) and is
    left as it is. Without effect where transformers' quantizers were imported already. transformers has
    no setting for this.

    Afterwards the check answers truly again everywhere, in the modules imported meanwhile too (each holds
    its own name for it); what those modules import from torchao when they load stays not imported."""
    if precision == "fp8" or "transformers.quantizers" in sys.modules:
        yield
        return
    import transformers.utils

    import_utils = Internal("transformers", "transformers.utils", ("import_utils",), TRANSFORMERS,
                            why="to answer its torchao check False while a bf16 model's code imports").load()
    real = getattr(import_utils, "is_torchao_available", None)
    if not callable(real):
        raise CompatError(f"{installed('transformers')}: transformers.utils.import_utils.is_torchao_available "
                          f"is not there; checked on {TRANSFORMERS}. Update raytune_ft/compat.py.")
    hidden = lambda *args, **kwargs: False    # noqa: E731
    import_utils.is_torchao_available = transformers.utils.is_torchao_available = hidden
    try:
        yield
    finally:
        for name, module in list(sys.modules.items()):
            if name.startswith("transformers") and getattr(module, "is_torchao_available", None) is hidden:
                module.is_torchao_available = real


def internals() -> dict[str, Internal]:
    """Every `Internal` entry of this module by its name (the test loads each)."""
    out = {name: value for name, value in globals().items() if isinstance(value, Internal)}
    out |= {f"TORCHAO_WEIGHT_WRAPPERS[{i}]": entry for i, entry in enumerate(TORCHAO_WEIGHT_WRAPPERS)}
    return out
