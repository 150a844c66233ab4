"""raytune_ft.storage.fs and the per-rank DCP reader against a real S3 server (SeaweedFS on loopback) and local folders."""
from __future__ import annotations

import errno
import json
import os

import pytest

from raytune_ft.storage import fs as storage
from raytune_ft.planning.disk import storage_plan


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path, monkeypatch):
    """A fresh storage root, once on a local folder and once in a bucket of the S3 server."""
    if request.param == "local":
        return storage.resolve(str(tmp_path / "runs"), create=True)
    server = request.getfixturevalue("s3_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return storage.resolve(f"s3://{server.bucket()}/team/runs", create=True)


def test_s3_from_the_standard_aws_environment(s3_env):
    # the keys come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, the endpoint from AWS_ENDPOINT_URL
    st = storage.resolve(f"s3://{s3_env.bucket()}/prefix")
    assert st.remote and st.root.endswith("/prefix") and st.uri() == f"s3://{st.root}"
    storage.write_json(st.fs, st.path("run", "a.json"), {"x": 1})
    assert storage.read_json(st.fs, st.path("run", "a.json")) == {"x": 1}
    assert storage.read_json(st.fs, st.path("run", "missing.json"), default={}) == {}
    # the filesystem handed to Ray workers carries no key: each node's SDK reads its own environment
    args = st.fs.__reduce__()[1][0]
    assert args["access_key"] is None and args["secret_key"] is None
    assert args["endpoint_override"] == s3_env.endpoint.split("://")[1] and args["scheme"] == "http"
    # a wrong secret is refused by the server
    os.environ["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    with pytest.raises(OSError, match="ACCESS_DENIED|SIGNATURE"):
        storage.read_json(storage.resolve(st.uri()).fs, st.path("run", "a.json"))


def test_resolve_local_and_bad_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    st = storage.resolve("./runs", create=True)
    assert not st.remote and st.root == str(tmp_path / "runs") and os.path.isdir(st.root)
    assert st.path("r", "checkpoint_x") == str(tmp_path / "runs" / "r" / "checkpoint_x")
    assert storage.resolve("file://" + str(tmp_path)).root == str(tmp_path)
    with pytest.raises(ValueError, match="only local paths and s3"):
        storage.resolve("gs://bucket/x")
    with pytest.raises(ValueError, match="no bucket"):
        storage.resolve("s3:///x")


def test_small_files_sizes_and_download(where, tmp_path):
    fs = where.fs
    run = where.path("run1")
    storage.write_text(fs, f"{run}/a/b.txt", "hello")
    storage.write_bytes(fs, f"{run}/a/c.bin", b"\0" * 1000)
    storage.write_json(fs, f"{run}/meta.json", {"step": 3})
    assert storage.read_text(fs, f"{run}/a/b.txt") == "hello"
    assert storage.tree_bytes(fs, run) == 5 + 1000 + len(storage.read_bytes(fs, f"{run}/meta.json"))
    assert storage.tree_bytes(fs, where.path("nothing")) == 0
    got = storage.download(fs, f"{run}/a", str(tmp_path / "dl"), only=lambda rel: rel.endswith(".txt"))
    assert got == ["b.txt"] and (tmp_path / "dl" / "b.txt").read_text() == "hello"
    assert not (tmp_path / "dl" / "c.bin").exists()


def _snapshot(names: list[str], latest: str | None) -> str:
    """A checkpoint manager snapshot in Ray Train's own schema (its pydantic model writes it)."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState,
        _TrainingResultState,
    )

    results = [_TrainingResultState(checkpoint_dir_name=n, metrics={"step": i}) for i, n in enumerate(names)]
    return _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(names))),
        latest_checkpoint_result=_TrainingResultState(checkpoint_dir_name=latest, metrics={}) if latest else None,
        pending_training_results=[], pending_validation_specs=[], current_report_index=len(names),
        validated_checkpoint_dir_names=[], timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[]).model_dump_json()


def test_orphan_checkpoints_removed_reported_ones_kept(where):
    fs, run = where.fs, where.path("run2")
    names = [f"checkpoint_2026-11-30_10-00-0{i}.000000" for i in range(5)]
    for n in names:
        storage.write_bytes(fs, f"{run}/{n}/dcp/__0_0.distcp", b"x" * 100)
    storage.write_bytes(fs, f"{run}/{names[2]}.merged_hf/config.json", b"{}")   # not Ray's: left alone
    # no snapshot yet: Ray never registered any of them, a restart starts from scratch
    assert storage.orphan_checkpoints(fs, run) == names
    # Ray kept 1 and 3 (keep_checkpoints=2), 3 the latest; 0 was deleted... and 2, 4 were never reported
    storage.write_text(fs, f"{run}/{storage.SNAPSHOT_FILE}", _snapshot([names[1], names[3]], names[3]))
    rep = storage.reported_checkpoints(fs, run)
    assert rep.kept == [names[1], names[3]] and rep.latest == names[3]
    assert storage.orphan_checkpoints(fs, run) == [names[0], names[2], names[4]]
    logged = []
    assert storage.remove_orphans(fs, run, log=logged.append) == [names[0], names[2], names[4]]
    assert storage.checkpoint_dirs(fs, run) == [names[1], names[3]]
    assert storage.exists(fs, f"{run}/{names[2]}.merged_hf/config.json")
    assert len(logged) == 3 and "never reported" in logged[0]
    assert storage.latest_checkpoint_bytes(fs, run) == 100
    assert storage.remove_orphans(fs, run) == []
    # a folder named in protect (the one an attempt resumes from) is never removed, whatever the record says
    storage.write_bytes(fs, f"{run}/{names[4]}/dcp/__0_0.distcp", b"x")
    assert storage.remove_orphans(fs, run, protect=[names[4]]) == []
    assert storage.checkpoint_dirs(fs, run) == [names[1], names[3], names[4]]


def test_ray_record_caught_mid_rewrite_is_read_again_and_a_torn_one_removes_nothing(tmp_path, monkeypatch):
    """Ray's controller rewrites its checkpoint record in place (open, write), so a worker reading it at that
    moment saw an empty file: the final save's room check failed a whole run with a JSONDecodeError."""
    import threading

    where = storage.resolve(str(tmp_path / "runs"), create=True)
    fs, run = where.fs, where.path("run3")
    names = [f"checkpoint_2026-11-30_10-00-0{i}.000000" for i in range(2)]
    for n in names:
        storage.write_bytes(fs, f"{run}/{n}/dcp/__0_0.distcp", b"x" * 100)
    record = f"{run}/{storage.SNAPSHOT_FILE}"
    with open(record, "w"):
        pass                                           # truncated, the rewrite not yet written
    later = threading.Timer(0.3, lambda: open(record, "w").write(_snapshot([names[1]], names[1])))
    later.start()
    rep = storage.reported_checkpoints(fs, run)
    later.join()
    assert rep.latest == names[1] and rep.kept == [names[1]]
    # a record that stays torn is an error of its own, never "no checkpoint registered"
    with open(record, "w") as f:
        f.write('{"checkpoint_results": [')
    monkeypatch.setattr(storage, "SNAPSHOT_WAIT_S", 0.2)
    with pytest.raises(storage.TornRecordError, match="did not parse"):
        storage.reported_checkpoints(fs, run)
    logged = []
    assert storage.orphan_checkpoints(fs, run, log=logged.append) == []       # nothing deleted on a torn read
    assert storage.checkpoint_dirs(fs, run) == names and "unreadable" in logged[0]


def test_room_check_and_disk_full_wording(where):
    free = storage.free_bytes(where)
    if where.remote:
        assert free is None                     # an object store cannot say
        assert storage.check_room(where, 10**15) is None
        return
    assert free and free > 0
    assert storage.check_room(where, 1000) == free
    # a filesystem too small for the next checkpoint (the free-space probe is patched: no tiny disk here)
    with pytest.raises(storage.StorageFullError) as e:
        storage.check_room(where, 5_000_000_000, path=where.path("run"), free_probe=lambda st, p: 1_000_000)
    msg = str(e.value)
    assert where.path("run") in msg and "5,000,000,000 bytes" in msg and "1,000,000 bytes" in msg
    assert "last good checkpoint is kept" in msg
    # a round trip through pickle (Ray ships worker errors to the driver that way)
    import pickle
    assert str(pickle.loads(pickle.dumps(e.value))) == msg


@pytest.mark.parametrize("exc,full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), True),
    (OSError("When uploading part: AWS Error ... QuotaExceeded"), True),
    (RuntimeError("some other failure"), False),
    (ValueError("bad value"), False),
])
def test_disk_full_errors_are_reported_in_plain_words(exc, full):
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = exc
    err = storage.disk_full_error(wrapped, "/mnt/shared/runs/r", needed=2_000, free=10)
    assert (err is not None) == full
    if full:
        assert isinstance(err, storage.StorageFullError)
        assert "storage /mnt/shared/runs/r is full" in str(err) and "2,000 bytes" in str(err)


def _recipe(job: str, *sets: str):
    import importlib.util

    from raytune_ft.cli import resolve
    from tests.conftest import REPO

    spec = importlib.util.spec_from_file_location(f"job_{job}", REPO / "jobs" / f"{job}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return resolve(mod.recipe, mod.local, local=False, overrides=list(sets))


def test_storage_plan_27b():
    plan = storage_plan(_recipe("qwen27b_b300"))
    P = plan.params
    assert 26e9 < P < 28e9
    # fp32 master weights + AdamW's two fp32 moments: 12 bytes a parameter, ~323 GB (no gradients are saved)
    assert plan.checkpoint_bytes == pytest.approx(12 * P, rel=1e-3)
    assert 3.1e11 < plan.checkpoint_bytes < 3.4e11
    assert plan.final_extra_bytes == 2 * P                       # bf16 Hugging Face export, ~54 GB
    assert plan.keep == 2 and plan.peak_bytes == 3 * plan.checkpoint_bytes + 2 * P
    text = "\n".join(plan.lines())
    assert "per checkpoint 322.8 GB" in text and "final export 53.8 GB" in text and "peak 1.0 TB" in text


def test_storage_plan_trl_recipes():
    full = storage_plan(_recipe("qwen3_4b_full"))
    assert full.loop == "trl" and full.final_extra_bytes == 0
    # bf16 weights in hf/ + two bf16 AdamW states in trainer/optimizer.pt
    assert full.checkpoint_bytes == pytest.approx(6 * full.params, rel=1e-2)
    lora = storage_plan(_recipe("qwen2_05b_lora"))
    assert 0 < lora.trainable < lora.params / 10 and lora.checkpoint_bytes < lora.params
    assert lora.final_extra_bytes == 2 * lora.params               # the merged export


# ---------------------------------------------------------------- DCP: each rank reads its own files


def _dcp_worker(rank: int, world: int, port: int, local_dir: str, s3_dir: str, out: str) -> None:
    from tests.conftest import spawned_gloo_rank

    with spawned_gloo_rank(rank, world, port):
        _dcp_rank(rank, local_dir, s3_dir, out)


def _dcp_rank(rank: int, local_dir: str, s3_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from raytune_ft.train import checkpoint as ckpt_io
    from raytune_ft.train import dcp_io
    from raytune_ft.train.state import TrainState

    torch.manual_seed(0)

    def build():
        m = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64))
        m.register_buffer("scale", torch.ones(8))        # a replicated buffer: DCP would de-duplicate it
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def train(m, opt, steps):
        for _ in range(steps):
            m(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, 3)
    saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
    saving = TrainState(model, opt)
    saving.schedule.step, saving.data.blocks_consumed = 3, rank
    ckpt_io.save_train_checkpoint(os.path.join(local_dir, "per_rank"), saving, rank)
    import torch.distributed.checkpoint as dcp
    dcp.save({"app": dcp_io._LegacyTrainState(saving.sharded, rank)},
             checkpoint_id=os.path.join(local_dir, "legacy", "dcp"))
    dist.barrier()
    st = storage.resolve(s3_dir)
    if rank == 0:                   # the upload Ray does after a report
        for name in ("per_rank", "legacy"):
            storage.upload(os.path.join(local_dir, name), st.fs, st.path(name))
    dist.barrier()

    fresh, fresh_opt = build()
    opened: list[str] = []      # what the FSDP2 loop's resume calls, reading from S3
    loading = TrainState(fresh, fresh_opt)
    ckpt_io.load_train_checkpoint(st.path("per_rank"), loading, rank, fs=st.fs, reads=opened)
    train_state = loading.state_dict()
    loaded = {k: v.full_tensor() for k, v in fresh.state_dict().items() if hasattr(v, "full_tensor")}
    same_weights = all(torch.equal(saved[k], loaded[k]) for k in saved)
    steps = sorted({float(s["step"]) for s in fresh_opt.state_dict()["state"].values()})
    # one more step from the loaded state equals one more step from the original
    torch.manual_seed(123 + rank)
    train(model, opt, 1)
    torch.manual_seed(123 + rank)
    train(fresh, fresh_opt, 1)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    same_after_step = all(torch.equal(full(a), full(b))
                          for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    legacy_model, legacy_opt = build()
    legacy_opened = dcp_io.load(st.fs, st.path("legacy"), TrainState(legacy_model, legacy_opt).sharded, rank)
    n_params = sum(p.numel() for p in model.parameters())  # DTensors: the global count
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"opened": opened, "legacy_opened": legacy_opened, "same_weights": same_weights,
                   "train_state": train_state,
                   "steps": steps, "same_after_step": same_after_step, "params_local": n_params}, f)


@pytest.mark.timeout(300)
def test_dcp_resume_reads_only_own_shards_from_s3(s3_env, tmp_path):
    import torch.multiprocessing as mp

    from tests.mlflow_server import free_port

    port = free_port()
    s3_dir = f"s3://{s3_env.bucket()}/dcp-test"
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_dcp_worker, args=(2, port, str(tmp_path / "local"), s3_dir, str(out)), nprocs=2, join=True)
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(res):
        files = sorted({"/".join(p.rsplit("/", 2)[-2:]) for p in r["opened"]})
        # the metadata, this rank's own shard file and train state, nothing of the other rank
        assert files == ["dcp/.metadata", f"dcp/__{rank}_0.distcp", f"train_state/rank{rank}.json"], r["opened"]
        assert r["train_state"]["step"] == 3 and r["train_state"]["blocks_consumed"] == rank
        assert all(p.startswith(storage.resolve(s3_dir).path("per_rank")) for p in r["opened"])
        assert r["same_weights"] and r["same_after_step"] and r["steps"] == [3.0]
    # what the per-rank layout avoids: DCP's de-duplication of replicated entries spreads them over
    # the ranks' files, so with a plain save some rank reads the other's shard file
    crossed = [rank for rank, r in enumerate(res)
               if any(p.endswith(".distcp") and f"__{rank}_" not in p for p in r["legacy_opened"])]
    assert crossed, [r["legacy_opened"] for r in res]
    # the plan's 12 bytes a parameter (fp32 weights + two AdamW moments) is what DCP writes
    st = storage.resolve(s3_dir)
    shard_bytes = sum(i.size for i in storage.list_files(st.fs, st.path("per_rank", "dcp"))
                      if i.base_name.endswith(".distcp"))
    from torch.distributed.checkpoint import FileSystemReader

    entries = len(FileSystemReader(str(tmp_path / "local" / "per_rank" / "dcp")).read_metadata().storage_data)
    params = res[0]["params_local"]
    # plus torch.save's framing of each entry (about 1.5 kB), which a model of billions of parameters never sees
    assert 12 * params <= shard_bytes <= 12 * params + 2048 * entries, (shard_bytes, params, entries)


def test_plan_command_and_dry_run_print_the_storage_plan(capsys):
    from raytune_ft import cli
    assert cli.main(["plan", "qwen27b_b300"]) == 0
    out = capsys.readouterr().out
    assert "storage      per checkpoint 322.8 GB" in out and "peak 1.0 TB" in out and "final export 53.8 GB" in out
    assert cli.main(["run", "qwen27b_b300", "--dry-run"]) == 0
    assert "storage      per checkpoint 322.8 GB" in capsys.readouterr().out


@pytest.mark.parametrize("exc,limit", [
    (OSError(errno.EFBIG, "File too large"), "maximum file size"),
    (OSError("When completing multiple part upload for key 'r/checkpoint_x/dcp/__0_0.distcp': AWS Error "
             "UNKNOWN (HTTP status 400) during CompleteMultipartUpload operation: EntityTooLarge: Your "
             "proposed upload exceeds the maximum allowed object size."), "largest object"),
])
def test_a_file_too_large_is_not_called_storage_full(exc, limit):
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = exc
    assert not storage.is_disk_full(wrapped)
    assert storage.disk_full_error(wrapped, "s3://b/runs/r", needed=2_000, free=None) is None
    err = storage.too_large_error(wrapped, "s3://b/runs/r", what="the step-4 checkpoint")
    assert isinstance(err, storage.FileTooLargeError)
    msg = str(err)
    assert "is full" not in msg and "too large" in msg and limit in msg and "s3://b/runs/r" in msg, msg
    import pickle
    assert str(pickle.loads(pickle.dumps(err))) == msg
    assert storage.too_large_error(OSError(errno.ENOSPC, "No space left on device"), "/x") is None


def test_runs_command_lists_runs_on_s3(s3_env, capsys):
    from dataclasses import asdict

    from raytune_ft import cli
    from raytune_ft.driver.run import RunSummary

    root = f"s3://{s3_env.bucket()}/team/runs"
    st = storage.resolve(root)
    done = RunSummary(job="qwen27b_b300", run_name="on-s3", status="registered", steps=12, final_loss=2.5,
                      registered_name="main.default.m", registered_version="3")
    storage.write_json(st.fs, st.path("on-s3", "summary.json"), asdict(done))
    storage.write_bytes(st.fs, st.path("not-a-run", "notes.txt"), b"x")
    assert cli.main(["runs", "--storage", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_name"] for r in rows] == ["on-s3"], rows
    assert rows[0]["path"] == f"{root}/on-s3" and rows[0]["steps"] == 12 and rows[0]["time"] > 0
    assert cli.main(["runs", "--storage", root]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "on-s3" in line and "main.default.m v3" in line and "2.5000" in line
    # a run still training on S3 has neither summary nor MLflow store there: its lease says who runs it
    from raytune_ft.storage import lease
    with lease.hold(st, st.path("in-flight"), settle_s=0) as held:
        assert cli.main(["runs", "--storage", root, "--json"]) == 0
    rows = {r["run_name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["in-flight"]["status"].startswith(f"running: {held.record.owner()}"), rows
    assert rows["in-flight"]["path"] == f"{root}/in-flight"


def test_a_run_folder_has_one_owner_at_a_time(where, monkeypatch):
    import socket
    import subprocess
    import time

    from raytune_ft.storage import lease
    run = where.path("leased")
    # the driver of `ray job submit` gets its submission id from Ray in this variable
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_A1"}}))
    a = lease.Lease.acquire(where, run, settle_s=0)
    rec = lease.read(where.fs, run)
    assert (rec.token, rec.pid, rec.host, rec.job_id) == (a.token, os.getpid(), socket.gethostname(), "raysubmit_A1")
    # a second job on a live lease stops at once, naming the owner and how to get past it
    with pytest.raises(lease.RunFolderInUse) as e:
        lease.Lease.acquire(where, run, settle_s=0)
    msg = str(e.value)
    assert where.uri(run) in msg and f"job raysubmit_A1 on host {rec.host} (pid {rec.pid})" in msg, msg
    assert "ray job stop raysubmit_A1" in msg and "tracking.run_name" in msg and lease.STALE_ENV in msg
    # the driver's heartbeat thread refreshes it
    a.start(every_s=0.05)
    deadline = time.time() + 10
    while lease.read(where.fs, run).heartbeat == rec.heartbeat and time.time() < deadline:
        time.sleep(0.05)
    assert lease.read(where.fs, run).heartbeat > rec.heartbeat
    a._stop.set()
    a._thread.join()
    # a heartbeat older than stale_s: the lease is taken over; the old owner's workers then stop at their
    # next start, its heartbeat writes nothing more and its release leaves the new owner's lease alone
    a.record.heartbeat = time.time() - 1000
    a._write()
    logged = []
    b = lease.Lease.acquire(where, run, stale_s=300, settle_s=0, log=logged.append)
    assert "taking over" in logged[0] and "heartbeat is 1000 s old" in logged[0], logged
    assert not a.beat() and a.lost_to.token == b.token
    with pytest.raises(lease.RunFolderInUse, match="not by this job"):
        lease.check_owner(where.fs, run, a.token)
    lease.check_owner(where.fs, run, b.token)
    lease.check_owner(where.fs, run, None)                # a trainer built without a lease checks nothing
    a.release()
    assert lease.read(where.fs, run).token == b.token
    b.release()
    assert lease.read(where.fs, run) is None and not storage.exists(where.fs, f"{run}/{lease.LEASE_FILE}")
    # a process started by hand (no Ray job): named by its pid and host
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    with lease.hold(where, run, settle_s=0):
        with pytest.raises(lease.RunFolderInUse, match=f"in use by process {os.getpid()} on host .*kill {os.getpid()}"):
            lease.Lease.acquire(where, run, settle_s=0)
    # an owner whose process is gone from this host: taken over at once, whatever the heartbeat says
    gone = subprocess.Popen(["true"])
    gone.wait()
    c = lease.Lease.acquire(where, run, settle_s=0)
    c.record.pid = gone.pid
    c._write()
    with lease.hold(where, run, settle_s=0) as d:
        assert lease.read(where.fs, run).token == d.token
    assert lease.read(where.fs, run) is None


def test_a_job_on_a_run_folder_another_job_holds_exits_2_before_ray_starts(tmp_path, capsys):
    import ray

    from raytune_ft import cli

    from raytune_ft.storage import lease
    from raytune_ft.console import quiet_env
    from raytune_ft.env import scoped_env

    st = storage.resolve(str(tmp_path / "runs"), create=True)
    with lease.hold(st, st.path("qwen27b-local"), settle_s=0) as other, scoped_env(keep=tuple(quiet_env(False))):
        code = cli.main(["run", "qwen27b_b300", "--local", f"--set=tracking.storage_path={st.root}"])
        assert lease.read(st.fs, st.path("qwen27b-local")).token == other.token
    assert code == 2 and not ray.is_initialized()
    err = capsys.readouterr().err
    assert err.startswith(f"error: run folder {st.path('qwen27b-local')} is in use by process {os.getpid()}"), err
    assert "Traceback" not in err


def test_the_attempt_start_room_check_asks_only_for_a_save_the_attempt_will_make():
    """An 8-step speed run (checkpoint_every 1000, no final save) writes nothing: no room check may refuse it.
    Where the run ends before the next periodic checkpoint, the final one (with its export) is the one checked."""
    from types import SimpleNamespace

    from raytune_ft.train.ckpt_storage import SaveGuard

    asked = []
    guard = SaveGuard.__new__(SaveGuard)     # no run storage needed: only which save gets checked is asserted
    guard.check = lambda step, final=False: asked.append((step, final))
    guard.check_first(0, SimpleNamespace(checkpoint_every=1000, max_steps=8, save_final=False))
    assert asked == []
    guard.check_first(0, SimpleNamespace(checkpoint_every=1000, max_steps=8, save_final=True))
    assert asked == [(8, True)]
    guard.check_first(100, SimpleNamespace(checkpoint_every=50, max_steps=0, save_final=True))
    guard.check_first(100, SimpleNamespace(checkpoint_every=50, max_steps=1000, save_final=False))
    assert asked[1:] == [(150, False), (150, False)]


@pytest.mark.timeout(60)
def test_a_lease_being_refreshed_is_never_read_half_written(tmp_path):
    """The heartbeat rewrites the lease file every few seconds; a second job reading it mid-write must see
    the owner, never nothing (a torn read looked like a free run folder, and a flaky test showed it)."""
    import threading
    import time

    from raytune_ft.storage import lease
    st = storage.resolve(str(tmp_path / "runs"), create=True)
    run = st.path("leased")
    held = lease.Lease.acquire(st, run, settle_s=0)
    stop, empty = threading.Event(), []

    def beat():
        while not stop.is_set():
            held.beat()

    writer = threading.Thread(target=beat, daemon=True)
    writer.start()
    deadline = time.time() + 3
    reads = 0
    while time.time() < deadline:
        reads += 1
        if lease.read(st.fs, run) is None:
            empty.append(reads)
    stop.set()
    writer.join(timeout=5)
    assert reads > 100 and not empty, f"{len(empty)} of {reads} reads found no lease"


@pytest.mark.timeout(120)
def test_giving_the_lease_back_to_object_storage_that_does_not_answer_is_bounded(s3_env, capsys):
    """The S3 server stopped (SIGSTOP to its process group) as the job ends: the release gives up within
    lease.RELEASE_S and says so (the file goes stale and is taken over); with the server back, it goes."""
    import signal
    import time

    from raytune_ft.storage import lease
    st = storage.resolve(f"s3://{s3_env.bucket()}/team/runs", create=True)
    held = lease.hold(st, st.path("hung"), settle_s=0)
    os.killpg(s3_env.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        held.release()
        seconds = time.monotonic() - t0
    finally:
        os.killpg(s3_env.proc.pid, signal.SIGCONT)
    assert seconds < lease.RELEASE_S + 1.5, seconds
    assert "could not release the lease of" in capsys.readouterr().out
    assert lease.read(st.fs, st.path("hung")) is not None           # left behind, to go stale
    held.release()
    assert lease.read(st.fs, st.path("hung")) is None
