"""The way users start work: `ray start --head`, then `ray job submit -- python jobs/qwen27b_b300.py --local`.

A real Ray head (with its dashboard and job server, token authentication on) on loopback, a real
job submission; the job must join that cluster rather than start its own Ray, train, and register. It logs to
the session's real `mlflow server`, named as http://user:password@host (a server behind basic auth; this one
does not check it), as a cluster's jobs log to a shared server: the password shows in neither the job's
output, summary.json, the run's params and tags, the registered model, nor the checkpoints.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_kit import stop_ray_head
from tests.conftest import REPO, actors_started_since, grep_files
from tests.mlflow_server import free_port

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    temp = tmp_path_factory.mktemp("rayhead")
    gcs, dash, agent, agent_grpc, metrics, renv = (free_port() for _ in range(6))
    # the cluster's processes (and so the job's `python`) use this virtualenv, as on a user's node. With
    # RAY_AUTH_MODE=token `ray start` needs a token and makes none (on a fresh machine the README's `ray
    # get-auth-token --generate` does, in ~/.ray): the head's own, in a file of its own
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    # PYTHONDONTWRITEBYTECODE: as container images often set it (the job keeps its own bytecode, below)
    # RAY_JOB_STOP_WAIT_TIME_S is left at Ray's default (3 s from SIGTERM to SIGKILL): the ending must fit it
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), PYTHONDONTWRITEBYTECODE="1",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_JOB_STOP_WAIT_TIME_S", None)
    start = subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=8", "--disable-usage-stats",
         # the job agent's default port (52365) may be held by another Ray on the machine
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={renv}",
         f"--temp-dir={temp}"],
        env=env, capture_output=True, text=True, timeout=180)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        yield f"http://127.0.0.1:{dash}", env, temp
    finally:
        alive = stop_ray_head(temp)     # this head's processes only
        assert not alive, f"head processes still alive: {[p.pid for p in alive]}"


@pytest.mark.timeout(600)
def test_ray_job_submit_runs_the_local_job_on_the_cluster(ray_head, mlflow_server, tmp_path):
    address, env, temp = ray_head
    storage = tmp_path / "runs"
    password = f"pw-{secrets.token_hex(12)}"
    server = mlflow_server              # the session's server (tests/conftest.py)
    tracking = server.uri.replace("http://", f"http://ci-user:{password}@")
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO),
           "--", "python", "jobs/qwen27b_b300.py", "--local", f"--set=tracking.storage_path={storage}",
           f"--set=tracking.tracking_uri={tracking}",
           "--set=train.max_steps=6", "--set=train.checkpoint_every=3",
           # the cluster writes no bytecode; "on", since this venv's torch has its own (where the install
           # shipped none, "auto" does the same)
           f"--set=train.cache_dir={tmp_path / 'cache'}", "--set=train.bytecode_cache=on"]
    for _ in range(12):  # the head's job agent can take a while to come up on a loaded host
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580)
        log = out.stdout + out.stderr
        if "No available agent to submit job" not in log:
            break
        time.sleep(10)
    assert out.returncode == 0, log[-4000:]
    assert "succeeded" in log
    # it joined the running cluster instead of starting a local Ray of its own
    assert "Started a local Ray instance" not in log
    summary = json.loads((storage / "qwen27b-local" / "summary.json").read_text())
    assert summary["status"] == "registered"
    assert summary["steps"] == 6
    assert summary["registered_name"] == "main.default.qwen27b_local"
    assert "registered       main.default.qwen27b_local version 1" in log
    # the start-up breakdown counts from Ray's acceptance of the submission: its first part is the wait for
    # Ray's job supervisor, the working directory and the job's process; the parts still add up to the phase
    startup = summary["startup"]
    assert startup["ray_workers.submission_s"] > 0, startup
    ray_parts = [v for k, v in startup.items() if k.startswith("ray_workers.")]
    assert sum(ray_parts) == pytest.approx(startup["ray_workers_s"], abs=0.05)
    assert "job submission" in log
    # rank 0 logged every step to the job's MLflow run, whether the run was open when the trainer started or
    # its id came later through Ray's key-value store (tracking.RunIdHandoff)
    from mlflow import MlflowClient

    client = MlflowClient(server.uri)                # on the server: the job logged there
    assert [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "train/loss")] == [1, 2, 3, 4, 5, 6]
    # the password: in no line of the job's output, the summary, the run's params and tags, the server's store
    # and artifacts (the registered model), the checkpoints; the URI shows with it masked
    run = client.get_run(summary["mlflow_run_id"])
    public = f"http://ci-user:***@127.0.0.1:{server.port}"
    # (Ray's job supervisor echoes the entrypoint as submitted, the user's own command line, --set included:
    # that one line of Ray's; every line the job printed must be clean)
    shown = [line for line in log.splitlines() if password in line]
    assert [line for line in shown if not line.startswith("Running entrypoint for job ")] == [], shown
    assert public in log                                                       # the summary names the store
    assert summary["tracking_uri"] == public and run.data.params["tracking.tracking_uri"] == public
    assert not [s for s in (*run.data.params.values(), *run.data.tags.values()) if password in s]
    hits, n = grep_files({"password": password.encode()}, storage, server.root)
    assert hits == [] and n > 20
    assert list((storage / "qwen27b-local").glob("checkpoint_*/dcp"))
    # the training worker, a process of the cluster's (which writes no bytecode), kept the modules only it
    # imports in the job's bytecode folder: from the job's uploaded copy of the project, and from torch
    bytecode = tmp_path / "cache" / "bytecode"
    assert list(bytecode.rglob("raytune_ft/train/fsdp_model.*.pyc")), "the worker's modules were not kept"
    assert list(bytecode.rglob("torch/distributed/fsdp/_fully_shard/_fully_shard.*.pyc"))
    # and rank 0 put that folder in the storage after the first step, for a node whose folder is empty
    import tarfile

    (bytecode_set,) = (storage / "jit_cache" / "bytecode").glob("bytecode-*.tar")
    assert bytecode_set.with_suffix(".json").is_file()
    with tarfile.open(bytecode_set) as tar:
        assert any("raytune_ft/train/fsdp_model." in n for n in tar.getnames())
    # a cluster's Ray has a dashboard, so Ray Train's placement-group cleaner can ask whether the controller
    # lives: it is kept (a job's own local Ray, without one, starts none: launch.without_blind_callbacks)
    (session,) = temp.glob("session_2*")
    actors = actors_started_since(0, session)
    assert "PlacementGroupCleaner" in actors, actors
    # a fresh node: another job on an empty cache folder and the same storage unpacks that set in its driver,
    # before the driver's imports, and trains
    fresh = [c.replace(str(tmp_path / "cache"), str(tmp_path / "fresh_cache")) for c in cmd]
    fresh[fresh.index("--set=train.max_steps=6")] = "--set=tracking.run_name=fresh-node"
    fresh += ["--set=train.max_steps=2", "--no-register"]
    out = subprocess.run(fresh, env=env, capture_output=True, text=True, timeout=580)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "Bytecode cache: restored" in log, log[-4000:]
    assert list((tmp_path / "fresh_cache" / "bytecode").rglob("raytune_ft/train/fsdp_model.*.pyc"))


def test_submit_without_token_is_refused(ray_head):
    """Token authentication stays on: a client without the token cannot list jobs."""
    address, env, _ = ray_head
    bare = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    bare["HOME"] = "/nonexistent-home"  # no ~/.ray/auth_token to fall back on
    bare["RAY_AUTH_MODE"] = "token"
    out = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=bare,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0


def _ray_job(env, *args, timeout=580) -> str:
    out = subprocess.run([str(BIN / "ray"), "job", *args], env=env, capture_output=True, text=True, timeout=timeout)
    return out.stdout + out.stderr


@pytest.mark.timeout(1200)
def test_ray_job_stop_says_one_line_ends_the_run_killed_and_the_same_submit_resumes(ray_head, tmp_path):
    """Issue 50 item 8: `ray job stop` (SIGTERM to the job's driver and its children) once the step-3 checkpoint
    is reported: the job's log ends with one line and no traceback, the MLflow run is KILLED with
    raytune.ended_by=interrupt, the lease is given back; the same submit resumes and finishes."""
    import re

    from mlflow import MlflowClient

    from raytune_ft.storage import fs as storage_mod
    from raytune_ft.cli import _job_recipe
    from raytune_ft.storage.lease import LEASE_FILE

    address, env, _ = ray_head
    sets = [f"tracking.storage_path={tmp_path / 'runs'}", "train.max_steps=8", "train.checkpoint_every=3",
            f"train.cache_dir={tmp_path / 'cache'}", "train.bytecode_cache=on"]
    entry = ["--", "python", "jobs/qwen27b_b300.py", "--local", "--no-register", *[f"--set={s}" for s in sets]]
    recipe = _job_recipe("qwen27b_b300", True, sets)
    folder = os.path.join(recipe.tracking.storage_path, recipe.tracking.run_name)
    for _ in range(12):  # the head's job agent can take a while to come up on a loaded host
        said = _ray_job(env, "submit", "--address", address, "--working-dir", str(REPO), "--no-wait", *entry)
        if "No available agent to submit job" not in said:
            break
        time.sleep(10)
    job = re.search(r"raysubmit_\w+", said)
    assert job, said
    fs = storage_mod.for_recipe(recipe).fs
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not storage_mod.reported_checkpoints(fs, folder):
        time.sleep(1)
    assert storage_mod.reported_checkpoints(fs, folder), _ray_job(env, "logs", "--address", address, job[0])[-4000:]
    _ray_job(env, "stop", "--address", address, job[0])
    log = _ray_job(env, "logs", "--address", address, job[0])
    assert "stopped" in _ray_job(env, "status", "--address", address, job[0]).lower()
    said = [ln for ln in log.splitlines() if ln.startswith("[raytune_ft] interrupted")]
    assert len(said) == 1 and re.fullmatch(r"\[raytune_ft\] interrupted at step \d+; the checkpoint at step \d+ is "
                                           r"kept; run the same command to resume", said[0]), log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    client = MlflowClient(recipe.tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "KILLED" and run.data.tags["raytune.ended_by"] == "interrupt"
    assert not os.path.exists(os.path.join(folder, LEASE_FILE))
    again = _ray_job(env, "submit", "--address", address, "--working-dir", str(REPO), *entry)
    assert "succeeded" in again, again[-4000:]
    summary = json.loads(open(os.path.join(folder, "summary.json")).read())
    assert summary["steps"] == 8 and summary["mlflow_run_id"] == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
