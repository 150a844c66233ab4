"""Exports in the base checkpoint's own layout (models/layout.py), on a tiny Qwen3_5ForConditionalGeneration
checkpoint built here (transformers' own conditional-generation config at a tiny size, with an MTP tensor and
processor file as the published checkpoint has them), trained by the FSDP2 loop's model in-process.

The full-SFT export and the merged LoRA export hold the trained text tower under the base's key names and
the base's untouched vision tower, MTP weights, config and processor files; the base's class loads them and
gives the trained model's text logits. The adapter names the base's module paths, PEFT loads it onto the base,
and the registry's merge gives a folder in the base's layout too.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.lora_helpers import blocks, build, ids, loop_logits, one_rank_group, recipe, train_step

MTP_KEY = "mtp.fc.weight"


def _conditional_base(folder) -> dict[str, torch.Tensor]:
    """A tiny Qwen3_5ForConditionalGeneration checkpoint with the project's tokenizer; its tensors."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from raytune_ft.models.tiny import local_tokenizer, tiny_config

    tok = local_tokenizer()
    cfg = Qwen3_5Config(text_config=tiny_config("qwen3_5", len(tok)).to_dict(),
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64, patch_size=4, num_position_embeddings=16))
    torch.manual_seed(11)
    Qwen3_5ForConditionalGeneration(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors[MTP_KEY] = torch.randn(8, 8)          # the published checkpoint's MTP head, unused by training
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "preprocessor_config.json").write_text(json.dumps({"patch_size": 4, "merge_size": 2}))
    return tensors


def _text_logits(folder, x):
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(folder))
    with torch.no_grad():
        return model(input_ids=x).logits[0]


def _assert_base_layout(folder, base: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    out = load_file(str(folder / "model.safetensors"))
    assert set(out) == set(base)                       # the base's key names, nothing more or less
    assert not any("lora" in k or "base_layer" in k for k in out)
    for k, v in base.items():
        if not k.startswith(("model.language_model.", "lm_head.")):      # vision tower, MTP: as they were
            assert torch.equal(out[k], v), k
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in cfg
    assert (folder / "preprocessor_config.json").is_file()


def _train_and_export(tmp_path, x, **train) -> torch.Tensor:
    """The loop's model on the base at tmp_path/base, 2 steps, its final export into tmp_path/ckpt; the trained
    model's logits for `x`. Before training, it gives the base's own text logits."""
    from raytune_ft.train.lora_export import final_export

    with one_rank_group():
        r = recipe(tmp_path, name=str(tmp_path / "base"), **train)
        model, lm, tok, opt = build(r)
        torch.testing.assert_close(loop_logits(model, x), _text_logits(tmp_path / "base", x), atol=1e-4, rtol=1e-4)
        for b in blocks(2):
            train_step(model, opt, b)
        trained = loop_logits(model, x)
        final_export(r, model, tok, 0, torch.float32)(str(tmp_path / "ckpt" / "hf"))
    return trained


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_full_sft_export_is_the_conditional_base_with_the_trained_text_tower(tmp_path):
    base = _conditional_base(tmp_path / "base")
    x = ids()
    trained = _train_and_export(tmp_path, x)
    _assert_base_layout(tmp_path / "ckpt" / "hf", base)
    torch.testing.assert_close(_text_logits(tmp_path / "ckpt" / "hf", x), trained, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_lora_adapter_and_merges_follow_the_conditional_base(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForConditionalGeneration

    from raytune_ft.registry import merge_lora

    base = _conditional_base(tmp_path / "base")
    x = ids()
    trained = _train_and_export(tmp_path, x, lora_r=4, lora_alpha=8, merge_adapter=True)
    ckpt = tmp_path / "ckpt"
    assert {p.name for p in ckpt.iterdir()} == {"adapter", "hf"}     # a real base: no base/ copy
    keys = list(load_file(str(ckpt / "adapter" / "adapter_model.safetensors")))
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    cfg = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tmp_path / "base")
    _assert_base_layout(ckpt / "hf", base)
    torch.testing.assert_close(_text_logits(ckpt / "hf", x), trained, atol=1e-4, rtol=1e-4)
    peft = PeftModel.from_pretrained(Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path / "base")),
                                     str(ckpt / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=x).logits[0], trained, atol=1e-4, rtol=1e-4)
    merged = merge_lora(ckpt / "adapter", tmp_path / "merged")       # the base named by the adapter
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    torch.testing.assert_close(_text_logits(merged, x), trained, atol=1e-4, rtol=1e-4)
