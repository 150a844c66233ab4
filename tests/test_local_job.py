"""The 27B recipe's --local job end to end on local Ray on CPU: train, checkpoint, register, load back."""
from __future__ import annotations

import json
import os

import pytest

from tests.conftest import local_job_process, local_job_recipe, train_state


@pytest.fixture(scope="module")
def local_run(local_job):
    proc = local_job["proc"]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:].decode(errors="replace")
    return local_job_recipe(local_job["overrides"]), local_job["summary"], proc.stdout.decode()


@pytest.mark.timeout(900)
def test_local_job_trains_and_registers(local_run):
    recipe, summary, out = local_run
    assert summary["status"] == "registered", out[-3000:]
    assert summary["steps"] == recipe.train.max_steps == 20
    assert summary["tokens"] > 0 and summary["tokens_per_s"] > 0
    assert summary["final_loss"] is not None and summary["final_loss"] == summary["final_loss"]  # finite
    # the printed summary a user reads
    for line in ("steps            20", "registered       main.default.qwen27b_local version 1", "checkpoint"):
        assert line in out, out[-3000:]
    # the loss falls on the learnable generated data
    hist = train_state(summary["checkpoint"])["history"]
    assert [h["step"] for h in hist] == list(range(1, 21))
    assert hist[-1]["loss"] < hist[0]["loss"] - 0.5
    assert summary["data"]["rows_read"] > 0 and summary["data"]["blocks"] > 0


@pytest.mark.timeout(300)
def test_registered_version_loads_with_transformers(local_run):
    import mlflow
    import torch
    from transformers import AutoModelForCausalLM

    recipe, summary, _ = local_run
    mlflow.set_tracking_uri(recipe.tracking_uri)
    mlflow.set_registry_uri(recipe.tracking_uri)
    client = mlflow.MlflowClient(recipe.tracking_uri)
    mv = client.get_model_version(summary["registered_name"], summary["registered_version"])
    assert mv.name == "main.default.qwen27b_local"
    # the exported HF folder loads with plain transformers and gives logits of the right shape
    hf = os.path.join(summary["checkpoint"], "hf")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    logits = model(ids).logits
    assert logits.shape == (1, 5, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    # and the registered copy loads back through MLflow
    loaded = mlflow.transformers.load_model(f"models:/{mv.name}/{mv.version}", return_type="components")
    assert loaded["model"].config.vocab_size == model.config.vocab_size


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_job_from_any_folder_logs_every_step_to_the_run_it_names(tmp_path):
    """`python jobs/qwen27b_b300.py --local` as a new user runs it: the default relative storage
    (./runs), started from a folder that is not the Ray workers' working folder. Every step's metrics
    reach the MLflow run the summary names, and no second MLflow store appears anywhere, the workers'
    folders (under Ray's temp dir) included."""
    from mlflow import MlflowClient

    work = tmp_path / "clone"
    work.mkdir()
    sets = ["train.max_steps=4", "train.log_every=1", "train.checkpoint_every=2", "registry.enabled=false"]
    with local_job_process(work, sets, drop_env=("RAYTUNE_LOCAL_STORAGE",), prefix="rtpath",
                           timeout=800) as (proc, ray_tmp):
        out = (proc.stdout + proc.stderr).decode(errors="replace")
        assert proc.returncode == 0, out[-4000:]
        run_dir = work / "runs" / "qwen27b-local"
        summary = json.loads((run_dir / "summary.json").read_text())
        db = run_dir / "mlflow.db"
        assert summary["tracking_uri"] == f"sqlite:///{db}"
        client = MlflowClient(summary["tracking_uri"])
        for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
            steps = sorted(m.step for m in client.get_metric_history(summary["mlflow_run_id"], key))
            assert steps == [1, 2, 3, 4], (key, steps)
        stray = [p for root in (work, ray_tmp) for p in root.rglob("mlflow.db") if p != db]
        assert not stray, stray
        assert "MLflow logging off" not in out and "MLflow metric logging failed" not in out, out[-3000:]
