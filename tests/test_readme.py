"""The README's commands work as written: every ```bash block is read, and each command that needs no GPU
and no cluster runs, in README order, from a fresh-clone-like copy of the tree (the tracked and
untracked-but-not-ignored files; `.venv` linked in, as `make setup` would have built it), in a bash that
first runs the README's own `source .venv/bin/activate`. The others are listed in SKIPPED with the reason,
and a README command in neither list fails the test, as does a SKIPPED entry the README no longer has.

One `--local` run serves the commands after it (`raytune-ft runs`, `raytune-ft register`, `mlflow ui`),
as it does for a user.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO

ACTIVATE = "source .venv/bin/activate"

# command (as the README writes it, comment and continuation lines stripped) -> why it does not run here
SKIPPED = {
    "make local": "builds .venv (the one this suite runs in) and runs the --local job, as "
                  "tests/conftest.py's local_job does in the fresh copy the other commands run in",
    "make test": "the test suite itself",
    "python jobs/qwen27b_b300.py --local": "tests/conftest.py's local_job runs it in the same fresh copy "
                                           "before the other commands (`raytune-ft run qwen27b_b300 --local` "
                                           "then finds the run finished)",
    "python jobs/qwen27b_b300.py --set train.lr=2e-5 --set data.max_rows=1000": "the full 27B recipe: GPUs",
    "raytune-ft run qwen2_05b_lora --local": "a second --local training run (minutes on 2 cores); "
                                             "tests/train/test_trl_recipes.py runs this recipe's loop on local Ray",
    "python jobs/qwen27b_b300.py --set 'data.template_kwargs={\"enable_thinking\": false}'":
        "the full 27B recipe: GPUs",
    "python jobs/qwen27b_b300.py --set 'data.template_kwargs={\"reasoning_effort\": \"low\"}'":
        "the full 27B recipe: GPUs",
    "ray get-auth-token --generate > /dev/null": "writes the user's ~/.ray/auth_token; tests/driver/test_job_submit.py "
                                                 "gives its head a token file of its own",
    "ray start --head": "a Ray cluster (tests/driver/test_job_submit.py starts one on loopback)",
    "export RAY_AUTH_MODE=token": "a Ray cluster",
    "ray job submit --working-dir . -- python jobs/qwen27b_b300.py": "a Ray cluster and GPUs",
    "ray start --head --num-cpus 8": "a Ray cluster (tests/driver/test_job_submit.py starts one with 8 logical CPUs "
                                     "on loopback)",
    "ray job submit --working-dir . -- python jobs/qwen27b_b300.py --local "
    "--set tracking.storage_path=$HOME/raytune_runs":
        "a Ray cluster: tests/driver/test_job_submit.py submits this --local job with an absolute run folder",
    "ray job submit --working-dir . -- python jobs/qwen27b_b300.py --set scaling.num_workers=16 "
    "--set tracking.storage_path=/mnt/shared/raytune_runs --set tracking.tracking_uri=http://HEAD_NODE:5000":
        "a Ray cluster of two GPU nodes",
}
SKIPPED["raytune-ft data check qwen27b_b300 --local --set data.source=s3://my-bucket/chat/"] = "an S3 bucket: tests/data/test_data_s3.py reads a two-source mixture " \
                                                  "from a SeaweedFS server"
SKIPPED["python jobs/qwen27b_b300.py --set data.seq_len=131072 --set scaling.context_parallel=8"] = \
    "an 8-GPU node; the same path on CPU: tests/train/test_context_parallel_loop.py (--local, context_parallel=2)"
SKIPPED["python jobs/qwen27b_b300.py --set data.seq_len=65536 --set scaling.context_parallel=4"] = \
    "an 8-GPU node; the same path on CPU: tests/train/test_context_parallel_loop.py (--local, context_parallel=2)"
SERVERS = {"mlflow ui --backend-store-uri sqlite:///runs/qwen27b-local/mlflow.db": "http://127.0.0.1:5000"}


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ```bash blocks, in order: continuation lines joined, comments and
    blank lines dropped."""
    commands = []
    for block in re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", text, flags=re.S | re.M):
        joined = re.sub(r"\s*\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line.strip()) if not line.strip().startswith("#") else ""
            if line:
                commands.append(line)
    return commands


def test_readme_commands_are_listed_or_run():
    """The cheap half: every README command is known to this test (so a new one is not silently skipped)."""
    commands = readme_commands((REPO / "README.md").read_text())
    assert ACTIVATE in commands and commands.index(ACTIVATE) < commands.index("raytune-ft plan qwen27b_b300")
    unknown = [c for c in commands if c != ACTIVATE and c not in SKIPPED and c not in SERVERS
               and not c.startswith(("python jobs/qwen27b_b300.py --dry-run", "raytune-ft "))]
    assert not unknown, f"README commands this test neither runs nor skips: {unknown}"
    assert not set(SKIPPED) - set(commands), f"SKIPPED lists commands the README lost: {set(SKIPPED) - set(commands)}"


def _bash(command: str) -> list[str]:
    return ["bash", "-c", f"set -e; {ACTIVATE}; {command}"]


def _serve_then_stop(command: str, url: str, cwd: Path, env: dict) -> None:
    p = subprocess.Popen(_bash(f"exec {command}"), cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            assert p.poll() is None, f"{command} exited: {p.stdout.read().decode(errors='replace')[-3000:]}"
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    assert r.status == 200
                    return
            except OSError:
                assert time.time() < deadline, f"{command}: nothing answered at {url} within 120 s"
                time.sleep(2)
    finally:
        os.killpg(p.pid, 15)
        p.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_readme_commands_run_as_written(local_job):
    """In the fresh copy where the session's local_job ran `python jobs/qwen27b_b300.py --local` (one
    --local training run for both): the README's other commands, in order."""
    clone = local_job["work"]
    assert local_job["proc"].returncode == 0, (local_job["proc"].stdout + local_job["proc"].stderr)[-3000:]
    ray_tmp = tempfile.mkdtemp(prefix="rtreadme", dir="/tmp")   # AF_UNIX paths are <= 107 bytes
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYTUNE_LOCAL_STORAGE")}
    env.update(RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1")
    ran = []
    try:
        for command in readme_commands((clone / "README.md").read_text()):
            if command == ACTIVATE or command in SKIPPED:
                continue
            if command in SERVERS:
                _serve_then_stop(command, SERVERS[command], clone, env)
            else:
                p = subprocess.run(_bash(command), cwd=clone, env=env, capture_output=True, timeout=900)
                out = (p.stdout + p.stderr).decode(errors="replace")
                assert p.returncode == 0, f"{command}\n{out[-4000:]}"
                if command.startswith("raytune-ft data check"):
                    assert "format " in out and "packing efficiency" in out and "held-out set" in out, out
                if command.startswith("raytune-ft run qwen27b_b300 --local --no-register --set data.source="):
                    assert "format sharegpt (picked by its fields" in out and "held-out set: 1 of 8 rows" in out, out
                if command.startswith("raytune-ft runs"):
                    assert "qwen27b-local" in out and "registered" in out, out
            ran.append(command)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert "raytune-ft run qwen27b_b300 --local" in ran and any(c.startswith("raytune-ft register") for c in ran)
    assert len(ran) >= 6, ran
