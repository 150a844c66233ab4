"""Registration of a trained checkpoint: HF export (LoRA merge if needed) -> MLflow -> registered model.

The order after `fit`:

    run_registration(checkpoint, recipe.registry, tracking_uri, metadata=..., run_id=...)   task.py
      -> a Ray task with its own CPUs/memory (never a training worker) runs register_checkpoint
           resolve the Hugging Face folder (checkpoint/hf, or merge checkpoint/adapter      resolve.py
           into its base)
           mlflow.transformers.log_model(<folder path>, task="llm/v1/chat",                mlflow_model.py
           registered_model_name=name), within registry.timeout_s
      -> on any failure: the checkpoint stays as it is, the run is tagged                  outcome.py
         raytune.status=trained_not_registered, registration_failed.json is written beside the
         checkpoint, and the outcome carries the exact `raytune-ft register ...` retry command.
    base.py holds what they share (errors, result types, names, the logger) and imports none of them;
    no part imports this package's entry back. `raytune-ft register` (cli.py) runs register_checkpoint
    in its own process.

Registry targets, chosen by the registry URI (names are always catalog.schema.model):
  - None: the tracking store itself (sqlite under the run folder, or an `mlflow server`);
  - "databricks-uc" (with tracking "databricks"): Unity Catalog on Databricks; credentials come only
    from the environment (DATABRICKS_HOST / DATABRICKS_TOKEN or a config profile) and are never
    written to params, tags, metadata, artifacts, logs or files beside the checkpoint (raytune_ft.env);
  - "uc:http://host:port": an open-source Unity Catalog server, through MLflow's UC OSS client.
"""
from raytune_ft.registry.base import (CHAT_TASK, FAILURE_FILE, STATUS_TAG, RegistrationError, RegistrationOutcome,
                                      RegistrationResult, RegistryTarget)
from raytune_ft.registry.mlflow_model import find_registered_version, register_checkpoint
from raytune_ft.registry.outcome import failure_file_for, record_failure, retry_command
from raytune_ft.registry.resolve import count_parameters, merge_lora, merged_folder_for, resolve_hf_folder
from raytune_ft.registry.task import register_task, run_registration

__all__ = [
    "CHAT_TASK", "FAILURE_FILE", "STATUS_TAG", "RegistrationError", "RegistrationOutcome", "RegistrationResult",
    "RegistryTarget",
    "register_checkpoint", "find_registered_version", "failure_file_for", "record_failure", "retry_command", "count_parameters",
    "merge_lora", "merged_folder_for", "resolve_hf_folder", "register_task", "run_registration",
]
