"""Registration through MLflow's open-source Unity Catalog client (`registry_uri="uc:http://host:port"`).

No runnable open-source Unity Catalog server can be installed here (it is a Java service, not on
PyPI), so this test serves the Unity Catalog REST calls that MLflow 3.17's UC OSS client makes
(mlflow/store/_unity_catalog/registry/uc_oss_rest_store.py) from a small in-test HTTP server:

  POST  /api/2.1/unity-catalog/models                                   create registered model
  POST  /api/2.1/unity-catalog/models/versions                          create model version
  PATCH /api/2.1/unity-catalog/models/{full_name}/versions/{v}/finalize  finalize the version
  GET   /api/2.1/unity-catalog/models/{full_name}/versions/{v}          read it (and its storage)

It hands out file:// storage locations, as a UC server backed by a local volume does, so MLflow
uploads the model files there and loads them back from there. What is checked: the calls made, the
three-level name split into catalog/schema/model, version numbering, the token sent only as an
Authorization header, and that the registered model loads and answers a chat request.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from raytune_ft import registry
from raytune_ft.cli import cli_register
from tests.mlflow_server import StubHttpServer, StubRequest, json_reply, make_tiny_qwen2_checkpoint

PREFIX = "/api/2.1/unity-catalog"
pytestmark = pytest.mark.slow          # each test logs and registers a model through MLflow


class FakeUnityCatalog:
    """The model-registry part of the Unity Catalog REST API, in memory, storage on local disk."""

    def __init__(self, storage_root: Path):
        self.storage_root = storage_root
        self._server = StubHttpServer(self._respond)
        self.calls: list[tuple[str, str, dict, str | None]] = []  # method, path, body, auth header
        self.models: dict[str, dict] = {}
        self.versions: dict[str, list[dict]] = {}
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return f"uc:{self._server.uri}"

    def handle(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        now = int(time.time() * 1000)
        if method == "POST" and path == f"{PREFIX}/models":
            full = f"{body['catalog_name']}.{body['schema_name']}.{body['name']}"
            if full in self.models:
                return 409, {"error_code": "RESOURCE_ALREADY_EXISTS", "message": f"{full} exists"}
            self.models[full] = {**body, "full_name": full, "created_at": now, "updated_at": now}
            self.versions[full] = []
            return 200, self.models[full]
        if method == "POST" and path == f"{PREFIX}/models/versions":
            full = f"{body['catalog_name']}.{body['schema_name']}.{body['model_name']}"
            if full not in self.models:
                return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": f"{full} not found"}
            version = len(self.versions[full]) + 1
            storage = self.storage_root / full / str(version)
            storage.mkdir(parents=True)
            info = {**body, "version": version, "status": "PENDING_REGISTRATION",
                    "storage_location": storage.as_uri(), "created_at": now, "updated_at": now}
            self.versions[full].append(info)
            return 200, info
        parts = path[len(PREFIX):].strip("/").split("/")
        if len(parts) >= 4 and parts[0] == "models" and parts[2] == "versions":
            full, version = parts[1], int(parts[3])
            if full not in self.versions or not 0 < version <= len(self.versions[full]):
                return 404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": f"{full}/{version}"}
            info = self.versions[full][version - 1]
            if method == "PATCH" and parts[4:] == ["finalize"]:
                info["status"] = "READY"
                return 200, info
            if method == "GET" and len(parts) == 4:
                return 200, info
        if method == "GET" and len(parts) == 2 and parts[0] == "models" and parts[1] in self.models:
            return 200, self.models[parts[1]]
        return 404, {"error_code": "ENDPOINT_NOT_FOUND", "message": f"{method} {path}"}

    def _respond(self, req: StubRequest):
        body = req.json()
        path = req.path.split("?", 1)[0]
        with self._lock:
            self.calls.append((req.method, path, body, req.headers.get("Authorization")))
            return json_reply(*self.handle(req.method, path, body))

    def __enter__(self):
        self._server.__enter__()
        return self

    def __exit__(self, *exc):
        self._server.__exit__(*exc)


@pytest.mark.timeout(600)
def test_uc_oss_registration_calls_and_three_level_name(tmp_path, fixtures, monkeypatch):
    import mlflow

    token = "uc-oss-token-5f2c9a"
    monkeypatch.setenv("MLFLOW_UC_OSS_TOKEN", token)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    ckpt = make_tiny_qwen2_checkpoint(tmp_path / "run" / "checkpoint_000003",
                                      fixtures / "tokenizers" / "qwen2-0.5b")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"  # runs and logged models; versions live in UC

    with FakeUnityCatalog(tmp_path / "uc_storage") as uc:
        target = registry.RegistryTarget(tracking, uc.uri)
        first = registry.register_checkpoint(str(ckpt), "main.default.tiny_uc", target)
        second = registry.register_checkpoint(str(ckpt), "main.default.tiny_uc", target)
        assert (first.version, second.version) == ("1", "2")
        assert first.model_uri == "models:/main.default.tiny_uc/1"

        calls = [(m, p) for m, p, _, _ in uc.calls]
        create_model = [b for m, p, b, _ in uc.calls if (m, p) == ("POST", f"{PREFIX}/models")]
        assert create_model[0] == {"name": "tiny_uc", "catalog_name": "main", "schema_name": "default",
                                   "comment": ""}
        create_version = [b for m, p, b, _ in uc.calls if (m, p) == ("POST", f"{PREFIX}/models/versions")]
        assert len(create_version) == 2
        assert {(b["catalog_name"], b["schema_name"], b["model_name"]) for b in create_version} == {
            ("main", "default", "tiny_uc")}
        # MLflow 3 registers the logged model (source models:/m-...), which points back to our run
        assert all(b["source"].startswith("models:/m-") for b in create_version)
        logged = mlflow.MlflowClient(tracking).get_logged_model(create_version[0]["source"][len("models:/"):])
        assert logged.source_run_id == first.run_id
        assert ("PATCH", f"{PREFIX}/models/main.default.tiny_uc/versions/1/finalize") in calls
        assert ("PATCH", f"{PREFIX}/models/main.default.tiny_uc/versions/2/finalize") in calls
        assert all(v["status"] == "READY" for v in uc.versions["main.default.tiny_uc"])
        # the token travels only as the bearer credential, never in a body
        assert {auth for *_, auth in uc.calls} == {f"Bearer {token}"}
        assert all(token not in json.dumps(b) for _, _, b, _ in uc.calls)

        # the files MLflow uploaded to the version's storage are a complete chat model
        stored = tmp_path / "uc_storage" / "main.default.tiny_uc" / "1"
        assert (stored / "MLmodel").is_file()
        assert "llm/v1/chat" in (stored / "MLmodel").read_text()
        assert list((stored / "model").glob("*.safetensors"))
        for f in stored.rglob("*"):
            if f.is_file():
                assert token.encode() not in f.read_bytes()

        # and it loads back through the UC registry URI and answers a chat request
        mlflow.set_tracking_uri(tracking)
        mlflow.set_registry_uri(uc.uri)
        try:
            chat_model = mlflow.pyfunc.load_model("models:/main.default.tiny_uc/2")
            (completion,) = chat_model.predict(
                {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3})
        finally:
            mlflow.set_registry_uri("")
            mlflow.set_tracking_uri(None)
            monkeypatch.delenv("MLFLOW_REGISTRY_URI", raising=False)
        assert completion["choices"][0]["message"]["role"] == "assistant"
        assert ("GET", f"{PREFIX}/models/main.default.tiny_uc/versions/2") in [(m, p) for m, p, _, _ in uc.calls]


@pytest.mark.timeout(600)
def test_uc_refusal_is_reported_with_retry_command(tmp_path, fixtures, monkeypatch):
    """A UC server that answers 403 to model creation: RegistrationError through the CLI path,
    the record beside the checkpoint, the retry command naming the uc: registry."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    ckpt = make_tiny_qwen2_checkpoint(tmp_path / "run" / "checkpoint_000004",
                                      fixtures / "tokenizers" / "qwen2-0.5b")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with FakeUnityCatalog(tmp_path / "uc_storage") as uc:
        uc.handle = lambda method, path, body: (403, {"error_code": "PERMISSION_DENIED",
                                                      "message": "User lacks CREATE MODEL on main.default"})
        rc = cli_register([str(ckpt), "--name", "main.default.tiny_uc", "--tracking-uri", tracking,
                           "--registry-uri", uc.uri, "--timeout", "100"])
    assert rc == 1
    record = json.loads((ckpt.parent / "registration_failed.json").read_text())
    assert "PERMISSION_DENIED" in record["error"]
    assert f"--registry-uri {uc.uri}" in record["retry_command"]
    assert record["run_tagged"] is True  # the sqlite tracking store was reachable
