"""transformers' and MLflow's private names: the Trainer's methods and attributes the TRL loop relies on,
a model's attention implementation and init, MLflow's stores and registration prints."""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from raytune_ft.compat.core import MLFLOW, TRANSFORMERS, CompatError, Internal, PrivateAttr, installed, private_attr

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
                          f"checked on {MLFLOW}. Update raytune_ft/compat/ for this MLflow.")
    printed = fluent.eprint
    fluent.eprint = lambda *a, **k: None
    try:
        yield
    finally:
        fluent.eprint = printed


# ---------------------------------------------------------------------------------------------------- transformers

def attn_implementation(config) -> str | None:
    """The attention implementation a built model's `config` says its layers use. transformers keeps it in
    a private attribute (set through the public PreTrainedModel.set_attn_implementation)."""
    return private_attr(config, "_attn_implementation", "transformers", TRANSFORMERS)


# Trainer methods the TRL loop's SFTTrainer subclass overrides (train/trl/trainer.py) and the attributes it
# reads: Hugging Face's Trainer has no public hook for each step's own loss, for where the best model is
# loaded from, or for a check before each save
TRAINER_INTERNALS = ("_maybe_log_save_evaluate", "_load_best_model", "_save_checkpoint", "_get_learning_rate")


TRAINER_LAST_LOGGED = PrivateAttr(
    "transformers", "transformers", "Trainer", "_globalstep_last_logged", TRANSFORMERS,
    named_in="_maybe_log_save_evaluate",
    why="for the step the Trainer last logged (train/trl/trainer.py keeps each step's own loss once, and not "
        "the resumed step's again)")
TRAINER_SCHEDULER_CREATED = PrivateAttr(
    "transformers", "transformers", "Trainer", "_created_lr_scheduler", TRANSFORMERS, named_in="create_scheduler",
    why="to mark the recipe's schedule as one the Trainer created (train/trl/trainer.py), which it builds again "
        "for another train(), as its own")
TRANSFORMERS_INIT_WEIGHTS = PrivateAttr(
    "transformers", "transformers", "PreTrainedModel", "_init_weights", TRANSFORMERS,
    why="to initialise each module of a materialised model on its own shard (models/build.py): the public "
        "init_weights() initialises whole tensors")


def check_trainer_internals(trainer_cls: type) -> type:
    """`trainer_cls`, once the Trainer methods the loop overrides are found on it (a renamed one would
    silently stop being called), and the Trainer's private attributes it reads."""
    missing = [name for name in TRAINER_INTERNALS if not callable(getattr(trainer_cls, name, None))]
    if missing:
        raise CompatError(f"{installed('transformers')}: Trainer has no {', '.join(missing)}; the TRL loop "
                          f"overrides them (train/trl/trainer.py); checked on {TRANSFORMERS}.")
    TRAINER_LAST_LOGGED.check()
    TRAINER_SCHEDULER_CREATED.check()
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
                          f"is not there; checked on {TRANSFORMERS}. Update raytune_ft/compat/.")
    hidden = lambda *args, **kwargs: False    # noqa: E731
    import_utils.is_torchao_available = transformers.utils.is_torchao_available = hidden
    try:
        yield
    finally:
        for name, module in list(sys.modules.items()):
            if name.startswith("transformers") and getattr(module, "is_torchao_available", None) is hidden:
                module.is_torchao_available = real
