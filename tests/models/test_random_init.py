"""model.init="random": the real architecture with transformers' init, plain or FSDP2-sharded, no checkpoint;
the builtin lognormal dataset used with it for throughput runs; the packed conv and GQA choices."""

import pytest
import torch
import torch.multiprocessing as mp

from raytune_ft.models.build import load_causal_lm, random_init_
from raytune_ft.models.tiny import real_config
from raytune_ft.recipe.recipe import ModelConfig, Recipe, RecipeError, validate
from tests.conftest import FIXTURES, spawned_gloo_rank
from tests.mlflow_server import free_port



def _stats(model):
    return {n: (float(p.float().mean()), float(p.float().std()) if p.numel() > 1 else 0.0)
            for n, p in model.named_parameters()}


def test_random_init_builds_the_real_shape_without_a_checkpoint():
    cfg = ModelConfig(name="Qwen/Qwen2-0.5B", family="qwen2", init="random")
    model = load_causal_lm(cfg, device="cpu", dtype=torch.bfloat16, seed=3)
    assert model.config.hidden_size == 896 and model.config.num_hidden_layers == 24
    n = sum(p.numel() for p in model.parameters())
    assert 490e6 < n < 500e6, n                       # Qwen2-0.5B: 494M parameters, tied embedding
    w = model.model.layers[5].mlp.up_proj.weight.float()
    assert abs(w.std().item() - model.config.initializer_range) < 1e-3
    assert torch.equal(model.model.layers[0].input_layernorm.weight.float(), torch.ones(896))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()   # tied
    again = load_causal_lm(cfg, device="cpu", dtype=torch.bfloat16, seed=3)
    assert torch.equal(again.model.layers[5].mlp.up_proj.weight, model.model.layers[5].mlp.up_proj.weight)


def _sharded_worker(rank, world, port, out):
    from torch.distributed.fsdp import fully_shard

    with spawned_gloo_rank(rank, world, port):
        from transformers import AutoModelForCausalLM

        cfg = real_config("qwen3.8-27b", num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                          vocab_size=1000)
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
        m.to_empty(device="cpu")
        with torch.no_grad():
            for p in m.parameters():
                p.to_local().fill_(float("nan"))
        random_init_(m, seed=0)
        full = {n: p.full_tensor() for n, p in m.named_parameters()}
        if rank == 0:
            torch.save(full, out)


@pytest.mark.timeout(300)
def test_random_init_of_a_sharded_model_matches_transformers_init(tmp_path):
    """Two gloo ranks, FSDP2 per layer then root, Qwen3.5 (gated-delta-net + attention) cut small: every
    parameter filled (no NaN left), with the same per-tensor statistics as transformers' own init."""
    out = str(tmp_path / "full.pt")
    mp.spawn(_sharded_worker, args=(2, free_port(), out), nprocs=2, join=True)
    full = torch.load(out)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = real_config("qwen3.8-27b", num_hidden_layers=4, hidden_size=256, intermediate_size=512, vocab_size=1000)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    ref_stats = _stats(ref)
    assert set(full) == set(ref_stats)
    for name, t in full.items():
        assert not t.isnan().any(), name
        mean, std = ref_stats[name]
        if t.numel() > 1000:                       # weights: N(0, 0.02) like the reference
            assert abs(t.mean().item() - mean) < 2e-3 and abs(t.std().item() - std) < 2e-3, name
        elif name.endswith(("layernorm.weight", "norm.weight")) or name.endswith("dt_bias"):
            assert torch.equal(t, torch.full_like(t, mean)), name     # constants: zeros / ones
        elif name.endswith("A_log"):
            assert ((t.exp() >= 0.01 - 1e-6) & (t.exp() <= 16 + 1e-4)).all(), name


def test_random_init_recipe_and_lognormal_source_validate():
    r = Recipe()
    r.model.init = "random"
    r.data.source = "builtin:lognormal:100"
    validate(r)
    r.data.source = "builtin:nonesuch:10"
    with pytest.raises(RecipeError, match="builtin"):
        validate(r)
    r.data.source = "builtin:lognormal"
    r.model.init = "zeros"
    with pytest.raises(RecipeError, match="model.init"):
        validate(r)


def test_builtin_lognormal_has_the_peers_lengths_in_real_qwen_tokens():
    """Each word is one token of the real Qwen3 vocabulary, so rendered conversations follow the peers'
    lognormal (median ~900 tokens, clipped 64..8192)."""
    import numpy as np
    from transformers import AutoTokenizer

    from raytune_ft.data.builtin import _PLAIN, builtin_lognormal

    tok = AutoTokenizer.from_pretrained(str(FIXTURES / "tokenizers" / "qwen3"))
    assert all(len(tok.encode(" " + w, add_special_tokens=False)) == 1 for w in _PLAIN)
    rows = builtin_lognormal(400, seed=0)
    assert rows == builtin_lognormal(400, seed=0)
    lens = [len(tok(tok.apply_chat_template(r["messages"], tokenize=False))["input_ids"]) for r in rows]
    assert 750 < float(np.median(lens)) < 1050
    assert min(lens) >= 64 and max(lens) <= 8192 + 32
    user = [len(r["messages"][0]["content"].split()) for r in rows]
    words = [len((r["messages"][0]["content"] + " " + r["messages"][1]["content"]).split()) for r in rows]
    assert abs(sum(user) / sum(words) - 0.3) < 0.01


@pytest.mark.parametrize("impl", ["shifted", "padded"])
def test_segment_conv_restarts_at_every_boundary(impl, monkeypatch):
    """Both torch implementations of the packed conv equal a plain causal conv run on each conversation
    alone (float64), conversations shorter than the kernel included; gradients too."""
    import torch.nn.functional as F

    import raytune_ft.models.gated_delta as gd

    monkeypatch.setattr(gd, "CONV_IMPL", impl)
    torch.manual_seed(0)
    c, t, k = 12, 80, 4
    x = torch.randn(1, t, c, dtype=torch.float64).transpose(1, 2).requires_grad_(True)   # channel-last
    w = torch.randn(c, k, dtype=torch.float64, requires_grad=True)
    b = torch.randn(c, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 1, 3, 30, 32, 33, 70, 80], dtype=torch.int32)
    y = gd.segment_causal_conv1d(x, w, b, cu)
    bounds = cu.tolist()
    ref = torch.cat([F.silu(F.conv1d(x[:, :, s:e], w.unsqueeze(1), b, padding=k - 1, groups=c)[..., :e - s])
                     for s, e in zip(bounds[:-1], bounds[1:])], dim=2)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    probe = torch.randn_like(ref)
    g = torch.autograd.grad((y * probe).sum(), (x, w, b))
    g_ref = torch.autograd.grad((ref * probe).sum(), (x, w, b))
    for a, r in zip(g, g_ref):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-11)


def test_varlen_gqa_is_used_natively_only_when_it_matches(monkeypatch):
    """The choice between passing fewer KV heads to varlen_attn and repeating them. varlen_attn needs CUDA,
    so the kernels here are test doubles built from SDPA: one that shares KV heads across query groups
    (native GQA), one that refuses fewer KV heads, one that silently reads only the first KV head."""
    import torch.nn.functional as F

    import raytune_ft.models.attention as att

    def sdpa_varlen(q, k, v, cu, cu_k, max_q, max_k, window_size=(-1, 0), scale=None):
        outs = []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            outs.append(F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                       v[s:e].transpose(0, 1), is_causal=True, scale=scale,
                                                       enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1))
        return torch.cat(outs)

    def refusing(q, k, v, *a, **kw):
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("number of heads in key/value must divide number of heads in query")
        return sdpa_varlen(q, k, v, *a, **kw)

    def wrong(q, k, v, *a, **kw):
        if q.shape[1] != k.shape[1]:
            k, v = k[:, :1].expand(-1, q.shape[1], -1), v[:, :1].expand(-1, q.shape[1], -1)
        return sdpa_varlen(q, k, v, *a, **kw)

    torch.manual_seed(0)
    q, k, v = torch.randn(40, 6, 8), torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    for fn, expect in ((sdpa_varlen, True), (refusing, False), (wrong, False)):
        monkeypatch.setattr(att, "_NATIVE_GQA", {})
        assert att._native_gqa_ok(fn, att.QKV(q, k, v), cu, 25, {"window_size": (-1, 0)}) is expect, fn.__name__


def test_context_parallel_attention_shares_the_kv_heads_where_the_kernel_does(monkeypatch):
    """Under CP each rank's queries run against the gathered keys of their conversations, more keys than queries.
    With a torch whose varlen_attn has no `enable_gqa` (2.11), the 4 KV heads went to the kernel repeated to 24:
    6x the selected keys and their gradients. Now the same check as the packed path decides. varlen_attn needs
    CUDA, so the kernels here are test doubles built from SDPA (bottom-right causal, as FlashAttention aligns
    more keys than queries): one that shares KV heads across query groups, one that refuses fewer KV heads."""
    import torch.nn.functional as F

    import raytune_ft.models.attention as att
    import raytune_ft.models.context_parallel as cp
    import raytune_ft.models.context_parallel.full_attention as fa

    seen: list[int] = []

    def sharing(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), scale=None):
        seen.append(k.shape[1])
        outs = []
        for qs, qe, ks, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril((ke - ks) - (qe - qs))
            outs.append(F.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1), attn_mask=mask,
                scale=scale, enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1))
        return torch.cat(outs)

    def refusing(q, k, v, *a, **kw):
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("number of heads in key/value must divide number of heads in query")
        return sharing(q, k, v, *a, **kw)

    torch.manual_seed(0)
    shard = cp.make_shard([0, 10, 40], 40, 1, 0)     # chunk 1 continues the conversation chunk 0 began
    q = torch.randn(40, 6, 8, dtype=torch.bfloat16)
    k, v = torch.randn(40, 2, 8, dtype=torch.bfloat16), torch.randn(40, 2, 8, dtype=torch.bfloat16)
    exact = fa.cp_attention(q.float(), k.float(), v.float(), shard)    # fp32: the masked SDPA path
    # the KV heads each kernel call got: the check's native and repeated forms, then the call itself
    for kernel, calls in ((sharing, [2, 6, 2]), (refusing, [6])):
        monkeypatch.setattr(att, "_NATIVE_GQA", {})
        monkeypatch.setattr(att, "_torch_varlen", lambda kernel=kernel: (kernel, frozenset({"window_size", "scale"})))
        seen.clear()
        out = fa.cp_attention(q, k, v, shard, backend="torch_varlen")
        assert seen == calls, kernel.__name__
        torch.testing.assert_close(out.float(), exact, atol=3e-2, rtol=3e-2)


def test_save_final_false_needs_registry_off():
    r = Recipe()
    r.train.save_final = False
    with pytest.raises(RecipeError, match="save_final"):
        validate(r)
    r.registry.enabled = False
    validate(r)


def test_relative_local_paths_reach_workers_as_absolute(tmp_path, monkeypatch):
    from raytune_ft.recipe.recipe import absolute_local_paths

    (tmp_path / "tok").mkdir()
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    r = Recipe()
    r.model.tokenizer, r.model.chat_template = "tok", "./t.jinja"
    absolute_local_paths(r)
    assert r.model.tokenizer == str(tmp_path / "tok") and r.model.chat_template == str(tmp_path / "t.jinja")
    assert r.model.name == "Qwen/Qwen3.8-27B"                 # a hub id, not a local path: unchanged
    assert r.data.source == "hf://HuggingFaceH4/ultrachat_200k"
