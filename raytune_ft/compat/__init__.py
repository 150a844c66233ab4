"""The private names of Ray, torch, MLflow, transformers, torchao and pyarrow that the package uses, behind
one door: `from raytune_ft import compat`, then `compat.<NAME>`. Its modules hold them by library
(ray_internals, torch_internals (with torchao), hf_internals (transformers and MLflow), pyarrow_internals),
on what core.py defines.

Each entry says why the public API does not do, and the versions it was checked on. A name that moved or
went away raises `CompatError` where it is first needed (at import for the ones a class is built on, at
the run's start for the rest), naming the installed version: an upgrade breaks here, loudly, never by a
fallback that quietly does less. Private attributes of the libraries' objects (`PrivateAttr`) are read and
set here too, each checked on its class where the code that needs it starts. tests/test_compat.py loads
every entry; tests/test_structure.py holds the rest of the package to importing none of these names
itself, tests/test_private_names.py to reading none of these attributes itself.

Checked on: Ray 2.60.0, torch 2.13.0 (CPU) and 2.11.0 (GPU), MLflow 3.17.2, transformers 5.25.0 (CPU) and
5.17.0 (GPU), torchao 0.18.0, pyarrow 25.0.1. Public APIs used instead where they exist: Ray Train's
`CheckpointUploadMode.NO_UPLOAD` (the FSDP2 loop reports a checkpoint it uploaded itself,
train/checkpointer.py), DCP's `DefaultStager` with `StagingOptions` (no patch on a torch that keeps its
stager reusable).
"""
from __future__ import annotations

from raytune_ft.compat.core import (MLFLOW, PYARROW, RAY, TORCH, TORCHAO, TRANSFORMERS, CompatError, Internal,
                                    PrivateAttr, installed, private_attr)
from raytune_ft.compat.hf_internals import (MLFLOW_CHAT_SIGNATURE, MLFLOW_REGISTRY_UTILS, TRAINER_INTERNALS,
                                            TRAINER_LAST_LOGGED, TRAINER_SCHEDULER_CREATED,
                                            TRANSFORMERS_INIT_WEIGHTS, attn_implementation,
                                            check_trainer_internals, mlflow_registration_prints_off,
                                            mlflow_target, transformers_without_torchao)
from raytune_ft.compat.pyarrow_internals import S3_OPTIONS_READ, s3_options, s3_rebuilt
from raytune_ft.compat.ray_internals import (RAY_ACCELERATORS, RAY_AUTOSCALING_COORDINATOR, RAY_DASHBOARD_URL,
                                             RAY_DATA_CONFIG_OPTIONS, RAY_DATA_CONFIG_SPLIT, RAY_FAILURE_POLICY,
                                             RAY_INTERNAL_KV, RAY_JOB_INFO, RAY_JOB_TABLE, RAY_QUIET_LOGGERS,
                                             RAY_REPORT_LOGGER_FILE, RAY_TORCH_BACKEND, RAY_TRAIN_CONSTANTS,
                                             RAY_TRAIN_FN_ERROR_LOGGER, RAY_TRAINER_INTERNALS,
                                             RAY_TRAINING_FRAMEWORK, RAY_WORKER_GROUP_CALLBACK, RAY_WRAPPED_ERROR,
                                             check_ray_trainer_internals, ray_data_config, ray_job_started_at,
                                             ray_wrapped_error)
from raytune_ft.compat.torch_internals import (TORCH_DTENSOR_LOCAL, TORCH_DTENSOR_OFFSETS, TORCH_DYNAMO_COUNTERS,
                                               TORCH_INDUCTOR_CACHE_DIR, TORCH_NON_PERSISTENT_BUFFERS,
                                               TORCHAO_WEIGHT_WRAPPERS, dtensor_local, fsdp_kept_unsharded,
                                               keep_stager_buffers, torchao_inner_tensor, torchao_weight_wrappers)


def internals() -> dict[str, Internal]:
    """Every `Internal` entry by its name (the test loads each)."""
    out = {name: value for name, value in globals().items() if isinstance(value, Internal)}
    out |= {f"TORCHAO_WEIGHT_WRAPPERS[{i}]": entry for i, entry in enumerate(TORCHAO_WEIGHT_WRAPPERS)}
    return out


def private_attrs() -> dict[str, PrivateAttr]:
    """Every `PrivateAttr` entry by its name (the test checks each)."""
    return {name: value for name, value in globals().items() if isinstance(value, PrivateAttr)}
