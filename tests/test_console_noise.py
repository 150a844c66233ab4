"""The project's own lines only on the console (issue 37): `raytune-ft register`, the kernel check and a TRL
recipe (its run is tests/train/test_trl_recipes.py's LoRA job, checked with `noise` from here), each run as a
user runs it (a fresh process, real libraries), print none of the libraries' noise; the libraries'
warnings land in the command's log file instead."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, env_with_path

# what the libraries printed before: torchao's library loads, torch's pytree enum warnings, transformers'
# deprecations and progress bars, Python's warnings in general
NOISE = re.compile(r"Failed to load .*torchao|is an Enum subclass|FutureWarning|DeprecationWarning|"
                   r"Writing model shards|warnings\.warn\(|Detected no triton|W\d{4} \d\d:\d\d")


def console_env(home) -> dict:
    env = env_with_path(REPO, drop=("RAY_ADDRESS",))
    env["HOME"] = str(home)          # the command's log file lands under this home
    return env


def noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if NOISE.search(line)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_kernel_check_prints_its_report_only(tmp_path):
    out = subprocess.run([sys.executable, "-m", "raytune_ft.models.kernel_check", "--model", "qwen3-4b",
                          "--repeat", "1"], cwd=tmp_path, env=console_env(tmp_path), capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT " in out.stdout and "kernels in use" in out.stdout
    assert not noise(out.stdout + out.stderr), noise(out.stdout + out.stderr)
    log = tmp_path / ".cache" / "raytune_ft" / "logs" / "kernel_check.log"
    assert "torchao" in log.read_text()     # the libraries' lines were kept, in the file


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_register_prints_its_result_only(tmp_path):
    """A plain HF folder of the tiny model with its tokenizer, registered into a real sqlite MLflow store."""
    import torch

    from raytune_ft.models.build import load_causal_lm
    from raytune_ft.models.tiny import local_tokenizer
    from raytune_ft.recipe.recipe import Recipe

    r = Recipe()
    r.model.local_tiny, r.model.dtype = True, "float32"
    folder = tmp_path / "hf"
    load_causal_lm(r.model, device="cpu", dtype=torch.float32, seed=1).save_pretrained(folder)
    local_tokenizer().save_pretrained(folder)
    out = subprocess.run([sys.executable, "-m", "raytune_ft.cli", "register", str(folder), "--name",
                          "main.default.noise", "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"],
                         cwd=tmp_path, env=console_env(tmp_path), capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "registered main.default.noise version 1" in out.stdout
    assert not noise(out.stdout + out.stderr), noise(out.stdout + out.stderr)
    assert not [line for line in out.stderr.splitlines() if line.strip()], out.stderr[-2000:]


# ----------------------------------------------------------------- a run in a terminal (issue 50 item 9)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PREFIX = re.compile(r"^\((?:\w+ )?pid=\d+(?:, ip=[^)]*)?\)\s?")


def run_in_terminal(cmd: list[str], *, cwd, env: dict, timeout: float) -> tuple[int, str]:
    """`cmd` with a pseudo-terminal as its stdin, stdout and stderr, as a user's shell runs it: (exit code,
    everything it wrote, raw)."""
    import os
    import pty
    import select
    import time

    main_fd, sub_fd = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=sub_fd, stdout=sub_fd, stderr=sub_fd, close_fds=True)
    os.close(sub_fd)
    out, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main_fd], [], [], 1.0)[0]:
                try:
                    data = os.read(main_fd, 65536)
                except OSError:          # the terminal's other side closed: the command ended
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
    finally:
        os.close(main_fd)
    return proc.wait(timeout=60), out.decode(errors="replace")


def screen_lines(raw: str) -> list[str]:
    """What a terminal shows, line by line: colours dropped, each carriage-return rewrite its own line."""
    return [line.rstrip() for chunk in ANSI.sub("", raw).split("\n") for line in chunk.split("\r")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_local_run_in_a_terminal_prints_the_projects_lines_once_and_ends_with_its_summary(tmp_path, fixtures):
    """The 27B recipe's --local job, as a user runs it in a terminal, on a small file of long conversations
    (two workers, the file's rows all on one of them) with a worker dying after its step-10 checkpoint is
    written, so the run resumes from step 5. In a pipe the console held only the project's lines; in a
    terminal it also held Ray Data's progress bars (redrawn around every line, leaving blank
    `(RayTrainWorker pid=...)` lines), Ray's "[repeated Nx across cluster]" second copy of lines such as
    `rank N resumed reading ...`, and lines after the summary."""
    import json
    import shutil
    import tempfile

    from tests.faults import job_env

    overrides = [f"data.source={fixtures / 'data' / 'ultrachat_200k_train_sft_first16.jsonl'}", "data.validation_split=none",
                 f"tracking.storage_path={tmp_path / 'runs'}", "train.max_steps=12", "train.checkpoint_every=5",
                 "train.eval_every=1000", "train.sample_prompts=0", "registry.enabled=false"]
    ray_tmp = tempfile.mkdtemp(prefix="rtpty", dir="/tmp")       # short: AF_UNIX paths are <= 107 bytes
    env = {**console_env(tmp_path), **job_env(str(tmp_path), exit_after_write="10:1:after=5"), "TERM": "xterm-256color",
           "RAY_TMPDIR": ray_tmp}
    env.pop("RAYTUNE_LOCAL_STORAGE", None)
    cmd = [sys.executable, str(REPO / "jobs" / "qwen27b_b300.py"), "--local", *[f"--set={o}" for o in overrides]]
    try:
        code, raw = run_in_terminal(cmd, cwd=tmp_path, env=env, timeout=840)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    lines = screen_lines(raw)
    assert code == 0, "\n".join(lines[-60:])
    shown = [line for line in lines if line.strip()]
    # no progress bar of Ray Data's, no blank prefixed line, no deduplicated second copy
    screen = "\n".join(shown)
    assert not [x for x in shown if "row/s" in x or "%|" in x or "Running Dataset" in x], screen
    assert not [x for x in shown if PREFIX.match(x) and not PREFIX.sub("", x).strip()], screen
    assert not [x for x in shown if "[repeated" in x], screen
    # the workers' own setup hook ran under the test's fault hook (tests/faults.with_runtime_env): Ray's lines
    # a user never sees stay off the console
    assert not [x for x in shown if "Reporting training result" in x or "Progress bars disabled" in x], screen
    # the other rank, stopped with the attempt (in a collective, or in a report's synchronisation), prints no
    # traceback: the controller's line says which worker died
    assert not [x for x in shown if "Traceback" in x or "Error in training function" in x], screen
    # each process's project lines once (the restarted attempt's workers are other processes)
    own = [x for x in shown if "raytune_ft" in x]
    twice = {x for x in own if own.count(x) > 1}
    assert not twice, "\n".join(shown)
    resumed = [x for x in own if "resumed reading" in x]
    assert sorted(PREFIX.sub("", x).split(" resumed")[0] for x in resumed) == ["[raytune_ft] rank 0",
                                                                            "[raytune_ft] rank 1"], resumed
    # the summary is the last thing on screen
    start = max(i for i, x in enumerate(shown) if x.startswith("job qwen27b_b300 (run "))
    assert shown[-1].startswith("  wall time"), shown[start:]
    assert all(x.startswith("  ") for x in shown[start + 1:]), shown[start:]
    # the padding of a small file's run (issue 50 item 6): in the summary, and an MLflow metric
    data_row = next(x for x in shown[start:] if x.startswith("  data "))
    share = float(re.search(r"padding ([\d.]+)% of the trained tokens", data_row).group(1))
    assert share <= 5.0 and "evened the ranks out" not in data_row, data_row
    summary = json.loads((tmp_path / "runs" / "qwen27b-local" / "summary.json").read_text())
    from mlflow import MlflowClient

    run = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"])
    assert run.data.metrics["padding_fraction"] == pytest.approx(share / 100, abs=5e-4)
