"""The 27B recipe's --local job end to end on local Ray on CPU: train, checkpoint, register, load back."""
from __future__ import annotations

import json
import os
import re

import pytest

from raytune_ft.tracking.mlflow_run import startup_from_params
from tests.conftest import local_job_recipe, train_state


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
def test_local_job_mlflow_run_has_every_step_and_the_startup_breakdown(local_run, local_job, tmp_path):
    """What the MLflow UI shows of `make local`: a point per optimizer step for loss, lr and grad norm
    (the recipe logs to the console every 5 steps), no MFU on CPU, the data counters as data.json, the
    start-up breakdown (also printed and in summary.json); the summary names the `mlflow ui` command."""
    import mlflow

    recipe, summary, out = local_run
    assert recipe.train.log_every == 5 and summary["steps"] == 20
    client = mlflow.MlflowClient(summary["tracking_uri"])
    run_id = summary["mlflow_run_id"]
    for key in ("train/loss", "train/lr", "train/grad_norm"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert sorted(steps) == list(range(1, 21)), (key, steps)
    assert sorted(m.step for m in client.get_metric_history(run_id, "tokens_per_s")) == [5, 10, 15, 20]
    metrics = client.get_run(run_id).data.metrics
    assert not [k for k in metrics if k.startswith(("mfu", "data/", "startup", "samples"))], sorted(metrics)
    data = client.download_artifacts(run_id, "data.json", str(tmp_path))
    assert json.load(open(data))["rows_read"] == summary["data"]["rows_read"] > 0
    # data.json in the run folder too, with each source's tokens; every row read trained, held out or skipped
    record = json.load(open(os.path.join(os.path.dirname(summary["checkpoint"]), "data.json")))
    assert record == json.load(open(data)) and record["by_source"][recipe.data.source]["tokens"] > 0
    assert record["rows_read"] == record["rows_trained"] + record["rows_held_out"] + record["rows_skipped"]

    startup = summary["startup"]
    phases = {k: v for k, v in startup.items() if "." not in k}     # the phases, not their parts
    assert set(phases) == {"ray_workers_s", "model_build_s", "kernel_check_s", "compile_s", "eval_setup_s",
                           "first_step_s", "total_s"}
    assert startup["eval_setup_s"] > 0      # --local reads held-out rows and samples the base model
    parts = sum(v for k, v in phases.items() if k != "total_s")
    assert parts == pytest.approx(startup["total_s"], abs=0.05) and 0 < startup["total_s"] < summary["seconds"]
    # "Ray and workers" split at the driver's steps and the worker process's start
    ray_parts = {k: v for k, v in startup.items() if k.startswith("ray_workers.")}
    assert set(ray_parts) == {f"ray_workers.{p}_s" for p in ("driver", "ray_start", "tracking", "datasets",
                                                              "scheduling", "worker_setup")}
    assert startup["ray_workers.driver_s"] > 0.5        # the job's process: Python, imports and checks
    assert sum(ray_parts.values()) == pytest.approx(startup["ray_workers_s"], abs=0.05)
    assert startup["ray_workers.ray_start_s"] > 0 and startup["ray_workers.worker_setup_s"] > 0
    # the model build split where the FSDP2 loop marks it
    built = {k: v for k, v in startup.items() if k.startswith("model_build.")}
    assert set(built) == {f"model_build.{p}_s" for p in ("setup", "tokenizer", "skeleton", "wrapping", "weights")}
    assert sum(built.values()) == pytest.approx(startup["model_build_s"], abs=0.05)
    assert startup["model_build.skeleton_s"] > 0 and startup["model_build.weights_s"] > 0
    assert 0 <= startup["first_step.data_wait_s"] <= startup["first_step_s"] + startup["compile_s"]
    assert startup_from_params(client.get_run(run_id).data.params) == pytest.approx(startup, abs=1e-3)
    assert sum("start-up " in line and "first step" in line for line in out.splitlines()) == 1, out[-3000:]
    ui = f"mlflow ui --backend-store-uri {summary['tracking_uri']}"
    assert ui in out, out[-2000:]


# What marks a line as the project's: its log prefixes, and the summary block run.RunSummary.lines()
# prints at the end ("job <job> (run <name>): <status>" and its indented rows)
PROJECT_PREFIXES = ("[raytune_ft]", "raytune_ft:")
RAY_PREFIX = re.compile(r"^\((?:[\w.]+ )?pid=\d+(?:, ip=[\d.]+)?\) ")
ERROR_MARK = re.compile(r"error|exception|traceback|fatal|critical|^\s+(file \"|\^)", re.I)


def foreign_lines(out: str) -> list[str]:
    """Console lines that are neither the project's nor an error (a traceback's lines count as error)."""
    foreign, in_summary, in_traceback = [], False, False
    for raw in out.splitlines():
        line = RAY_PREFIX.sub("", raw)
        in_summary = in_summary or bool(re.match(r"^job \S+ \(run \S+\): ", line))
        in_traceback = line.startswith("Traceback") or (in_traceback and line.startswith((" ", "\t")))
        if not line.strip() or line.startswith(PROJECT_PREFIXES) or ERROR_MARK.search(line) or in_traceback:
            continue
        if in_summary and (line.startswith("  ") or line.startswith("job ")):
            continue
        foreign.append(raw)
    return foreign


def test_local_job_console_is_the_project_s_lines_and_nothing_else(local_job):
    """`make local`'s command with its output in a pipe: every line is the project's or an error, no
    colour codes, and the summary labels its two tokens/s figures."""
    proc = local_job["proc"]
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == 0, out[-4000:]
    assert "\x1b" not in out, [line for line in out.splitlines() if "\x1b" in line][:5]
    assert foreign_lines(out) == [], "\n".join(foreign_lines(out)[:40])
    assert "tokens/s over the training loop, saves and evals included" in out and "training steps " in out, out[-2000:]
    data = next(line for line in out.splitlines() if line.startswith("  data "))
    assert re.search(r"\d+ skipped, \d+ blocks", data), data


def test_the_tokenizing_tasks_run_in_the_processes_the_driver_started_ahead(local_job):
    """The driver starts the tokenizing processes (loading the tokenizer) once its own tokenizer is loaded,
    long before a training worker's first read reaches Ray Data; the map's tasks run in them. Read from
    Ray's worker logs: each process's log names the tasks it ran."""
    import glob

    proc = local_job["proc"]
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    logs = glob.glob(str(local_job["ray_tmp"] / "ray" / "session_2*" / "logs" / "worker-*.out"))
    texts = [open(f, errors="replace").read() for f in logs]
    warm = [t for t in texts if ":task_name:_load_tokenizer_here" in t]
    assert 1 <= len(warm) <= 2, len(warm)          # one task per training worker, at least 2 (data.tokenize_workers)
    assert any(":task_name:MapBatches(fn)" in t for t in warm), "no tokenizing task ran in a process started ahead"


@pytest.mark.timeout(120)
def test_registration_names_the_logged_model_after_the_run_and_tags_its_version_once(local_run):
    import mlflow

    recipe, summary, _ = local_run
    client = mlflow.MlflowClient(recipe.tracking_uri)
    tags = client.get_run(summary["mlflow_run_id"]).data.tags
    assert tags.get("raytune.registered_model_version") == summary["registered_version"]
    assert "raytune.registered_version" not in tags
    mv = client.get_model_version(summary["registered_name"], summary["registered_version"])
    # the sqlite registry leaves the version's model_id empty; its source names the logged model
    assert mv.source.startswith("models:/m-"), mv.source
    model_id = mv.model_id or mv.source.removeprefix("models:/")
    assert client.get_logged_model(model_id).name == summary["run_name"] == "qwen27b-local"


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


@pytest.mark.timeout(300)
def test_exported_folder_matches_the_dcp_checkpoint_and_moved_from_the_initialisation(local_run):
    """The final checkpoint's hf/ export loads with transformers and gives the same logits as its
    DCP-checkpointed model (the FSDP2 loop's sharded state, gathered by DCP into one unsharded model)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from raytune_ft.models.build import load_causal_lm
    from raytune_ft.train.fsdp_model import PackedCausalLM

    recipe, summary, _ = local_run
    ckpt = summary["checkpoint"]
    assert train_state(ckpt)["step"] == recipe.train.max_steps        # the final checkpoint, the one with the export
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(ckpt, "hf"), dtype=torch.float32)
    ref = PackedCausalLM(load_causal_lm(recipe.model, device="cpu", dtype=torch.float32))
    state = {"app": {"model": ref.state_dict()}}
    dcp.load(state, checkpoint_id=os.path.join(ckpt, "dcp"))
    ref.load_state_dict(state["app"]["model"])
    ids = torch.randint(0, hf.config.vocab_size, (1, 32))
    with torch.no_grad():
        a = hf(ids).logits
        b = ref.lm(ids).logits
    assert not torch.equal(b, ref.lm.lm_head(torch.zeros(1, 1, hf.config.hidden_size)).expand_as(b))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # training moved the weights away from the seeded initialisation
    init = load_causal_lm(recipe.model, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(init(ids).logits, a, atol=1e-3)


@pytest.mark.timeout(300)
def test_local_job_from_any_folder_logs_every_step_to_the_run_it_names(local_job):
    """`python jobs/qwen27b_b300.py --local` as a new user runs it: the default relative storage
    (./runs), started from a folder that is not the Ray workers' working folder. Every step's metrics
    reach the MLflow run the summary names, and no second MLflow store appears anywhere, the workers'
    folders (under Ray's temp dir) included."""
    from mlflow import MlflowClient

    proc, work, ray_tmp = local_job["proc"], local_job["work"], local_job["ray_tmp"]
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == 0, out[-4000:]
    run_dir = work / "runs" / "qwen27b-local"
    summary = json.loads((run_dir / "summary.json").read_text())
    db = run_dir / "mlflow.db"
    assert summary["tracking_uri"] == f"sqlite:///{db}"
    client = MlflowClient(summary["tracking_uri"])
    for key in ("train/loss", "train/lr", "train/grad_norm"):
        steps = sorted(m.step for m in client.get_metric_history(summary["mlflow_run_id"], key))
        assert steps == list(range(1, 21)), (key, steps)
    stray = [p for root in (work, ray_tmp) for p in root.rglob("mlflow.db") if p != db]
    assert not stray, stray
    assert "MLflow logging off" not in out and "MLflow metric logging failed" not in out, out[-3000:]


# ---------------------------------------------------------------- the LoRA recipe's --local job

@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """jobs/qwen27b_lora.py --local as a user runs it, with rank 1 dying once the final checkpoint's files are
    written (after step 10's was registered): Ray's restart resumes from step 10 and trains steps 11-20 again."""
    from tests.conftest import local_job_process
    from tests.faults import job_env

    work = tmp_path_factory.mktemp("lorajob")
    overrides = [f"tracking.storage_path={work / 'runs'}"]
    with local_job_process(work, overrides, extra_env=job_env(str(work), exit_after_write="20:1:after=10"),
                           job="qwen27b_lora", prefix="rtlora") as (proc, _):
        out = (proc.stdout + proc.stderr).decode(errors="replace")
        assert proc.returncode == 0, out[-4000:]
        summary = json.loads((work / "runs" / "qwen27b-lora-local" / "summary.json").read_text())
        yield summary, out


@pytest.mark.timeout(900)
def test_lora_job_trains_the_adapters_resumes_exactly_and_registers_the_merged_model(lora_run):
    """Adapters only in the checkpoints; every step the restarted attempt trained again has the loss the
    first attempt logged for it; the final checkpoint holds the PEFT adapter, the tiny base it adapts and the
    merged model, which is registered with the base it was trained from."""
    import mlflow
    from torch.distributed.checkpoint import FileSystemReader

    summary, out = lora_run
    assert summary["status"] == "registered" and summary["steps"] == 20, out[-3000:]
    assert "test fault: rank 1 exiting" in out
    ckpt = summary["checkpoint"]
    state = train_state(ckpt)
    assert state["resumed_from"] == [10]
    hist = state["history"]
    assert [h["step"] for h in hist] == list(range(1, 21)) and hist[-1]["loss"] < hist[0]["loss"]
    client = mlflow.MlflowClient(summary["tracking_uri"])
    logged: dict[int, list[float]] = {}
    for m in client.get_metric_history(summary["mlflow_run_id"], "train/loss"):
        logged.setdefault(m.step, []).append(m.value)
    twice = {s: v for s, v in logged.items() if len(v) == 2}
    assert set(twice) == set(range(11, 21)), logged                 # steps 11-20 trained by both attempts
    assert all(a == b for a, b in twice.values()), twice
    saved = FileSystemReader(os.path.join(ckpt, "dcp")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("app.model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert {"adapter", "base", "hf"} <= set(os.listdir(ckpt))
    v = client.get_model_version(summary["registered_name"], summary["registered_version"])
    assert v.tags["raytune.lora"] == "merged" and v.tags["raytune.base_model"].startswith("base/ of the checkpoint")
