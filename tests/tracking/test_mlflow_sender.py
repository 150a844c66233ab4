"""Rank 0's MLflow calls made by a process of their own (train/mlflow_sender.MlflowSender, through WorkerLog):
in order, on a real sqlite store; a failed call said in the worker's words with the next calls still made;
the worker's process never imports MLflow; a sender that dies hands the next calls to a new process; a hung
tracking server costs a checkpoint report at most REPORT_WAIT_S."""
from __future__ import annotations

import contextlib

import io
import json
import os
import subprocess
import sys
import signal
import textwrap

import pytest

from raytune_ft.recipe.recipe import Recipe
from tests.conftest import REPO, env_with_path


WORKER = textwrap.dedent("""
    import io, json, sys
    from raytune_ft.recipe.recipe import recipe_from_dict
    from raytune_ft.train.common import WorkerLog
    recipe = recipe_from_dict(json.loads(sys.argv[1]))
    out = io.StringIO()
    log = WorkerLog(0, recipe, sys.argv[2], stream=out)
    sender_pid = log._sender.pid
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
    recipe.tracking.system_metrics = "off"        # the worker's own lines only (train/system_metrics.py)
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


@pytest.mark.slow          # starts sender processes and kills one
@pytest.mark.timeout(300)
def test_a_sender_that_dies_hands_the_next_calls_to_a_new_process(mlflow_run):
    import signal
    import time

    from mlflow import MlflowClient

    from raytune_ft.train.common import WorkerLog

    recipe, run_id = mlflow_run
    out = io.StringIO()
    log = WorkerLog(0, recipe, run_id, stream=out)
    log.log_metrics({"loss": 2.0}, 1)
    assert log.flush(timeout=240)
    first = log._sender.pid
    os.kill(first, signal.SIGKILL)                     # e.g. killed for memory
    deadline = time.monotonic() + 60
    while log._sender.pid == first and time.monotonic() < deadline:
        time.sleep(0.05)
    log.log_metrics({"loss": 1.0}, 2)
    log.close()
    assert ("MLflow sender exited (code -9) with 0 call(s) not made; the next ones go to a new process"
            in out.getvalue()), out.getvalue()
    history = MlflowClient(recipe.tracking_uri).get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0)]


@pytest.mark.slow          # the session's tracking server, stopped and started again
@pytest.mark.timeout(300)
def test_a_hung_tracking_server_costs_a_checkpoint_report_at_most_the_stated_bound(mlflow_server, tmp_path):
    """The tracking server stops answering (SIGSTOP to its process group) mid-run: each checkpoint report's
    flush (what the loops call before ray.train.report) waited up to 120 s: now the first one after the stop
    waits at most REPORT_WAIT_S and the next ones not at all; once the server answers again every step's
    metrics arrive."""
    import signal
    import time

    from mlflow import MlflowClient

    from raytune_ft.tracking import mlflow_run as tracking
    from raytune_ft.train.common import WorkerLog
    from raytune_ft.tracking.sender import REPORT_WAIT_S

    recipe = Recipe()
    recipe.tracking.storage_path = str(tmp_path / "runs")
    recipe.tracking.tracking_uri, recipe.tracking.run_name = mlflow_server.uri, "hung-store"
    recipe.tracking.system_metrics = "off"
    run_id = tracking.start_run(recipe)
    out = io.StringIO()
    log = WorkerLog(0, recipe, run_id, stream=out)
    log.log_metrics({"loss": 1.0}, 1)
    assert log.flush(timeout=240), out.getvalue()       # the sender up and the store answering
    stalls = []
    os.killpg(mlflow_server.proc.pid, signal.SIGSTOP)
    try:
        for step in range(2, 6):                         # a checkpoint report at each
            log.log_metrics({"loss": 1.0 / step}, step)
            t0 = time.monotonic()
            log.flush()
            stalls.append(time.monotonic() - t0)
    finally:
        os.killpg(mlflow_server.proc.pid, signal.SIGCONT)
    print(f"checkpoint reports' stalls with the tracking server stopped: {[round(s, 2) for s in stalls]} s")
    assert stalls[0] <= REPORT_WAIT_S + 0.5 and max(stalls[1:]) < 0.5, stalls
    log.close()
    history = MlflowClient(recipe.tracking_uri).get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5], out.getvalue()


def test_an_unreachable_store_turns_logging_off_and_training_goes_on(tmp_path):
    from raytune_ft.train.common import WorkerLog

    recipe = Recipe()
    recipe.tracking.tracking_uri = "nosuchscheme://nowhere"
    recipe.tracking.system_metrics = "off"        # the sender's lines only (train/system_metrics.py)
    out = io.StringIO()
    log = WorkerLog(0, recipe, "0123456789abcdef", stream=out)
    log.log_metrics({"loss": 2.0}, 1)
    log.close()
    assert out.getvalue().startswith("[raytune_ft] MLflow logging off:"), out.getvalue()


def _never_reached(tmp_path):
    """A recipe with a store the stopped sender never reaches (it is stopped before it reads a line)."""
    recipe = Recipe()
    recipe.tracking.storage_path = str(tmp_path / "runs")
    return recipe, "0123456789abcdef"


def _stopped_sender(recipe, run_id, said: list):
    """A sender whose process is stopped (SIGSTOP) before it reads a call: a tracking store that stalls,
    so the pipe to it fills. The sender's own process, a real one, is what is stopped."""
    import signal

    from raytune_ft.tracking.sender import MlflowSender

    sender = MlflowSender(recipe.tracking_uri, run_id, said.append)
    os.kill(sender.pid, signal.SIGSTOP)
    return sender


def _calls_in_a_thread(sender, steps) -> "threading.Thread":
    import threading

    def calls():             # each call a few KiB: a pipe holds 64 KiB, 60 calls more than twice that
        for step in steps:
            sender.call("log_batch", "MLflow metric logging failed ({error})",
                        metrics=[[f"train/m{i:03d}", float(step), 0, step] for i in range(100)])

    t = threading.Thread(target=calls, daemon=True)
    t.start()
    return t


@contextlib.contextmanager
def _stalled_sender_after_60_calls(recipe, run_id, said: list):
    """A stopped sender (`_stopped_sender`) handed 60 calls from a thread, which must not block on it;
    yields the sender, whose process is killed at the end if still there."""
    sender = _stopped_sender(recipe, run_id, said)
    try:
        t = _calls_in_a_thread(sender, range(1, 61))
        t.join(timeout=30)
        assert not t.is_alive(), "the training thread blocked on the sender's full pipe"
        yield sender
    finally:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(sender.pid, signal.SIGKILL)


@pytest.mark.slow          # thousands of points into a real store
@pytest.mark.timeout(300)
def test_a_stalled_sender_never_blocks_the_training_thread_and_its_calls_are_made_later(mlflow_run):
    import signal

    from mlflow import MlflowClient

    recipe, run_id = mlflow_run
    said: list[str] = []
    with _stalled_sender_after_60_calls(recipe, run_id, said) as sender:
        os.kill(sender.pid, signal.SIGCONT)            # the store answers again
        assert sender.flush(timeout=240) is True, said
        sender.close(timeout=60)
    assert said == []
    history = MlflowClient(recipe.tracking_uri).get_metric_history(run_id, "train/m007")
    assert [m.step for m in history] == list(range(1, 61))           # none lost, in order


@pytest.mark.timeout(300)
def test_a_flush_that_times_out_is_bounded_and_close_says_what_was_lost(tmp_path):
    import time

    from raytune_ft.channel import KILL_GRACE_S

    recipe, run_id = _never_reached(tmp_path)
    said: list[str] = []
    with _stalled_sender_after_60_calls(recipe, run_id, said) as sender:
        pid = sender.pid
        t0 = time.monotonic()
        assert sender.flush(timeout=1) is False and time.monotonic() - t0 < 2   # the calls are made later
        assert said == []
        start = time.monotonic()
        closing = _closing_in_a_thread(sender, timeout=2)
        closing.join(timeout=60)
        assert not closing.is_alive(), "close() held the end of the run"
        assert time.monotonic() - start < 2 + 2 * KILL_GRACE_S + 5
        assert said[-1] == "MLflow: 60 call(s) not made after 2 s; the sender is stopped", said
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _closing_in_a_thread(sender, timeout: float):
    import threading

    t = threading.Thread(target=sender.close, kwargs={"timeout": timeout}, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(120)
def test_calls_beyond_the_senders_queue_are_dropped_and_said(tmp_path, monkeypatch):
    from raytune_ft.tracking import sender as mlflow_sender

    monkeypatch.setattr(mlflow_sender, "QUEUE_CALLS", 20, raising=False)
    recipe, run_id = _never_reached(tmp_path)
    said: list[str] = []
    with _stalled_sender_after_60_calls(recipe, run_id, said) as sender:
        assert any(s.startswith("MLflow: 1 call(s) dropped so far: 20 calls wait for the sender") for s in said), said
        sender.close(timeout=1)
        # the queue holds 20, the run's first message among them; the sender's thread may have moved a few more
        # into the pipe before it filled
        import re
        lost = re.fullmatch(r"MLflow: (\d+) call\(s\) not made after 1 s; the sender is stopped", said[-2])
        dropped = re.fullmatch(r"MLflow: (\d+) call\(s\) were dropped while the sender was behind", said[-1])
        assert lost and dropped, said
        assert int(lost[1]) + int(dropped[1]) == 60 and 19 <= int(lost[1]) < 60, said


@pytest.mark.slow          # a sender process and a real sqlite store
@pytest.mark.timeout(120)
def test_calls_made_before_the_run_opens_wait_in_the_sender_and_are_made_once_its_id_comes(mlflow_run):
    """Issue 58 item 3: rank 0 builds and steps while the driver's run opens; its calls wait (bounded) in the
    sender's process and are made, in order, once `give_run` hands the id over."""
    from mlflow import MlflowClient

    from raytune_ft.tracking.sender import MlflowSender

    recipe, run_id = mlflow_run
    said: list[str] = []
    sender = MlflowSender(recipe.tracking_uri, None, said.append)
    try:
        for step in (1, 2, 3):
            sender.call("log_batch", "MLflow metric logging failed ({error})",
                        metrics=[["train/loss", float(step), 0, step]])
        assert not sender.flush(1.0), "calls were made before the run had an id"
        sender.give_run(run_id)
        assert sender.flush(60), said
    finally:
        sender.close(30)
    history = MlflowClient(recipe.tracking_uri).get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert not [s for s in said if "failed" in s], said


@pytest.mark.slow          # a sender process and a real sqlite store
@pytest.mark.timeout(120)
def test_the_checkpoints_history_fills_the_steps_a_tracking_outage_kept_from_the_run(mlflow_run):
    """Issue 58 item 3: the store received steps 1-3 of 6 (an outage dropped the rest); the next contact (a
    resume, the end of the run: WorkerLog.backfill with the checkpoint's history) logs steps 4-6 of every
    curve, and steps 1-3 are not logged twice."""
    from mlflow import MlflowClient

    from raytune_ft.train.common import WorkerLog

    recipe, run_id = mlflow_run
    recipe.tracking.system_metrics = "off"
    client = MlflowClient(recipe.tracking_uri)
    for step in (1, 2, 3):
        client.log_metric(run_id, "train/loss", 10.0 + step, step=step)
    history = [{"step": s, "loss": 10.0 + s, "lr": 1e-5 * s, "grad_norm": 0.5} for s in range(1, 7)]
    log = WorkerLog(0, recipe, run_id=run_id, stream=io.StringIO())
    log.backfill(history)
    log.close()
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert loss == [(s, 10.0 + s) for s in range(1, 7)]
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/lr")) == list(range(1, 7))
