"""`python -m bench gpu lora`: the 16-layer cut's LoRA against its full SFT, and the real 64 layers with LoRA,
through the recipes (jobs/qwen27b_b300.py, jobs/qwen27b_lora.py) on Ray Train; its CPU smoke on the jobs'
--local forms writes a dated record per run, the LoRA run's with the plan beside the measured figures."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.__main__ import main as bench_main
from tests.conftest import REPO


def test_lora_bench_runs_the_cut_s_full_sft_and_lora_then_the_64_layers(capsys):
    assert bench_main(["gpu", "lora", "--gpus", "0", "--dry-run"]) == 0
    full, lora, big = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=== ")]
    assert "jobs/qwen27b_b300.py" in full and "train.master_weights=bf16" in full
    for line in (full, lora):
        assert "qwen3.8-27b-16layers" in line and "model.init=random" in line and "scaling.num_workers=1" in line
    assert "jobs/qwen27b_lora.py" in lora and "master_weights" not in lora
    assert "jobs/qwen27b_lora.py" in big and big.rstrip().split("  (limit")[0].endswith(
        "model.name=/tmp/raytune_bench/qwen3.8-27b-64layers --set data.seq_len=32768")
    assert bench_main(["gpu", "lora", "--gpus", "0", "--dry-run", "--lora-seq", "16384"]) == 0
    assert "data.seq_len=16384" in capsys.readouterr().out
    assert bench_main(["gpu", "lora", "--gpus", "0", "--dry-run", "--part", "pair"]) == 0
    pair = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=== ")]
    assert [("qwen27b_b300" in x, "qwen27b_lora" in x) for x in pair] == [(True, False), (False, True)]
    assert bench_main(["gpu", "lora", "--gpus", "0", "--dry-run", "--part", "real"]) == 0
    (real,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=== ")]
    assert "qwen3.8-27b-64layers" in real
    with pytest.raises(SystemExit, match="pair, real or all"):
        bench_main(["gpu", "lora", "--gpus", "0", "--dry-run", "--part", "cold"])


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_cpu_smoke_of_the_lora_bench_records_both_runs_the_plan_and_the_ratio(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "lora", "--cpu-smoke", "--steps", "4",
                           "--results", str(results), "--workdir", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=1180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "LoRA r=16 alpha=32" in proc.stdout
    recs = [json.loads(line) for line in next(results.glob("*.jsonl")).read_text().splitlines()]
    by = {r["label"]: r for r in recs}
    assert set(by) == {"full-16", "lora-16", "lora_over_full"}
    assert by["full-16"]["figures"]["tok_s"] > 0 and by["lora-16"]["figures"]["tok_s"] > 0
    assert "plan_total_gib" not in by["full-16"]["figures"]
    assert by["lora-16"]["figures"]["plan_total_gib"] > 0 and by["lora-16"]["figures"]["plan_gpu"] == "cpu"
    assert by["lora_over_full"]["tok_s_ratio"] > 0
