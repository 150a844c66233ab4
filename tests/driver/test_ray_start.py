"""The Ray a job starts for itself: what its raylet starts before the run asks for anything."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import REPO, shared_ray_down


@pytest.fixture(autouse=True)
def _no_shared_ray_beside_a_child_ray(request):
    """A test that starts a Ray in a child process runs without the session's shared one: a second Ray on
    the machine finds the dashboard agent's port taken and spends ~3 s retrying it."""
    if "ray_local" not in request.fixturenames:
        shared_ray_down()
    yield

# A driver that starts its Ray as a job does and, in order: counts the Python workers its raylet started
# unasked; starts the actor Ray Train's controller waits for (the --local one); builds the train dataset and reads
# it whole. Two such drivers (a --local job's Ray and a cluster-sized one) serve the tests below: a fresh Ray
# each, ~10 s apiece on 2 cores, where one per test made five.
JOB_RAY = """
import sys, time, psutil
from raytune_ft.driver.start_ahead import ensure_ray, start_train_helpers
local, settings = sys.argv[1] == "local", sys.argv[2:]
ensure_ray(local=local)
time.sleep(6)
# a Python worker names itself ray::IDLE once started (default_worker.py before)
workers = [p for p in psutil.Process().children(recursive=True)
           if " ".join(p.cmdline()).startswith("ray::IDLE") or any(a.endswith("default_worker.py") for a in p.cmdline())]
print("idle workers", len(workers), flush=True)
if local:
    import ray
    start_train_helpers()
    actor = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    print("coordinator", ray.get(actor.__ray_ready__.remote(), timeout=60), flush=True)
from raytune_ft.driver.launch import build_datasets, tokenize_processes
from tests.conftest import local_job_recipe
r = local_job_recipe(settings)
r.data.source = "builtin:chat:3000"
datasets, _ = build_datasets(r)
assert len(datasets["train"].take_all()) == 3000
print("tokenize processes", tokenize_processes(r), flush=True)
"""


@pytest.fixture(scope="module")
def job_rays(tmp_path_factory):
    """{"local": ..., "cluster": ...}: each driver's output and the number of its Ray's worker processes
    that ran a tokenizing task (from Ray's worker logs; Ray may start a spare one that runs nothing)."""
    import glob

    shared_ray_down()
    out = {}
    for kind, settings in (("local", []), ("cluster", ["data.tokenize_workers=3"])):
        with tempfile.TemporaryDirectory(prefix="rtray", dir="/tmp") as ray_tmp:
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": ray_tmp}
            proc = subprocess.run([sys.executable, "-c", JOB_RAY, kind, *settings], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=240)
            logs = glob.glob(os.path.join(ray_tmp, "ray", "session_2*", "logs", "worker-*.out"))  # not session_latest
            ran = [f for f in logs if ":task_name:MapBatches(fn)" in open(f, errors="replace").read()]
        out[kind] = {"proc": proc, "tokenized_in": len(ran), "logs": len(logs)}
    return out


def _driver(job_rays, kind: str) -> str:
    proc = job_rays[kind]["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["local", "cluster"])
def test_a_ray_the_job_starts_starts_no_idle_workers(job_rays, kind):
    """Ray starts one idle worker per logical CPU for the first driver; a run never uses them (its
    runtime_env does not match theirs) and on a GPU node they are dozens of Python start-ups beside the
    run's own, so a Ray the job starts has none (a --local job's Ray, and one of the machine's size)."""
    assert "idle workers 0" in _driver(job_rays, kind), _driver(job_rays, kind)[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, expected", [("local", 2), ("cluster", 3)])
def test_tokenizing_runs_in_a_few_processes_not_one_per_free_cpu(job_rays, kind, expected):
    """Ray Data would tokenize in one new process per `num_cpus_per_op` of free CPU (32 on a local
    Ray), each importing transformers while the model builds; a run tokenizes `tokenize processes` at once:
    one per training worker (at least 2: the local driver), or `data.tokenize_workers` (3: the other one).
    One process more may run a few tokenizing tasks: the stream's cut into fixed-size bundles
    (StreamingRepartition) holds a worker process for a moment while the map's next task waits for one."""
    out = _driver(job_rays, kind)
    assert f"tokenize processes {expected}" in out, out[-2000:]
    assert 1 <= job_rays[kind]["tokenized_in"] <= expected + 1, job_rays[kind]


@pytest.mark.timeout(180)
def test_the_held_out_split_is_built_only_when_evaluation_or_samples_read_it(ray_local):
    """The local recipe holds out rows; its held-out dataset is built (and handed to the trainer, whose
    controller and workers set it up) only when evaluation or sample prompts read it. Where neither reads it
    nothing is held out: the training split trains the rows it would hold out (in their places, kept empty
    with the skip reason `held_out` when held out) and every other row the same."""
    from raytune_ft.driver.launch import build_datasets
    from tests.conftest import local_job_recipe

    sets = ["data.source=builtin:chat:200"]
    on, _ = build_datasets(local_job_recipe(sets))
    off, _ = build_datasets(local_job_recipe([*sets, "train.eval_every=0", "train.sample_prompts=0"]))
    evaluated, _ = build_datasets(local_job_recipe([*sets, "train.sample_prompts=0"]))
    assert sorted(on) == sorted(evaluated) == ["train", "validation"] and sorted(off) == ["train"]
    assert on["validation"].count() > 0
    train_on, train_off = on["train"].take_all(), off["train"].take_all()
    assert len(train_on) == len(train_off) == 200
    held = [i for i, r in enumerate(train_on) if r["skip_reason"] == "held_out"]
    assert len(held) == on["validation"].count() and not any(r["skip_reason"] == "held_out" for r in train_off)
    assert all(len(train_on[i]["input_ids"]) == 0 < len(train_off[i]["input_ids"]) for i in held)
    assert [list(r["input_ids"]) for i, r in enumerate(train_on) if i not in held] == \
        [list(r["input_ids"]) for i, r in enumerate(train_off) if i not in held]


@pytest.mark.timeout(180)
def test_the_datasets_carry_the_tokenizer_settings_not_the_tokenizer(ray_local):
    """The Train controller, the dataset manager and the split coordinator unpickle the datasets before
    any row is read; a tokenizer object inside would make each import transformers and rebuild it. They
    carry the model's tokenizer settings; the tokenizing tasks load it, and the rows are the same."""
    import ray.cloudpickle

    from raytune_ft.data.pipeline import build_dataset
    from raytune_ft.models.build import tokenizer_for
    from raytune_ft.driver.launch import build_datasets
    from tests.conftest import local_job_recipe

    r = local_job_recipe([])
    r.data.source = "builtin:chat:200"
    datasets, _ = build_datasets(r)
    carried = ray.cloudpickle.dumps(datasets["train"])
    assert b"transformers" not in carried and b"tokenizers" not in carried
    rows = datasets["train"].take_all()
    same = build_dataset(r.data, tokenizer_for(r.model), split="train").take_all()
    assert len(rows) == len(same) == 200
    assert all(list(a["input_ids"]) == list(b["input_ids"]) and list(a["mask"]) == list(b["mask"])
               for a, b in zip(rows, same))


def test_the_tokenizer_settings_carry_the_chat_template_file_as_its_text(tmp_path, fixtures):
    """A tokenizing task may run on a node without the recipe's template file: the settings hold its text."""
    import pickle

    from raytune_ft.models.tokenizer import TokenizerOf
    from tests.conftest import local_job_recipe

    template = tmp_path / "template.jinja"
    template.write_text((fixtures / "templates" / "qwen3.8-27b.chat_template.jinja").read_text())
    r = local_job_recipe([f"model.chat_template={template}"])
    carried = pickle.dumps(TokenizerOf.of(r.model))
    template.unlink()
    tok = pickle.loads(carried).load()
    assert tok.chat_template == (fixtures / "templates" / "qwen3.8-27b.chat_template.jinja").read_text()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_actor_ray_trains_controller_waits_for_is_started_with_ray(job_rays):
    """Ray Train's controller asks Ray Data's autoscaling coordinator for the workers' resources on its
    start, waiting for that actor's new process; the job starts it as soon as its Ray is up, so it comes
    up beside the MLflow run and the datasets, and the controller finds it running."""
    out = _driver(job_rays, "local")
    assert "coordinator True" in out, out[-2000:]


# a tokenizing process: the carried settings in, the rows it makes and whether it imported torch out
TOKENIZING_PROCESS = """
import json, pickle, sys
ref = pickle.loads(bytes.fromhex(sys.argv[1]))
from raytune_ft.data.pipeline import tokenize_rows
tok = ref.load()
cols = tokenize_rows(open(sys.argv[2]).read().splitlines(), tok)
print(json.dumps({"torch": "torch" in sys.modules, "class": type(tok).__name__, "ids": cols["input_ids"],
                  "mask": cols["mask"]}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tokenizer, data, template", [
    ("qwen3", "ultrachat_200k_train_sft_first16.jsonl", True),
    ("qwen2-0.5b", "capybara_ldjnr_first16.jsonl", False),
])
def test_a_tokenizing_process_loads_the_class_the_driver_chose_without_torch(fixtures, tokenizer, data,
                                                                              template):
    """AutoTokenizer reads the model config through transformers' configuration code, which imports torch:
    seconds of each tokenizing process's start before its first row, on the way to the first step. The
    driver loads the tokenizer through AutoTokenizer; the settings carry the class it chose, and a
    tokenizing process loads that class alone: no torch, the same class, the same rows."""
    import json
    import pickle

    from raytune_ft.data.pipeline import tokenize_rows
    from raytune_ft.models.tokenizer import TokenizerOf, tokenizer_for
    from tests.conftest import local_job_recipe

    settings = [f"model.name={fixtures / 'tokenizers' / tokenizer}", "model.local_tiny=false"]
    if template:
        settings.append(f"model.chat_template={fixtures / 'templates' / 'qwen3.8-27b.chat_template.jinja'}")
    r = local_job_recipe(settings)
    assert TokenizerOf.of(r.model).tokenizer_class is None      # nothing loaded here yet: AutoTokenizer decides
    driver = tokenizer_for(r.model)                              # what the driver does beside Ray's start
    carried = TokenizerOf.of(r.model)
    assert carried.tokenizer_class == f"{type(driver).__module__}.{type(driver).__qualname__}"
    rows = fixtures / "data" / data
    proc = subprocess.run([sys.executable, "-c", TOKENIZING_PROCESS, pickle.dumps(carried).hex(), str(rows)],
                          cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch"] is False
    assert out["class"] == type(driver).__name__
    expected = tokenize_rows(rows.read_text().splitlines(), driver)
    assert sum(map(len, out["ids"])) > 1000 and sum(map(sum, out["mask"])) > 100
    assert out["ids"] == expected["input_ids"] and out["mask"] == expected["mask"]


# the driver's work beside Ray's start, in a fresh process: whether it imported torch, and the class carried
DRIVER_PREPARES = """
import json, sys
from raytune_ft.driver.start_ahead import prepare_driver
from raytune_ft.models.tokenizer import TokenizerOf
from tests.conftest import local_job_recipe
r = local_job_recipe(sys.argv[1:])
prepare_driver(r)
print(json.dumps({"torch": "torch" in sys.modules, "class": TokenizerOf.of(r.model).tokenizer_class}))
"""


@pytest.mark.timeout(240)
def test_a_driver_loads_a_tokenizer_once_then_remembers_the_class_autotokenizer_chose(fixtures, tmp_path):
    """Through AutoTokenizer a tokenizer's load imports torch (5-10 s on a GPU node), which under `ray job
    submit` nothing hides: the first driver loads it (the check in its words) and remembers the class
    AutoTokenizer chose, beside the JIT caches; a later driver with the same files carries that class and
    imports no torch; a changed file makes the next driver load it again."""
    import json
    import shutil

    tok = tmp_path / "tokenizer"
    shutil.copytree(fixtures / "tokenizers" / "qwen3", tok)
    settings = [f"model.name={tok}", "model.local_tiny=false", f"train.cache_dir={tmp_path / 'cache'}",
                f"model.chat_template={fixtures / 'templates' / 'qwen3.8-27b.chat_template.jinja'}"]

    def driver() -> dict:
        proc = subprocess.run([sys.executable, "-c", DRIVER_PREPARES, *settings], cwd=REPO, capture_output=True,
                              text=True, timeout=100)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = driver()
    assert first["torch"] is True and first["class"].startswith("transformers.")
    memo = json.loads((tmp_path / "cache" / "tokenizer_classes.json").read_text())
    assert list(memo.values()) == [first["class"]]
    assert driver() == {"torch": False, "class": first["class"]}
    with open(tok / "vocab.json", "a") as f:      # the folder changed: loaded (and checked) again
        f.write("\n")
    assert driver()["torch"] is True
    assert len(json.loads((tmp_path / "cache" / "tokenizer_classes.json").read_text())) == 2


@pytest.mark.timeout(180)
def test_the_worker_reads_the_first_tokenized_batch_before_the_next_is_made(ray_local, tmp_path):
    """The tokenizing map makes blocks of 64 rows, the first packing window; the worker takes each block
    as it comes. Here the batches after the first wait (up to 30 s) for the worker to have read a row:
    read in batches of 256, the worker would wait for them and they for it."""
    import numpy as np
    import pyarrow as pa
    import ray

    from raytune_ft.data.pipeline import _iter_rows

    read, waited_out = tmp_path / "read", tmp_path / "waited_out"

    def tokenize(batch: pa.Table) -> pa.Table:
        import time

        if batch.column("id")[0].as_py() >= 64:          # not the first batch: wait for the worker's first read
            deadline = time.time() + 30
            while not read.exists() and time.time() < deadline:
                time.sleep(0.1)
            if not read.exists():
                waited_out.touch()
        n = batch.num_rows
        return pa.table({"input_ids": [np.arange(4) for _ in range(n)], "mask": [np.ones(4, np.int8)] * n,
                         "skip_reason": [""] * n})

    ds = ray.data.range(256, override_num_blocks=4).map_batches(tokenize, batch_format="pyarrow", batch_size=64)
    rows = 0
    for _row in _iter_rows(ds.iterator()):
        if rows == 0:
            read.touch()
        rows += 1
    assert rows == 256
    assert not waited_out.exists(), "the worker waited for more than the first tokenized batch"
