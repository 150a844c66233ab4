"""train.save_final=false (throughput runs of models too big to write out): a run trains to max_steps and ends
with no checkpoint folder at all, its summary still holding the steps, tokens and last loss; registration is
refused by validation, so nothing is registered.

The TRL loop: the Qwen3-4B recipe's --local job on a real local Ray, here. The FSDP2 loop: the bench's
throughput runs are such runs (4 steps logged every 2, no periodic checkpoint, train.save_final=false), and
tests/test_bench_entry.py's re-submit smoke checks both of its `ray job submit`s of the 27B recipe's --local
job with `assert_trained_without_a_checkpoint`.
"""
from __future__ import annotations

import glob
import json
import math
import os

import pytest


def assert_trained_without_a_checkpoint(run_dir: str, steps: int, lr_metric: str) -> None:
    """The run in `run_dir` trained `steps` steps, logged every 2 (MLflow still has each step's loss once, and
    the summary's is the last step's), and wrote no checkpoint."""
    from mlflow import MlflowClient

    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["status"] == "trained" and summary["checkpoint"] is None
    assert summary["steps"] == steps and summary["tokens"] > 0
    assert summary["final_loss"] is not None and math.isfinite(summary["final_loss"])
    assert glob.glob(os.path.join(run_dir, "checkpoint_*")) == []
    client = MlflowClient(summary["tracking_uri"])
    for key in ("train/loss", "train/grad_norm", lr_metric):
        hist = client.get_metric_history(summary["mlflow_run_id"], key)
        assert sorted(m.step for m in hist) == list(range(1, steps + 1)), (key, [(m.step, m.value) for m in hist])
    last = max(client.get_metric_history(summary["mlflow_run_id"], "train/loss"), key=lambda m: m.step)
    assert summary["final_loss"] == pytest.approx(last.value)
    assert summary["startup"]["total_s"] > 0 and summary["startup"]["first_step_s"] > 0


@pytest.mark.timeout(600)
def test_save_final_false_trains_and_writes_no_checkpoint_in_the_trl_loop(ray_local, tmp_path):
    from raytune_ft.cli import _job_recipe
    from raytune_ft.driver.run import run

    recipe = _job_recipe("qwen3_4b_full", True, [
        f"tracking.storage_path={tmp_path}", "tracking.run_name=nosave", "train.max_steps=4",
        "train.log_every=2", "train.checkpoint_every=100", "train.save_final=false", "registry.enabled=false",
        "train.eval_every=null", "train.load_best_at_end=false"])
    summary = run(recipe, local=True)      # on the session's local Ray (conftest.ray_local)
    assert summary.status == "trained" and summary.checkpoint is None
    assert_trained_without_a_checkpoint(recipe.run_dir, 4, "train/learning_rate")
