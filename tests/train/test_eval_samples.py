"""Held-out loss and sample generations while training (issue 25): the FSDP2 loop's eval loss against a
separate forward, its sharded greedy generations against the exported model's, the MLflow metrics and
table, the TRL loop's metric names, the recipe fields and the plan's cost lines."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from raytune_ft.recipe.recipe import RecipeError, apply_overrides, validate
from tests.conftest import train_state
from tests.train.test_fsdp_loop import tiny_recipe

PROMPTS = [
    "Please list three colors.",
    {"messages": [{"role": "system", "content": "You answer briefly."},
                  {"role": "user", "content": "What is a python list?"},
                  {"role": "assistant", "content": "cut: the sampler answers from here"}]},
]


def write_prompts(path) -> str:
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return str(path)


# ---------------------------------------------------------------- recipe and data

def test_sample_prompts_are_checked_before_ray_starts(tmp_path):
    from raytune_ft.recipe.recipe import Recipe

    with pytest.raises(RecipeError, match="train.sample_prompts: '/no/such.jsonl' is not a .jsonl/.json file"):
        validate(apply_overrides(Recipe(), ["train.sample_prompts=/no/such.jsonl"]))
    with pytest.raises(RecipeError, match="train.sample_prompts: 2 held-out conversations need held-out data"):
        validate(apply_overrides(Recipe(), ["train.sample_prompts=2", "data.validation_fraction=0"]))
    with pytest.raises(RecipeError, match="offered by the FSDP2 loop only"):
        validate(apply_overrides(Recipe(), ["train.loop=trl", f"train.sample_prompts={write_prompts(tmp_path / 'p.jsonl')}"]))
    with pytest.raises(RecipeError, match="data.validation_max_rows"):
        validate(apply_overrides(Recipe(), ["data.validation_max_rows=0"]))
    ok = validate(apply_overrides(Recipe(), ["train.sample_prompts=2", "data.validation_split=test_sft",
                                             "train.eval_every=0", "train.sample_max_new_tokens=16"]))
    assert ok.train.sample_max_new_tokens == 16


@pytest.mark.timeout(300)
def test_validation_max_rows_keeps_the_first_held_out_rows(ray_local):
    from raytune_ft.data.pipeline import build_dataset
    from raytune_ft.models.tiny import local_tokenizer
    from raytune_ft.recipe.recipe import DataConfig

    data = DataConfig(source="builtin:chat:200", seq_len=256, validation_fraction=0.3, seed=3)
    every = build_dataset(data, local_tokenizer(), split="validation").take_all()
    data.validation_max_rows = 5
    first = build_dataset(data, local_tokenizer(), split="validation").take_all()
    assert len(every) > 20 and len(first) == 5
    assert [list(r["input_ids"]) for r in first] == [list(r["input_ids"]) for r in every[:5]]
    # the train split is not capped; its held-out rows keep their place, marked and empty, to be counted
    train = build_dataset(data, local_tokenizer(), split="train").take_all()
    held = [r for r in train if r["skip_reason"] == "held_out"]
    assert len(train) == 200 and len(held) == len(every) and not any(r["input_ids"] for r in held)


# ---------------------------------------------------------------- generation, one process

def test_batched_packed_greedy_equals_generate_one_prompt_at_a_time():
    """Several prompts generated together in one packed row match transformers' generate on each alone:
    no sequence sees another's tokens, and each stops at its own end."""
    from raytune_ft.models.build import load_causal_lm
    from raytune_ft.models.gated_delta import enable_packing
    from raytune_ft.recipe.recipe import Recipe
    from raytune_ft.train.fsdp_model import PackedCausalLM
    from raytune_ft.train.sampling import generate_greedy

    r = Recipe()
    r.model.local_tiny, r.model.dtype = True, "float32"
    lm = load_causal_lm(r.model, device="cpu", dtype=torch.float32, seed=5).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2000, (n,), generator=g).tolist() for n in (5, 17, 9)]
    with torch.no_grad():
        ref = [lm.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, use_cache=True)[0, len(p):].tolist()
               for p in prompts]
    # a stop token the reference produced early in one sequence: that sequence must stop there
    stop = ref[1][3]
    got = generate_greedy(PackedCausalLM(enable_packing(lm)).eval(), prompts, max_new_tokens=12, stop_ids=[stop],
                          device=torch.device("cpu"))
    for (ids, _), want in zip(got, ref):
        cut = want[:want.index(stop) + 1] if stop in want else want
        assert ids == cut
    assert len(got[1][0]) == 4 and len(got[0][0]) > 4


def test_held_out_prompts_stop_before_the_last_answer():
    from raytune_ft.data.sft import render_sft
    from raytune_ft.models.tiny import local_tokenizer
    from raytune_ft.train.sampling import held_out_prompts, render_prompts

    tok = local_tokenizer()
    conv = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second question"}, {"role": "assistant", "content": "second answer"}]
    ids, mask = render_sft(tok, conv)
    rows = [{"input_ids": [], "mask": [], "skip_reason": "no_assistant"}, {"input_ids": ids, "mask": mask, "skip_reason": ""}]
    (p,) = held_out_prompts(rows, 2, tok)
    # the same tokens the template gives the conversation without its last answer, plus a generation prompt
    assert p.ids == render_prompts(tok, [conv[:3]], {})[0].ids
    assert p.text.endswith("<|im_start|>assistant\n") and "second answer" not in p.text


def _training_compiles(samples: bool) -> list[tuple]:
    """The graphs torch.compile builds over 3 training steps of the local recipe's tiny model with its layers
    compiled as `train.compile` compiles them; `samples`: generations of other lengths and a held-out loss
    before the first step and between steps, as the loop runs them. Real Dynamo (tracing, guards,
    recompiles); the backend only counts each graph it is handed (grad mode, symbolic sizes) and runs it
    eagerly, where Inductor would spend the test's time in a C++ compiler."""
    import functools

    import numpy as np

    from raytune_ft.data.packing import block_from_segments
    from raytune_ft.models.build import load_causal_lm
    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.evaluate import held_out_loss
    from raytune_ft.train.fsdp_model import PackedCausalLM, compile_pointwise
    from raytune_ft.train.sampling import generate_greedy
    from tests.conftest import local_job_recipe

    graphs = []

    def counting(gm, example_inputs):
        dynamic = any(isinstance(x, torch.SymInt) for x in example_inputs)
        graphs.append((torch.is_grad_enabled(), dynamic))
        return gm.forward

    torch._dynamo.reset()
    r = local_job_recipe([])
    lm = load_causal_lm(r.model, device="cpu", dtype=torch.float32, seed=1)
    real_compile = torch.compile
    torch.compile = functools.partial(real_compile, backend=counting)
    try:
        compile_pointwise(lm)
    finally:
        torch.compile = real_compile
    model, cpu = PackedCausalLM(lm), torch.device("cpu")
    rng = np.random.default_rng(0)

    def block():
        return block_from_segments([(ids, np.ones(len(ids), bool)) for ids in
                                    (rng.integers(0, 1000, n) for n in (40, 50))], 128)

    def probes(lengths):
        generate_greedy(model, [list(range(1, n + 1)) for n in lengths], max_new_tokens=5, stop_ids=[], device=cpu)
        held_out_loss(model, [block(), block()], micro_batch_size=1, device=cpu)

    if samples:
        probes((5, 3))
    for step in range(3):
        mb = StepBatch.from_blocks([block()], cpu)
        loss_sum, _ = model(mb.labels, **mb.kwargs)
        loss_sum.backward()
        if samples:
            probes((9 + step,))
    torch._dynamo.reset()
    return graphs


@pytest.mark.slow          # two compiled training runs
@pytest.mark.timeout(600)
def test_samples_and_eval_leave_the_training_graphs_alone():
    """Issue 36: the step-0 generation ran variable-length rows through the compiled layers, so the training
    step's graphs recompiled (then went dynamic) until the recompile limit. With samples and evaluation on,
    the same graphs as with them off: all for training (grad on), none with symbolic sizes."""
    off = _training_compiles(samples=False)
    on = _training_compiles(samples=True)
    assert off and all(grad and not dynamic for grad, dynamic in off)
    assert on == off


# ---------------------------------------------------------------- the FSDP2 loop on local Ray

@pytest.fixture(scope="module")
def watched_run(ray_local, tmp_path_factory):
    """2 CPU workers, held-out loss every 2 steps, 2 sample prompts from a file, MLflow on; the data and the
    held-out rows read from before the model is built (train.read_ahead=on, the GPU workers' default)."""
    from raytune_ft.tracking import mlflow_run as tracking
    from raytune_ft.driver.launch import build_trainer

    tmp = tmp_path_factory.mktemp("watched")
    r = tiny_recipe(tmp, "watched", max_steps=4, checkpoint_every=2)
    r.data.validation_fraction = 0.2
    r.train.eval_every, r.train.sample_max_new_tokens = 2, 10
    r.train.sample_prompts = write_prompts(tmp / "prompts.jsonl")
    r.train.read_ahead = "on"
    r = validate(r)
    from raytune_ft.tracking.opening import put_run_id

    run_id = tracking.start_run(r)
    put_run_id("mlflow_run/watched", {"run_id": run_id})      # the one way a run id reaches rank 0
    result = build_trainer(r, mlflow_run_key="mlflow_run/watched").fit()
    return r, result, run_id


@pytest.mark.timeout(600)
def test_eval_loss_equals_a_separate_forward_over_the_held_out_blocks(watched_run):
    from transformers import AutoModelForCausalLM

    from raytune_ft.data.pipeline import build_dataset, iter_blocks
    from raytune_ft.models.gated_delta import enable_packing
    from raytune_ft.models.tiny import local_tokenizer
    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.fsdp_model import PackedCausalLM

    r, result, _ = watched_run
    blocks = list(iter_blocks(build_dataset(r.data, local_tokenizer(), split="validation"), r.data))
    assert len(blocks) >= 3        # more than one per rank, an odd count: the padding blocks are exercised
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(result.checkpoint.path, "hf"), dtype=torch.float32)
    model = PackedCausalLM(enable_packing(hf)).eval()
    loss, n = 0.0, 0
    with torch.no_grad():
        for b in blocks:
            mb = StepBatch.from_blocks([b], torch.device("cpu"))
            ls, cnt = model(mb.labels, **mb.kwargs)
            loss, n = loss + float(ls), n + int(cnt)
    assert result.metrics["eval/loss"] == pytest.approx(loss / n, rel=1e-5)
    assert result.metrics["eval/tokens"] == n
    assert result.metrics["eval/perplexity"] == pytest.approx(math.exp(loss / n), rel=1e-5)
    state = train_state(result.checkpoint.path)
    assert [e["step"] for e in state["eval_history"]] == [2, 4]


@pytest.mark.timeout(600)
def test_sharded_generations_equal_the_exported_models(watched_run):
    """The final samples, generated by the 2-worker FSDP2-sharded model, are what transformers' generate
    gives from the run's hf/ export for the same prompts (greedy)."""
    from transformers import AutoModelForCausalLM

    from raytune_ft.models.tiny import local_tokenizer
    from raytune_ft.train.sampling import read_prompt_file, render_prompts, stop_token_ids

    r, result, _ = watched_run
    rows = train_state(result.checkpoint.path)["samples"]
    assert [row["step"] for row in rows] == [4, 4]
    tok = local_tokenizer()
    prompts = render_prompts(tok, read_prompt_file(r.train.sample_prompts), {})
    assert "cut: the sampler" not in prompts[1].text
    stops = stop_token_ids(tok, {})
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(result.checkpoint.path, "hf"), dtype=torch.float32).eval()
    for p, row in zip(prompts, rows):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p.ids]), max_new_tokens=10, do_sample=False, eos_token_id=stops,
                              pad_token_id=tok.pad_token_id)[0, len(p.ids):].tolist()
        assert row["tokens"] == len(out)
        if out[-1] in stops:
            out = out[:-1]
        assert row["completion"] == tok.decode(out, skip_special_tokens=True)
        assert row["prompt"] == p.text


@pytest.mark.timeout(600)
def test_eval_and_samples_reach_mlflow_with_their_cost(watched_run):
    import mlflow

    r, result, run_id = watched_run
    client = mlflow.MlflowClient(r.tracking_uri)
    hist = {k: {m.step: m.value for m in client.get_metric_history(run_id, k)}
            for k in ("validation/loss", "validation/perplexity", "validation/seconds")}
    assert sorted(hist["validation/loss"]) == [2, 4]
    for s, loss in hist["validation/loss"].items():
        assert hist["validation/perplexity"][s] == pytest.approx(math.exp(loss))
        assert hist["validation/seconds"][s] > 0
    # a sample round's seconds are its table rows' (below), not a chart
    assert not [k for k in client.get_run(run_id).data.metrics if k.startswith("samples")]
    table = json.loads(open(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="samples.json",
                                                                tracking_uri=r.tracking_uri)).read())
    assert table["columns"] == ["step", "prompt", "completion", "tokens", "seconds", "base_completion"]
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [row["step"] for row in rows] == [0, 0, 2, 2, 4, 4]
    base = [row["completion"] for row in rows[:2]]
    assert all(row["base_completion"] == base[i % 2] for i, row in enumerate(rows))
    assert all(0 < row["tokens"] <= 10 and row["seconds"] >= 0 for row in rows)


# ---------------------------------------------------------------- the TRL loop's metric names

def test_trl_eval_loss_is_logged_as_eval_loss_and_perplexity(tmp_path):
    """Hugging Face's eval_loss / eval_runtime reach MLflow as validation/loss, validation/perplexity,
    validation/seconds (the FSDP2 loop's names there)."""
    import types

    import mlflow

    from raytune_ft.tracking import mlflow_run as tracking
    from raytune_ft.recipe.recipe import Recipe
    from raytune_ft.train.common import WorkerLog
    from raytune_ft.train.trl.base import Paused
    from raytune_ft.train.trl.report import ReportContext, report_callback

    r = Recipe()
    r.train.loop, r.scaling.use_gpu = "trl", False
    r.tracking.storage_path, r.tracking.run_name = str(tmp_path), "trl-names"
    run_id = tracking.start_run(r)
    log = WorkerLog(0, r, run_id)
    cb = report_callback(ReportContext(recipe=r, rank=0, world=1, log=log, blocks=None, lora=False, paused=Paused()))
    cb.on_log(None, types.SimpleNamespace(global_step=3, max_steps=5), None,
              logs={"eval_loss": 1.25, "eval_runtime": 2.5})
    log.flush(240)                 # rank 0's MLflow calls are made by a process of their own
    got = {k: mlflow.MlflowClient(r.tracking_uri).get_metric_history(run_id, k)
           for k in ("validation/loss", "validation/perplexity", "validation/seconds")}
    assert [(m.step, m.value) for m in got["validation/loss"]] == [(3, 1.25)]
    assert got["validation/perplexity"][0].value == pytest.approx(math.exp(1.25))
    assert got["validation/seconds"][0].value == 2.5


# ---------------------------------------------------------------- the plan

def test_plan_states_the_cost_of_evaluation_and_samples():
    from raytune_ft.cli import _job_recipe
    from raytune_ft.planning.plan import memory_plan

    r = _job_recipe("qwen27b_b300", False, [])
    assert r.train.eval_every and r.train.sample_prompts
    plan = memory_plan(r)
    text = plan.render()
    assert plan.eval_seconds and plan.sample_seconds
    assert "evaluation" in text and "samples" in text
    off = memory_plan(_job_recipe("qwen27b_b300", False, ["train.eval_every=0", "train.sample_prompts=0"]))
    assert not off.eval_seconds and not off.sample_seconds
    # twice the held-out rows: twice the evaluation time
    more = memory_plan(_job_recipe("qwen27b_b300", False, [f"data.validation_max_rows={2 * r.data.validation_max_rows}"]))
    assert more.eval_seconds == pytest.approx(2 * plan.eval_seconds)
    longer = memory_plan(_job_recipe("qwen27b_b300", False, [f"train.sample_max_new_tokens={2 * r.train.sample_max_new_tokens}"]))
    assert longer.sample_seconds > 1.9 * plan.sample_seconds


# ---------------------------------------------------------------- --local

@pytest.mark.timeout(900)
def test_local_job_logs_eval_and_a_samples_table(local_job):
    import mlflow

    from tests.conftest import local_job_recipe

    proc = local_job["proc"]
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:].decode(errors="replace")
    recipe, summary = local_job_recipe(local_job["overrides"]), local_job["summary"]
    run_id = summary["mlflow_run_id"]
    client = mlflow.MlflowClient(recipe.tracking_uri)
    assert client.get_metric_history(run_id, "validation/loss")
    table = json.loads(open(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="samples.json",
                                                                tracking_uri=recipe.tracking_uri)).read())
    steps = [row[0] for row in table["data"]]
    assert steps[:2] == [0, 0] and steps[-2:] == [recipe.train.max_steps] * 2 and len(set(steps)) >= 3
