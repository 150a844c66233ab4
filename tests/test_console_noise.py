"""The project's own lines only on the console (issue 37): `raytune-ft register`, the kernel check and a TRL
recipe (its run is tests/test_trl_recipes.py's LoRA job, checked with `noise` from here), each run as a
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
    from raytune_ft.recipe import Recipe

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
