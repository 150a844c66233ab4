"""Registration of a trained checkpoint: HF export (LoRA merge if needed) -> MLflow -> registered model.

The order after `fit`:

    run_registration(checkpoint, recipe.registry, tracking_uri, metadata=..., run_id=...)
      -> a Ray task with its own CPUs/memory (never a training worker) runs register_checkpoint
           resolve the Hugging Face folder (checkpoint/hf, or merge checkpoint/adapter into its base)
           mlflow.transformers.log_model(<folder path>, task="llm/v1/chat", registered_model_name=name)
      -> on any failure: the checkpoint stays as it is, the run is tagged
         raytune.status=trained_not_registered, registration_failed.json is written beside the
         checkpoint, and the outcome carries the exact `raytune-ft register ...` retry command.

Registry targets, chosen by the registry URI (names are always catalog.schema.model):
  - None: the tracking store itself (sqlite under the run folder, or an `mlflow server`);
  - "databricks-uc" (with tracking "databricks"): Unity Catalog on Databricks; credentials come only
    from the environment (DATABRICKS_HOST / DATABRICKS_TOKEN or a config profile) and are never
    written to params, tags, metadata, artifacts or files beside the checkpoint;
  - "uc:http://host:port": an open-source Unity Catalog server, through MLflow's UC OSS client.

Memory: by default the model is logged from the folder on disk. MLflow's transformers flavor then
copies the files into the MLflow model and loads only the tokenizer, so registering a 27B model
needs neither its weights in host RAM nor a GPU (bench/registry_memory.py measures it).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.metadata
import json
import logging
import os
import re
import shlex
import signal
import struct
import sys
import tempfile
import threading
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from raytune_ft.tracking import redact  # noqa: F401  (re-exported: tests and callers use registry.redact)
from raytune_ft.recipe import RecipeError, RegistryConfig, validate_registry_name

logger = logging.getLogger(__name__)

CHAT_TASK = "llm/v1/chat"
META_FILE = "raytune_meta.json"
FAILURE_FILE = "registration_failed.json"
STATUS_TAG = "raytune.status"
_KILL_GRACE_S = 30.0  # run_registration kills the task this long after its own deadline
# Environment variables whose values are credentials: never logged, never written anywhere.
_SECRET_KEY = re.compile(r"token|secret|password|passwd|credential|api[_-]?key|access[_-]?key",
                         re.IGNORECASE)


class RegistrationError(RuntimeError):
    """Registration failed; `run_id` names the MLflow run involved, when one was reached."""

    def __init__(self, message: str, run_id: str | None = None):
        super().__init__(message)
        self.run_id = run_id

    def __reduce__(self):  # keep run_id when Ray ships the exception back to the driver
        return (type(self), (str(self), self.run_id))


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


# ---------------------------------------------------------------- secrets


def _scrub(obj: Any) -> Any:
    """Drop secret-looking keys and redact secret values in user metadata before it is logged."""
    if isinstance(obj, dict):
        return {str(k): _scrub(v) for k, v in obj.items() if not _SECRET_KEY.search(str(k))}
    if isinstance(obj, (list, tuple)):
        return [_scrub(v) for v in obj]
    if isinstance(obj, str):
        return redact(obj)
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    return redact(str(obj))


def _public_uri(uri: str | None) -> str | None:
    """A URI fit for a log line or a file: no userinfo password, no query string (tokens live there)."""
    if not uri:
        return uri
    parsed = urllib.parse.urlsplit(uri)
    if parsed.password or parsed.query:
        netloc = parsed.hostname or ""
        if parsed.username:
            netloc = f"{parsed.username}@{netloc}"
        if parsed.port:
            netloc += f":{parsed.port}"
        uri = urllib.parse.urlunsplit((parsed.scheme, netloc, parsed.path, "", ""))
    return redact(uri)


# ---------------------------------------------------------------- checkpoint -> HF folder


def read_meta(checkpoint_path: str | os.PathLike) -> dict[str, Any]:
    """The training loop's `raytune_meta.json` at the checkpoint's top, or {} for a plain HF folder."""
    p = Path(checkpoint_path) / META_FILE
    if p.is_file():
        with open(p) as f:
            return json.load(f)
    return {}


def _is_hf_folder(p: Path) -> bool:
    return (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))


def _adapter_folder(p: Path) -> Path | None:
    for cand in (p / "adapter", p):
        if (cand / "adapter_config.json").is_file():
            return cand
    return None


def merged_folder_for(checkpoint_path: str | os.PathLike) -> Path:
    """Where the merged model of a LoRA checkpoint goes: a sibling of the checkpoint, never inside."""
    p = Path(checkpoint_path).resolve()
    return p.parent / f"{p.name}.merged_hf"


def resolve_hf_folder(checkpoint_path: str | os.PathLike, *, base_model: str | None = None) -> Path:
    """The Hugging Face folder to register for a checkpoint.

    `checkpoint/hf` (full fine-tune, or a LoRA run that merged already), a plain HF folder given
    directly, or, for a LoRA checkpoint (`checkpoint/adapter`), the adapter merged into its base
    model and written beside the checkpoint (reused if a previous attempt completed it).
    """
    p = Path(checkpoint_path)
    if not p.is_dir():
        raise RegistrationError(f"checkpoint {checkpoint_path!s} is not a directory")
    if _is_hf_folder(p / "hf"):
        return p / "hf"
    if _is_hf_folder(p):
        return p
    adapter = _adapter_folder(p)
    if adapter is not None:
        out = merged_folder_for(p)
        if _is_hf_folder(out) and (out / ".merge_complete").is_file():
            return out
        return merge_lora(adapter, out, base_model=base_model)
    raise RegistrationError(
        f"checkpoint {checkpoint_path!s} holds neither a Hugging Face folder (hf/ with config.json "
        "and *.safetensors) nor a PEFT adapter (adapter/ with adapter_config.json)")


def merge_lora(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
               base_model: str | None = None) -> Path:
    """Merge a PEFT LoRA adapter into its base model and save a safetensors HF folder at `out_dir`.

    The base is `base_model`, else the adapter's `base_model_name_or_path` (a local folder or a hub
    id). The folder is written under a temporary name and renamed, so a crash leaves no half folder
    that a later attempt would take for a finished one. The adapter's files are only read.
    """
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    peft_cfg = PeftConfig.from_pretrained(str(adapter_dir))
    base_ref = base_model or peft_cfg.base_model_name_or_path
    if not base_ref:
        raise RegistrationError(f"{adapter_dir}/adapter_config.json names no base_model_name_or_path")
    logger.info("merging LoRA adapter %s into base %s", adapter_dir, base_ref)
    model = AutoModelForCausalLM.from_pretrained(base_ref, dtype="auto")
    model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    # the adapter folder carries the tokenizer the run trained with (chat template included)
    tok_src = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_ref
    tokenizer = AutoTokenizer.from_pretrained(str(tok_src))

    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(str(tmp), max_shard_size="5GB", safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / ".merge_complete").write_text(json.dumps({"adapter": str(adapter_dir), "base": base_ref}))
        if out_dir.exists():  # an unfinished earlier attempt: replace it
            import shutil
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    del model
    return out_dir


def count_parameters(hf_dir: str | os.PathLike) -> int:
    """Number of parameters in the folder's *.safetensors files, read from their headers only."""
    total = 0
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            n = 1
            for d in info["shape"]:
                n *= d
            total += n
    return total


def _hf_config(hf_dir: Path) -> dict[str, Any]:
    with open(hf_dir / "config.json") as f:
        return json.load(f)


def build_metadata(hf_dir: Path, meta: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """The MLmodel metadata: task, pretrained name, family, parameter count, the run's facts."""
    cfg = _hf_config(hf_dir)
    md: dict[str, Any] = {
        "task": CHAT_TASK,
        "pretrained_model_name": meta.get("model_name") or cfg.get("_name_or_path") or "unknown",
        "model_family": meta.get("family") or cfg.get("model_type") or "unknown",
        "parameter_count": count_parameters(hf_dir),
        "architecture": (cfg.get("architectures") or ["unknown"])[0],
    }
    for key in ("job", "run_name", "step", "final_loss", "lora"):
        if key in meta:
            md[f"raytune_{key}"] = meta[key]
    md.update(_scrub(extra or {}))
    md["task"] = CHAT_TASK  # MLflow checks it against the flavor's task: the caller cannot change it
    return _scrub(md)


# ---------------------------------------------------------------- MLflow plumbing


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
    from mlflow.transformers.llm_inference_utils import _SIGNATURE_FOR_LLM_INFERENCE_TASK
    return _SIGNATURE_FOR_LLM_INFERENCE_TASK[CHAT_TASK]


def restore_env(saved: dict[str, str | None]) -> None:
    """Put environment variables back as `saved` recorded them (None: the variable was unset)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _mlflow_target(tracking_uri: str, registry_uri: str | None) -> Iterator[None]:
    """Point MLflow's fluent API at these stores for the block, then put the previous ones back.

    A Ray worker process is reused across tasks, so an earlier registration's URIs must not leak.
    """
    import mlflow
    from mlflow.tracking._model_registry import utils as reg_utils
    from mlflow.tracking._tracking_service import utils as trk_utils

    saved_env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    saved_tracking = getattr(trk_utils, "_tracking_uri", None)
    saved_registry = getattr(reg_utils, "_registry_uri", None)
    mlflow.set_tracking_uri(tracking_uri)
    # unset registry URI: the tracking store, or databricks-uc when tracking is databricks
    mlflow.set_registry_uri(registry_uri or reg_utils._get_default_registry_uri_for_tracking_uri(tracking_uri))
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved_tracking)
        reg_utils._registry_uri = saved_registry
        restore_env(saved_env)


class _Deadline:
    fired = False


@contextlib.contextmanager
def _deadline(timeout_s: float | None) -> Iterator[_Deadline]:
    """Raise TimeoutError after `timeout_s` (SIGALRM: only in a process's main thread; elsewhere the
    caller, e.g. run_registration through ray.get, enforces the limit). The yielded object's `fired`
    says whether it went off, because an exception raised from a signal handler inside C code can
    surface as an unrelated-looking SystemError."""
    state = _Deadline()
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
    cfg = _hf_config(hf_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None


# ---------------------------------------------------------------- registration


def register_checkpoint(checkpoint_path: str, name: str, *, tracking_uri: str,
                        registry_uri: str | None = None, timeout_s: float = 1800,
                        run_id: str | None = None, metadata: dict | None = None,
                        log_from_disk: bool = True, experiment: str | None = None) -> RegistrationResult:
    """Log a checkpoint's HF model to MLflow as an llm/v1/chat model and register it as `name`.

    `run_id`: log under the training run (reopened, left FINISHED); None starts a new run in
    `experiment`. `log_from_disk`: hand MLflow the folder path (no weights in RAM) instead of a
    loaded model. The original checkpoint files are only read. Raises RegistrationError.
    """
    validate_registry_name(name, path="name")
    import mlflow

    ckpt = Path(checkpoint_path)
    active_run_id = run_id
    deadline = _Deadline()
    try:
        with _deadline(timeout_s) as deadline, _mlflow_target(tracking_uri, registry_uri):
            meta = read_meta(ckpt) if ckpt.is_dir() else {}
            hf_dir = resolve_hf_folder(ckpt)
            md = build_metadata(hf_dir, meta, metadata)

            if run_id:
                run = mlflow.start_run(run_id=run_id)
            else:
                _ensure_experiment(experiment or _default_experiment(tracking_uri), tracking_uri)
                run = mlflow.start_run(run_name=f"{meta.get('run_name', ckpt.name)}-register")
            active_run_id = run.info.run_id
            try:
                mlflow.set_tags({STATUS_TAG: "registering", "raytune.checkpoint": str(ckpt.resolve()),
                                 "raytune.registered_model_name": name})
                if log_from_disk:
                    model_arg: Any = str(hf_dir.resolve())
                else:
                    model_arg = _load_components(hf_dir)
                shim = _pipeline_impl_shim() if log_from_disk else contextlib.nullcontext()
                with shim:
                    info = mlflow.transformers.log_model(
                        transformers_model=model_arg,
                        name="model",
                        task=CHAT_TASK,
                        signature=chat_signature(),
                        metadata=md,
                        pip_requirements=pip_requirements(),
                        registered_model_name=name,
                        model_card=_model_card(meta, md),
                        torch_dtype=_torch_dtype(hf_dir),
                        await_registration_for=int(min(timeout_s, 600)) if timeout_s else 300,
                    )
                del model_arg
                if deadline.fired:  # the alarm's TimeoutError was swallowed by a broad except in a library
                    raise TimeoutError(f"registration did not finish within {timeout_s:g}s")
                version = str(info.registered_model_version)
                mlflow.set_tags({STATUS_TAG: "registered", "raytune.registered_model_version": version})
            finally:
                with contextlib.suppress(Exception):
                    mlflow.end_run()
    except RegistrationError as e:
        raise RegistrationError(redact(str(e)), run_id=e.run_id or active_run_id) from None
    except (RecipeError, KeyboardInterrupt):
        raise
    except BaseException as e:  # MlflowException, OSError, TimeoutError, connection errors...
        logger.warning("registration of %s as %s failed", ckpt, name, exc_info=True)
        if deadline.fired:
            raise RegistrationError(f"registration did not finish within {timeout_s:g}s "
                                    f"(timeout_s); stopped during {type(e).__name__}",
                                    run_id=active_run_id) from None
        raise RegistrationError(redact(f"{type(e).__name__}: {e}"), run_id=active_run_id) from None

    _clear_failure_record(ckpt)
    return RegistrationResult(name=name, version=version, model_uri=f"models:/{name}/{version}",
                              run_id=active_run_id)


def _load_components(hf_dir: Path) -> dict[str, Any]:
    """The in-memory alternative to logging from disk: the model's weights all in host RAM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype="auto")
    return {"model": model, "tokenizer": AutoTokenizer.from_pretrained(str(hf_dir))}


# ---------------------------------------------------------------- failures and retry


def retry_command(checkpoint_path: str, name: str, tracking_uri: str | None,
                  registry_uri: str | None = None, run_id: str | None = None) -> str:
    """The exact command that repeats a registration from the command line."""
    parts = ["raytune-ft", "register", str(Path(checkpoint_path).resolve()), "--name", name]
    if tracking_uri:
        parts += ["--tracking-uri", _public_uri(tracking_uri)]
    if registry_uri:
        parts += ["--registry-uri", _public_uri(registry_uri)]
    if run_id:
        parts += ["--run-id", run_id]
    return shlex.join(parts)


def failure_file_for(checkpoint_path: str | os.PathLike) -> Path:
    """registration_failed.json sits beside the checkpoint (in the run folder), not inside it."""
    return Path(checkpoint_path).resolve().parent / FAILURE_FILE


@contextlib.contextmanager
def _quick_http() -> Iterator[None]:
    """Short timeouts and no retries for best-effort calls to a store that may be down."""
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tag_not_registered(tracking_uri: str, run_id: str, error: str) -> bool:
    """Tag the run trained_not_registered; False when the tracking store cannot be reached."""
    try:
        from mlflow import MlflowClient
        with _quick_http():
            client = MlflowClient(tracking_uri=tracking_uri)
            client.set_tag(run_id, STATUS_TAG, "trained_not_registered")
            client.set_tag(run_id, "raytune.registration_error", error[:4000])
        return True
    except Exception as e:  # the store being down is one of the failures we are reporting
        logger.warning("could not tag run %s on %s: %s", run_id, _public_uri(tracking_uri), redact(str(e)))
        return False


def record_failure(checkpoint_path: str, name: str, tracking_uri: str | None, registry_uri: str | None,
                   run_id: str | None, error: str) -> RegistrationOutcome:
    """Tag the run (if reachable), write registration_failed.json, build the retry command."""
    error = redact(error)
    cmd = retry_command(checkpoint_path, name, tracking_uri, registry_uri, run_id)
    tagged = bool(run_id and tracking_uri and _tag_not_registered(tracking_uri, run_id, error))
    record = {
        "status": "trained_not_registered",
        "checkpoint": str(Path(checkpoint_path).resolve()),
        "name": name,
        "tracking_uri": _public_uri(tracking_uri),
        "registry_uri": _public_uri(registry_uri),
        "run_id": run_id,
        "run_tagged": tagged,
        "error": error,
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "retry_command": cmd,
    }
    path = failure_file_for(checkpoint_path)
    written: str | None = str(path)
    try:
        path.write_text(json.dumps(record, indent=2) + "\n")
    except OSError as e:
        logger.warning("could not write %s: %s", path, e)
        written = None
    logger.error("registration of %s as %s failed: %s\nretry with: %s", checkpoint_path, name, error, cmd)
    return RegistrationOutcome(ok=False, error=error, retry_command=cmd, failure_file=written)


def _clear_failure_record(ckpt: Path) -> None:
    """After a successful retry, a failure record about this checkpoint would only mislead."""
    path = failure_file_for(ckpt)
    try:
        if json.loads(path.read_text()).get("checkpoint") == str(ckpt.resolve()):
            path.unlink()
    except (OSError, ValueError):
        pass


def __getattr__(attr: str):
    """`register_task`: register_checkpoint as a Ray remote function, made on first use so that the
    command line does not pay for importing Ray. Use `.options(num_cpus=..., memory=...).remote(...)`."""
    if attr == "register_task":
        import ray
        task = ray.remote(max_retries=0)(register_checkpoint)
        globals()["register_task"] = task
        return task
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


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
        task = globals().get("register_task") or __getattr__("register_task")
        ref = task.options(**options).remote(
            checkpoint_path, registry_cfg.name, tracking_uri=tracking_uri,
            registry_uri=registry_cfg.registry_uri, timeout_s=registry_cfg.timeout_s,
            run_id=run_id, metadata=metadata)
        # the task stops itself at timeout_s (and says so); the grace covers a task that cannot
        # (stuck in C code, its node lost) before it is killed
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
        error = str(cause) if isinstance(cause, RegistrationError) else f"{type(cause).__name__}: {cause}"
    except Exception as e:  # scheduling problems, a lost worker, a dead node
        error = f"{type(e).__name__}: {e}"
    return record_failure(checkpoint_path, registry_cfg.name, tracking_uri, registry_cfg.registry_uri,
                          failed_run_id, error)


# ---------------------------------------------------------------- command line


def cli_register(argv: list[str]) -> int:
    """`raytune-ft register CHECKPOINT --name catalog.schema.model [...]`; returns the exit code."""
    ap = argparse.ArgumentParser(
        prog="raytune-ft register",
        description="Register a trained checkpoint (HF folder, Ray Train checkpoint with hf/ or "
                    "adapter/) as an MLflow / Unity Catalog model, task llm/v1/chat.")
    ap.add_argument("checkpoint", help="checkpoint folder (with hf/ or adapter/) or a plain HF folder")
    ap.add_argument("--name", required=True, help="registered model name, catalog.schema.model")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    ap.add_argument("--registry-uri", default=None,
                    help="databricks-uc, uc:http://host:port, or unset for the tracking store")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    ap.add_argument("--run-id", default=None, help="log under this MLflow run (the training run)")
    ap.add_argument("--in-memory", action="store_true",
                    help="load the model in RAM and log it from there (default: log the folder from disk)")
    args = ap.parse_args(argv)
    try:
        validate_registry_name(args.name, path="--name")
    except RecipeError as e:
        print(f"raytune-ft register: {e}", file=sys.stderr)
        return 2
    if not args.tracking_uri:
        print("raytune-ft register: --tracking-uri is required (or set MLFLOW_TRACKING_URI)", file=sys.stderr)
        return 2
    if not Path(args.checkpoint).is_dir():
        print(f"raytune-ft register: {args.checkpoint} is not a directory", file=sys.stderr)
        return 2
    try:
        result = register_checkpoint(args.checkpoint, args.name, tracking_uri=args.tracking_uri,
                                     registry_uri=args.registry_uri, timeout_s=args.timeout,
                                     run_id=args.run_id, log_from_disk=not args.in_memory)
    except RegistrationError as e:
        outcome = record_failure(args.checkpoint, args.name, args.tracking_uri, args.registry_uri,
                                 e.run_id or args.run_id, str(e))
        print(f"registration failed: {outcome.error}\nthe checkpoint is unchanged; record: "
              f"{outcome.failure_file}\nretry with:\n  {outcome.retry_command}", file=sys.stderr)
        return 1
    print(f"registered {result.name} version {result.version}: {result.model_uri} (run {result.run_id})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m raytune_ft.registry register ...` (the same as `raytune-ft register ...`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "register":
        print("usage: python -m raytune_ft.registry register CHECKPOINT --name catalog.schema.model "
              "[--tracking-uri URI] [--registry-uri URI] [--timeout S] [--run-id ID]", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return cli_register(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
