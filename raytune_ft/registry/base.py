"""What every part of the registry shares: its errors, result types, file and tag names, and logger.

Imports no other part, so each part can import it without a circle.
"""
from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("raytune_ft.registry")

CHAT_TASK = "llm/v1/chat"
FAILURE_FILE = "registration_failed.json"
STATUS_TAG = "raytune.status"
CHECKPOINT_TAG = "raytune.checkpoint"   # on the run and on the model version: which checkpoint it is


def checkpoint_id(checkpoint_path: str | os.PathLike) -> str:
    """How a checkpoint is named in tags, records, logs and commands: its public URI (s3://..., no
    credential of a userinfo or query) or its absolute path."""
    from raytune_ft.env import public_uri

    path = str(checkpoint_path)
    if "://" in path and not path.startswith("file://"):
        return public_uri(path.rstrip("/"))
    return os.path.abspath(path[len("file://"):] if path.startswith("file://") else path)


class RegistrationError(RuntimeError):
    """Registration failed; `run_id` names the MLflow run involved, when one was reached."""

    def __init__(self, message: str, run_id: str | None = None):
        super().__init__(message)
        self.run_id = run_id

    def __reduce__(self):  # keep run_id when Ray ships the exception back to the driver
        return (type(self), (str(self), self.run_id))


@dataclass(frozen=True)
class RegistryTarget:
    """Where a registration goes: the tracking store, the registry (None: the one the tracking URI
    implies), and the run the model is logged under (None: a new run in `experiment`, or the tracking
    store's default experiment)."""
    tracking_uri: str
    registry_uri: str | None = None
    run_id: str | None = None
    experiment: str | None = None


@dataclass
class RegistrationResult:
    name: str            # catalog.schema.model
    version: str         # the new version, as the registry numbers it
    model_uri: str       # models:/<name>/<version>
    run_id: str | None   # the MLflow run the model was logged under


@dataclass
class RegistrationOutcome:
    """What `run_registration` hands back to the run: never raises for a registry problem."""
    ok: bool
    result: RegistrationResult | None = None
    error: str | None = None
    retry_command: str | None = None
    failure_file: str | None = None
    skipped: bool = False            # registry.enabled was false

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
