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
from pathlib import Path
from typing import Any, Iterator

from raytune_ft.env import redact, redact_exception, scoped_env
from raytune_ft.recipe import RecipeError, validate_registry_name
from raytune_ft.registry.base import CHAT_TASK, STATUS_TAG, RegistrationError, RegistrationResult, logger
from raytune_ft.registry.outcome import clear_failure_record
from raytune_ft.registry.resolve import build_metadata, hf_config, resolve_hf_folder
from raytune_ft.train.checkpoint import read_meta


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


@contextlib.contextmanager
def _mlflow_target(tracking_uri: str, registry_uri: str | None) -> Iterator[None]:
    """Point MLflow's fluent API at these stores for the block, then put the previous ones back.

    A Ray worker process is reused across tasks, so an earlier registration's URIs must not leak.
    """
    import mlflow
    from mlflow.tracking._model_registry import utils as reg_utils
    from mlflow.tracking._tracking_service import utils as trk_utils

    saved_tracking = getattr(trk_utils, "_tracking_uri", None)
    saved_registry = getattr(reg_utils, "_registry_uri", None)
    # set_*_uri also export MLFLOW_*_URI to the environment (and so to subprocesses)
    with scoped_env(keep=("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")):
        mlflow.set_tracking_uri(tracking_uri)
        # unset registry URI: the tracking store, or databricks-uc when tracking is databricks
        mlflow.set_registry_uri(registry_uri or reg_utils._get_default_registry_uri_for_tracking_uri(tracking_uri))
        try:
            yield
        finally:
            mlflow.set_tracking_uri(saved_tracking)
            reg_utils._registry_uri = saved_registry


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
    cfg = hf_config(hf_dir)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None


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
        # the traceback helps whoever reads the task's log; its text can quote a credential (a server
        # echoing the token it refused), so it is redacted like everything else written
        logger.warning("registration of %s as %s failed:\n%s", ckpt, name,
                       redact_exception(e, with_traceback=True))
        if deadline.fired:
            raise RegistrationError(f"registration did not finish within {timeout_s:g}s "
                                    f"(timeout_s); stopped during {type(e).__name__}",
                                    run_id=active_run_id) from None
        raise RegistrationError(redact_exception(e), run_id=active_run_id) from None

    clear_failure_record(ckpt)
    return RegistrationResult(name=name, version=version, model_uri=f"models:/{name}/{version}",
                              run_id=active_run_id)


def _load_components(hf_dir: Path) -> dict[str, Any]:
    """The in-memory alternative to logging from disk: the model's weights all in host RAM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype="auto")
    return {"model": model, "tokenizer": AutoTokenizer.from_pretrained(str(hf_dir))}
