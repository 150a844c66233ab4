"""The TRL loop resumes a killed run exactly: real local Ray, the Qwen3-4B recipe's --local job (tiny
qwen3 on CPU, one worker, 8 steps, checkpoint + evaluation every 4).

An uninterrupted run is the reference. A second run's worker SIGKILLs itself at the end of step 6
(tests/faults.py, kill_at_step=6:0, after the step-4 checkpoint is registered; deterministic, where a killer
thread outside raced the run on a busy host); with max_failures=1 Ray starts a new worker, which rebuilds
the Hugging Face checkpoint folder from the Ray checkpoint (weights, optimizer, scheduler, RNG), skips the
packed blocks it already trained on and carries on. Its losses after the resume point, its evaluation losses and the
final weights must equal the reference's: nothing trained twice, nothing skipped. The finished reference
submitted again under its name trains nothing.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import REPO

STEPS, EVERY, KILL_AT = 8, 4, 6


def _recipe(storage, run_name: str, max_failures: int, *overrides: str):
    """The Qwen3-4B recipe's --local job under `run_name`; `overrides` (key=value) applied last."""
    from raytune_ft.cli import resolve

    spec = importlib.util.spec_from_file_location("job_4b_resume", REPO / "jobs" / "qwen3_4b_full.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return resolve(job.recipe, job.local, local=True, overrides=[
        f"tracking.storage_path={storage}", f"tracking.run_name={run_name}",
        f"train.max_steps={STEPS}", f"train.checkpoint_every={EVERY}", f"train.eval_every={EVERY}",
        "train.log_every=1", f"scaling.max_failures={max_failures}", "registry.enabled=false", *overrides])


def _history(recipe, run_id: str, key: str) -> dict[int, list[float]]:
    from mlflow import MlflowClient

    out: dict[int, list[float]] = {}
    for m in MlflowClient(tracking_uri=recipe.tracking_uri).get_metric_history(run_id, key):
        out.setdefault(m.step, []).append(m.value)
    return out


def _weights(ckpt: str) -> dict:
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(ckpt, "hf", "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_close_weights(ckpt: str, reference: str) -> None:
    """The hf/ weights of two checkpoints agree (fp32 on CPU: within rounding)."""
    import torch

    a, b = _weights(reference), _weights(ckpt)
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import ray

    from raytune_ft.env import scoped_env
    from raytune_ft.run import run
    from tests.faults import fault_env

    storage = tmp_path_factory.mktemp("trl_resume")
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    try:
        ref = _recipe(storage, "reference", max_failures=0)
        out = {"ref": (ref, run(ref, local=True))}
        killed = _recipe(storage, "killed", max_failures=1)
        with scoped_env(fault_env(kill_at_step=f"{KILL_AT}:0")):    # forwarded to the workers by launch
            out["killed"] = (killed, run(killed, local=True))
        out["again"] = run(ref, local=True)            # the finished reference submitted again
        return out
    finally:
        ray.shutdown()


@pytest.mark.timeout(900)
def test_killed_trl_worker_resumes_exactly(runs):
    (ref_recipe, ref), (k_recipe, k) = runs["ref"], runs["killed"]
    assert ref.steps == STEPS and k.steps == STEPS

    ref_loss = _history(ref_recipe, ref.mlflow_run_id, "train/loss")
    k_loss = _history(k_recipe, k.mlflow_run_id, "train/loss")
    assert sorted(ref_loss) == list(range(1, STEPS + 1))
    assert sorted(k_loss) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for value in k_loss[step]:                             # a step run twice must give the same loss
            assert value == pytest.approx(ref_loss[step][0], rel=1e-5), (step, k_loss[step], ref_loss[step])
    # killed at the end of step 6 (before that step's log), restarted from the step-4 checkpoint: step 5
    # was logged by both attempts, everything else once; nothing before the checkpoint trained again
    assert {s: len(v) for s, v in k_loss.items()} == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 1, 7: 1, 8: 1}

    ref_eval, k_eval = _history(ref_recipe, ref.mlflow_run_id, "eval_loss"), _history(
        k_recipe, k.mlflow_run_id, "eval_loss")
    assert sorted(ref_eval) == [EVERY, STEPS] and sorted(k_eval) == [EVERY, STEPS]
    assert k_eval[STEPS][-1] == pytest.approx(ref_eval[STEPS][0], rel=1e-5)
    assert k.best_loss == pytest.approx(ref.best_loss, rel=1e-5)

    assert_close_weights(k.checkpoint, ref.checkpoint)


@pytest.mark.timeout(900)
def test_finished_trl_run_submitted_again_trains_nothing(runs):
    """Its final checkpoint is the latest: the worker reports the run complete and that checkpoint stays
    the result (no second pass: the submission names the finished run's MLflow run, opens no second one,
    and adds no training loss to its history)."""
    (ref_recipe, ref), again = runs["ref"], runs["again"]
    assert again.checkpoint == ref.checkpoint
    assert again.steps == STEPS
    assert again.final_loss == pytest.approx(ref.final_loss)
    assert again.mlflow_run_id == ref.mlflow_run_id          # no second, empty MLflow run for a finished run
    assert {s: len(v) for s, v in _history(ref_recipe, ref.mlflow_run_id, "train/loss").items()} == {
        s: 1 for s in range(1, STEPS + 1)}
