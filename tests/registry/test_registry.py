"""Registration against a real `mlflow server` on loopback, through the post-fit Ray task.

What a user relies on: a finished run's checkpoint becomes a new version of `main.default.<name>`
that loads back and answers a chat request; a registry that is down or refuses leaves the checkpoint
untouched, says so on the run and prints a retry command that works once the registry is back;
credentials from the environment end up nowhere: every MLflow call of the module carries a bearer token
(MLFLOW_TRACKING_TOKEN), which the refusing registry quotes back in its error, as some do.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import secrets
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.mlflow_server import StubHttpServer, StubRequest, json_reply, make_tiny_qwen2_checkpoint
from raytune_ft import registry
from raytune_ft.cli import cli_register
from raytune_ft.env import redact, scoped_env
from raytune_ft.recipe.recipe import RegistryConfig

REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
TOKEN = f"sk-echoed-{secrets.token_hex(16)}"      # MLFLOW_TRACKING_TOKEN for the module (quick_http)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def quick_http():
    """No HTTP retries with back-off (7 by default, minutes against a dead port), and the bearer token every
    MLflow call sends (this server ignores it). Set before Ray starts, so the registration task's worker
    processes inherit them too, as a cluster's processes carry their node's credentials."""
    with scoped_env({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
                     "MLFLOW_TRACKING_TOKEN": TOKEN}):
        yield


@pytest.fixture(scope="module")
def server(mlflow_server, quick_http):
    return mlflow_server              # the session's server (tests/conftest.py)


@pytest.fixture(scope="module")
def ray_registry(quick_http):
    import ray
    ray.init(address="local", num_cpus=4, include_dashboard=False, ignore_reinit_error=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory, fixtures):
    return make_tiny_qwen2_checkpoint(tmp_path_factory.mktemp("ckpt") / "checkpoint_000001",
                                      fixtures / "tokenizers" / "qwen2-0.5b")


@pytest.fixture
def checkpoint(base_checkpoint, tmp_path):
    """A private copy inside its own run folder (failure records land beside the checkpoint)."""
    dst = tmp_path / "run" / base_checkpoint.name
    shutil.copytree(base_checkpoint, dst)
    return dst


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def training_run(tracking_uri: str, name: str = "train") -> str:
    """A finished MLflow run standing in for the training run the registration attaches to."""
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("raytune_ft")
    exp_id = exp.experiment_id if exp else client.create_experiment("raytune_ft")
    run = client.create_run(exp_id, run_name=name)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def run_cli(cmd: str, tmp_path: Path, home: Path | None = None) -> subprocess.CompletedProcess:
    """Run a printed retry command as printed, with the venv's `raytune-ft` console script (or
    `python -m raytune_ft.cli register ...` where the package is not installed as a script); `home`: its
    HOME (where its library log goes, ~/.cache/raytune_ft/logs)."""
    import shlex
    argv = shlex.split(cmd)
    assert argv[:2] == ["raytune-ft", "register"], cmd
    script = Path(sys.executable).with_name("raytune-ft")
    prefix = [str(script)] if script.exists() else [sys.executable, "-m", "raytune_ft.cli"]
    env = dict(os.environ, **({"HOME": str(home)} if home else {}))
    return subprocess.run([*prefix, *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)


class RegistryProxy:
    """A loopback HTTP proxy to the MLflow server that can refuse model-registry calls with 403, as a
    registry whose service principal lacks the grant on the catalog would, quoting the credential it got."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.refuse = True
        self.refused: list[str] = []
        self.credentials: list[str] = []           # the Authorization headers of the refused calls
        self._server = StubHttpServer(self._respond)
        self.uri = self._server.uri

    def _respond(self, req: StubRequest):
        if self.refuse and ("/registered-models/" in req.path or "/model-versions/" in req.path):
            self.refused.append(req.path)
            auth = req.headers.get("Authorization", "")
            self.credentials.append(auth)
            return json_reply(403, {"error_code": "PERMISSION_DENIED",
                                    "message": f"credential {auth} has no CREATE_MODEL grant on main.default"})
        conn = http.client.HTTPConnection("127.0.0.1", self.target_port, timeout=60)
        headers = {k: v for k, v in req.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(req.method, req.path, body=req.body or None, headers=headers)
        resp = conn.getresponse()
        reply = resp.status, dict(resp.getheaders()), resp.read()
        conn.close()
        return reply

    def __enter__(self):
        self._server.__enter__()
        return self

    def __exit__(self, *exc):
        self._server.__exit__(*exc)


# ---------------------------------------------------------------- the success path


@pytest.mark.timeout(900)
def test_post_fit_task_registers_versions_that_answer_chat(server, ray_registry, checkpoint):
    import mlflow
    from mlflow import MlflowClient

    name = f"main.default.tiny_chat_{uuid.uuid4().hex[:6]}"
    cfg = RegistryConfig(name=name, timeout_s=400, num_cpus=1, memory_gb=2)
    run_id = training_run(server.uri)
    before = tree_hashes(checkpoint)

    first = registry.run_registration(str(checkpoint), cfg, server.uri, run_id=run_id,
                                      metadata={"dataset": "fixture-chat"})
    assert first.ok, first.error
    assert (first.result.name, first.result.version) == (name, "1")
    assert first.result.run_id == run_id
    # registered again (a re-submit, a retry): the version made from this checkpoint, not a second one
    second = registry.run_registration(str(checkpoint), cfg, server.uri, run_id=run_id)
    assert second.ok, second.error
    assert second.result.version == "1"
    assert tree_hashes(checkpoint) == before  # registration only reads the checkpoint

    client = MlflowClient(server.uri)
    versions = sorted(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    assert versions == [1]
    run = client.get_run(run_id)
    assert run.data.tags["raytune.status"] == "registered"
    assert run.data.tags["raytune.registered_model_version"] == "1"

    mlflow.set_tracking_uri(server.uri)  # the registry defaults to the tracking server
    try:
        info = mlflow.models.get_model_info(f"models:/{name}/1")
        md = info.metadata
        assert md["task"] == "llm/v1/chat"
        assert md["pretrained_model_name"] == "Qwen/Qwen2-0.5B"
        assert md["model_family"] == "qwen2"
        assert md["parameter_count"] == registry.count_parameters(checkpoint / "hf") > 4_000_000
        assert md["dataset"] == "fixture-chat"
        assert info.signature.inputs.to_dict()[0]["name"] == "messages"
        assert info.flavors["transformers"]["inference_task"] == "llm/v1/chat"

        pipe = mlflow.transformers.load_model(f"models:/{name}/1")
        answer = pipe(CHAT, max_new_tokens=5)
        turns = answer[0]["generated_text"]
        assert [t["role"] for t in turns] == ["system", "user", "assistant"]
        assert isinstance(turns[-1]["content"], str)

        chat_model = mlflow.pyfunc.load_model(f"models:/{name}/1")
        (completion,) = chat_model.predict({"messages": CHAT, "max_tokens": 5})
        assert completion["object"] == "chat.completion"
        assert completion["choices"][0]["message"]["role"] == "assistant"
        assert 0 < completion["usage"]["completion_tokens"] <= 5
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_checkpoint_is_merged_beside_it_and_registered(tmp_path, fixtures):
    """A LoRA checkpoint (adapter/ only): merged into its base with peft, the merged folder written
    next to the checkpoint, the registered model computing what base+adapter computes."""
    import mlflow
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = make_tiny_qwen2_checkpoint(tmp_path / "base", fixtures / "tokenizers" / "qwen2-0.5b",
                                          hf_subdir=None, seed=3)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(1)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=["q_proj", "v_proj", "down_proj"]))
    ckpt = tmp_path / "run" / "checkpoint_000002"
    peft_model.save_pretrained(str(ckpt / "adapter"))
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(ckpt / "adapter"))
    (ckpt / "raytune_meta.json").write_text(json.dumps(
        {"job": "qwen2_05b_lora", "model_name": "Qwen/Qwen2-0.5B", "revision": "91d2e1b", "family": "qwen2",
         "step": 1, "final_loss": 3.0, "run_name": "lora-run", "lora": True}))
    assert json.loads((ckpt / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(base_dir)
    before = tree_hashes(ckpt)

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = registry.register_checkpoint(str(ckpt), "main.default.tiny_lora", registry.RegistryTarget(tracking))
    assert result.version == "1"
    assert tree_hashes(ckpt) == before
    merged = registry.merged_folder_for(ckpt)
    assert merged.parent == ckpt.parent and (merged / "config.json").is_file()

    ids = torch.tensor([[9707, 11, 1879, 0]])
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    mlflow.set_tracking_uri(tracking)
    try:
        pipe = mlflow.transformers.load_model("models:/main.default.tiny_lora/1")
        with torch.no_grad():
            got = pipe.model.float()(input_ids=ids).logits
        info = mlflow.models.get_model_info("models:/main.default.tiny_lora/1")
    finally:
        mlflow.set_tracking_uri(None)
    # the merged weights are stored in the base's bf16, so compare at bf16 precision
    assert torch.allclose(got, expected, atol=5e-2, rtol=5e-2)
    with torch.no_grad():
        base_only = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)(input_ids=ids).logits
    assert not torch.allclose(got, base_only, atol=1e-3)  # the adapter really was merged
    assert info.metadata["raytune_lora"] is True
    _assert_records_base_and_adapter(tracking, "main.default.tiny_lora", "1", tmp_path)


def _assert_records_base_and_adapter(tracking: str, name: str, version: str, tmp_path: Path) -> None:
    """The version names the base model and revision it was trained from (tags and the model's metadata),
    is the merged model, and its run holds the PEFT adapter itself."""
    import mlflow

    client = mlflow.MlflowClient(tracking, registry_uri=tracking)
    v = client.get_model_version(name, version)
    assert v.tags["raytune.base_model"] == "Qwen/Qwen2-0.5B" and v.tags["raytune.base_model_revision"] == "91d2e1b"
    assert v.tags["raytune.lora"] == "merged"
    mlflow.set_tracking_uri(tracking)
    try:
        info = mlflow.models.get_model_info(f"models:/{name}/{version}")
    finally:
        mlflow.set_tracking_uri(None)
    assert info.metadata["base_model"] == "Qwen/Qwen2-0.5B" and info.metadata["base_model_revision"] == "91d2e1b"
    got = client.download_artifacts(v.run_id, v.tags["raytune.lora_adapter_artifact"], str(tmp_path / "dl"))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(got))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_checkpoint_merged_in_training_registers_as_a_full_model(tmp_path, fixtures):
    """hf/ (merged by the loop) beside adapter/: hf/ is registered as it is, as a full model, nothing merged
    again; the version records the base and its revision and the run keeps the adapter."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir = make_tiny_qwen2_checkpoint(tmp_path / "base", fixtures / "tokenizers" / "qwen2-0.5b",
                                          hf_subdir=None, seed=3)
    torch.manual_seed(1)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj"]))
    ckpt = tmp_path / "run" / "checkpoint_000002"
    peft_model.save_pretrained(str(ckpt / "adapter"))
    peft_model.merge_and_unload().save_pretrained(str(ckpt / "hf"))
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(ckpt / "hf"))
    (ckpt / "raytune_meta.json").write_text(json.dumps(
        {"job": "qwen27b_lora", "model_name": "Qwen/Qwen2-0.5B", "revision": "91d2e1b", "family": "qwen2",
         "step": 1, "final_loss": 3.0, "run_name": "lora-merged", "lora": True}))
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = registry.register_checkpoint(str(ckpt), "main.default.tiny_merged", registry.RegistryTarget(tracking))
    assert result.version == "1" and not registry.merged_folder_for(ckpt).exists()
    _assert_records_base_and_adapter(tracking, "main.default.tiny_merged", "1", tmp_path)
    import mlflow

    mlflow.set_tracking_uri(tracking)
    try:
        info = mlflow.models.get_model_info("models:/main.default.tiny_merged/1")
    finally:
        mlflow.set_tracking_uri(None)
    assert info.metadata["architecture"] == "Qwen2ForCausalLM"
    assert info.metadata["parameter_count"] == registry.count_parameters(ckpt / "hf")


# ---------------------------------------------------------------- failures


@pytest.mark.timeout(900)
def test_registry_refusing_keeps_checkpoint_tags_run_and_retry_works(server, ray_registry, checkpoint,
                                                                      tmp_path):
    from mlflow import MlflowClient

    name = f"main.default.refused_{uuid.uuid4().hex[:6]}"
    run_id = training_run(server.uri)
    before = tree_hashes(checkpoint)
    with RegistryProxy(server.port) as proxy:
        cfg = RegistryConfig(name=name, registry_uri=proxy.uri, timeout_s=400, num_cpus=1)
        outcome = registry.run_registration(str(checkpoint), cfg, server.uri, run_id=run_id)

        assert not outcome.ok and outcome.result is None
        assert proxy.refused, "the registry was never asked"
        assert "PERMISSION_DENIED" in outcome.error
        assert tree_hashes(checkpoint) == before
        run = MlflowClient(server.uri).get_run(run_id)
        assert run.data.tags["raytune.status"] == "trained_not_registered"
        assert "PERMISSION_DENIED" in run.data.tags["raytune.registration_error"]
        record = json.loads(Path(outcome.failure_file).read_text())
        assert Path(outcome.failure_file).parent == checkpoint.parent  # beside, not inside
        assert record["retry_command"] == outcome.retry_command
        assert outcome.retry_command.startswith(f"raytune-ft register {checkpoint} --name {name} ")
        assert f"--registry-uri {proxy.uri}" in outcome.retry_command
        assert f"--run-id {run_id}" in outcome.retry_command
        # the token reached the registry and came back inside MLflow's exception: redacted wherever it shows
        assert f"Bearer {TOKEN}" in proxy.credentials
        assert "credential Bearer *** has no CREATE_MODEL" in outcome.error, outcome.error
        assert "credential Bearer *** has no" in run.data.tags["raytune.registration_error"]
        # the retry command run before the grant fails the same way, in the project's words only (the
        # libraries' lines go to its log file, under tmp_path's home, grepped below)
        refused = run_cli(outcome.retry_command, tmp_path, home=tmp_path / "home")
        assert refused.returncode == 1 and "credential Bearer *** has no" in refused.stderr, refused.stderr[-3000:]
        assert "Traceback" not in refused.stderr, refused.stderr[-3000:]
        record_text = Path(outcome.failure_file).read_text()

        proxy.refuse = False  # the grant was given
        done = run_cli(outcome.retry_command, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"registered {name} version 1" in done.stdout

    client = MlflowClient(server.uri)
    assert [v.version for v in client.search_model_versions(f"name = '{name}'")] == ["1"]
    assert client.get_run(run_id).data.tags["raytune.status"] == "registered"
    assert not Path(outcome.failure_file).exists()  # the stale failure record went with success
    assert tree_hashes(checkpoint) == before
    # the token is written nowhere: the consoles, the failure record (read before the success removed it), the
    # Ray task's log (which has the failure's traceback), Ray's other logs, the server's store and artifacts
    consoles = refused.stdout + refused.stderr + done.stdout + done.stderr
    assert TOKEN not in consoles and TOKEN not in record_text
    from tests.conftest import grep_files, ray_session_dir

    session = ray_session_dir()
    logs = [p.read_text(errors="replace") for p in session.glob("logs/worker-*")]
    assert any("registration of" in text and "Traceback" in text for text in logs)
    hits, n = grep_files({"MLFLOW_TRACKING_TOKEN": TOKEN.encode()}, session, tmp_path, server.root)
    assert hits == [] and n > 20


@pytest.mark.timeout(900)
def test_registry_down_keeps_checkpoint_and_retry_works_when_back(server, ray_registry, checkpoint,
                                                                   tmp_path):
    from mlflow import MlflowClient

    name = f"main.default.down_{uuid.uuid4().hex[:6]}"
    run_id = training_run(server.uri)
    before = tree_hashes(checkpoint)
    server.stop()
    try:
        cfg = RegistryConfig(name=name, timeout_s=400, num_cpus=1)
        outcome = registry.run_registration(str(checkpoint), cfg, server.uri, run_id=run_id)
        assert not outcome.ok
        assert "Connection refused" in outcome.error or "ConnectionError" in outcome.error, outcome.error
        assert tree_hashes(checkpoint) == before
        record = json.loads((checkpoint.parent / "registration_failed.json").read_text())
        assert record["run_tagged"] is False  # the tracking server was down too: nothing to tag
        assert record["checkpoint"] == str(checkpoint) and record["name"] == name
        assert outcome.retry_command == record["retry_command"]
    finally:
        server.start()  # same port, same store: the registry is back

    done = run_cli(outcome.retry_command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(server.uri)
    assert [v.version for v in client.search_model_versions(f"name = '{name}'")] == ["1"]
    assert client.get_run(run_id).data.tags["raytune.status"] == "registered"
    assert tree_hashes(checkpoint) == before


@pytest.mark.timeout(120)
def test_timeout_kills_the_task_and_reports(server, ray_registry, checkpoint, monkeypatch):
    """A task that does not stop by itself is killed once timeout_s (+ grace, 0 here) has passed."""
    from raytune_ft.registry import task

    monkeypatch.setattr(task, "_KILL_GRACE_S", 0.0)
    cfg = RegistryConfig(name="main.default.too_slow", timeout_s=0.5, num_cpus=1)
    before = tree_hashes(checkpoint)
    outcome = registry.run_registration(str(checkpoint), cfg, server.uri)
    assert not outcome.ok
    assert "within registry.timeout_s=0.5s (task killed" in outcome.error
    assert "raytune-ft register" in outcome.retry_command
    assert tree_hashes(checkpoint) == before


@pytest.mark.timeout(300)
def test_registration_stops_itself_at_its_deadline(server, checkpoint, tmp_path):
    """`raytune-ft register --timeout` in a process of its own, as users run it. The deadline is a SIGALRM
    whose exception can land anywhere in MLflow's client, a lock held or a thread pool half-fed, so the
    process it went off in is not used again: the command exits, the Ray task has max_calls=1. (Run here in
    the test's own process, it once left the next test's model download waiting forever.)"""
    name = "main.default.too_slow_2"
    proc = run_cli(f"raytune-ft register {checkpoint} --name {name} --tracking-uri {server.uri} --timeout 0.05",
                   tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "registration failed: registration did not finish within 0.05s" in proc.stderr
    assert f"raytune-ft register {checkpoint} --name {name}" in proc.stderr   # the retry command


def test_the_registration_task_runs_in_a_process_used_once():
    """Its deadline's exception may leave MLflow's client state inconsistent (see above): never reused."""
    from raytune_ft.registry import task

    assert task.register_task()._default_options.get("max_calls") == 1


# ---------------------------------------------------------------- secrets


@pytest.mark.timeout(600)
def test_databricks_token_is_written_nowhere(server, checkpoint, tmp_path, monkeypatch):
    import mlflow
    from mlflow import MlflowClient

    secret = f"dapi-{uuid.uuid4().hex}"
    monkeypatch.setenv("DATABRICKS_TOKEN", secret)
    monkeypatch.setenv("DATABRICKS_HOST", "https://example.invalid")
    name = f"main.default.secret_{uuid.uuid4().hex[:6]}"
    result = registry.register_checkpoint(
        str(checkpoint), name, registry.RegistryTarget(server.uri),
        # a careless caller passing it along: dropped by key, redacted by value
        metadata={"databricks_token": secret, "note": f"auth {secret}", "nested": {"api_key": secret}})

    client = MlflowClient(server.uri)
    run = client.get_run(result.run_id)
    blob = json.dumps([run.data.params, run.data.tags, dict(client.get_model_version(name, "1"))],
                      default=str)
    mlflow.set_tracking_uri(server.uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(result.model_uri, dst_path=str(tmp_path / "dl")))
        info = mlflow.models.get_model_info(result.model_uri)
    finally:
        mlflow.set_tracking_uri(None)
    assert (local / "MLmodel").is_file()
    assert info.metadata["note"] == "auth ***" and "databricks_token" not in info.metadata
    assert secret not in blob
    places = [local, checkpoint.parent, server.root]  # downloaded model, run folder, server store + db
    for root in places:
        for f in root.rglob("*"):
            if f.is_file():
                assert secret.encode() not in f.read_bytes(), f"secret found in {f}"


@pytest.mark.slow          # registers twice, each in a child process of its own
@pytest.mark.timeout(600)
def test_cli_register_retried_without_a_run_id_keeps_one_version(checkpoint, tmp_path, capsys):
    """`raytune-ft register CKPT --name ...` run again (after a transient error that hid its answer, say)
    returns the version it made: found by the checkpoint tag on the version, with no run id to go by."""
    from mlflow import MlflowClient

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    name = "main.default.retried"
    # the run folder's record, as a run whose own registration failed leaves it
    record = checkpoint.parent / "summary.json"
    record.write_text(json.dumps({"status": "trained_not_registered", "checkpoint": str(checkpoint),
                                  "registration_error": "ConnectionError", "retry_command": "raytune-ft register"}))
    argv = [str(checkpoint), "--name", name, "--tracking-uri", tracking, "--timeout", "300"]
    assert cli_register(argv) == 0
    # the record now says registered: `raytune-ft runs` lists it so, and a re-submit answers from it without Ray
    assert json.loads(record.read_text()) == {"status": "registered", "checkpoint": str(checkpoint),
                                              "registered_name": name, "registered_version": "1",
                                              "registration_error": None, "retry_command": None}
    assert cli_register(argv) == 0
    out = capsys.readouterr().out
    assert out.count(f"registered {name} version 1:") == 2
    # each call's libraries' lines in a file of its own, not one register.log for every process of the machine
    logs = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("the libraries' warnings: ")]
    assert len(set(logs)) == 2 and all(os.path.basename(f).startswith("register-") for f in logs), logs
    versions = MlflowClient(tracking).search_model_versions(f"name = '{name}'")
    assert [str(v.version) for v in versions] == ["1"]
    assert versions[0].tags["raytune.checkpoint"] == str(checkpoint)


@pytest.mark.timeout(120)
def test_existing_version_lookup_is_bounded_by_the_registry_timeout(checkpoint, quick_http):
    """A registry that accepts the connection and never answers (a stub: a real MLflow server cannot be
    made to stall) holds the lookup no longer than registry.timeout_s; the lookup then finds nothing."""
    import threading
    import time

    release = threading.Event()

    def stall(req: StubRequest):
        release.wait(60)
        return json_reply(503, {"error_code": "TEMPORARILY_UNAVAILABLE", "message": "stalled"})

    with StubHttpServer(stall) as stalled:
        t0 = time.monotonic()
        try:
            found = registry.find_registered_version(str(checkpoint), "main.default.m", tracking_uri=stalled.uri,
                                                     timeout_s=2)
        finally:
            took = time.monotonic() - t0
            release.set()
            # the lookup left behind ends once answered: not later, logging into a test that has ended
            for t in threading.enumerate():
                if t.name == "raytune-version-lookup":
                    t.join(timeout=30)
    assert found is None and took < 10


def test_redaction_and_retry_command_quote_paths(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_verysecretvalue")
    assert redact("got hf_verysecretvalue back") == "got *** back"
    cmd = registry.retry_command("/runs/my run/ckpt", "main.default.m",
                                 "https://bob:pw123@mlflow.example:5000/?token=abc", "uc:http://h:8080")
    assert "pw123" not in cmd and "token=abc" not in cmd
    assert "'/runs/my run/ckpt'" in cmd and "--registry-uri uc:http://h:8080" in cmd


def test_cli_rejects_bad_name_and_missing_checkpoint(tmp_path, capsys):
    assert cli_register([str(tmp_path), "--name", "just_a_name", "--tracking-uri", "sqlite:///x.db"]) == 2
    assert "catalog.schema.model" in capsys.readouterr().err
    assert cli_register([str(tmp_path / "nope"), "--name", "a.b.c", "--tracking-uri", "sqlite:///x.db"]) == 2
    helped = subprocess.run([sys.executable, "-m", "raytune_ft.cli", "register", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--registry-uri" in helped.stdout
