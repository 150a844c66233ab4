"""`python -m bench gpu shape --cpu-smoke` (bench/shape.py): the recipe's FSDP2 path as rank 0 of 8 on torch's
fake process group, on the recipe's tiny local model, with its DCP shard written in the background and read back.
The GPU figures are in bench/RESULTS.md; this holds the path."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, env_with_path


@pytest.mark.slow
@pytest.mark.timeout(900)   # a fresh process, the model build and three steps on a loaded 2-core machine
def test_shape_bench_runs_rank_0_of_8_and_reads_its_shard_back(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench", "gpu", "shape", "--cpu-smoke", "--ranks", "8", "--ckpt", "on",
                          "--ckpt-dir", str(tmp_path / "ckpt"), "--set", "train.compile=false"],
                         cwd=REPO, env=env_with_path(REPO), capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rec = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert rec["setting"] == {"ranks": 8, "seq": 512, "master": "fp32"}
    # this rank holds an eighth of the parameters (FSDP2 pads uneven shards on the last ranks)
    assert rec["local_params"] * 8 == pytest.approx(rec["params"], rel=0.05) and rec["params"] > 100_000
    assert len(rec["step_s"]) == 3 and rec["tok_s_per_rank"] > 0 and "compile_s" in rec
    ck = rec["checkpoint"]
    assert ck["restored"] is True and ck["read_files"] == [".metadata", "__0_0.distcp"], ck
    assert ck["held_s"] <= ck["write_s"] and ck["bytes"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shape_bench_runs_rank_0_of_a_context_parallel_group():
    """Issue 59: `--cp 4 --whole` is rank 0 of a CP-4 group; a step trains the group's 4 blocks, this rank's
    quarter of each (the CP loop's own micro-batches), and counts a quarter of the group's tokens."""
    out = subprocess.run([sys.executable, "-m", "bench", "gpu", "shape", "--cpu-smoke", "--ranks", "8", "--cp", "4",
                          "--whole", "--ckpt", "off", "--set", "train.compile=false"],
                         cwd=REPO, env=env_with_path(REPO), capture_output=True, text=True, timeout=880)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rec = json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert rec["cp"] == 4 and rec["conversations"] == "whole block"
    # 4 blocks of 512 tokens a step over 4 ranks: 512 tokens a rank a step
    assert "512.0 tokens" in out.stdout and len(rec["step_s"]) == 3
    assert rec["tok_s_per_rank"] == pytest.approx(512 / rec["s_per_step"], rel=0.02)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_shape_run_stopped_by_timeout_still_records_its_steps(tmp_path):
    """A long-context step takes minutes, and `timeout` (SIGTERM) once cut a run after its first step with nothing
    written. Stopped after a step, the run writes its record: the steps it made, their losses and that it was cut."""
    import signal

    results = tmp_path / "results"
    proc = subprocess.Popen([sys.executable, "-m", "bench", "gpu", "shape", "--cpu-smoke", "--ranks", "8", "--steps",
                             "3", "--ckpt", "off", "--set", "train.compile=false", "--results", str(results)],
                            cwd=REPO, env=env_with_path(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[shape] step 1/"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    out = "".join(lines) + rest
    assert proc.returncode == 124, out[-3000:]
    (record,) = [json.loads(ln) for f in results.glob("*.jsonl") for ln in f.read_text().splitlines()]
    assert record["cut"].startswith("stopped by signal") and record["cut"].endswith("of 3 steps")
    assert 1 <= len(record["step_s"]) < 3 and len(record["losses"]) == len(record["step_s"])
    assert "RESULT " in out and record["setting"] == {"ranks": 8, "seq": 512, "master": "fp32"}


def test_the_memory_peak_replays_the_step_and_names_the_lines_live_at_it():
    """bench/memory_peak.py on a hand-written trace (the CUDA memory history needs a GPU): the peak is the
    baseline plus the most the step's own allocations held at once; what is live then is grouped by the first
    frame in the project (or transformers), else the first frame; a freed allocation is not counted."""
    sys.path.insert(0, str(REPO))
    from bench.memory_peak import peak_of_trace, site

    gib = 2 ** 30
    own = [{"filename": "/x/site-packages/torch/autograd/function.py", "line": 5, "name": "apply"},
           {"filename": "/repo/raytune_ft/models/loss.py", "line": 64, "name": "backward"}]
    lib = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"}]
    trace = [{"action": "alloc", "addr": 1, "size": gib, "frames": own},
             {"action": "alloc", "addr": 2, "size": 2 * gib, "frames": lib},
             {"action": "alloc", "addr": 3, "size": gib, "frames": own},
             {"action": "free_requested", "addr": 1, "size": gib},
             {"action": "free_completed", "addr": 1, "size": gib},
             {"action": "alloc", "addr": 4, "size": gib // 2, "frames": lib}]
    got = peak_of_trace(trace, baseline=10 * gib)
    assert got["peak_gib"] == 14.0 and got["step_gib"] == 4.0 and got["baseline_gib"] == 10.0
    assert site(own) == "raytune_ft/models/loss.py:64 backward"
    assert got["by_site_gib"] == {"torch/nn/functional.py:9 linear": 2.0, "raytune_ft/models/loss.py:64 backward": 2.0}
    assert got["largest"][0]["gib"] == 2.0


def test_the_shape_bench_takes_the_memory_peak_option():
    sys.path.insert(0, str(REPO))
    from bench.shape import parse

    assert parse(["--memory-peak", "--cp", "8"]).memory_peak and not parse([]).memory_peak


def test_a_diagnostic_step_that_raises_leaves_its_error_in_the_record_and_the_timed_steps_stand():
    """The first GPU run of `--memory-peak` (a CP step, torch 2.11) raised inside torch and the bench exited without
    writing the record of the step timed before it; the profile and the memory peak now keep their error instead."""
    sys.path.insert(0, str(REPO))
    from bench.shape import diagnose

    rec = {"s_per_step": 47.1}

    def fails():
        raise SystemError("<built-in method apply of FunctionMeta object> returned NULL without setting an exception")

    assert not diagnose(rec, "memory_peak", fails)
    assert rec["memory_peak"]["error"].startswith("SystemError: <built-in method apply") and rec["s_per_step"] == 47.1
    assert diagnose(rec, "profile", lambda: {"wall_ms": 1.0}) and rec["profile"] == {"wall_ms": 1.0}


def test_the_memory_peak_step_runs_its_compiled_regions_eagerly():
    """torch 2.11 fails a compiled region's recompute under the CUDA memory history (pytorch/pytorch#179536; both
    GPU runs of `--memory-peak` raised it): the recorded step runs compiled regions eagerly. On CPU, with a
    counting backend: the wrapped step compiles nothing and computes the same; the plain call compiles."""
    import torch

    sys.path.insert(0, str(REPO))
    from bench.memory_peak import eager_regions

    compiled = []

    def counting(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2, backend=counting, dynamic=False)
    x = torch.randn(8)
    got = []
    eager_regions(lambda: got.append(fn(x)))()
    assert compiled == [] and torch.allclose(got[0], torch.nn.functional.silu(x) * 2)
    assert torch.allclose(fn(x), got[0]) and len(compiled) == 1


def test_a_gpu_shape_run_stops_when_a_fast_kernel_fails_its_check_unless_told_otherwise(tmp_path):
    """A speed figure of a fallback path is no figure: on a GPU the shape bench runs the start-up kernel check
    strict (a kernel that fails stops the run in seconds, recorded with the failure), `--set train.kernels=check`
    measures the paths that passed; the CPU smoke run keeps the recipe's own setting."""
    sys.path.insert(0, str(REPO))
    from bench.shape import make_recipe, parse

    setting = {"ranks": 8, "seq": 32768, "master": "bf16"}
    assert make_recipe(parse([]), setting, str(tmp_path)).train.kernels == "strict"
    told = parse(["--set", "train.kernels=check"])
    assert make_recipe(told, setting, str(tmp_path)).train.kernels == "check"
    smoke = parse(["--cpu-smoke"])
    assert make_recipe(smoke, {**setting, "seq": 512}, None).train.kernels == "check"
