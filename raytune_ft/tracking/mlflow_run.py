"""The MLflow run of a job: created by the driver before `fit`, written by rank 0, closed by the driver.

Credentials (Databricks, Hugging Face, MLflow tokens) are read by MLflow and the hub client from the
environment only; nothing here writes them: params and tags go through `raytune_ft.env.redact`.
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from raytune_ft.env import NO_RUN_URL_PRINT, redact, scoped_env
from raytune_ft.recipe.recipe import Recipe, RecipeError

# the settings that decide which weights a run trains: a finished run re-submitted with one of these
# changed would hand back (and register) weights these settings never produced
TRAINING_PARAMS = ("job", "model.", "data.", "train.")


# MLflow's run page draws a section per metric prefix, prefixed sections alphabetically and the unprefixed
# metrics last: the per-step training curves go under train/ and the held-out figures under validation/
# (the name of the Ray dataset they come from), so the page opens on loss, lr and grad norm
TRAIN_CURVES = ("loss", "lr", "learning_rate", "grad_norm")
_RENAMED_PREFIXES = (("eval/", "validation/"),)
STARTUP_PARAM = "startup."
# "false" on a finished run whose latest checkpoint is not a final one (train.save_final=false): a
# re-submit resumes it from there, as the loops do, instead of handing back its weights
FINAL_CHECKPOINT_TAG = "raytune.final_checkpoint"
# what a failed or stopped attempt leaves on the run (endings.mlflow_ending), removed when a later attempt finishes it
ENDING_TAGS = ("raytune.error", "raytune.ended_by")


def mlflow_metric_name(key: str) -> str:
    """The MLflow name of a training loop's metric `key` (`loss` -> `train/loss`, `eval/loss` ->
    `validation/loss`; other keys as they are)."""
    if key in TRAIN_CURVES:
        return f"train/{key}"
    for loop, shown in _RENAMED_PREFIXES:
        if key.startswith(loop):
            return shown + key[len(loop):]
    return key


def loop_metric_name(name: str) -> str:
    """The training loop's key of the MLflow metric `name` (the inverse of `mlflow_metric_name`)."""
    if name.startswith("train/") and name[len("train/"):] in TRAIN_CURVES:
        return name[len("train/"):]
    for loop, shown in _RENAMED_PREFIXES:
        if name.startswith(shown):
            return loop + name[len(shown):]
    return name


def attempt_id(started: float | None = None) -> str:
    """A name of its own for one attempt of a run (rank 0's start, in milliseconds, and 4 random hex digits):
    attempts that share a first step (a re-run killed before its first checkpoint, two jobs resuming one
    checkpoint) never share it, and its leading time orders attempts."""
    import secrets
    import time

    return f"{int((started or time.time()) * 1000):013d}-{secrets.token_hex(2)}"


_ATTEMPT_PARAM = re.compile(r"(\d{13}-[0-9a-f]{4})\.(.+)")


def startup_params(breakdown: dict, attempt: str) -> dict[str, str]:
    """The start-up breakdown (`startup/<phase>_s` seconds) as MLflow params `startup.<attempt>.<phase>_s`
    (`attempt`: `attempt_id()`): one-off values per attempt, not curves; MLflow params cannot change, so
    each attempt logs under names of its own."""
    return {f"{STARTUP_PARAM}{attempt}.{k.split('/', 1)[1]}": f"{float(v):.3f}" for k, v in breakdown.items()}


def startup_by_attempt(params: dict) -> dict[str, dict[str, float]]:
    """The start-up breakdowns a run's params hold: attempt id -> {phase (`ray_workers_s`, ...): seconds}."""
    by_attempt: dict[str, dict[str, float]] = {}
    for k, v in params.items():
        m = _ATTEMPT_PARAM.fullmatch(k[len(STARTUP_PARAM):]) if k.startswith(STARTUP_PARAM) else None
        if m:
            by_attempt.setdefault(m[1], {})[m[2]] = float(v)
    return by_attempt


def startup_from_params(params: dict) -> dict[str, float]:
    """The start-up breakdown of the run's latest attempt its params hold, by phase (`ray_workers_s`:
    seconds, ...)."""
    by_attempt = startup_by_attempt(params)
    return by_attempt[max(by_attempt)] if by_attempt else {}


class FinishedRunError(RecipeError):
    """A re-submit asks a finished run for weights it did not train."""


def flat_params(recipe: Recipe) -> dict[str, str]:
    out: dict[str, str] = {}

    def walk(prefix: str, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = redact(str(value))[:500]

    walk("", recipe.to_dict())
    return out


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def run_tags(recipe: Recipe) -> dict[str, str]:
    from raytune_ft.env import package_versions

    tags = {"raytune.job": recipe.job, "raytune.run_name": recipe.tracking.run_name,
            "raytune.git_commit": _git_commit(), "raytune.python": platform.python_version()}
    versions = package_versions(("raytune-ft", "torch", "ray", "transformers", "trl", "peft", "mlflow"), missing="")
    return tags | {f"version.{pkg}": v for pkg, v in versions.items() if v}


def start_run(recipe: Recipe) -> str:
    """Create (or reopen, on a re-submit of the same run name) the MLflow run; return its id. A finished
    run's re-submit gets the finished run's id (FinishedRunError when its training settings differ); one
    that finished without a final checkpoint is reopened, as the training loop resumes it."""
    import mlflow

    client = mlflow.MlflowClient(recipe.tracking_uri)
    exp = client.get_experiment_by_name(recipe.tracking.experiment)
    if exp:
        exp_id = exp.experiment_id
    else:
        # with the default sqlite store, artifacts (plots, registered models) go next to it, not to
        # MLflow's default ./mlruns under whatever folder the job was started from
        location = None
        if recipe.tracking.tracking_uri is None and "://" not in recipe.run_dir:
            location = Path(recipe.run_dir, "mlartifacts").resolve().as_uri()
        elif "://" in recipe.run_dir and recipe.tracking_uri.startswith("sqlite:"):
            # a file store cannot live on object storage, its artifacts can: the run folder's mlartifacts
            location = recipe.run_dir.rstrip("/") + "/mlartifacts"
        exp_id = client.create_experiment(recipe.tracking.experiment, artifact_location=location)
    found = client.search_runs([exp_id], filter_string=f"tags.`raytune.run_name` = '{recipe.tracking.run_name}'",
                               max_results=1, order_by=["attributes.start_time DESC"])
    resumable = found and found[0].data.tags.get(FINAL_CHECKPOINT_TAG) == "false"
    if found and (found[0].info.status in ("RUNNING", "FAILED", "KILLED") or resumable):
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "raytune.resubmitted", "true")
        return run_id
    if found and found[0].info.status == "FINISHED":
        return _resubmitted_finished_run(client, found[0], recipe)
    run = client.create_run(exp_id, run_name=recipe.tracking.run_name, tags=run_tags(recipe))
    params = flat_params(recipe)
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 90):
        client.log_batch(run.info.run_id, params=items[i:i + 90])
    return run.info.run_id


def finished_run_id(recipe: Recipe) -> str | None:
    """The id of this run name's MLflow run when it finished with its final checkpoint (a re-submit then
    trains nothing: FinishedRunError when its training settings differ), else None. Reads the store only."""
    import mlflow

    client = mlflow.MlflowClient(recipe.tracking_uri)
    exp = client.get_experiment_by_name(recipe.tracking.experiment)
    if exp is None:
        return None
    found = client.search_runs([exp.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
                               filter_string=f"tags.`raytune.run_name` = '{recipe.tracking.run_name}'")
    if not found or found[0].info.status != "FINISHED" or found[0].data.tags.get(FINAL_CHECKPOINT_TAG) == "false":
        return None
    return _resubmitted_finished_run(client, found[0], recipe)


def _resubmitted_finished_run(client, found, recipe: Recipe) -> str:
    """The finished run's own id: nothing is trained again, so no second, empty MLflow run is opened.

    Training settings other than those the run trained with stop here (FinishedRunError naming them);
    another registry name registers the run's weights under it, and says which weights those are."""
    run_id, old = found.info.run_id, found.data.params
    new = flat_params(recipe)
    # a param the finished run did not log (a field added since) cannot have changed what it trained
    changed = [k for k in sorted(new) if k.startswith(TRAINING_PARAMS) and k in old and old[k] != new[k]]
    where = f"run {recipe.tracking.run_name!r} finished already (MLflow run {run_id})"
    if changed:
        diffs = "; ".join(f"{k}: {old[k]} -> {new[k]}" for k in changed[:5])
        more = f"; and {len(changed) - 5} more" if len(changed) > 5 else ""
        raise FinishedRunError(
            f"{changed[0]}: {where} with other training settings ({diffs}{more}). A finished run is not "
            "trained again: set tracking.run_name to a new name to train with these settings, or re-submit "
            "with the settings it finished with.")
    weights = redact(found.data.tags.get("raytune.checkpoint") or "its final checkpoint")
    before = old.get("registry.name")
    if recipe.registry.enabled and before and before != recipe.registry.name:
        print(f"[raytune_ft] {where}: nothing is trained; the weights it trained ({weights}) are registered "
              f"as {recipe.registry.name}, as this recipe asks (the run was submitted as {before})")
    else:
        print(f"[raytune_ft] {where}: nothing is trained; its weights are {weights}")
    client.set_tag(run_id, "raytune.resubmitted", "true")
    return run_id


@dataclass(frozen=True)
class RunEnd:
    """How a run is closed: its status, its tags, end-of-run metrics, params and JSON files (name -> document;
    a `.jsonl` name: a list of records, a line each)."""
    status: str = "FINISHED"
    tags: dict | None = None
    metrics: dict | None = None
    json_artifacts: dict | None = None
    params: dict[str, str] | None = None


def end_run(recipe: Recipe, run_id: str, end: RunEnd = RunEnd()) -> str:
    """Close the run as `end` says; returns its experiment's id. Params MLflow refuses (a resumed run's param
    logged before with another value) are said, and the run is closed all the same."""
    import mlflow

    from raytune_ft.env import scrub

    status, tags, metrics, json_artifacts, params = end.status, end.tags, end.metrics, end.json_artifacts, end.params
    client = mlflow.MlflowClient(recipe.tracking_uri)
    if params:
        from mlflow.entities import Param

        try:
            client.log_batch(run_id, params=[Param(k, redact(str(v))) for k, v in params.items()])
        except Exception as e:  # noqa: BLE001 - the run's end is not given up for its data params
            print(f"[raytune_ft] could not log {len(params)} params to MLflow: {type(e).__name__}", flush=True)
    for k, v in (tags or {}).items():
        client.set_tag(run_id, k, redact(str(v)))
    for k, v in (metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            client.log_metric(run_id, k, float(v))
    for name, doc in (json_artifacts or {}).items():
        if name.endswith(".jsonl"):            # a list of records, one JSON line each
            client.log_text(run_id, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in scrub(doc)), name)
        else:
            client.log_dict(run_id, scrub(doc), name)
    if status == "FINISHED":   # a resumed run that finishes carries nothing of an earlier attempt's ending
        stale = [k for k in ENDING_TAGS if k in client.get_run(run_id).data.tags]
        for k in stale:
            client.delete_tag(run_id, k)
    with scoped_env(NO_RUN_URL_PRINT):
        client.set_terminated(run_id, status=status)
    return client.get_run(run_id).info.experiment_id


def keep_tracking_db(recipe: Recipe, st, run_path: str) -> None:
    """On object storage, a copy of the run's sqlite tracking store (which cannot live there) goes into the
    run folder at the end, so nothing of the run stays only on the launching machine."""
    uri = recipe.tracking_uri
    if not st.remote or not uri.startswith("sqlite:///") or recipe.tracking.tracking_uri:
        return
    from raytune_ft.storage import fs as storage
    from raytune_ft.env import redact_exception

    try:
        storage.upload(uri[len("sqlite:///"):], st.fs, f"{run_path}/mlflow.db")
    except OSError as e:
        print(f"[raytune_ft] could not copy the tracking store to {st.uri(run_path)}: {redact_exception(e)}")
