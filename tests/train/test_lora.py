"""LoRA in the FSDP2 loop (train/lora.py, train/lora_export.py), in-process on a one-rank gloo group with the
tiny qwen3_5 model: the model `build_fsdp_model` builds, trained on packed blocks by the loop's own step.

- Adapters on every linear of both layer kinds, narrowed by train.lora_target_modules; the base frozen, only
  the adapters in the optimizer.
- The adapter folder is what PEFT writes for the same model and config (key set and shapes); PEFT loads it
  onto the base and gives the trained model's logits; the registry's merge and the loop's own merged hf/
  give them too.
- A checkpoint holds the adapters and their optimizer state only, and a step trained again after a resume
  from it gives the same loss.
The loop on Ray with this setting runs in tests/driver/test_local_job.py (jobs/qwen27b_lora.py --local).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from raytune_ft.recipe.sections import FSDP2_LORA_TARGETS
from tests.lora_helpers import blocks, build, ids, loop_logits, one_rank_group, recipe, train_step

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _peft_state(adapter_dir: str):
    """What PEFT itself makes of the tiny model with the adapter's own config: {key: shape}."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from raytune_ft.models.tiny import local_tokenizer, tiny_config

    cfg = LoraConfig.from_pretrained(adapter_dir)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_5", len(local_tokenizer())))
    return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(get_peft_model(base, cfg)).items()}


def _adapter_state(adapter_dir: str):
    from safetensors.torch import load_file

    return load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_adapters_wrap_every_linear_of_both_layer_kinds_and_only_they_train(tmp_path):
    from raytune_ft.train.lora import LoraLinear
    from raytune_ft.train.lora_export import write_adapter
    from raytune_ft.models.layout import BaseLayout

    with one_rank_group():
        r = recipe(tmp_path, lora_r=4, lora_alpha=8)
        model, lm, tok, opt = build(r)
        wrapped = {n.rsplit(".", 1)[-1]: n for n, m in lm.named_modules() if isinstance(m, LoraLinear)}
        assert set(wrapped) == set(FSDP2_LORA_TARGETS) == set(ATTN + GDN + MLP)
        kinds = lm.config.layer_types
        n_lora = sum(isinstance(m, LoraLinear) for m in lm.modules())
        assert n_lora == kinds.count("full_attention") * 7 + kinds.count("linear_attention") * 8
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
        assert in_opt == {id(p) for p in model.parameters() if p.requires_grad}
        # the frozen base is sharded by FSDP2 like the adapters
        from torch.distributed.tensor import DTensor
        assert all(isinstance(p, DTensor) for p in model.parameters())
        base_before = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
        losses = [train_step(model, opt, b) for b in blocks(3)]
        assert losses[-1] < losses[0]
        assert all(torch.equal(p.full_tensor(), base_before[n]) for n, p in model.named_parameters()
                   if not p.requires_grad)
        write_adapter(str(tmp_path / "adapter"), model, r, tok, 0, BaseLayout())
    ours = {k: tuple(v.shape) for k, v in _adapter_state(str(tmp_path / "adapter")).items()}
    assert ours == _peft_state(str(tmp_path / "adapter"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == set(FSDP2_LORA_TARGETS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lora_target_modules_narrows_the_adapted_linears(tmp_path):
    from raytune_ft.train.lora import LoraLinear
    from raytune_ft.train.lora_export import write_adapter
    from raytune_ft.models.layout import BaseLayout

    with one_rank_group():
        r = recipe(tmp_path, lora_r=2, lora_target_modules=["q_proj", "in_proj_b", "down_proj"])
        model, lm, tok, _ = build(r)
        names = {n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, LoraLinear)}
        assert names == {"q_proj", "in_proj_b", "down_proj"}
        write_adapter(str(tmp_path / "adapter"), model, r, tok, 0, BaseLayout())
    ours = {k: tuple(v.shape) for k, v in _adapter_state(str(tmp_path / "adapter")).items()}
    assert ours == _peft_state(str(tmp_path / "adapter"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_peft_loads_the_adapter_with_the_trained_logits_and_both_merges_agree(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from raytune_ft.registry import merge_lora
    from raytune_ft.train.lora_export import final_export

    x = ids()
    with one_rank_group():
        r = recipe(tmp_path, lora_r=4, lora_alpha=16, merge_adapter=True)
        model, lm, tok, opt = build(r)
        base_logits = loop_logits(model, x)
        for b in blocks(3):
            train_step(model, opt, b)
        trained = loop_logits(model, x)
        final_export(r, model, tok, 0, torch.float32)(str(tmp_path / "ckpt" / "hf"))
    assert (trained - base_logits).abs().max() > 1e-3          # the adapters moved the model
    ckpt = tmp_path / "ckpt"
    assert {p.name for p in ckpt.iterdir()} == {"adapter", "base", "hf"}
    base = AutoModelForCausalLM.from_pretrained(str(ckpt / "base"))
    with torch.no_grad():
        assert torch.allclose(base(x).logits[0], base_logits, atol=1e-4)
        peft_logits = PeftModel.from_pretrained(base, str(ckpt / "adapter"))(x).logits[0]
    torch.testing.assert_close(peft_logits, trained, atol=1e-4, rtol=1e-4)
    merged_here = AutoModelForCausalLM.from_pretrained(str(ckpt / "hf"))
    assert type(merged_here).__name__ == "Qwen3_5ForCausalLM"      # a text-only base: today's layout
    assert not any("lora" in k or "base_layer" in k for k in merged_here.state_dict())
    merged_registry = merge_lora(ckpt / "adapter", tmp_path / "merged", base_model=str(ckpt / "base"))
    with torch.no_grad():
        for folder in (ckpt / "hf", merged_registry):
            logits = AutoModelForCausalLM.from_pretrained(str(folder))(x).logits[0]
            torch.testing.assert_close(logits, trained, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoint_holds_adapters_only_and_a_resumed_step_gives_the_same_loss(tmp_path):
    """Steps 1-2, checkpoint, step 3; then a fresh build resumed from the checkpoint trains step 3 again."""
    from torch.distributed.checkpoint import FileSystemReader

    from raytune_ft.train import checkpoint as ckpt_io
    from raytune_ft.train.state import TrainState

    data = blocks(3)
    with one_rank_group():
        r = recipe(tmp_path, lora_r=4, lora_alpha=8, lora_dropout=0.0)
        model, lm, tok, opt = build(r)
        state = TrainState(model, opt, trainable_only=True)
        for b in data[:2]:
            train_step(model, opt, b)
        state.schedule.step = 2
        ckpt_io.save_train_checkpoint(str(tmp_path / "ck"), state, 0)
        third = train_step(model, opt, data[2])

        model2, _, _, opt2 = build(r)
        state2 = TrainState(model2, opt2, trainable_only=True)
        ckpt_io.load_train_checkpoint(str(tmp_path / "ck"), state2, 0)
        assert state2.step == 2
        again = train_step(model2, opt2, data[2])
    assert again == third
    saved = FileSystemReader(str(tmp_path / "ck" / "dcp")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("app.model.")]
    moments = [k for k in saved if k.startswith("app.optim.state.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights)
    assert moments and all(".lora_A." in k or ".lora_B." in k for k in moments)
    n_adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert len(weights) == sum(1 for p in model.parameters() if p.requires_grad) and n_adapter > 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_bf16_base_and_fp32_adapters_shard_together_and_only_the_adapters_get_gradients(tmp_path):
    """As on a GPU: the base built in bf16 (the compute dtype), the adapters fp32, one FSDP2 unit per layer
    under the bf16 policy, activation checkpointing on; the base never gets a gradient and the loss falls."""
    from raytune_ft.models.build import load_causal_lm, materialize_model
    from raytune_ft.models.tiny import local_tokenizer
    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.fsdp_loop import forward_backward
    from raytune_ft.train.fsdp_model import shard_packed_model
    from raytune_ft.train.lora import add_adapters, init_adapters

    with one_rank_group():
        r = recipe(tmp_path, lora_r=4, lora_alpha=8)
        lm = load_causal_lm(r.model, tokenizer_vocab_size=len(local_tokenizer()), device="meta", dtype=torch.bfloat16)
        add_adapters(lm, r.train)
        model = shard_packed_model(lm, torch.device("cpu"), compute_dtype=torch.bfloat16,
                                   activation_checkpointing="full")
        materialize_model(lm, r.model, "cpu", seed=0)
        init_adapters(lm, 0)
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert {p.dtype for p in trainable} == {torch.float32}
        assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
        opt = torch.optim.AdamW(trainable, lr=5e-3)
        losses = []
        for b in blocks(3):
            loss_sum, denom = forward_backward(model, [StepBatch.from_blocks([b], torch.device("cpu"))], 1,
                                               torch.device("cpu"))
            assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable)
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss_sum / denom))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("family,n_linears", [("qwen3_5", 31), ("qwen3", 28), ("qwen2", 28)])
def test_every_linear_by_default_and_a_named_target_the_model_lacks_is_refused(family, n_linears):
    """The default set adapts whatever linears the family has (qwen3/qwen2: no gated-delta-net ones); a target
    named in train.lora_target_modules that no layer has fails with the field's name."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from raytune_ft.models.tiny import tiny_config
    from raytune_ft.train.lora import add_adapters

    def adapted(targets):
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(tiny_config(family, 512))
        return add_adapters(lm, SimpleNamespace(lora_r=2, lora_alpha=4, lora_dropout=0.0,
                                                lora_target_modules=targets))

    assert len(adapted([])) == n_linears
    if family != "qwen3_5":
        with pytest.raises(ValueError, match=r"train.lora_target_modules: \['in_proj_b'\]"):
            adapted(["q_proj", "in_proj_b"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_layers_with_adapters_train_as_the_eager_ones(tmp_path, monkeypatch):
    """train.compile with LoRA: each layer's MLP (its adapted gate/up/down inside) goes through torch.compile's
    graph capture, and the steps give the eager model's losses. The graphs run on dynamo's "eager" backend:
    Inductor would spend the test's time in a C++ compiler (tests/train/test_eval_samples.py does the same)."""
    import functools

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    data = blocks(2)
    losses = {}
    for compiled in (False, True):
        with one_rank_group():
            torch._dynamo.reset()
            model, lm, tok, opt = build(recipe(tmp_path, lora_r=4, lora_alpha=8, compile=compiled))
            losses[compiled] = [train_step(model, opt, b) for b in data]
    assert graphs and any("lora_A" in str(g.code) or "lora_a" in str(g.code).lower() for g in graphs)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
