"""Credentials come from the environment only and are written nowhere; remote code stays off.

The 27B recipe's --local job runs as a user runs it (a subprocess: `python jobs/qwen27b_b300.py
--local`, registration included; the session's shared run) with DATABRICKS_TOKEN, HF_TOKEN, MLFLOW_TRACKING_TOKEN (and a
few more) set to unique random strings. Ray, started by the job, inherits them in every process
it spawns, as it would on a cluster whose nodes carry them. Afterwards none of the values may
appear, as bytes, in the job's stdout/stderr, in Ray's session logs (its own RAY_TMPDIR), in the
MLflow store (the sqlite file, the registered model's artifacts), in the checkpoints or in
summary.json.

A registration that fails with the token inside its exception (a registry that quotes the credential it
refused, as some do), through the post-fit Ray task and the command line: tests/registry/test_registry.py's refusing
registry. A password in the tracking URI: tests/driver/test_job_submit.py's job.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, SECRET_VARS, grep_files


@pytest.fixture(scope="module")
def job_with_secrets(local_job):
    """The session's --local job (tests/conftest.py): it ran with the tokens planted."""
    return local_job


@pytest.mark.timeout(600)
def test_tokens_appear_in_no_log_param_artifact_or_checkpoint(job_with_secrets):
    proc, planted = job_with_secrets["proc"], job_with_secrets["planted"]
    work, ray_tmp = job_with_secrets["work"], job_with_secrets["ray_tmp"]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:].decode(errors="replace")
    assert b": registered" in proc.stdout, proc.stdout[-2000:]      # the registration ran too
    values = {k: v.encode() for k, v in planted.items()}

    # the job's own output
    assert [k for k, v in values.items() if v in out] == []
    # Ray's session logs (driver, controller, workers, raylet, GCS, export events)
    sessions = [p for p in ray_tmp.rglob("session_*") if p.is_dir() and not p.is_symlink()]
    assert sessions and any((s / "logs").is_dir() for s in sessions), list(ray_tmp.iterdir())
    hits, n_ray = grep_files(values, ray_tmp)
    assert hits == []
    # the MLflow store (params, tags, metrics in sqlite; the registered model's artifacts),
    # the checkpoints and summary.json: everything the run wrote under its working folder
    hits, n_run = grep_files(values, work)
    assert hits == []
    # the scan read what it had to: the store, a checkpoint, the registered model's files
    run_dir = work / "runs" / "qwen27b-local"
    assert (run_dir / "mlflow.db").is_file() and list(run_dir.glob("checkpoint_*/dcp"))
    assert list(work.rglob("MLmodel")), "no registered model artifacts found to scan"
    assert n_ray > 20 and n_run > 20
    # ...and it does find a value that was written: the run name, in the store and the logs
    canary = {"run_name": b"qwen27b-local"}
    assert grep_files(canary, run_dir)[0] and grep_files(canary, ray_tmp)[0]


def test_worker_environment_forwards_no_credentials(monkeypatch):
    """Tokens reach workers through the nodes' own environment, never through Ray's runtime_env
    (which Ray records in its job and train-run state and shows on the dashboard)."""
    from raytune_ft.driver.launch import _worker_env

    for k in SECRET_VARS:
        monkeypatch.setenv(k, "sk-should-not-be-forwarded")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mnt/shared/jit/triton")
    env = _worker_env()
    assert env.get("HF_HUB_OFFLINE") == "1"        # the forwarding works...
    assert env.get("TRITON_CACHE_DIR") == "/mnt/shared/jit/triton"
    assert not set(SECRET_VARS) & set(env)          # ...and leaves credentials out
    # the CUDA allocator's expandable segments by default, the user's own allocator setting where there is one
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert _worker_env()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert _worker_env()["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_recipes_leave_trust_remote_code_off():
    import importlib.util

    for job in ("qwen27b_b300", "qwen3_4b_full", "qwen2_05b_lora"):
        spec = importlib.util.spec_from_file_location(f"job_{job}", REPO / "jobs" / f"{job}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert mod.recipe().model.trust_remote_code is False, job
        assert mod.local(mod.recipe()).model.trust_remote_code is False, job


@pytest.mark.timeout(180)
def test_remote_code_in_a_model_folder_runs_only_when_the_recipe_allows_it(tmp_path):
    """A model folder whose config points at its own Python (auto_map) is refused by default and
    its code never runs; with model.trust_remote_code=true transformers runs it."""
    model = tmp_path / "remote_model"
    model.mkdir()
    marker = tmp_path / "remote_code_ran"
    (model / "config.json").write_text(
        '{"model_type": "raytune_remote", "auto_map": {"AutoConfig": "remote_config.RemoteConfig"}}')
    (model / "remote_config.py").write_text(textwrap.dedent(f"""
        import pathlib
        pathlib.Path({str(marker)!r}).write_text("ran")
        from transformers import PretrainedConfig

        class RemoteConfig(PretrainedConfig):
            model_type = "raytune_remote"
    """))
    script = textwrap.dedent(f"""
        import sys
        from raytune_ft.recipe.recipe import ModelConfig
        from raytune_ft.models.build import text_config_for
        trust = sys.argv[1] == "1"
        try:
            text_config_for(ModelConfig(name={str(model)!r}, trust_remote_code=trust))
            print("loaded")
        except Exception as e:
            print("refused", type(e).__name__, e)
    """)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    off = subprocess.run([sys.executable, "-c", script, "0"], env=env, capture_output=True, text=True,
                         timeout=150, cwd=REPO)
    assert off.stdout.startswith("refused"), off.stdout + off.stderr[-2000:]
    assert "trust_remote_code" in off.stdout
    assert not marker.exists()
    on = subprocess.run([sys.executable, "-c", script, "1"], env=env, capture_output=True, text=True,
                        timeout=150, cwd=REPO)
    assert marker.exists(), on.stdout + on.stderr[-2000:]


def test_redaction_survives_another_thread_changing_the_environment(monkeypatch):
    """MLflow's telemetry thread sets and drops its own variables while the driver redacts: reading the
    environment must not fail (KeyError, 'dictionary changed size') nor miss a credential."""
    import threading

    from raytune_ft.env import redact, secret_values
    from raytune_ft.recipe.recipe import Recipe
    from raytune_ft.tracking.mlflow_run import flat_params

    token = f"sk-planted-{secrets.token_hex(12)}"
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", token)
    # pad the environment so one pass over it is long enough for the other thread to cut in
    for i in range(300):
        monkeypatch.setenv(f"RAYTUNE_TEST_PAD_{i}", "x")
    recipe = Recipe()
    recipe.tracking.tracking_uri = f"https://ci:{token}@mlflow.example"
    stop = threading.Event()

    def churn():
        i = 0
        while not stop.is_set():
            name = f"_RAYTUNE_TEST_CHURN_{i % 50}"
            os.environ[name] = str(i)
            os.environ.pop(name, None)
            i += 1

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)          # switch threads as often as the interpreter can
    mutator = threading.Thread(target=churn, daemon=True)
    mutator.start()
    try:
        for _ in range(100):
            assert token in secret_values()
            assert token not in redact(f"bearer {token}")
            assert token not in str(flat_params(recipe))
    finally:
        stop.set()
        mutator.join(timeout=10)
        sys.setswitchinterval(old_interval)
        for i in range(50):
            os.environ.pop(f"_RAYTUNE_TEST_CHURN_{i}", None)


def test_uri_credentials_are_masked_in_params_and_public_uris(monkeypatch):
    """A token in a query string, an S3 key pair in a storage path's userinfo or query, a bare token as the
    user name: the params of the MLflow run and the public form of each URI carry none of them."""
    from raytune_ft.env import public_uri, redact
    from raytune_ft.recipe.recipe import Recipe
    from raytune_ft.tracking.mlflow_run import flat_params

    planted = {name: f"{name}-{secrets.token_hex(10)}" for name in ("token", "password", "secret_key", "sig", "git")}
    recipe = Recipe()
    recipe.tracking.tracking_uri = f"https://ci:{planted['password']}@mlflow.example/?token={planted['token']}"
    recipe.tracking.storage_path = (f"s3://AKIDEXAMPLE:{planted['secret_key']}@bucket/runs?endpoint_override="
                                    f"s3.example:9000&X-Amz-Signature={planted['sig']}")
    recipe.registry.registry_uri = f"uc:https://{planted['git']}@uc.example"
    shown = [*flat_params(recipe).values(), public_uri(recipe.tracking.tracking_uri),
             public_uri(recipe.tracking.storage_path), redact(f"store at {recipe.tracking.tracking_uri}, done")]
    assert [k for k, v in planted.items() if any(v in s for s in shown)] == []
    # what is not a credential stays, so the URI still says where things are
    assert public_uri(recipe.tracking.storage_path) == ("s3://AKIDEXAMPLE:***@bucket/runs?endpoint_override="
                                                        "s3.example:9000&X-Amz-Signature=***")
    assert flat_params(recipe)["tracking.tracking_uri"] == "https://ci:***@mlflow.example/?token=***"
    assert public_uri("sqlite:////runs/x/mlflow.db") == "sqlite:////runs/x/mlflow.db"
