"""Servers for tests on loopback: a real `mlflow server` process (sqlite backend, proxied local artifacts),
and `StubHttpServer`, a small in-thread HTTP server for the services no real one can stand in for here
(a registry that refuses, a Unity Catalog REST API, a server that echoes a token).

The session has one: tests/conftest.py's `mlflow_server` fixture (server.uri == "http://127.0.0.1:<port>").
A test that needs a server of its own:

    with MlflowServer(tmp_path / "mlflow") as server:
        ...

The server can be stopped and started again on the same port and store (`stop()` / `start()`),
which is how the registration-failure tests take the registry down and bring it back.

`StubHttpServer(respond)` calls `respond(request)` for every request (any method) and sends back the
(status, headers, body) it returns; `json_reply(status, payload)` builds such a triple.

`make_tiny_qwen2_checkpoint` builds what the training loops leave behind (hf/ + raytune_meta.json)
for a random tiny Qwen2 with the real Qwen2 tokenizer and chat template, in about a second.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable


def free_port() -> int:
    """A TCP port nothing listens on right now (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """One `mlflow server` child process: sqlite store and artifacts under `root`."""

    def __init__(self, root: str | os.PathLike, port: int | None = None, start_timeout_s: float = 90.0):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log_path = self.root / "server.log"

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "MlflowServer":
        mlflow_bin = Path(sys.executable).with_name("mlflow")
        cmd = [str(mlflow_bin) if mlflow_bin.exists() else "mlflow", "server",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", str(self.root / "artifacts"),
               # one worker: the tests need a process, not throughput, and the machine has 2 cores
               "--workers", "1"]
        env = dict(os.environ)
        env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
        log = open(self.log_path, "ab")
        # own process group, so stop() ends the server and any worker it forked, and nothing else
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.root)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}:\n"
                                   f"{self.log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health within {self.start_timeout_s}s:\n"
                           f"{self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None
        # wait until the port is really closed, so a "registry down" test sees connection refused
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)

    def __enter__(self) -> "MlflowServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class StubRequest:
    method: str
    path: str                        # as sent, query string included
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body) if self.body else {}


Reply = tuple[int, dict[str, str], bytes]


def json_reply(status: int, payload: dict) -> Reply:
    return status, {"Content-Type": "application/json"}, json.dumps(payload).encode()


class StubHttpServer:
    """A loopback HTTP server in a daemon thread; `respond(StubRequest) -> (status, headers, body)`.

    Bound when made, so `uri` is known before `with`; serves inside the `with` block."""

    def __init__(self, respond: Callable[[StubRequest], Reply]):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _serve(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, data = respond(StubRequest(self.command, self.path, dict(self.headers.items()),
                                                            body))
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _serve

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._httpd.server_address[1]

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "StubHttpServer":
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def make_tiny_qwen2_checkpoint(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, *,
                               seed: int = 0, hidden: int = 32, layers: int = 2,
                               hf_subdir: str | None = "hf", meta: dict | None = None) -> Path:
    """A Ray Train style checkpoint: `hf/` (sharded bf16 safetensors, tokenizer with chat template)
    and `raytune_meta.json`. `hf_subdir=None` writes a plain HF folder at `out_dir` instead."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    hf = out / hf_subdir if hf_subdir else out
    hf.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tokenizer.chat_template, "the fixture tokenizer must carry a chat template"
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True, max_position_embeddings=512,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(hf), max_shard_size="4MB")   # several shards + index, like a real one
    tokenizer.save_pretrained(str(hf))
    if hf_subdir:
        meta = {"job": "test_job", "model_name": "Qwen/Qwen2-0.5B", "family": "qwen2", "step": 7,
                "final_loss": 2.5, "run_name": "tiny-run", **(meta or {})}
        (out / "raytune_meta.json").write_text(json.dumps(meta))
    return out
