"""Credentials come from the environment only and are written nowhere; remote code stays off.

The 27B recipe's --local job runs as a user runs it (a subprocess: `python jobs/qwen27b_b300.py
--local`, registration included; the session's shared run) with DATABRICKS_TOKEN, HF_TOKEN, MLFLOW_TRACKING_TOKEN (and a
few more) set to unique random strings. Ray, started by the job, inherits them in every process
it spawns, as it would on a cluster whose nodes carry them. Afterwards none of the values may
appear, as bytes, in the job's stdout/stderr, in Ray's session logs (its own RAY_TMPDIR), in the
MLflow store (the sqlite file, the registered model's artifacts), in the checkpoints or in
summary.json.

A registration that fails with the token inside its exception (a registry that quotes the credential it
refused, as some do) is run the same way, through the post-fit Ray task and the command line: neither
the logged traceback nor the failure record nor the run's tags may carry it.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, SECRET_VARS
from tests.mlflow_server import StubHttpServer, StubRequest, json_reply, make_tiny_qwen2_checkpoint


def _files(*roots: Path):
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                p = Path(dirpath) / n
                if p.is_file() and not p.is_symlink():
                    yield p


def _grep(values: dict[str, bytes], *roots: Path) -> tuple[list[str], int]:
    """(where each value was found, number of files read)."""
    hits, n = [], 0
    for p in _files(*roots):
        try:
            data = p.read_bytes()
        except OSError:      # a socket or a file removed while Ray shut down
            continue
        n += 1
        hits += [f"{name} in {p}" for name, v in values.items() if v in data]
    return hits, n


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
    hits, n_ray = _grep(values, ray_tmp)
    assert hits == []
    # the MLflow store (params, tags, metrics in sqlite; the registered model's artifacts),
    # the checkpoints and summary.json: everything the run wrote under its working folder
    hits, n_run = _grep(values, work)
    assert hits == []
    # the scan read what it had to: the store, a checkpoint, the registered model's files
    run_dir = work / "runs" / "qwen27b-local"
    assert (run_dir / "mlflow.db").is_file() and list(run_dir.glob("checkpoint_*/dcp"))
    assert list(work.rglob("MLmodel")), "no registered model artifacts found to scan"
    assert n_ray > 20 and n_run > 20
    # ...and it does find a value that was written: the run name, in the store and the logs
    canary = {"run_name": b"qwen27b-local"}
    assert _grep(canary, run_dir)[0] and _grep(canary, ray_tmp)[0]


def test_worker_environment_forwards_no_credentials(monkeypatch):
    """Tokens reach workers through the nodes' own environment, never through Ray's runtime_env
    (which Ray records in its job and train-run state and shows on the dashboard)."""
    from raytune_ft.train.launch import _worker_env

    for k in SECRET_VARS:
        monkeypatch.setenv(k, "sk-should-not-be-forwarded")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mnt/shared/jit/triton")
    env = _worker_env()
    assert env.get("HF_HUB_OFFLINE") == "1"        # the forwarding works...
    assert env.get("TRITON_CACHE_DIR") == "/mnt/shared/jit/triton"
    assert not set(SECRET_VARS) & set(env)          # ...and leaves credentials out


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
        from raytune_ft.recipe import ModelConfig
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


_REGISTER_IN_RAY = textwrap.dedent("""
    import json, sys
    import ray
    from raytune_ft.recipe import RegistryConfig
    from raytune_ft.registry import run_registration
    ckpt, tracking, registry_uri, run_id = sys.argv[1:5]
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    cfg = RegistryConfig(name="main.default.echoed", registry_uri=registry_uri, timeout_s=240, num_cpus=1)
    outcome = run_registration(ckpt, cfg, tracking, run_id=run_id)
    print("OUTCOME " + json.dumps(outcome.to_dict()))
    ray.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_token_in_a_failing_registrations_exception_reaches_no_log_or_file(tmp_path, fixtures):
    """The registry (a stub: MLflow's registry REST API refusing, no real one can be made to misbehave
    like this) answers 403 with the caller's bearer token quoted in its message. MLflow puts that message
    in its exception; the Ray task logs the failure with its traceback, the driver records it."""
    import json

    from mlflow import MlflowClient

    token = f"sk-echoed-{secrets.token_hex(16)}"
    seen: list[str] = []

    def echo_refusal(req: StubRequest):
        seen.append(req.headers.get("Authorization", ""))
        return json_reply(403, {"error_code": "PERMISSION_DENIED",
                                "message": f"credential {req.headers.get('Authorization')} lacks CREATE_MODEL"})

    ckpt = make_tiny_qwen2_checkpoint(tmp_path / "run" / "checkpoint_000001", fixtures / "tokenizers" / "qwen2-0.5b")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking)
    exp = client.create_experiment("raytune_ft", artifact_location=(tmp_path / "mlartifacts").as_uri())
    run_id = client.create_run(exp, run_name="train").info.run_id
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtreg", dir="/tmp"))    # short: AF_UNIX paths <= 107 bytes
    env = {**os.environ, "MLFLOW_TRACKING_TOKEN": token, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "RAY_TMPDIR": str(ray_tmp), "PYTHONUNBUFFERED": "1",
           "HOME": str(tmp_path / "home")}       # the CLI's library log (~/.cache/raytune_ft/logs) inside tmp_path
    env.pop("RAY_ADDRESS", None)
    try:
        with StubHttpServer(echo_refusal) as registry:
            in_ray = subprocess.run([sys.executable, "-c", _REGISTER_IN_RAY, str(ckpt), tracking, registry.uri,
                                     run_id], cwd=tmp_path, env=env, capture_output=True, timeout=500)
            out = (in_ray.stdout + in_ray.stderr).decode(errors="replace")
            assert in_ray.returncode == 0, out[-4000:]
            outcome = json.loads(next(l for l in out.splitlines() if l.startswith("OUTCOME "))[8:])
            by_cli = subprocess.run([sys.executable, "-m", "raytune_ft.cli", "register", str(ckpt), "--name",
                                     "main.default.echoed", "--tracking-uri", tracking, "--registry-uri",
                                     registry.uri, "--run-id", run_id], cwd=tmp_path, env=env,
                                    capture_output=True, timeout=300)
        # the token did reach the registry and came back inside the exception: redacted where it shows
        assert f"Bearer {token}" in seen
        assert not outcome["ok"] and "credential Bearer *** lacks CREATE_MODEL" in outcome["error"], outcome
        cli_err = by_cli.stderr.decode(errors="replace")
        assert by_cli.returncode == 1 and "credential Bearer *** lacks" in cli_err, cli_err[-3000:]
        # the console has the project's lines only (the libraries' lines go to the CLI's log file, in
        # tmp_path's home, grepped below); the failure's traceback is in the Ray task's log
        assert "Traceback" not in cli_err, cli_err[-3000:]
        worker_logs = [p for p in _files(ray_tmp) if p.name.startswith("worker-")]
        assert any(b"registration of" in p.read_bytes() and b"Traceback" in p.read_bytes()
                   for p in worker_logs)       # ...in the Ray task's log too

        planted = {"MLFLOW_TRACKING_TOKEN": token.encode()}
        leaks = [k for k, v in planted.items() if v in in_ray.stdout + in_ray.stderr + by_cli.stdout + by_cli.stderr]
        assert leaks == []
        hits, n_ray = _grep(planted, ray_tmp)           # every Ray log: driver, the task's worker, raylet
        assert hits == [] and n_ray > 10
        hits, n_run = _grep(planted, tmp_path)          # failure record, sqlite store (tags), artifacts
        assert hits == []
        assert (ckpt.parent / "registration_failed.json").is_file()
        tags = client.get_run(run_id).data.tags
        assert tags["raytune.status"] == "trained_not_registered" and "***" in tags["raytune.registration_error"]
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_redaction_survives_another_thread_changing_the_environment(monkeypatch):
    """MLflow's telemetry thread sets and drops its own variables while the driver redacts: reading the
    environment must not fail (KeyError, 'dictionary changed size') nor miss a credential."""
    import threading

    from raytune_ft.env import redact, secret_values
    from raytune_ft.recipe import Recipe
    from raytune_ft.tracking import flat_params

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
    from raytune_ft.recipe import Recipe
    from raytune_ft.tracking import flat_params

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
