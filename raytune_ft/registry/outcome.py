"""What a failed registration leaves behind: the run tagged, a record beside the checkpoint, a retry command.

A registration that fails never fails the run: the checkpoint stays as it is, the MLflow run is tagged
raytune.status=trained_not_registered (when the store can be reached), registration_failed.json is
written beside the checkpoint, and the outcome carries the exact `raytune-ft register ...` command that
repeats it. Every text here has been through redaction: it ends up in files and tags.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
from pathlib import Path

from raytune_ft.storage import fs as storage
from raytune_ft.env import public_uri, redact, redact_exception, scoped_env
from raytune_ft.registry.base import FAILURE_FILE, STATUS_TAG, RegistrationOutcome, checkpoint_id, logger


def retry_command(checkpoint_path: str, name: str, tracking_uri: str | None,
                  registry_uri: str | None = None, run_id: str | None = None) -> str:
    """The exact command that repeats a registration from the command line (a URI stays a URI)."""
    parts = ["raytune-ft", "register", checkpoint_id(checkpoint_path), "--name", name]
    if tracking_uri:
        parts += ["--tracking-uri", public_uri(tracking_uri)]
    if registry_uri:
        parts += ["--registry-uri", public_uri(registry_uri)]
    if run_id:
        parts += ["--run-id", run_id]
    return shlex.join(parts)


def _beside(checkpoint_path: str | os.PathLike, filename: str) -> Path | str:
    """A file of the run folder the checkpoint sits in: a local Path, or a URI next to a checkpoint on object
    storage."""
    ckpt = checkpoint_id(checkpoint_path)
    if storage.is_uri(ckpt):
        return f"{ckpt.rsplit('/', 1)[0]}/{filename}"
    return Path(ckpt).parent / filename


def failure_file_for(checkpoint_path: str | os.PathLike) -> Path | str:
    """registration_failed.json sits beside the checkpoint (in the run folder), not inside it."""
    return _beside(checkpoint_path, FAILURE_FILE)


def _write_record(path: Path | str, record: dict) -> None:
    if isinstance(path, Path):
        path.write_text(json.dumps(record, indent=2) + "\n")
    else:
        st = storage.resolve(path)
        storage.write_json(st.fs, st.root, record)


def _read_record(path: Path | str) -> dict | None:
    if isinstance(path, Path):
        return json.loads(path.read_text())
    st = storage.resolve(path)
    return storage.read_json(st.fs, st.root)


def read_failure_record(checkpoint_path: str | os.PathLike) -> dict | None:
    """The failure record beside the checkpoint when it is about this checkpoint, else None."""
    try:
        record = _read_record(failure_file_for(checkpoint_path))
    except (OSError, ValueError):
        return None
    return record if record and record.get("checkpoint") == checkpoint_id(checkpoint_path) else None


def record_registered(checkpoint_path: str | os.PathLike, name: str, version: str) -> None:
    """The run folder's summary.json, where it names this checkpoint, says the run is registered now (a retried
    registration): the record `raytune-ft runs` lists, and what a re-submit of the finished run answers from
    without starting Ray. OSError when the folder cannot be read or written."""
    path = _beside(checkpoint_path, storage.SUMMARY_FILE)
    try:
        summary = _read_record(path)
    except (FileNotFoundError, ValueError):     # no summary, or one this code did not write: left as it is
        return
    ours = isinstance(summary, dict) and checkpoint_id(summary.get("checkpoint") or "") == checkpoint_id(checkpoint_path)
    if not ours:
        return
    summary.update(status="registered", registered_name=name, registered_version=str(version),
                   registration_error=None, retry_command=None)
    _write_record(path, summary)


def _tag_not_registered(tracking_uri: str, run_id: str, error: str) -> bool:
    """Tag the run trained_not_registered; False when the tracking store cannot be reached."""
    try:
        from mlflow import MlflowClient

        # short timeouts and no retries: the store may be down, which is one of the failures reported
        with scoped_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}):
            client = MlflowClient(tracking_uri=tracking_uri)
            client.set_tag(run_id, STATUS_TAG, "trained_not_registered")
            client.set_tag(run_id, "raytune.registration_error", error[:4000])
        return True
    except Exception as e:
        logger.warning("could not tag run %s on %s: %s", run_id, public_uri(tracking_uri), redact_exception(e))
        return False


def record_failure(checkpoint_path: str, name: str, tracking_uri: str | None, registry_uri: str | None,
                   run_id: str | None, error: str) -> RegistrationOutcome:
    """Tag the run (if reachable), write registration_failed.json, build the retry command."""
    error = redact(error)
    cmd = retry_command(checkpoint_path, name, tracking_uri, registry_uri, run_id)
    tagged = bool(run_id and tracking_uri and _tag_not_registered(tracking_uri, run_id, error))
    record = {
        "status": "trained_not_registered",
        "checkpoint": checkpoint_id(checkpoint_path),
        "name": name,
        "tracking_uri": public_uri(tracking_uri),
        "registry_uri": public_uri(registry_uri),
        "run_id": run_id,
        "run_tagged": tagged,
        "error": error,
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "retry_command": cmd,
    }
    path = failure_file_for(checkpoint_path)
    written: str | None = str(path)
    try:
        _write_record(path, record)
    except OSError as e:
        logger.warning("could not write %s: %s", path, redact_exception(e))
        written = None
    logger.error("registration of %s as %s failed: %s\nretry with: %s", checkpoint_id(checkpoint_path), name, error,
                 cmd)
    return RegistrationOutcome(ok=False, error=error, retry_command=cmd, failure_file=written)


def clear_failure_record(ckpt: str | os.PathLike) -> None:
    """After a successful retry, a failure record about this checkpoint would only mislead."""
    if read_failure_record(ckpt) is None:
        return
    path = failure_file_for(ckpt)
    try:
        if isinstance(path, Path):
            path.unlink()
        else:
            st = storage.resolve(path)
            st.fs.delete_file(st.root)
    except OSError:
        pass
