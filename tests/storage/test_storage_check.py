"""s3:// storage that cannot be used stops the job before Ray starts and before an MLflow run is opened, with
a message naming the endpoint, the variables read (names, never values) and what failed; against the real
SeaweedFS server of tests/s3_server.py (wrong keys) and a port nobody listens on."""
from __future__ import annotations

import secrets
import time

import pyarrow.fs as pafs
import pytest

from raytune_ft.cli import main
from tests.mlflow_server import free_port


def _submit(bucket: str, capsys) -> tuple[int, str, float]:
    """`raytune-ft run qwen27b_b300 --local` on s3://<bucket>/runs: (exit code, its output, seconds)."""
    t0 = time.monotonic()
    code = main(["run", "qwen27b_b300", "--local", "--set", f"tracking.storage_path=s3://{bucket}/runs",
                 "--set", "registry.enabled=false"])
    out = capsys.readouterr()
    return code, out.out + out.err, time.monotonic() - t0


def _objects(server, bucket: str) -> list[str]:
    """The bucket's objects (SeaweedFS also lists the folders a deleted object implied: not objects)."""
    infos = server.filesystem().get_file_info(pafs.FileSelector(bucket, recursive=True))
    return [i.path for i in infos if i.type == pafs.FileType.File]


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No cluster to join, and the default tracking store of an S3 run in this test's folder."""
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAYTUNE_TRACKING_HOME", str(tmp_path / "tracking"))
    yield tmp_path / "tracking"
    ray.shutdown()                  # if the job started Ray after all, the next test gets a clean process


def _nothing_started(tracking_home) -> None:
    import ray

    assert not ray.is_initialized()
    assert not tracking_home.exists() or not list(tracking_home.rglob("mlflow.db"))   # no MLflow run opened


@pytest.mark.timeout(300)
def test_wrong_s3_keys_stop_the_job_before_ray_naming_endpoint_and_variables(s3_env, isolated, capsys,
                                                                            monkeypatch):
    bucket = s3_env.bucket()
    wrong = secrets.token_hex(20)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    code, out, seconds = _submit(bucket, capsys)
    assert code == 2, out[-3000:]
    assert "refused the credentials" in out and s3_env.endpoint in out and "AWS_ENDPOINT_URL" in out
    assert "AWS_ACCESS_KEY_ID" in out and "AWS_SECRET_ACCESS_KEY" in out
    assert wrong not in out and s3_env.access_key not in out        # names only
    assert "Traceback" not in out and seconds < 30
    _nothing_started(isolated)
    assert _objects(s3_env, bucket) == []


@pytest.mark.timeout(300)
def test_unreachable_s3_endpoint_stops_the_job_in_seconds(s3_env, isolated, capsys, monkeypatch):
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    code, out, seconds = _submit("any-bucket", capsys)
    assert code == 2, out[-3000:]
    assert "cannot be reached" in out and f"{endpoint} (from AWS_ENDPOINT_URL)" in out
    assert "Traceback" not in out and seconds < 30
    _nothing_started(isolated)


@pytest.mark.timeout(120)
def test_usable_s3_storage_passes_and_the_probe_leaves_nothing(s3_env, tmp_path):
    from raytune_ft.cli import _job_recipe
    from raytune_ft.storage.check import check_storage

    bucket = s3_env.bucket()
    check_storage(_job_recipe("qwen27b_b300", True, [f"tracking.storage_path=s3://{bucket}/runs"]))
    assert _objects(s3_env, bucket) == []


@pytest.mark.timeout(300)
def test_a_server_error_that_says_try_again_is_tried_again(s3_env, monkeypatch):
    """S3 answers 500 InternalError now and then (SeaweedFS did under load, in this suite): the probe
    tries again instead of failing the job. The real server takes every request; only the first write is
    made to fail here with S3's wording (a server cannot be told to fail once), and the write that
    follows goes to the real server."""
    from raytune_ft.storage import fs as storage
    from raytune_ft.storage import check as storage_check
    from raytune_ft.cli import _job_recipe

    real_write, calls = storage.write_bytes, []

    def flaky_write(fs, path, data):
        calls.append(path)
        if len(calls) == 1:
            raise OSError("When uploading part for key 'x': AWS Error INTERNAL_FAILURE during UploadPart "
                          "operation: We encountered an internal error, please try again.")
        return real_write(fs, path, data)

    monkeypatch.setattr(storage_check.storage, "write_bytes", flaky_write)
    bucket = s3_env.bucket()
    storage_check.check_storage(_job_recipe("qwen27b_b300", True, [f"tracking.storage_path=s3://{bucket}/runs"]))
    assert len(calls) == 2 and _objects(s3_env, bucket) == []

    # refused credentials are not a passing trouble: one attempt, and the job stops
    calls.clear()

    def refused(fs, path, data):
        calls.append(path)
        raise OSError("AWS Error ACCESS_DENIED during PutObject operation: Access Denied, please try again")

    monkeypatch.setattr(storage_check.storage, "write_bytes", refused)
    with pytest.raises(storage_check.StorageAccessError, match="refused the credentials"):
        storage_check.check_storage(_job_recipe("qwen27b_b300", True, [f"tracking.storage_path=s3://{bucket}/runs"]))
    assert len(calls) == 1
