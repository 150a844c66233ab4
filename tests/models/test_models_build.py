"""Model building: tokenizers, tiny and real-shaped configs, checkpoint loading (VL text tower, sharded)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from raytune_ft.models.build import (decoder_layers, load_causal_lm, load_pretrained_weights_sharded,
                                     materialize_model, tokenizer_for)
from raytune_ft.models.gated_delta import packed_forward_kwargs
from raytune_ft.models.tiny import (ASSETS, CHATML_TEMPLATE, build_tokenizer_files, local_tokenizer,
                                    real_config, tiny_config)
from raytune_ft.recipe.recipe import ModelConfig

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6, of course."},
]


# ----------------------------------------------------------------- tokenizers

def test_local_tokenizer_special_tokens_and_template():
    tok = local_tokenizer()
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"):
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and tok.convert_ids_to_tokens(ids[0]) == t
    assert 2000 <= len(tok) <= 4200
    enc = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "It is 4.<|im_end|>6, of course.<|im_end|>"
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    no_think = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(tok.encode("Hello, world! 1234")) == "Hello, world! 1234"


def test_shipped_tokenizer_is_what_the_generator_makes(tmp_path):
    """The asset is reproducible from its script (deterministic BPE training)."""
    out = build_tokenizer_files(tmp_path / "tok")
    shipped = json.loads((ASSETS / "tokenizer.json").read_text())
    fresh = json.loads((out / "tokenizer.json").read_text())
    assert fresh["model"]["vocab"] == shipped["model"]["vocab"]
    assert fresh["model"]["merges"] == shipped["model"]["merges"]
    assert sum(f.stat().st_size for f in ASSETS.iterdir()) < 2_000_000


def test_tokenizer_for_real_qwen_files(fixtures, tmp_path):
    cfg = ModelConfig(name=str(fixtures / "tokenizers" / "qwen3"), family="qwen3")
    tok = tokenizer_for(cfg)
    assert tok.encode("Hello, world!", add_special_tokens=False) == [9707, 11, 1879, 0]
    assert tok.pad_token is not None
    cfg27 = ModelConfig(name=str(fixtures / "tokenizers" / "qwen3"),
                        chat_template=str(fixtures / "templates" / "qwen3.8-27b.chat_template.jinja"))
    tok27 = tokenizer_for(cfg27)
    assert tok27.chat_template == (fixtures / "templates" / "qwen3.8-27b.chat_template.jinja").read_text()
    # A tokenizer folder without a template gets our ChatML one.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("vocab.json", "merges.txt"):
        os.symlink(fixtures / "tokenizers" / "qwen3" / f, bare / f)
    (bare / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer",
                                                            "eos_token": "<|endoftext|>"}))
    assert tokenizer_for(ModelConfig(name=str(bare), family="qwen2")).chat_template == CHATML_TEMPLATE


# ----------------------------------------------------------------- tiny models

@pytest.mark.parametrize("family,cls", [("qwen3_5", "Qwen3_5ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"),
                                        ("qwen2", "Qwen2ForCausalLM")])
def test_tiny_build_each_family(family, cls):
    tok = local_tokenizer()
    cfg = ModelConfig(family=family, local_tiny=True)
    model = load_causal_lm(cfg, tokenizer_vocab_size=len(tok))
    assert type(model).__name__ == cls
    assert model.config.vocab_size == len(tok)
    assert len(decoder_layers(model)) == model.config.num_hidden_layers == 4
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    if family == "qwen3_5":
        assert model.config.layer_types.count("full_attention") == 1
        assert model.config.layer_types.count("linear_attention") == 3
    again = load_causal_lm(cfg, tokenizer_vocab_size=len(tok))
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n                     # seeded: the same weights every time
    other = load_causal_lm(cfg, tokenizer_vocab_size=len(tok), seed=5)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
    ids = torch.tensor([tok.encode("Hello there, how are you?")])
    out = model(input_ids=ids)
    assert out.logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(out.logits).all()
    meta = load_causal_lm(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())


def test_tiny_config_rejects_unknown_family():
    with pytest.raises(ValueError, match="model.family"):
        tiny_config("llama", 100)


# ----------------------------------------------------------------- real shapes

def test_real_config_parameter_counts():
    expected = {  # total parameters (a tied matrix once), billions
        "qwen3-4b": (4.02, 0.01),
        "qwen2-0.5b": (0.494, 0.002),
        "qwen3.8-27b": (26.9, 0.2),      # the text tower of the 27B VL checkpoint
    }
    for name, (b, tol) in expected.items():
        cfg = real_config(name)
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg)
        total = sum(p.numel() for p in m.parameters()) / 1e9
        assert abs(total - b) < tol, (name, total)
    c27 = real_config("qwen3.8-27b")
    assert c27.layer_types.count("full_attention") == 16 and c27.layer_types.count("linear_attention") == 48
    assert (c27.hidden_size, c27.num_attention_heads, c27.num_key_value_heads, c27.head_dim) == (5120, 24, 4, 256)
    assert (c27.linear_num_key_heads, c27.linear_num_value_heads, c27.vocab_size) == (16, 48, 248320)
    assert not c27.tie_word_embeddings and real_config("qwen3-4b").tie_word_embeddings
    cut = real_config("qwen3.8-27b", num_hidden_layers=8)
    assert cut.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


# ----------------------------------------------------------------- checkpoints

def _tiny_vl_checkpoint(path):
    """A tiny Qwen3.5 vision-language checkpoint laid out as the 27B one (text under model.language_model)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_config("qwen3_5", 300).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    vl = Qwen3_5ForConditionalGeneration(cfg).eval()
    vl.save_pretrained(str(path))
    return vl


def test_vl_checkpoint_loads_as_text_causal_lm(tmp_path):
    vl = _tiny_vl_checkpoint(tmp_path / "vl")
    keys = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert keys["model_type"] == "qwen3_5"
    cfg = ModelConfig(name=str(tmp_path / "vl"), family="qwen3_5")
    model = load_causal_lm(cfg)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not any("visual" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(model.model.layers[3].self_attn.q_proj.weight,
                               vl.model.language_model.layers[3].self_attn.q_proj.weight)
    ids = torch.randint(0, 290, (1, 24))
    with torch.no_grad():
        want = vl(input_ids=ids, use_cache=False).logits
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # Packed: two conversations through the text model equal each alone through the VL model.
    block = dict(input_ids=ids[0], position_ids=torch.cat([torch.arange(10), torch.arange(14)]),
                 cu_seqlens=torch.tensor([0, 10, 24], dtype=torch.int32))
    with torch.no_grad():
        packed = model(**packed_forward_kwargs(block)).logits[0]
        second = vl(input_ids=ids[:, 10:], use_cache=False).logits[0]
    torch.testing.assert_close(packed[10:], second, atol=1e-5, rtol=0)
    # The meta flow reads the same weights.
    meta = load_causal_lm(cfg, device="meta")
    meta.to_empty(device="cpu")
    report = load_pretrained_weights_sharded(meta, cfg)
    assert not report["missing"] and len(report["loaded"]) == len(list(model.parameters()))
    for (n, a), b in zip(model.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), n


def test_qwen3_checkpoint_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("qwen3", 300, tie_word_embeddings=True)
    torch.manual_seed(0)
    src = AutoModelForCausalLM.from_config(cfg).eval()
    src.save_pretrained(str(tmp_path / "q3"))
    model = load_causal_lm(ModelConfig(name=str(tmp_path / "q3"), family="qwen3"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, src(input_ids=ids, use_cache=False).logits,
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="does not fit the model"):
        _load_into_mismatched(tmp_path / "q3")


def _load_into_mismatched(folder):
    """A checkpoint of another architecture is refused with the missing names, not half-loaded."""
    other = load_causal_lm(ModelConfig(family="qwen3_5", local_tiny=True), device="meta")
    other.to_empty(device="cpu")
    return load_pretrained_weights_sharded(other, ModelConfig(name=str(folder), family="qwen3_5"))


# ----------------------------------------------------------------- FSDP2 (2 CPU ranks, gloo)

def _fsdp_worker(rank, world, port, folder, result_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests.conftest import spawned_gloo_rank

    with spawned_gloo_rank(rank, world, port):
        cfg = ModelConfig(name=folder, family="qwen3_5")
        model = load_causal_lm(cfg, device="meta")
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        materialize_model(model, cfg, "cpu")
        local_rows = model.model.embed_tokens.weight.to_local().shape[0]
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        ids = torch.arange(3, 27)[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        if rank == 0:
            torch.save({"state": full, "logits": logits, "rows": local_rows}, os.path.join(result_dir, "r0.pt"))


@pytest.mark.timeout(240)
def test_fsdp2_sharded_load_matches_unsharded(tmp_path):
    """Two gloo ranks, FSDP2 on meta, each rank fills only its shard: same weights and logits as one process."""
    import torch.multiprocessing as mp

    from tests.mlflow_server import free_port

    _tiny_vl_checkpoint(tmp_path / "vl")
    mp.spawn(_fsdp_worker, args=(2, free_port(), str(tmp_path / "vl"), str(tmp_path)), nprocs=2)
    got = torch.load(tmp_path / "r0.pt")
    ref = load_causal_lm(ModelConfig(name=str(tmp_path / "vl"), family="qwen3_5"))
    assert got["rows"] == 150                       # vocab 300 split over 2 ranks
    for k, v in ref.state_dict().items():
        assert torch.equal(got["state"][k], v), k
    with torch.no_grad():
        want = ref(input_ids=torch.arange(3, 27)[None]).logits
    torch.testing.assert_close(got["logits"], want, atol=1e-5, rtol=0)
