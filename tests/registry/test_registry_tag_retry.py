"""A version whose checkpoint tag could not be written is still found by a retry with no run id.

Real parts: a real MLflow store (sqlite) and a real tiny checkpoint. The one test double is the failing
write: `MlflowClient.set_model_version_tag` raises once (a registry that dropped that one request), since
a real store cannot be made to refuse exactly one tag write.
"""
from __future__ import annotations

import pytest

from tests.mlflow_server import make_tiny_qwen2_checkpoint
from raytune_ft import registry
from raytune_ft.registry.base import checkpoint_id


@pytest.mark.timeout(600)
def test_failed_version_tag_write_then_retry_keeps_one_version(tmp_path, fixtures, monkeypatch):
    from mlflow import MlflowClient

    ckpt = make_tiny_qwen2_checkpoint(tmp_path / "run" / "checkpoint_000001",
                                      fixtures / "tokenizers" / "qwen2-0.5b")
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    name = "main.default.tag_dropped"
    real_write = MlflowClient.set_model_version_tag
    failures = []

    def fails_once(self, *args, **kwargs):
        if not failures:
            failures.append(args)
            raise ConnectionError("the registry dropped this tag write")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "set_model_version_tag", fails_once)
    first = registry.register_checkpoint(str(ckpt), name, registry.RegistryTarget(tracking), timeout_s=300)
    assert failures, "the tag write was never attempted"
    client = MlflowClient(tracking)
    assert "raytune.checkpoint" not in client.get_model_version(name, first.version).tags

    again = registry.register_checkpoint(str(ckpt), name, registry.RegistryTarget(tracking), timeout_s=300)
    assert again.version == first.version
    versions = client.search_model_versions(f"name = '{name}'")
    assert [str(v.version) for v in versions] == [first.version]
    # the retry names the version from now on
    assert versions[0].tags["raytune.checkpoint"] == checkpoint_id(str(ckpt))
