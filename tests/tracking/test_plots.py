"""Progress output and end-of-run plots: plain log lines off a terminal, PNGs on disk and in MLflow."""
from __future__ import annotations

import io
import json
import os
import re

import pytest

from raytune_ft.tracking.plots import LOSS_PNG, THROUGHPUT_PNG, run_history, write_run_plots
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.common import WorkerLog, plain
from tests.conftest import REPO

# every C0/C1 control character except the newline, and the ESC of ANSI sequences
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def _metrics(step: int) -> dict:
    return {"step": step, "loss": 2.0 / step, "lr": 1e-5, "grad_norm": 0.5, "tokens_per_s": 12345.6,
            "mfu": 0.0 if step < 10 else 0.41, "tokens": 1000 * step}


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_is_plain_lines():
    out = io.StringIO()
    log = WorkerLog(0, Recipe(), stream=out)
    log.info("starting \x1b[31mred\x1b[0m\ttab\rreturn")        # even a message carrying escapes
    for step in (5, 10, 20):
        log.progress(_metrics(step), 20, elapsed=3.0 * step)
    log.close()
    text = out.getvalue()
    assert not CONTROL.search(text), repr(text)
    lines = text.splitlines()
    assert len(lines) == 4 and all(line.startswith("[raytune_ft] ") for line in lines)
    assert "step 5/20 (25%) | loss 0.4000 |" in lines[1] and "12,346 tok/s" in lines[1]
    assert "MFU n/a" in lines[1] and "ETA 0:00:45" in lines[1]             # 15 s for 5 steps, 15 left
    assert "MFU 41.0%" in lines[3] and "ETA" not in lines[3]                # done: no ETA


def test_progress_on_a_terminal_redraws_one_line():
    tty = _Tty()
    log = WorkerLog(0, Recipe(), stream=tty)
    log.progress(_metrics(5), 20, 15.0)
    log.progress(_metrics(10), 20, 30.0)
    log.info("checkpoint at step 10")
    log.close()
    text = tty.getvalue()
    assert text.count("\r") == 2 and "\x1b[K" in text
    # the message starts on a fresh line, after the live progress line
    assert "\x1b[K\n[raytune_ft] checkpoint at step 10\n" in text


def test_other_ranks_are_quiet():
    out = io.StringIO()
    log = WorkerLog(1, Recipe(), stream=out)
    log.info("hello")
    log.progress(_metrics(5), 20, 1.0)
    assert out.getvalue() == ""


def test_plain_strips_escapes():
    assert plain("a\x1b[1;32mb\x1b[0m\rc\td\x07") == "abc d"


def _history(n: int = 60, every: int = 10) -> list[dict]:
    hist = [{"step": s, "loss": 3.0 - s / n, "lr": 1e-5, "grad_norm": 1.0} for s in range(1, n + 1)]
    for h in hist:
        if h["step"] % every == 0:
            h["tokens_per_s"] = 1000.0 + h["step"]
    return hist


def _open_png(path: str):
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return im.format, im.size


def test_write_run_plots_writes_two_images(tmp_path):
    evals = [{"step": 30, "eval_loss": 2.6}, {"step": 60, "eval_loss": 2.2}]
    paths = write_run_plots(_history(), evals, str(tmp_path / "p"), title="t", checkpoint_steps=[25, 50])
    assert [os.path.basename(p) for p in paths] == [LOSS_PNG, THROUGHPUT_PNG]
    for p in paths:
        fmt, (w, h) = _open_png(p)
        assert fmt == "PNG" and w > 400 and h > 300


def test_plots_without_data(tmp_path):
    assert write_run_plots([], [], str(tmp_path)) == []
    # no throughput figures in the history: the loss plot only
    paths = write_run_plots([{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan")}], [], str(tmp_path))
    assert [os.path.basename(p) for p in paths] == [LOSS_PNG]


def test_run_history_from_fsdp_and_trl_checkpoints(tmp_path):
    fsdp = tmp_path / "fsdp" / "train_state"
    fsdp.mkdir(parents=True)
    (fsdp / "rank0.json").write_text(json.dumps({"step": 3, "history": _history(3, 1)}))
    hist, evals = run_history(str(tmp_path / "fsdp"))
    assert [h["step"] for h in hist] == [1, 2, 3] and evals == []

    trl = tmp_path / "trl" / "trainer"
    trl.mkdir(parents=True)
    (trl / "trainer_state.json").write_text(json.dumps({"log_history": [
        {"step": 10, "loss": 2.5, "learning_rate": 1e-5}, {"step": 25, "eval_loss": 2.4},
        {"step": 20, "loss": 2.3, "learning_rate": 1e-5}]}))
    hist, evals = run_history(str(tmp_path / "trl"))
    assert [(h["step"], h["loss"]) for h in hist] == [(10, 2.5), (20, 2.3)]
    assert evals == [{"step": 25, "eval_loss": 2.4}]


# ---------------------------------------------------------------- a finished local run

@pytest.fixture(scope="module")
def finished_run(local_job):
    """The session's --local job (tests/conftest.py), as a (recipe, summary) pair."""
    from types import SimpleNamespace

    from tests.conftest import local_job_recipe

    proc = local_job["proc"]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:].decode(errors="replace")
    return local_job_recipe(local_job["overrides"]), SimpleNamespace(**local_job["summary"])


@pytest.mark.timeout(300)
def test_finished_run_has_png_plots_in_mlflow(finished_run, tmp_path):
    import mlflow

    recipe, summary = finished_run
    assert summary.steps == recipe.train.max_steps
    assert sorted(os.path.basename(p) for p in summary.plots) == [LOSS_PNG, THROUGHPUT_PNG]
    assert all(p.startswith(os.path.join(recipe.run_dir, "plots")) for p in summary.plots)
    client = mlflow.MlflowClient(recipe.tracking_uri)
    names = sorted(a.path for a in client.list_artifacts(summary.mlflow_run_id, "plots"))
    assert names == ["plots/" + LOSS_PNG, "plots/" + THROUGHPUT_PNG]
    for name in names:
        local = client.download_artifacts(summary.mlflow_run_id, name, str(tmp_path))
        fmt, (w, h) = _open_png(local)
        assert fmt == "PNG" and w > 400 and h > 300


@pytest.mark.timeout(300)
def test_finished_run_tags_and_data_counters_in_mlflow(finished_run, tmp_path):
    import mlflow

    recipe, summary = finished_run
    client = mlflow.MlflowClient(recipe.tracking_uri)
    r = client.get_run(summary.mlflow_run_id)
    assert r.data.tags["raytune.gpu"] == "2 x CPU (no GPU)"
    assert r.data.tags["raytune.job"] == "qwen27b_b300" and r.data.tags["raytune.git_commit"]
    assert r.data.params["train.max_steps"] == str(recipe.train.max_steps)
    # single values, not curves: one JSON artifact
    m = json.load(open(client.download_artifacts(summary.mlflow_run_id, "data.json", str(tmp_path))))
    assert m["rows_read"] == summary.data["rows_read"] > 0
    assert m["blocks"] == summary.data["blocks"] > 0
    assert 0.0 <= m["padding_fraction"] < 0.5
    assert m["rows_skipped"] == sum(summary.data["rows_skipped_by_reason"].values())
    assert m["rows_skipped_by_reason"] == summary.data["rows_skipped_by_reason"]
