"""Each node's health in MLflow (issue 36): MLflow's system metrics, on by default where the workers have GPUs
and off on CPU runs, `tracking.system_metrics` to choose; turned on, a real monitor process samples this
machine (psutil's CPU and memory figures need no GPU) into a real MLflow store."""
from __future__ import annotations

import time

import pytest

from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, validate
from raytune_ft.train.common import WorkerLog
from raytune_ft.train.system_metrics import NodeMonitor, start_for_node, wanted


def test_on_by_default_on_gpu_runs_off_on_cpu_and_a_setting_turns_them_off():
    gpu = validate(Recipe())
    assert gpu.scaling.use_gpu and gpu.tracking.system_metrics == "auto"
    assert wanted(gpu.tracking.system_metrics, use_gpu=True)
    assert not wanted("auto", use_gpu=False)
    assert not wanted(validate(apply_overrides(Recipe(), ["tracking.system_metrics=off"])).tracking.system_metrics,
                      use_gpu=True)
    assert wanted("on", use_gpu=False)
    with pytest.raises(RecipeError, match="tracking.system_metrics"):
        apply_overrides(Recipe(), ["tracking.system_metrics=sometimes"])


def test_a_cpu_run_starts_no_monitor(tmp_path):
    from tests.conftest import local_job_recipe

    r = local_job_recipe([f"tracking.storage_path={tmp_path}"])
    assert not r.scaling.use_gpu and r.tracking.system_metrics == "auto"
    assert start_for_node(r, 0, "some-run", None, print) is None
    log = WorkerLog(0, r, None)
    assert log._system is None
    # a GPU recipe's loop on a machine without one (as the loop tests run it) starts none either
    gpu_recipe = validate(Recipe())
    assert gpu_recipe.scaling.use_gpu and start_for_node(gpu_recipe, 0, "some-run", None, print) is None


@pytest.mark.timeout(120)
def test_turned_on_the_monitor_logs_system_metrics_of_this_node(mlflow_run):
    import mlflow

    recipe, run_id = mlflow_run
    uri = recipe.tracking_uri
    said: list[str] = []
    monitor = NodeMonitor(uri, "node_0", said.append, sample_every_s=0.5)
    monitor.give_run(run_id)
    client = mlflow.MlflowClient(uri)
    deadline = time.time() + 90
    names: set = set()
    while time.time() < deadline and "system/node_0/cpu_utilization_percentage" not in names:
        time.sleep(0.5)
        names = set(client.get_run(run_id).data.metrics)
    monitor.close()
    assert "system/node_0/cpu_utilization_percentage" in names, names
    assert "system/node_0/system_memory_usage_megabytes" in names
    assert not said
    assert monitor._channel is None
