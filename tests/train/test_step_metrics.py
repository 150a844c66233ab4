"""What a training loop's rank 0 writes to MLflow (a real sqlite store): one point per optimizer step for
loss, lr and grad norm whatever `train.log_every` says, the windowed figures at the window's last step, no
MFU where no peak is known, the start-up breakdown (printed once, logged as startup.* params), and the
order MLflow's run page shows the metrics in: the training curves first."""
from __future__ import annotations

import io
import time

import pytest

from raytune_ft.train.common import WorkerLog
from raytune_ft.train.startup_clock import STARTUP_METRICS, STARTUP_PHASES, JobStart, StartupClock


def _history(recipe, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(recipe.tracking_uri).get_metric_history(run_id, key))


def _window(steps: list[int], device_name: str | None) -> tuple[list[dict], dict]:
    from raytune_ft.planning.hardware import mfu_metrics

    points = [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-4 * s, "grad_norm": 0.5 + s} for s in steps]
    window = {**points[-1], "tokens_per_s": 1234.0, "tokens": 99 * steps[-1],
              **mfu_metrics(0.4 * 989e12, device_name)}
    return points, window


def test_every_step_has_its_own_loss_lr_and_grad_norm_point(mlflow_run):
    recipe, run_id = mlflow_run
    log = WorkerLog(0, recipe, run_id, stream=io.StringIO())
    for steps in ([1, 2, 3, 4, 5], [6, 7]):
        points, window = _window(steps, None)
        log.progress(window, 7, elapsed=1.0, steps=points)
    log.flush(240)                 # rank 0's MLflow calls are made by a process of their own
    for key in ("train/loss", "train/lr", "train/grad_norm"):
        hist = _history(recipe, run_id, key)
        assert [s for s, _ in hist] == [1, 2, 3, 4, 5, 6, 7], (key, hist)
    assert _history(recipe, run_id, "train/loss")[2] == (3, pytest.approx(2.7))
    # the windowed throughput stays one point per window
    assert [s for s, _ in _history(recipe, run_id, "tokens_per_s")] == [5, 7]


def test_no_mfu_metric_where_no_peak_is_known(mlflow_run):
    from mlflow import MlflowClient

    recipe, run_id = mlflow_run
    out = io.StringIO()
    log = WorkerLog(0, recipe, run_id, stream=out)
    points, window = _window([1, 2], None)          # CPU: no datasheet peak
    log.progress(window, 4, elapsed=1.0, steps=points)
    log.flush(240)
    metrics = MlflowClient(recipe.tracking_uri).get_run(run_id).data.metrics
    assert "tokens_per_s" in metrics
    assert not [k for k in metrics if k.startswith("mfu")], metrics
    assert "MFU n/a" in out.getvalue()               # the console still says why there is none
    points, window = _window([3, 4], "NVIDIA H200")  # a known GPU: measured, so logged
    log.progress(window, 4, elapsed=2.0, steps=points)
    log.flush(240)
    assert _history(recipe, run_id, "mfu") == [(4, pytest.approx(0.4))]


def test_data_counters_are_not_metrics(mlflow_run):
    from mlflow import MlflowClient

    recipe, run_id = mlflow_run
    log = WorkerLog(0, recipe, run_id, stream=io.StringIO())
    log.log_metrics({"loss": 1.0, "tokens": 10, "data/rows_read": 600.0, "data/blocks": 40.0}, 3)
    log.flush(240)
    metrics = MlflowClient(recipe.tracking_uri).get_run(run_id).data.metrics
    assert metrics.keys() == {"train/loss", "tokens"}


def test_startup_breakdown_sums_to_the_time_since_the_job_started():
    job_start = time.time() - 0.30                   # the driver started 0.3 s before this worker
    clock = StartupClock(job_start)
    checking = time.time()
    time.sleep(0.05)
    clock.mark("kernel_check", since=checking)
    time.sleep(0.02)
    clock.mark("model_build")                        # the build's time less the check inside it
    time.sleep(0.04)
    m = clock.finish()
    assert list(m) == list(STARTUP_METRICS)
    assert m["startup/ray_workers_s"] == pytest.approx(0.30, abs=0.05)
    assert m["startup/kernel_check_s"] == pytest.approx(0.05, abs=0.02)
    assert m["startup/model_build_s"] == pytest.approx(0.02, abs=0.02)
    assert m["startup/first_step_s"] == pytest.approx(0.04, abs=0.02)
    assert m["startup/compile_s"] == 0.0             # nothing was torch.compiled
    parts = sum(v for k, v in m.items() if k != "startup/total_s")
    assert parts == pytest.approx(m["startup/total_s"], abs=1e-6)
    assert clock.finish() == m                       # the first step ends once


def test_startup_figures_noted_beside_the_phases_leave_the_phases_alone():
    """A node that unpacked the storage's JIT cache says how much and how long, next to the breakdown."""
    clock = StartupClock(time.time() - 0.1)
    clock.note("jit_cache", {"files": 812, "mib": 96.5, "download_s": 0.8, "restore_s": 1.4})
    m = clock.finish()
    assert list(m)[:len(STARTUP_METRICS)] == list(STARTUP_METRICS)
    assert {k: v for k, v in m.items() if k.startswith("startup/jit_cache.")} == {
        "startup/jit_cache.files": 812, "startup/jit_cache.mib": 96.5, "startup/jit_cache.download_s": 0.8,
        "startup/jit_cache.restore_s": 1.4}
    phases = sum(m[f"startup/{p}_s"] for p in STARTUP_PHASES)
    assert phases == pytest.approx(m["startup/total_s"], abs=1e-6)


@pytest.mark.parametrize("submitted", [False, True])
def test_the_ray_workers_parts_follow_the_drivers_marks_from_the_submission_when_there_is_one(submitted):
    """A driver of `ray job submit` counts from Ray's acceptance and marks its own process's start."""
    from raytune_ft.env import process_start

    # this process plays the worker: its start is the end of the driver's part of the wait
    now = time.time()
    created = process_start()
    # the driver builds the datasets while the MLflow run opens, then waits for the run (run.py)
    marks = {"driver": created - 4.0, "ray_start": created - 3.0, "datasets": created - 2.0,
             "tracking": created - 1.0}
    job_start = created - 6.0
    if submitted:
        marks["process"] = created - 5.0
    clock = StartupClock(job_start, marks)
    parts = {k.split(".", 1)[1]: v for k, v in clock.parts.items()}
    expected = ["driver", "ray_start", "datasets", "tracking", "scheduling", "worker_setup"]
    assert list(parts) == (["submission"] + expected if submitted else expected)
    assert parts["driver"] == pytest.approx(1.0 if submitted else 2.0, abs=1e-6)
    assert parts.get("submission", 1.0) == pytest.approx(1.0, abs=1e-6)
    assert parts["scheduling"] == pytest.approx(1.0, abs=1e-6)
    assert sum(parts.values()) == pytest.approx(clock.seconds["ray_workers"], abs=1e-6)
    assert clock.seconds["ray_workers"] >= now - job_start - 1e-3


def test_a_process_ray_started_before_the_attempt_asked_for_workers_counts_from_the_ask():
    """Ray hands a new worker an idle process that has run nothing yet, which may have started before a restart
    (the recovery bench once read a negative wait from the kill to the new workers): the workers' set-up counts
    from when the controller asked for them (launch.NoteWorkersAsked), the wait before it is scheduling."""
    from raytune_ft.env import process_start

    created = process_start()
    marks = {"driver": created - 4.0, "ray_start": created - 3.0, "datasets": created - 2.0, "tracking": created - 1.0}
    clock = StartupClock(created - 6.0, marks, workers_asked=created + 0.5)
    parts = {k.split(".", 1)[1]: v for k, v in clock.parts.items()}
    assert parts["scheduling"] == pytest.approx(1.5, abs=1e-6)
    assert parts["worker_setup"] == pytest.approx(clock.seconds["ray_workers"] - 6.5, abs=1e-6)
    assert sum(parts.values()) == pytest.approx(clock.seconds["ray_workers"], abs=1e-6)
    # an ask before the process started changes nothing: a process Ray started for it counts from its start
    early = StartupClock(created - 6.0, marks, workers_asked=created - 0.5)
    assert early.parts["ray_workers.scheduling"] == pytest.approx(1.0, abs=1e-6)


def test_first_step_prints_one_breakdown_line_and_logs_it(mlflow_run):
    import torch

    recipe, run_id = mlflow_run
    out = io.StringIO()
    log = WorkerLog(0, recipe, run_id, stream=out, job=JobStart(time.time() - 1.0))
    log.startup.mark("model_build")
    first = log.first_step_done(1, torch.device("cpu"))
    again = log.first_step_done(2, torch.device("cpu"))
    lines = [ln for ln in out.getvalue().splitlines() if "start-up" in ln]
    assert len(lines) == 1, out.getvalue()
    for label in ("Ray and workers", "model build", "kernel check", "compile", "first step"):
        assert label in lines[0], lines[0]
    assert again == first and first["startup/total_s"] >= 1.0
    log.flush(240)
    from mlflow import MlflowClient

    from raytune_ft.tracking.mlflow_run import startup_from_params

    params = MlflowClient(recipe.tracking_uri).get_run(run_id).data.params
    assert startup_from_params(params) == pytest.approx({k[len("startup/"):]: v for k, v in first.items()}, abs=1e-3)
    assert set(params) >= {f"startup.{log.attempt_id}." + k[len("startup/"):] for k in STARTUP_METRICS}


def _run_page_sections(keys) -> list[list[str]]:
    """The charts MLflow's run page (charts tab, MLflow 3) draws for these metric keys on a first visit,
    section by section: one per prefix (the key up to its last "/"), the prefixed ones alphabetically,
    then the unprefixed ones ("Model metrics"); charts alphabetical within a section. The UI's rule as
    its code has it, written out here because no browser runs in the tests (bench/mlflow_screenshot.sh
    takes the real page)."""
    by_prefix: dict[str, list[str]] = {}
    for k in sorted(keys):
        by_prefix.setdefault(k.rpartition("/")[0], []).append(k)
    return [by_prefix[p] for p in sorted(by_prefix, key=lambda p: (p == "", p))]


def test_run_page_opens_on_the_training_curves(mlflow_run):
    """Loss, lr and grad norm are the run page's first charts, ahead of the held-out figures; the
    one-off start-up figures are params and the samples' seconds stay in their table, not charts."""
    import torch
    from mlflow import MlflowClient

    recipe, run_id = mlflow_run
    log = WorkerLog(0, recipe, run_id, stream=io.StringIO(), job=JobStart(time.time() - 1.0))
    log.log_metrics({"samples/seconds": 0.2, "samples/tokens": 8}, 0)        # what Sampler.run returns
    log.first_step_done(1, torch.device("cpu"))
    points, window = _window([1, 2], None)
    log.progress(window, 4, elapsed=1.0, steps=points)
    log.log_metrics({"eval/loss": 2.0, "eval/perplexity": 7.4, "eval/tokens": 100, "eval/seconds": 0.5,
                     "samples/seconds": 0.2, "samples/tokens": 8}, 2)       # what EvalAndSamples.run returns
    log.flush(240)
    metrics = MlflowClient(recipe.tracking_uri).get_run(run_id).data.metrics
    sections = _run_page_sections(metrics)
    assert sections[0][:3] == ["train/grad_norm", "train/loss", "train/lr"], sections
    assert sections[1] == ["validation/loss", "validation/perplexity", "validation/seconds", "validation/tokens"]
    assert not [k for k in metrics if k.startswith(("startup", "samples"))], sorted(metrics)


_COMPILE_ONCE = """
import json, time, torch
from raytune_ft.train.startup_clock import StartupClock
clock = StartupClock(time.time())
f = torch.compile(lambda x: torch.relu(x) * 2 + 1)
x = torch.randn(16, requires_grad=True)
f(x).sum().backward()
m = clock.finish()
print(json.dumps({"counts": {k: v for k, v in m.items() if k.startswith("startup/compile.")}, "line": clock.line()}))
"""


@pytest.mark.timeout(600)
def test_the_breakdown_says_how_many_compiled_graphs_came_from_the_cache(tmp_path):
    """A cold process compiles its graphs, the next one with the same Inductor cache folder finds them all;
    the start-up line says which (real torch.compile on CPU, two fresh processes)."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(REPO))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _COMPILE_ONCE], env=env, capture_output=True, text=True,
                             timeout=500)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = (r["counts"] for r in runs)
    assert cold["startup/compile.fx_cache_hits"] == 0 and cold["startup/compile.fx_cache_misses"] >= 2  # fw, bw
    assert warm["startup/compile.fx_cache_misses"] == 0 and warm["startup/compile.aot_cache_misses"] == 0
    assert warm["startup/compile.aot_cache_hits"] >= 1
    n = cold["startup/compile.fx_cache_misses"]
    assert f"graphs from the cache: Inductor 0 of {n}," in runs[0]["line"]
    assert f"graphs from the cache: Inductor {n} of {n}," in runs[1]["line"]


def test_a_later_attempts_line_says_its_scheduling_holds_the_earlier_attempts():
    """Issue 36: a restarted attempt's "trainer and worker scheduling" (from the driver's last mark) held the
    whole first attempt, and was read as the recovery's time."""
    from raytune_ft.env import process_start

    created = process_start()
    marks = {"driver": created - 4.0, "ray_start": created - 3.0, "datasets": created - 2.0, "tracking": created - 1.0}
    first, later = StartupClock(created - 6.0, marks), StartupClock(created - 6.0, marks)
    later.attempt = 2
    assert "trainer and worker scheduling 1.0" in first.line() and "earlier attempts" not in first.line()
    assert "earlier attempts, then attempt 2's trainer and worker scheduling 1.0" in later.line()
