"""A run's lifecycle in the driver (issue 53 item 1, issue 50 item 8): every way out gives back what the run
took, within lifecycle.END_BOUND_S, and leaves no RUNNING MLflow run and no lease. A real driver process (its
MLflow run opened by a real opener process, on a real sqlite store or a real `mlflow server`) gets real
signals; a return and an error end the same lifecycle in this process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from mlflow import MlflowClient

from raytune_ft.cli import _job_recipe
from raytune_ft.storage.lease import LEASE_FILE
from raytune_ft.driver.lifecycle import END_BOUND_S
from tests.conftest import REPO, env_with_path
from tests.s3_server import s3_server  # noqa: F401 (a fixture)

# a driver as run() is up to its fit: the lifecycle holds the run folder and opens the MLflow run, then waits
DRIVER = textwrap.dedent("""
    import json, sys, time
    from raytune_ft.storage import fs as storage
    from raytune_ft.cli import _job_recipe
    from raytune_ft.driver.endings import ending_line, exit_code
    from raytune_ft.driver.lifecycle import RunLifecycle
    recipe = _job_recipe("qwen27b_b300", True, json.loads(sys.argv[1]))
    try:
        with RunLifecycle(recipe, local=True) as life:
            life.hold_folder(*storage.run_storage(recipe))
            life.open_run()
            if sys.argv[2] == "opened":
                print("RUN", life.run_id(), flush=True)
            print("READY", flush=True)
            time.sleep(600)
    except BaseException as e:
        if ending_line(e) is None:                 # ended before the run began: the test says why
            import traceback
            traceback.print_exc()
        print("LINE", ending_line(e), flush=True)
        from raytune_ft.channel import exit_if_abandoned
        exit_if_abandoned(exit_code(e))    # as cli.job_main does
        sys.exit(exit_code(e))
""")


def _recipe(tmp_path, *overrides):
    return _job_recipe("qwen27b_b300", True, [f"tracking.storage_path={tmp_path / 'runs'}",
                                               f"tracking.run_name=lifecycle-{tmp_path.name}", *overrides])


def _driver(tmp_path, wait: str, *overrides, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    """The driver started, and what it printed up to READY (its run id under "RUN" where it waited for it)."""
    # a run name of its own: the `mlflow server` is the session's, and other tests finish runs of the job's name
    args = [f"tracking.storage_path={tmp_path / 'runs'}", f"tracking.run_name=lifecycle-{tmp_path.name}", *overrides]
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(args), wait], cwd=REPO,
                            env={**env_with_path(REPO), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    said, lines = {}, []
    for line in proc.stdout:
        lines.append(line.rstrip())
        key, _, value = line.strip().partition(" ")
        said[key] = value
        if key == "READY":
            return proc, said
    tail = "\n".join(lines[-30:])
    raise AssertionError(f"the driver exited with {proc.wait()} before it was ready: {said}\n{tail}")


def _ended(proc: subprocess.Popen, sig: int) -> tuple[int, float, str, list[psutil.Process]]:
    """Send `sig`; the exit code, the seconds to the exit, the ending line, and the driver's children then."""
    children = psutil.Process(proc.pid).children(recursive=True)
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    rest = proc.stdout.read()
    code = proc.wait(timeout=120)
    line = next((ln[len("LINE "):] for ln in rest.splitlines() if ln.startswith("LINE ")), "")
    seconds = time.monotonic() - t0
    print(f"{signal.Signals(sig).name} to the driver's exit: {seconds:.1f} s")
    return code, seconds, line, children


def _statuses(recipe) -> list[str]:
    client = MlflowClient(recipe.tracking_uri)
    return [r.info.status for r in client.search_runs([e.experiment_id for e in client.search_experiments()])]


def _lease_gone(recipe) -> bool:
    return not os.path.exists(os.path.join(recipe.tracking.storage_path, recipe.tracking.run_name, LEASE_FILE))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_run_killed_as_an_interrupt_within_the_bound(tmp_path, sig, code):
    recipe = _recipe(tmp_path)
    proc, said = _driver(tmp_path, "opened")
    got, seconds, line, children = _ended(proc, sig)
    assert got == code and seconds < END_BOUND_S, (got, seconds)
    assert line == "interrupted before the first step; no checkpoint was written; run the same command to start again"
    run = MlflowClient(recipe.tracking_uri).get_run(said["RUN"])
    assert run.info.status == "KILLED" and run.data.tags["raytune.ended_by"] == "interrupt"
    assert _lease_gone(recipe) and children and not [p for p in children if p.is_running()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_signal_while_the_run_still_opens_ends_the_run_the_opener_opens(tmp_path):
    """The run ends while its opener's process is still importing MLflow to reopen an earlier attempt's run:
    the opener was terminated 2 s later, and a run it had created or reopened to RUNNING stayed RUNNING. Now
    the opener ends the run it opens, within the bound."""
    from raytune_ft.tracking.mlflow_run import RunEnd, end_run, start_run

    recipe = _recipe(tmp_path)
    end_run(recipe, start_run(recipe), RunEnd(status="KILLED"))   # an earlier attempt's: the opener reopens it
    proc, _ = _driver(tmp_path, "opening")
    got, seconds, line, children = _ended(proc, signal.SIGINT)
    assert got == 130 and seconds < END_BOUND_S, (got, seconds)
    assert line.startswith("interrupted before the first step")
    assert _statuses(recipe) == ["KILLED"]
    assert _lease_gone(recipe) and not [p for p in children if p.is_running()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tracking_store_that_does_not_answer_ends_within_the_bound(tmp_path, mlflow_server):
    """The tracking server stops answering (SIGSTOP to its process group) while the run opens: the ending
    does not wait for it past the bound, kills the opener and gives the lease back."""
    recipe = _recipe(tmp_path, f"tracking.tracking_uri={mlflow_server.uri}")
    os.killpg(mlflow_server.proc.pid, signal.SIGSTOP)
    try:
        proc, _ = _driver(tmp_path, "opening", f"tracking.tracking_uri={mlflow_server.uri}")
        time.sleep(3)           # the opener's call to the store is under way
        got, seconds, line, children = _ended(proc, signal.SIGTERM)
    finally:
        os.killpg(mlflow_server.proc.pid, signal.SIGCONT)
    assert got == 143 and seconds < END_BOUND_S, (got, seconds)
    assert line.startswith("interrupted")
    assert _lease_gone(recipe) and not [p for p in children if p.is_running()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ending_keeps_its_bound_with_the_tracking_server_and_the_object_store_both_stopped(
        tmp_path, mlflow_server, s3_server):
    """Issue 58 item 3: the run is open on a real `mlflow server`, its folder and lease on a real S3 server; both
    stop answering (SIGSTOP), then SIGTERM: every part of the ending (the MLflow end, the checkpoint's step, the
    opener's close, the lease, the run key) draws on one deadline, so the driver exits within END_BOUND_S + 1 s
    though each part alone would wait longer."""
    bucket = s3_server.bucket()
    sets = [f"tracking.tracking_uri={mlflow_server.uri}", f"tracking.storage_path=s3://{bucket}/runs"]
    proc, said = _driver(tmp_path, "opened", *sets, env=s3_server.env())
    assert said.get("RUN")
    os.killpg(mlflow_server.proc.pid, signal.SIGSTOP)
    os.killpg(s3_server.proc.pid, signal.SIGSTOP)
    try:
        got, seconds, line, children = _ended(proc, signal.SIGTERM)
    finally:
        os.killpg(s3_server.proc.pid, signal.SIGCONT)
        os.killpg(mlflow_server.proc.pid, signal.SIGCONT)
    assert got == 143 and seconds < END_BOUND_S + 1, (got, seconds)
    assert line.startswith("interrupted")
    assert not [p for p in children if p.is_running()]


def test_a_deadline_shares_its_bound_and_a_lease_is_given_back_once(tmp_path):
    """The ending's parts take what is left of one deadline; the lease's second release (the context manager's,
    after the ending's) neither waits nor touches storage."""
    from raytune_ft.channel import Deadline
    from raytune_ft.storage import fs as storage
    from raytune_ft.storage.lease import hold

    d = Deadline(0.3)
    assert 0.2 < d.left() <= 0.3 and d.left(0.1) == 0.1 and not d.passed
    time.sleep(0.35)
    assert d.left() == 0.0 and d.left(5) == 0.0 and d.passed
    st = storage.resolve(str(tmp_path / "runs"))
    lease = hold(st, st.root + "/run")
    path = os.path.join(tmp_path, "runs", "run", LEASE_FILE)
    assert os.path.exists(path)
    record = open(path).read()
    lease.release()
    assert not os.path.exists(os.path.dirname(path))     # the folder the lease made, empty: gone with it
    os.makedirs(os.path.dirname(path))
    open(path, "w").write(record)      # this job's own lease again: a second release must not touch it
    t0 = time.monotonic()
    lease.release()
    assert os.path.exists(path) and time.monotonic() - t0 < 0.05


def test_call_within_returns_raises_or_gives_up_within_its_bound():
    import threading

    from raytune_ft.channel import NoAnswer, call_within

    assert call_within(5, "sum", sum, [1, 2]) == 3
    with pytest.raises(ZeroDivisionError):
        call_within(5, "division", lambda: 1 / 0)
    hold, t0 = threading.Event(), time.monotonic()
    with pytest.raises(NoAnswer, match="hung call: no answer within 0.5 s"):
        call_within(0.5, "hung call", hold.wait)
    assert time.monotonic() - t0 < 2
    hold.set()


@pytest.mark.slow          # a real `mlflow server`
@pytest.mark.timeout(180)
def test_a_returned_runs_reads_of_a_store_that_does_not_answer_are_bounded(tmp_path, mlflow_server, capsys):
    """After fit, the driver reads the run's metrics back (train.save_final=false) and logs its plots: with
    the tracking server stopped (SIGSTOP), each gives up within its bound and says so; the summary goes on."""
    from raytune_ft.driver import run as run_module
    from raytune_ft.tracking.mlflow_run import mlflow_metric_name, start_run

    # the server is the session's: a run name of this test's own
    recipe = _recipe(tmp_path, f"tracking.tracking_uri={mlflow_server.uri}",
                     f"tracking.run_name=readback-{tmp_path.name}")
    run_id = start_run(recipe)
    MlflowClient(mlflow_server.uri).log_metric(run_id, mlflow_metric_name("loss"), 1.5, step=3)
    assert run_module._last_logged_metrics(recipe, run_id)["step"] == 3
    os.killpg(mlflow_server.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert run_module._last_logged_metrics(recipe, run_id, timeout_s=2) == {}
        seconds = time.monotonic() - t0
    finally:
        os.killpg(mlflow_server.proc.pid, signal.SIGCONT)
    assert seconds < 5, seconds
    assert "could not read the run's metrics back from MLflow: NoAnswer" in capsys.readouterr().out


@pytest.mark.slow          # two opener processes
@pytest.mark.timeout(120)
def test_a_return_finishes_the_run_and_an_error_fails_it(tmp_path):
    from raytune_ft.storage import fs as storage
    from raytune_ft.driver.endings import ending_line
    from raytune_ft.driver.lifecycle import RunLifecycle

    recipe = _recipe(tmp_path)
    client = MlflowClient(recipe.tracking_uri)
    with RunLifecycle(recipe, local=True) as life:
        life.hold_folder(*storage.run_storage(recipe))
        life.open_run()
        run_id = life.run_id()
        assert life.finish({"raytune.status": "trained"}, {"total_tokens": 10}, {"data.json": {"rows_read": 3}},
                           {"data.sources.0.rows_read": "3"})
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["total_tokens"] == 10
    assert run.data.params["data.sources.0.rows_read"] == "3"          # the data params, in the bounded ending
    assert _lease_gone(recipe)

    again = _recipe(tmp_path, "tracking.run_name=failing")
    with pytest.raises(RuntimeError) as caught, RunLifecycle(again, local=True) as life:
        life.hold_folder(*storage.run_storage(again))
        life.open_run()
        failing = life.run_id()
        raise RuntimeError("disk on fire")
    assert ending_line(caught.value).startswith("failed before the first step (RuntimeError: disk on fire)")
    run = MlflowClient(again.tracking_uri).get_run(failing)
    assert run.info.status == "FAILED" and run.data.tags["raytune.ended_by"] == "RuntimeError"
    assert _lease_gone(again)


def _local_job(tmp_path, overrides: list[str]) -> subprocess.Popen:
    """`python jobs/qwen27b_b300.py --local` as a user starts it in a terminal: its own process group (the
    terminal's Ctrl-C reaches the whole group), its own local Ray with its files in a short RAY_TMPDIR."""
    env = {**env_with_path(REPO), "RAY_TMPDIR": str(tmp_path / "ray"), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen([sys.executable, "jobs/qwen27b_b300.py", "--local", "--no-register",
                             *[f"--set={o}" for o in overrides]], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ctrl_c_on_a_local_job_says_one_line_and_the_same_command_resumes(tmp_path):
    """Issue 50 item 8: Ctrl-C (SIGINT to the job's process group, as a terminal sends it) once the step-3
    checkpoint is reported: one line and no traceback, exit code 130, the MLflow run KILLED with
    raytune.ended_by=interrupt, the lease given back; the same command then resumes from step 3 and finishes."""
    import shutil
    import tempfile
    from pathlib import Path

    short = Path(tempfile.mkdtemp(prefix="rtint", dir="/tmp"))   # Ray's AF_UNIX paths: <= 107 bytes
    try:
        _interrupt_and_resume(short)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _interrupt_and_resume(tmp_path) -> None:
    import re

    from raytune_ft.storage import fs as storage
    overrides = [f"tracking.storage_path={tmp_path / 'runs'}", f"tracking.run_name=lifecycle-{tmp_path.name}",
                 "train.max_steps=8", "train.checkpoint_every=3"]
    recipe = _recipe(tmp_path, *overrides[1:])
    folder = os.path.join(recipe.tracking.storage_path, recipe.tracking.run_name)
    proc = _local_job(tmp_path, overrides)
    out = []
    for line in proc.stdout:
        out.append(line)
        if re.search(r"checkpoint at step 3\b", line):
            break
    fs = storage.for_recipe(recipe).fs
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (storage.reported_checkpoints(fs, folder) or None):
        time.sleep(0.2)
    assert storage.reported_checkpoints(fs, folder), "".join(out)[-4000:]
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out.append(proc.stdout.read())
    code, seconds = proc.wait(timeout=120), time.monotonic() - t0
    print(f"Ctrl-C to the local job's exit: {seconds:.1f} s")
    console = "".join(out)
    said = [ln for ln in console.splitlines() if ln.startswith("[raytune_ft] interrupted")]
    assert code == 130 and seconds < END_BOUND_S + 10, (code, seconds, console[-4000:])
    assert "Traceback" not in console, console[-4000:]
    assert len(said) == 1 and re.fullmatch(r"\[raytune_ft\] interrupted at step \d+; the checkpoint at step 3 is "
                                           r"kept; run the same command to resume", said[0]), console[-4000:]
    client = MlflowClient(recipe.tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "KILLED" and run.data.tags["raytune.ended_by"] == "interrupt"
    assert _lease_gone(recipe)

    again = _local_job(tmp_path, overrides)
    console = again.stdout.read()
    assert again.wait(timeout=900) == 0, console[-4000:]
    summary = json.load(open(os.path.join(folder, "summary.json")))
    assert summary["steps"] == 8 and summary["mlflow_run_id"] == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    # resumed from the step-3 checkpoint: steps 1-3 trained once, every step logged
    assert [steps.count(s) for s in (1, 2, 3)] == [1, 1, 1] and set(steps) == set(range(1, 9)), steps
