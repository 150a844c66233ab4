"""Dated JSON records of benchmark runs: what ran (command), where (hardware), with what (versions), and
the figures, one JSON object per line in RESULTS_DIR/<date>.jsonl, so a figure in RESULTS.md can always be
traced to the run that produced it.

Read without importing torch or CUDA: the bench's parent process must not hold a GPU context while its
children measure.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_RESULTS_DIR = os.path.join(REPO, "bench", "results")
# distributions whose versions move the figures (absent ones are recorded as absent: that is a finding)
DISTRIBUTIONS = ("torch", "triton", "transformers", "flash-linear-attention", "fla-core", "tilelang",
                 "causal-conv1d", "flash-attn", "liger-kernel", "torchao", "trl", "ray", "mlflow-skinny",
                 "mlflow", "datasets", "peft")


def versions() -> dict:
    from raytune_ft.env import package_versions

    return {"python": platform.python_version(), **package_versions(DISTRIBUTIONS, "absent")}


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def hardware() -> dict:
    """GPUs as nvidia-smi lists them (none on a CPU machine), CPU cores and host memory."""
    gpus = []
    if shutil.which("nvidia-smi"):
        fields = ("index", "name", "memory.total", "driver_version", "compute_cap")
        text = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
        gpus = [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in text.splitlines() if line]
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem_gib = round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {"gpus": gpus, "cpu_cores": os.cpu_count(), "host_memory_gib": mem_gib, "machine": platform.machine()}


def commit() -> str | None:
    """The checkout's commit, with '+changes' when the tree differs from it; None outside a git checkout."""
    head = _run(["git", "rev-parse", "--short", "HEAD"])
    if not head:
        return None
    return head + ("+changes" if _run(["git", "status", "--porcelain", "--untracked-files=no"]) else "")


def append(results_dir: str, record: dict, now: _dt.datetime | None = None) -> str:
    """Append `record` with its date, hardware, versions and commit to RESULTS_DIR/<date>.jsonl; returns the file."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    full = {"date": now.isoformat(timespec="seconds"), **record, "hardware": hardware(), "versions": versions(),
            "commit": commit(), "argv": sys.argv[1:]}
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, f"{now.date().isoformat()}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(full, default=str) + "\n")
    return path
