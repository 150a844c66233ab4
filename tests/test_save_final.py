"""train.save_final=false (throughput runs of models too big to write out): the 27B recipe's --local job
on a real local Ray trains to max_steps and ends with no checkpoint folder at all, its summary still
holding the steps, tokens and last loss; registration is refused by validation, so nothing is registered."""
from __future__ import annotations

import glob
import math
import os

import pytest


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job_name,extra", [
    ("qwen27b_b300", []),                                                    # the FSDP2 loop
    ("qwen3_4b_full", ["train.eval_every=null", "train.load_best_at_end=false"]),   # the TRL loop
])
def test_save_final_false_trains_and_writes_no_checkpoint(ray_local, tmp_path, job_name, extra):
    from raytune_ft.cli import _job_recipe
    from raytune_ft.run import run

    recipe = _job_recipe(job_name, True, [
        f"tracking.storage_path={tmp_path}", "tracking.run_name=nosave", "train.max_steps=4",
        "train.log_every=2", "train.checkpoint_every=100", "train.save_final=false", "registry.enabled=false",
        *extra])
    summary = run(recipe, local=True)      # on the session's local Ray (conftest.ray_local)
    assert summary.status == "trained" and summary.checkpoint is None
    assert summary.steps == 4 and summary.tokens > 0
    assert summary.final_loss is not None and math.isfinite(summary.final_loss)
    assert glob.glob(os.path.join(recipe.run_dir, "checkpoint_*")) == []
    assert os.path.isfile(os.path.join(recipe.run_dir, "summary.json"))
    # logged every 2 steps, yet MLflow has each step's loss once, and the summary's is the last step's
    from mlflow import MlflowClient

    client = MlflowClient(recipe.tracking_uri)
    for key in ("train/loss", "train/grad_norm", "train/lr" if job_name == "qwen27b_b300" else "train/learning_rate"):
        hist = client.get_metric_history(summary.mlflow_run_id, key)
        assert sorted(m.step for m in hist) == [1, 2, 3, 4], (key, [(m.step, m.value) for m in hist])
    last = max(client.get_metric_history(summary.mlflow_run_id, "train/loss"), key=lambda m: m.step)
    assert summary.final_loss == pytest.approx(last.value)
    assert summary.startup["total_s"] > 0 and summary.startup["first_step_s"] > 0
