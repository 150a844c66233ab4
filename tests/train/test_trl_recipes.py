"""The two TRL recipes' --local jobs end to end on local Ray on CPU (real Ray, real MLflow store).

Full fine-tune (jobs/qwen3_4b_full.py): evaluation on schedule, at most `keep` checkpoints, and the run
ends on the best one. To make a later checkpoint honestly worse, the test uses a learning rate far past
what any model tolerates, behind a linear warmup: warmup starts at LR 0, so step 1 leaves the weights as
initialised (eval loss about ln(vocab)), and step 2 takes one Adam step at LR 0.5
(every weight moves by about 0.5 against an init scale of 0.02), which wrecks them (eval loss well above
ln(vocab)). Nothing in the loop is rigged; the run must notice on its own that the step-1
weights were the best and hand those back.

LoRA (jobs/qwen2_05b_lora.py, 2 data-parallel workers): the adapter loads with peft, the merged model's
logits equal base + adapter, and the merged weights are what the MLflow registry holds.
"""
from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tests.conftest import REPO

FIXTURE = "data/capybara_ldjnr_first16.jsonl"


def _run(job: str, storage, overrides: list[str]):
    from raytune_ft.cli import _job_recipe
    from raytune_ft.driver.run import run

    recipe = _job_recipe(job, True, [f"tracking.storage_path={storage}", *overrides])
    return recipe, run(recipe, local=True)


def _safetensors(folder: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _eval_loss(hf_dir: str, blocks: list[dict]) -> float:
    """Hugging Face's eval loss on packed blocks: the mean over micro-batches (here one block each) of
    the token-mean cross-entropy, through the same packed attention path the trainer used."""
    import torch
    from transformers import AutoModelForCausalLM

    from raytune_ft.models.gated_delta import enable_packing
    from raytune_ft.train.batch import collate_blocks

    model = enable_packing(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)).eval()
    losses = []
    with torch.no_grad():
        for b in blocks:
            batch = collate_blocks([b])
            losses.append(float(model(**batch, use_cache=False).loss))
    return sum(losses) / len(losses)


@pytest.mark.timeout(300)
def test_full_finetune_evaluates_keeps_two_and_ends_on_best(ray_local, fixtures, tmp_path):
    import mlflow

    recipe, summary = _run("qwen3_4b_full", tmp_path, [
        f"data.source={fixtures / FIXTURE}", "data.seq_len=256", "data.validation_fraction=0.3",
        "train.max_steps=2", "train.eval_every=1", "train.checkpoint_every=1", "train.log_every=1",
        "train.grad_accum=1", "train.schedule=linear", "train.lr=1.0", "train.warmup_steps=2",
        "train.max_grad_norm=0"])
    assert summary.status == "registered", summary.lines()
    assert summary.steps == 2

    # evaluated at steps 1 and 2, and the LR-0.5 step made step 2 far worse
    client = mlflow.MlflowClient(recipe.tracking_uri)
    evals = {m.step: m.value for m in client.get_metric_history(summary.mlflow_run_id, "eval_loss")}
    assert sorted(evals) == [1, 2], evals
    assert evals[2] > evals[1] + 1.0, evals

    # three reports (steps 1, 2, final); Ray kept 2: the step-2 one and the final one, with the best weights
    ckpts = sorted(p for p in glob.glob(os.path.join(recipe.run_dir, "checkpoint_*")) if os.path.isdir(p))
    assert len(ckpts) == 2, ckpts
    assert os.path.samefile(summary.checkpoint, ckpts[-1])
    meta = json.load(open(os.path.join(summary.checkpoint, "raytune_meta.json")))
    assert meta["loop"] == "trl" and meta["final"] and meta["best_step"] == 1
    assert meta["best_eval_loss"] == pytest.approx(evals[1])
    for key in ("job", "model_name", "family", "step", "final_loss", "run_name"):
        assert meta[key] is not None, key
    step2 = json.load(open(os.path.join(ckpts[0], "raytune_meta.json")))
    assert step2["step"] == 2 and not step2["final"]
    assert os.path.isfile(os.path.join(ckpts[0], "trainer", "optimizer.pt"))   # resumable

    final_w, step2_w = _safetensors(os.path.join(ckpts[1], "hf")), _safetensors(os.path.join(ckpts[0], "hf"))
    assert any(not final_w[k].equal(step2_w[k]) for k in final_w), "the final checkpoint is the last one"

    # the final weights reproduce the step-1 eval loss on the validation blocks
    from raytune_ft.data.pipeline import build_dataset, iter_blocks
    from raytune_ft.models.build import tokenizer_for

    val = list(iter_blocks(build_dataset(recipe.data, tokenizer_for(recipe.model), split="validation"),
                           recipe.data))
    assert val
    assert _eval_loss(os.path.join(summary.checkpoint, "hf"), val) == pytest.approx(evals[1], abs=1e-3)


@pytest.mark.timeout(600)
def test_lora_adapter_loads_merges_and_the_merged_model_is_registered(fixtures, tmp_path):
    """Run as a user runs it (`python jobs/qwen2_05b_lora.py --local`, a fresh process with its own local
    Ray): the console holds the project's lines only, each once (tests/test_console_noise.py's check of a
    TRL recipe), and the checkpoint and registry hold what the recipe promises."""
    import subprocess
    import sys
    from types import SimpleNamespace

    import mlflow
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytune_ft.cli import _job_recipe
    from tests.conftest import shared_ray_down
    from tests.test_console_noise import console_env, noise

    shared_ray_down()        # a Ray beside the job's own would hold its dashboard agent's port
    # 16 rows: a 0.3 validation share so the seeded carve-out holds a few conversations
    sets = [f"tracking.storage_path={tmp_path / 'runs'}", f"data.source={fixtures / FIXTURE}",
            "data.validation_fraction=0.3"]
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "qwen2_05b_lora.py"), "--local",
                          *[f"--set={s}" for s in sets]], cwd=tmp_path, env=console_env(tmp_path),
                         capture_output=True, text=True, timeout=580)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert not noise(text), noise(text)
    # the trainer's own printer printed every log dict (twice, beside the loop's line)
    assert not [line for line in text.splitlines() if "{'loss'" in line or "{'train_runtime'" in line]
    assert re.search(r"\[raytune_ft\] step \d+/\d+", text)
    assert os.path.exists(tmp_path / ".cache" / "raytune_ft" / "logs" / "workers.log")

    recipe = _job_recipe("qwen2_05b_lora", True, sets)
    with open(os.path.join(recipe.run_dir, "summary.json")) as f:
        summary = SimpleNamespace(**json.load(f))
    assert recipe.scaling.num_workers == 2 and recipe.train.lora_r == 8
    assert summary.status == "registered", text[-3000:]
    ck = summary.checkpoint
    for sub in ("adapter", "base", "hf"):
        assert os.path.isdir(os.path.join(ck, sub)), sub
    assert os.path.isfile(os.path.join(ck, "adapter", "tokenizer_config.json"))
    assert sorted(os.listdir(os.path.join(ck, "train_state"))) == ["rank0.json", "rank1.json"]

    # the adapter loads with peft onto its base, and training moved it away from the identity
    base = AutoModelForCausalLM.from_pretrained(os.path.join(ck, "base"), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 8]])
    with torch.no_grad():
        base_logits = base(ids).logits
    peft_model = PeftModel.from_pretrained(base, os.path.join(ck, "adapter")).eval()
    lora_modules = {n.split(".")[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert set(recipe.train.lora_target_modules) <= lora_modules
    with torch.no_grad():
        adapted = peft_model(ids).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-4)

    # the merged model (hf/) equals base + adapter
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(ck, "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logits = merged(ids).logits
    torch.testing.assert_close(merged_logits, adapted, atol=1e-4, rtol=1e-4)

    # and the merged weights are what the registry holds
    client = mlflow.MlflowClient(recipe.tracking_uri, registry_uri=recipe.tracking_uri)
    mv = client.get_model_version(summary.registered_name, summary.registered_version)
    assert mv.name == recipe.registry.name
    mlflow.set_tracking_uri(recipe.tracking_uri)
    mlflow.set_registry_uri(recipe.tracking_uri)
    local = mlflow.artifacts.download_artifacts(f"models:/{mv.name}/{mv.version}", dst_path=str(tmp_path / "reg"))
    reg_files = glob.glob(os.path.join(local, "**", "*.safetensors"), recursive=True)
    assert reg_files
    registered = _safetensors(os.path.dirname(reg_files[0]))
    ours = _safetensors(os.path.join(ck, "hf"))
    assert set(registered) == set(ours)
    assert all(registered[k].float().equal(ours[k].float()) for k in ours)
    assert not any("lora" in k for k in registered)
