"""`python -m bench gpu ckpt` (bench/ckpt_async.py): the same recipe run with train.async_checkpoint off then on,
and the held seconds of each save read from the run's MLflow store."""
from __future__ import annotations

import pytest

from bench import ckpt_async
from bench.__main__ import main as bench_main


def test_ckpt_runs_the_recipe_twice_synchronous_then_in_the_background(capsys, tmp_path):
    assert bench_main(["gpu", "ckpt", "--gpus", "0", "--workdir", str(tmp_path), "--dry-run"]) == 0
    off, on = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=== ")]
    for line, mode in ((off, "off"), (on, "on")):
        assert line.startswith(f"=== ckpt / ckpt-async-{mode}: ") and "jobs/qwen27b_b300.py" in line
        assert f"train.async_checkpoint={mode}" in line
        # the bench's interval after the kit's own (the later --set wins), one registered checkpoint kept
        assert line.index("train.checkpoint_every=2") > line.index("train.checkpoint_every=1000")
        assert "train.keep_checkpoints=1" in line
    assert bench_main(["gpu", "ckpt", "--gpus", "0", "--ckpt-every", "3", "--dry-run"]) == 0
    assert all("train.checkpoint_every=3" in line for line in capsys.readouterr().out.splitlines()
               if line.startswith("=== ckpt"))
    # each rank's local copy of a checkpoint elsewhere than the run's disk: the job's TMPDIR
    assert bench_main(["gpu", "ckpt", "--gpus", "0", "--local-copies", "/dev/shm", "--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("=== ckpt")]
    assert len(lines) == 2 and all(": TMPDIR=/dev/shm " in line for line in lines)


def test_the_held_seconds_of_each_save_come_from_the_runs_mlflow_store(tmp_path):
    import mlflow

    from raytune_ft.tracking.mlflow_run import mlflow_metric_name     # the names the loop's metrics get in MLflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("ckpt"))
    for step, held, background in ((2, 0.5, 3.0), (4, 0.25, 2.0), (6, 0.25, 2.5)):
        client.log_metric(run.info.run_id, mlflow_metric_name("checkpoint/blocked_s"), held, step=step)
        client.log_metric(run.info.run_id, mlflow_metric_name("checkpoint/background_s"), background, step=step)
    fig = ckpt_async.save_figures({"tracking_uri": uri, "mlflow_run_id": run.info.run_id})
    assert fig["saves"] == 3 and fig["blocked_s"] == [0.5, 0.25, 0.25]
    assert fig["blocked_s_mean"] == round(1.0 / 3, 3) and fig["background_s"] == [3.0, 2.0, 2.5]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_stager_bench_times_both_policies_against_a_synchronous_save(tmp_path):
    """bench/stager_reuse.py --cpu-check: a fresh Python (a gloo group of one) runs the checkpointer's own
    staging three times with the stager kept and three times with a new one, and a synchronous DCP save."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run([sys.executable, "bench/stager_reuse.py", "--cpu-check", "--saves", "3",
                          "--folder", str(tmp_path / "saves")], cwd=REPO, capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(result["kept_held_s"]) == len(result["fresh_held_s"]) == 3 and len(result["sync_s"]) == 2
    assert all(s > 0 for s in result["sync_s"]) and result["kept_over_sync"] > 0
    assert list((tmp_path / "saves").iterdir()) == []          # each save's files deleted once written
