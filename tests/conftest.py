"""Shared test fixtures: paths to ../shared/fixtures and a local Ray instance per module."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("RAYTUNE_FIXTURES", REPO.parent / "shared" / "fixtures"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def fixtures() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"fixtures not found at {FIXTURES}; set RAYTUNE_FIXTURES")
    return FIXTURES


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray with more logical CPUs than cores, so Ray Data inside a trainer does not starve."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=True,
             ignore_reinit_error=True)
    yield ray
    ray.shutdown()


SECRET_VARS = ("DATABRICKS_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MLFLOW_TRACKING_TOKEN",
               "MLFLOW_TRACKING_PASSWORD", "DATABRICKS_CLIENT_SECRET")


@pytest.fixture(scope="session")
def local_job(tmp_path_factory):
    """The 27B recipe's --local job, run once per session as a user runs it (a subprocess, its own local
    Ray, registration included), with credentials planted in its environment.

    Shared by the end-to-end, plots and secrets tests: one run instead of three keeps the suite's time
    down. Ray's files go to their own RAY_TMPDIR (short: AF_UNIX paths are <= 107 bytes) so the secrets
    test can read every log it wrote.
    """
    import json
    import secrets
    import shutil
    import subprocess
    import sys
    import tempfile

    work = tmp_path_factory.mktemp("localjob")
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtjob", dir="/tmp"))
    planted = {k: f"sk-{k.lower()}-{secrets.token_hex(16)}" for k in SECRET_VARS}
    env = {**os.environ, **planted, "RAY_TMPDIR": str(ray_tmp), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    overrides = [f"tracking.storage_path={work / 'runs'}", "train.log_every=1"]
    cmd = [sys.executable, str(REPO / "jobs" / "qwen27b_b300.py"), "--local"] + [f"--set={o}" for o in overrides]
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, timeout=900)
        summary_path = work / "runs" / "qwen27b-local" / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        yield {"proc": proc, "planted": planted, "work": work, "ray_tmp": ray_tmp, "summary": summary,
               "overrides": overrides}
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def local_job_recipe(overrides):
    """The resolved recipe the local_job fixture ran."""
    import importlib.util

    from raytune_ft.cli import resolve

    spec = importlib.util.spec_from_file_location("_job27b", REPO / "jobs" / "qwen27b_b300.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return resolve(job.recipe, job.local, local=True, overrides=overrides)


@pytest.fixture(autouse=True)
def _isolated_mlflow_uris():
    """mlflow.set_tracking_uri / set_registry_uri are process-global and also export MLFLOW_*_URI to the
    environment (and so to subprocesses): put both back after every test so no test leaks its store."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    yield
    try:
        import mlflow.tracking._model_registry.utils as reg
        import mlflow.tracking._tracking_service.utils as trk
    except ImportError:
        return
    from raytune_ft.registry import restore_env

    reg._registry_uri = None
    trk._tracking_uri = None
    restore_env(saved)
