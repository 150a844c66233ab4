"""Rank 0's MLflow calls made by a process of their own (train/mlflow_sender.MlflowSender, through WorkerLog):
in order, on a real sqlite store; a failed call said in the worker's words with the next calls still made;
the worker's process never imports MLflow; a sender that dies hands the next calls back to the worker."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pytest

from raytune_ft.recipe import Recipe
from tests.conftest import REPO, env_with_path


WORKER = textwrap.dedent("""
    import io, json, sys
    from raytune_ft.recipe import recipe_from_dict
    from raytune_ft.train.common import WorkerLog
    recipe = recipe_from_dict(json.loads(sys.argv[1]))
    out = io.StringIO()
    log = WorkerLog(0, recipe, sys.argv[2], stream=out)
    sender_pid = log._sender._proc.pid
    with open(f"/proc/{sender_pid}/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    log.log_param("basis", "a")
    log.log_metrics({"loss": 2.0}, 1)
    log.log_param("basis", "b")            # MLflow refuses a param changed: said, and the next calls made
    log.log_metrics({"loss": 1.5}, 2)
    log.set_tag("raytune.kernels", "attention=sdpa")
    log.close()
    print(json.dumps({"mlflow_imported": "mlflow" in sys.modules, "out": out.getvalue(), "cmdline": cmdline,
                      "sender_pid": sender_pid}))
""")


@pytest.mark.timeout(300)
def test_a_workers_mlflow_calls_are_made_in_order_by_a_process_of_their_own(mlflow_run):
    from mlflow import MlflowClient

    recipe, run_id = mlflow_run
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(recipe.to_dict(), default=str), run_id],
                          env=env_with_path(REPO), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["mlflow_imported"] is False        # the 4-6 s of MLflow's imports and store set-up are elsewhere
    assert recipe.tracking_uri not in got["cmdline"]   # the URI (credentials in it too) goes over the pipe
    assert got["out"] == "[raytune_ft] MLflow param basis not logged (MlflowException)\n", got["out"]
    client = MlflowClient(recipe.tracking_uri)
    run = client.get_run(run_id).data
    assert run.params["basis"] == "a"
    assert run.tags["raytune.kernels"] == "attention=sdpa" and "raytune.gpu" in run.tags
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 2.0), (2, 1.5)]
    with pytest.raises(ProcessLookupError):            # close() ended the sender
        os.kill(got["sender_pid"], 0)


@pytest.mark.timeout(300)
def test_a_sender_that_dies_hands_the_next_calls_back_to_the_worker(mlflow_run):
    from mlflow import MlflowClient

    from raytune_ft.train.common import WorkerLog

    recipe, run_id = mlflow_run
    out = io.StringIO()
    log = WorkerLog(0, recipe, run_id, stream=out)
    log.log_metrics({"loss": 2.0}, 1)
    log.flush()
    log._sender._proc.kill()                           # e.g. killed for memory
    log._sender._reader.join(timeout=60)
    log.log_metrics({"loss": 1.0}, 2)
    log.close()
    assert "MLflow sender exited (code -9) with 0 call(s) not made" in out.getvalue()
    history = MlflowClient(recipe.tracking_uri).get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0)]


def test_an_unreachable_store_turns_logging_off_and_training_goes_on(tmp_path):
    from raytune_ft.train.common import WorkerLog

    recipe = Recipe()
    recipe.tracking.tracking_uri = "nosuchscheme://nowhere"
    out = io.StringIO()
    log = WorkerLog(0, recipe, "0123456789abcdef", stream=out)
    log.log_metrics({"loss": 2.0}, 1)
    log.close()
    assert out.getvalue().startswith("[raytune_ft] MLflow logging off:"), out.getvalue()
