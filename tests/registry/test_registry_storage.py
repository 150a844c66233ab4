"""Registration of a checkpoint on object storage (the SeaweedFS S3 server on loopback), and retries that
never register a checkpoint twice.

The checkpoint is a tiny Qwen2 (hf/ + raytune_meta.json, as the loops leave it) uploaded to a bucket with a
dcp/ folder beside it that registration must not read; MLflow's store is sqlite with the experiment's
artifacts on the same S3 server, as a run with tracking.storage_path=s3://... sets it up.
"""
from __future__ import annotations

import pytest

from raytune_ft import registry

from raytune_ft.storage import fs as storage
from tests.mlflow_server import make_tiny_qwen2_checkpoint


@pytest.fixture
def s3_checkpoint(s3_env, tmp_path, fixtures):
    local = make_tiny_qwen2_checkpoint(tmp_path / "ckpt" / "checkpoint_2026-11-30_10-00-00.000000",
                                       fixtures / "tokenizers" / "qwen2-0.5b")
    (local / "dcp").mkdir()
    (local / "dcp" / "__0_0.distcp").write_bytes(b"\0" * 1000)     # must not be fetched
    st = storage.resolve(f"s3://{s3_env.bucket()}/runs/tiny-run", create=True)
    storage.upload(str(local), st.fs, st.path(local.name))
    uri = st.uri(st.path(local.name))
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from mlflow import MlflowClient

    client = MlflowClient(tracking)
    exp = client.create_experiment("raytune_ft", artifact_location=st.uri(st.path("mlartifacts")))
    run_id = client.create_run(exp, run_name="tiny-run").info.run_id
    return {"uri": uri, "st": st, "tracking": tracking, "run_id": run_id, "client": client}


def _versions(client, name: str) -> list[str]:
    return sorted(str(v.version) for v in client.search_model_versions(f"name = '{name}'"))


@pytest.mark.timeout(600)
def test_register_from_s3_uri_reads_only_the_model_and_is_idempotent_on_retry(s3_checkpoint, monkeypatch):
    c = s3_checkpoint
    name = "main.default.tiny_s3"
    fetched = []
    real_download = storage.download

    def counting_download(fs, src, dst, *, only=None, **kw):
        got = real_download(fs, src, dst, only=only, **kw)
        fetched.extend(got)
        return got

    monkeypatch.setattr(storage, "download", counting_download)
    first = registry.register_checkpoint(c["uri"], name, registry.RegistryTarget(c["tracking"], run_id=c["run_id"]))
    assert first.version == "1"
    assert "raytune_meta.json" in fetched and any(f.startswith("hf/") for f in fetched)
    assert not any(f.startswith("dcp/") for f in fetched)
    # the version says which checkpoint it is; the model's files went to the S3 artifact store
    mv = c["client"].get_model_version(name, "1")
    assert mv.tags[registry.base.CHECKPOINT_TAG] == c["uri"]
    arts = [i.path for i in storage.list_files(c["st"].fs, c["st"].path("mlartifacts"))]
    assert any(p.endswith(".safetensors") for p in arts), arts

    # a failed attempt leaves its record beside the checkpoint (on S3) and a retry command naming the URI
    outcome = registry.record_failure(c["uri"], name, c["tracking"], None, c["run_id"], "timed out")
    assert outcome.failure_file == c["uri"].rsplit("/", 1)[0] + "/registration_failed.json"
    assert f"raytune-ft register {c['uri']} --name {name}" in outcome.retry_command
    assert storage.read_json(c["st"].fs, c["st"].path("registration_failed.json"))["checkpoint"] == c["uri"]
    # the retry finds the version that attempt made (e.g. it timed out after registering): no second one
    again = registry.register_checkpoint(c["uri"], name, registry.RegistryTarget(c["tracking"], run_id=c["run_id"]))
    assert again.version == "1" and _versions(c["client"], name) == ["1"]
    assert not storage.exists(c["st"].fs, c["st"].path("registration_failed.json"))   # cleared on success
    assert registry.find_registered_version(c["uri"], name, tracking_uri=c["tracking"]).version == "1"
    # registering the same checkpoint under the same name again, after a finished registration: still one version
    target = registry.RegistryTarget(c["tracking"], run_id=c["run_id"])
    assert registry.register_checkpoint(c["uri"], name, target).version == "1"
    assert _versions(c["client"], name) == ["1"]


@pytest.mark.timeout(600)
def test_transient_errors_are_retried_without_a_second_version(s3_checkpoint, monkeypatch):
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, TEMPORARILY_UNAVAILABLE

    from raytune_ft.registry import mlflow_model

    c = s3_checkpoint
    monkeypatch.setattr(mlflow_model, "RETRY_FIRST_WAIT_S", 0.01)
    real = mlflow.transformers.log_model
    calls = []

    def registers_then_loses_the_answer(*args, **kwargs):
        calls.append(kwargs["registered_model_name"])
        info = real(*args, **kwargs)
        if len(calls) == 1:   # the version exists, but the caller never hears back
            raise MlflowException("503 Service Unavailable", error_code=TEMPORARILY_UNAVAILABLE)
        return info

    monkeypatch.setattr(mlflow.transformers, "log_model", registers_then_loses_the_answer)
    name = "main.default.tiny_flaky"
    result = registry.register_checkpoint(c["uri"], name, registry.RegistryTarget(c["tracking"], run_id=c["run_id"]))
    assert result.version == "1" and len(calls) == 1          # found, not logged again
    # found by its run (the lost answer left it untagged), then named after its checkpoint for later retries
    assert c["client"].get_model_version(name, "1").tags[registry.base.CHECKPOINT_TAG] == c["uri"]
    assert _versions(c["client"], name) == ["1"]
    assert c["client"].get_run(c["run_id"]).data.tags["raytune.status"] == "registered"

    # a refusal is not retried
    calls.clear()

    def refuses(*args, **kwargs):
        calls.append(1)
        raise MlflowException("User lacks CREATE MODEL", error_code=PERMISSION_DENIED)

    monkeypatch.setattr(mlflow.transformers, "log_model", refuses)
    with pytest.raises(registry.RegistrationError, match="PERMISSION_DENIED|lacks"):
        registry.register_checkpoint(c["uri"], "main.default.tiny_refused", registry.RegistryTarget(c["tracking"]))
    assert len(calls) == 1
