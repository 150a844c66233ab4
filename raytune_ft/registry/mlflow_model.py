"""Log a checkpoint's Hugging Face folder to MLflow as an llm/v1/chat model and register it, within a deadline.

`register_checkpoint` is what both the post-fit Ray task and `raytune-ft register` run. It stops itself
at `timeout_s` (SIGALRM, where it runs in a process's main thread), points MLflow's process-global
fluent API at the run's stores only for its own duration (a Ray worker process is reused across tasks),
and turns every failure into a RegistrationError whose text is redacted.

Memory: by default the model is logged from the folder on disk. MLflow's transformers flavor then
copies the files into the MLflow model and loads only the tokenizer, so registering a 27B model
needs neither its weights in host RAM nor a GPU (bench/registry_memory.py measures it).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from raytune_ft import compat
from raytune_ft.env import NO_RUN_URL_PRINT, redact, redact_exception, scoped_env
from raytune_ft.recipe.recipe import RecipeError, validate_registry_name
from raytune_ft.registry.base import (CHAT_TASK, CHECKPOINT_TAG, STATUS_TAG, RegistrationError, RegistrationResult,
                                      RegistryTarget, checkpoint_id, logger)
from raytune_ft.registry.outcome import clear_failure_record, read_failure_record
from raytune_ft.registry.resolve import (ADAPTER_ARTIFACT, build_metadata, hf_config, local_checkpoint,
                                        resolve_hf_folder, version_tags)
from raytune_ft.train.checkpoint_meta import read_meta


def pip_requirements() -> list[str]:
    """Pinned requirements of the served model. Explicit, because MLflow's default for a torch
    model adds torchvision, which is not installed here and breaks loading from a fresh env."""
    reqs = []
    for pkg in ("transformers", "torch", "tokenizers", "safetensors", "accelerate", "jinja2"):
        try:
            version = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            continue
        reqs.append(f"{pkg}=={version.split('+')[0]}")  # drop local labels such as +cpu / +cu128
    return reqs


def chat_signature():
    """The signature MLflow assigns to task llm/v1/chat (OpenAI-style messages in, completion out)."""
    return compat.MLFLOW_CHAT_SIGNATURE.load()[CHAT_TASK]


@contextlib.contextmanager
def _mlflow_target(tracking_uri: str, registry_uri: str | None) -> Iterator[None]:
    """Point MLflow's fluent API at these stores for the block, then put the previous ones back
    (compat.mlflow_target), with MLflow's run-URL prints off."""
    # set_*_uri also export MLFLOW_*_URI to the environment (and so to subprocesses)
    with scoped_env(NO_RUN_URL_PRINT, keep=("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")), \
            compat.mlflow_target(tracking_uri, registry_uri):
        yield


class _Deadline:
    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self.fired = False


@contextlib.contextmanager
def _deadline(timeout_s: float | None) -> Iterator[_Deadline]:
    """Raise TimeoutError after `timeout_s` (SIGALRM: only in a process's main thread; elsewhere the
    caller, e.g. run_registration through ray.get, enforces the limit). The yielded object's `fired`
    says whether it went off, because an exception raised from a signal handler inside C code can
    surface as an unrelated-looking SystemError. That exception can land anywhere in MLflow's client (a
    lock held, a thread pool half-fed): the process it went off in is not used for more MLflow work, the
    command line exits and the post-fit task's worker process serves one call (registry.task)."""
    state = _Deadline(timeout_s)
    usable = (timeout_s and timeout_s > 0 and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield state
        return

    def on_alarm(signum, frame):
        state.fired = True
        raise TimeoutError(f"registration did not finish within {timeout_s:g}s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield state
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def logged_model_name(meta: dict, ckpt: Path) -> str:
    """The name the model is logged under in its MLflow run: the run's (MLflow refuses / : . % and quotes)."""
    import re

    return re.sub(r"[/:.%\"']", "-", str(meta.get("run_name") or ckpt.name)) or "model"


@contextlib.contextmanager
def _pipeline_impl_shim() -> Iterator[None]:
    """Let mlflow 3.17 log a model from a folder under transformers 5.

    MLflow's local-checkpoint path reads `transformers.pipelines.check_task(task)[1]["impl"].__name__`;
    transformers 5 keeps `impl` as a dotted string (the class is imported lazily), so the call fails
    with "'str' object has no attribute '__name__'". For the duration of log_model this wraps
    check_task to return a copy with `impl` resolved to the class; the registry itself is untouched.
    """
    import importlib

    from transformers import pipelines

    original = pipelines.check_task

    def check_task(task):
        normalized, targeted, options = original(task)
        impl = targeted.get("impl")
        if isinstance(impl, str):
            module, _, cls = impl.rpartition(".")
            targeted = {**targeted, "impl": getattr(importlib.import_module(module), cls)}
        return normalized, targeted, options

    pipelines.check_task = check_task
    try:
        yield
    finally:
        pipelines.check_task = original


def _default_experiment(tracking_uri: str) -> str:
    # Databricks workspaces want an absolute workspace path for an experiment name
    return "/Shared/raytune_ft" if tracking_uri.startswith("databricks") else "raytune_ft"


def _ensure_experiment(exp_name: str, tracking_uri: str) -> None:
    """Select the experiment, creating it if needed. For a sqlite store the artifacts go beside the
    database file (MLflow would otherwise put them in ./mlruns of whatever the current folder is)."""
    import mlflow
    if mlflow.get_experiment_by_name(exp_name) is None and tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        artifacts = (db.parent / "mlartifacts").resolve()
        with contextlib.suppress(Exception):  # created meanwhile by someone else: fine
            mlflow.create_experiment(exp_name, artifact_location=artifacts.as_uri())
    mlflow.set_experiment(exp_name)


def _model_card(meta: dict[str, Any], metadata: dict[str, Any]):
    """A model card built here, so MLflow does not go to the hub for one (air-gapped clusters)."""
    try:
        from huggingface_hub import ModelCard, ModelCardData
    except ImportError:
        return None
    base = metadata.get("pretrained_model_name", "unknown")
    data = ModelCardData(base_model=base if "/" in str(base) and not str(base).startswith("/") else None,
                         tags=["raytune_ft", "qwen", "sft"])
    text = (f"---\n{data.to_yaml()}\n---\n\n# {meta.get('run_name', 'raytune_ft model')}\n\n"
            f"Fine-tuned from `{base}` by raytune_ft (job `{meta.get('job', 'unknown')}`, "
            f"step {meta.get('step', '?')}, final loss {meta.get('final_loss', '?')}).\n")
    return ModelCard(text)


def _torch_dtype(hf_dir: Path):
    import torch
    cfg = hf_config(hf_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None


# A registry that answers "try again" (or cannot be reached for a moment) gets this many attempts, the
# first wait doubling each time, all inside timeout_s; a refusal or a bad request is never retried.
RETRY_ATTEMPTS = 3
RETRY_FIRST_WAIT_S = 2.0
_TRANSIENT_CODES = {"TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "RESOURCE_EXHAUSTED", "REQUEST_LIMIT_EXCEEDED",
                    "SERVICE_UNAVAILABLE", "ABORTED"}
_TRANSIENT_TEXT = ("connection refused", "connection reset", "connectionerror", "max retries exceeded",
                   "temporarily unavailable", "service unavailable", "bad gateway", "gateway timeout",
                   "too many requests", "remotedisconnected", "read timed out")


def is_transient(exc: BaseException) -> bool:
    """Whether a registry error is worth another attempt: unreachable, overloaded, 5xx or 429."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (RegistrationError, RecipeError, KeyboardInterrupt)):
            return False
        code = getattr(exc, "error_code", None)
        if code in _TRANSIENT_CODES:
            return True
        status = getattr(exc, "get_http_status_code", lambda: None)()
        if isinstance(status, int) and (status == 429 or 500 <= status < 600) and code != "INVALID_PARAMETER_VALUE":
            return True
        if isinstance(exc, ConnectionError) or any(t in str(exc).lower() for t in _TRANSIENT_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _find_version(client, name: str, ckpt_id: str, run_id: str | None):
    """The newest version of `name` made from this checkpoint, or None (`client`: an MlflowClient).

    A version is tagged with the checkpoint it came from; with `run_id`, one without the tag (an attempt
    cut off between creating and tagging it) counts when it was logged under that training run."""
    try:
        versions = client.search_model_versions(f"name = '{name}'")
    except Exception as e:  # a registry without search (or none yet): nothing to reuse
        logger.info("no existing version looked up for %s: %s", name, redact_exception(e))
        return None
    mine = [v for v in versions
            if (v.tags or {}).get(CHECKPOINT_TAG) == ckpt_id
            or (CHECKPOINT_TAG not in (v.tags or {}) and v.run_id
                and (v.run_id == run_id or _run_made(client, v.run_id, ckpt_id, name)))]
    return max(mine, key=lambda v: int(v.version)) if mine else None


def _run_made(client, run_id: str, ckpt_id: str, name: str) -> bool:
    """Whether the run an untagged version was logged under registered this checkpoint as `name`: its
    own tags say so. A version whose tag write failed is found this way by a retry with no run id."""
    try:
        tags = client.get_run(run_id).data.tags
    except Exception:   # a run of another store or deleted: not ours to reuse
        return False
    return tags.get(CHECKPOINT_TAG) == ckpt_id and tags.get("raytune.registered_model_name") == name


def find_registered_version(checkpoint_path: str, name: str, *, tracking_uri: str,
                            registry_uri: str | None = None, run_id: str | None = None,
                            timeout_s: float | None = None) -> RegistrationResult | None:
    """The version already registered for this checkpoint under `name`, or None (never raises). Gives up
    after `timeout_s` (registry.timeout_s): a registry that does not answer holds nothing up; the
    registration that follows looks again, inside its own deadline."""
    from mlflow import MlflowClient

    from raytune_ft.channel import NoAnswer, call_within

    def look():
        # a client of its own, not the process-global target: this thread may be left behind
        client = MlflowClient(tracking_uri, registry_uri=registry_uri
                              or compat.MLFLOW_REGISTRY_UTILS.load()(tracking_uri))
        return _find_version(client, name, checkpoint_id(checkpoint_path), run_id)

    try:
        v = call_within(timeout_s, "version lookup", look) if timeout_s is not None else look()
    except NoAnswer:
        logger.warning("no answer from the registry within %gs while looking for a version of %s",
                       timeout_s, name)
        return None
    except Exception as e:
        logger.info("could not look for a version of %s: %s", name, redact_exception(e))
        return None
    if v is None:
        return None
    return RegistrationResult(name=name, version=str(v.version), model_uri=f"models:/{name}/{v.version}",
                              run_id=v.run_id or run_id)


def _unfinished_before(ckpt_id: str, name: str, run_id: str | None) -> bool:
    """Whether an earlier registration of this checkpoint did not finish (failed, timed out or was cut off):
    its failure record is beside the checkpoint, or the training run still says so. Then a version it may
    have created before tagging it is found by its run too."""
    record = read_failure_record(ckpt_id)
    if record and record.get("name") == name:
        return True
    if not run_id:
        return False
    from mlflow import MlflowClient

    try:
        tags = MlflowClient().get_run(run_id).data.tags
    except Exception:
        return False
    return (tags.get(STATUS_TAG) in ("registering", "trained_not_registered")
            and tags.get("raytune.registered_model_name", name) == name)


def _tag_version(name: str, version: str, ckpt_id: str, tags: dict | None = None) -> None:
    """Which checkpoint this version is (a retry or a re-submit finds it by this tag), and `tags`
    (resolve.version_tags: the base model and revision it was trained from, LoRA's facts)."""
    from mlflow import MlflowClient

    try:
        client = MlflowClient()
        for key, value in {**(tags or {}), CHECKPOINT_TAG: ckpt_id}.items():
            client.set_model_version_tag(name, version, key, value)
    except Exception as e:  # a registry without version tags: its run's tags still identify it
        logger.warning("could not tag %s version %s with its checkpoint (a retry finds it by its run's "
                       "tags): %s", name, version, redact_exception(e))


@dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint being registered: its local folder, how tags name it, its Hugging Face folder, its
    meta file's contents and the model's metadata."""
    path: Path
    id: str
    hf_dir: Path
    meta: dict
    metadata: dict


def register_checkpoint(checkpoint_path: str, name: str, target: RegistryTarget, *, timeout_s: float = 1800,
                        metadata: dict | None = None, log_from_disk: bool = True) -> RegistrationResult:
    """Log a checkpoint's HF model to MLflow as an llm/v1/chat model and register it as `name`.

    `checkpoint_path`: a local folder or a URI (s3://...; only its meta file and model folder are read).
    `target.run_id`: log under the training run (reopened, left FINISHED); None starts a new run in
    `target.experiment`. `log_from_disk`: hand MLflow the folder path (no weights in RAM) instead of a
    loaded model. The original checkpoint files are only read. Transient registry errors are retried
    (RETRY_ATTEMPTS, with backoff); a version of `name` already made from this checkpoint (a retry, a
    re-submit) is returned, not made again. Raises RegistrationError.
    """
    validate_registry_name(name, path="name")
    import mlflow
    from mlflow import MlflowClient

    ckpt_id, run_id = checkpoint_id(checkpoint_path), target.run_id
    state = {"run_id": run_id}
    deadline = _Deadline(timeout_s)
    try:
        with _deadline(timeout_s) as deadline, _mlflow_target(target.tracking_uri, target.registry_uri), \
                local_checkpoint(checkpoint_path) as local:
            meta = read_meta(local) if local.is_dir() else {}
            hf_dir = resolve_hf_folder(local)
            ckpt = _Checkpoint(local, ckpt_id, hf_dir, meta, build_metadata(hf_dir, meta, metadata))
            reuse = _unfinished_before(ckpt_id, name, run_id)
            for attempt in range(RETRY_ATTEMPTS):
                # a version tagged with this checkpoint is returned, never made twice (a retried `raytune-ft
                # register` has no run id to go by); after an unfinished attempt, an untagged one of its run
                found = _find_version(MlflowClient(), name, ckpt_id, run_id if reuse else None)
                if found is not None:
                    version = str(found.version)
                    logger.info("%s version %s was already made from %s: returned, not registered again",
                                name, version, ckpt_id)
                    if CHECKPOINT_TAG not in (found.tags or {}):   # found by its run: named from now on
                        _tag_version(name, version, ckpt_id)
                    if run_id:
                        mlflow.MlflowClient().set_tag(run_id, STATUS_TAG, "registered")
                        mlflow.MlflowClient().set_tag(run_id, "raytune.registered_model_version", version)
                    state["run_id"] = found.run_id or run_id
                    break
                try:
                    version = _log_and_register(ckpt, name, target, log_from_disk=log_from_disk,
                                                deadline=deadline, state=state)
                    break
                except BaseException as e:
                    if deadline.fired or attempt == RETRY_ATTEMPTS - 1 or not is_transient(e):
                        raise
                    wait = RETRY_FIRST_WAIT_S * 2 ** attempt
                    logger.warning("registration of %s as %s: %s; attempt %d of %d in %g s", ckpt_id, name,
                                   redact_exception(e), attempt + 2, RETRY_ATTEMPTS, wait)
                    time.sleep(wait)
                    reuse = True      # the failed attempt may have created the version before it broke
    except RegistrationError as e:
        raise RegistrationError(redact(str(e)), run_id=e.run_id or state["run_id"]) from None
    except (RecipeError, KeyboardInterrupt):
        raise
    except BaseException as e:  # MlflowException, OSError, TimeoutError, connection errors...
        # the traceback helps whoever reads the task's log; its text can quote a credential (a server
        # echoing the token it refused), so it is redacted like everything else written
        logger.warning("registration of %s as %s failed:\n%s", ckpt_id, name,
                       redact_exception(e, with_traceback=True))
        if deadline.fired:
            raise RegistrationError(f"registration did not finish within {timeout_s:g}s "
                                    f"(timeout_s); stopped during {type(e).__name__}",
                                    run_id=state["run_id"]) from None
        raise RegistrationError(redact_exception(e), run_id=state["run_id"]) from None

    clear_failure_record(ckpt_id)
    return RegistrationResult(name=name, version=version, model_uri=f"models:/{name}/{version}",
                              run_id=state["run_id"])


def _log_and_register(ckpt: _Checkpoint, name: str, target: RegistryTarget, *, log_from_disk: bool,
                      deadline: _Deadline, state: dict) -> str:
    """One attempt: log the model under the run, register it, tag the version with its checkpoint."""
    import mlflow

    if target.run_id:
        run = mlflow.start_run(run_id=target.run_id)
    else:
        _ensure_experiment(target.experiment or _default_experiment(target.tracking_uri), target.tracking_uri)
        run = mlflow.start_run(run_name=f"{ckpt.meta.get('run_name', ckpt.path.name)}-register")
    state["run_id"] = run.info.run_id
    timeout_s, meta, hf_dir = deadline.timeout_s, ckpt.meta, ckpt.hf_dir
    try:
        mlflow.set_tags({STATUS_TAG: "registering", CHECKPOINT_TAG: ckpt.id,
                         "raytune.registered_model_name": name})
        model_arg: Any = str(hf_dir.resolve()) if log_from_disk else _load_components(hf_dir)
        shim = _pipeline_impl_shim() if log_from_disk else contextlib.nullcontext()
        with shim, compat.mlflow_registration_prints_off():
            info = mlflow.transformers.log_model(
                transformers_model=model_arg,
                name=logged_model_name(meta, ckpt.path),
                task=CHAT_TASK,
                signature=chat_signature(),
                metadata=ckpt.metadata,
                pip_requirements=pip_requirements(),
                registered_model_name=name,
                model_card=_model_card(meta, ckpt.metadata),
                torch_dtype=_torch_dtype(hf_dir),
                await_registration_for=int(min(timeout_s, 600)) if timeout_s else 300,
            )
        del model_arg
        if deadline.fired:  # the alarm's TimeoutError was swallowed by a broad except in a library
            raise TimeoutError(f"registration did not finish within {timeout_s:g}s")
        version = str(info.registered_model_version)
        if (ckpt.path / "adapter" / "adapter_config.json").is_file():   # LoRA: the adapter itself beside the model
            mlflow.log_artifacts(str(ckpt.path / "adapter"), artifact_path=ADAPTER_ARTIFACT)
        _tag_version(name, version, ckpt.id, version_tags(meta, ckpt.path))
        mlflow.set_tags({STATUS_TAG: "registered", "raytune.registered_model_version": version})
        return version
    finally:
        with contextlib.suppress(Exception):
            mlflow.end_run()


def _load_components(hf_dir: Path) -> dict[str, Any]:
    """The in-memory alternative to logging from disk: the model's weights all in host RAM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype="auto")
    return {"model": model, "tokenizer": AutoTokenizer.from_pretrained(str(hf_dir))}
