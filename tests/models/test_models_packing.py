"""Packed blocks must give each conversation exactly what it gets alone (fp32, CPU).

The models have both kinds of Qwen3.5 token mixer (gated-delta-net and full attention) or only full
attention (Qwen3). The unpatched transformers path is exercised too, so the equality is shown to mean
something: without enable_packing the gated-delta-net layers refuse packing signals or leak.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from raytune_ft.models import attention as attn_mod
from raytune_ft.models.build import load_causal_lm
from raytune_ft.models.gated_delta import (DeltaRuleInputs, enable_packing, is_packing_enabled, packed_forward_kwargs,
                                           segment_causal_conv1d, segment_gated_delta_rule)
from raytune_ft.models.loss import chunked_cross_entropy
from tests.loss_helpers import enable_chunked_loss
from raytune_ft.recipe.recipe import ModelConfig

# Lengths cross the gated-delta-net's 64-token chunk and include a one-token conversation.
LENS = [23, 70, 1, 9, 41]
ATOL = 1e-5


def _block(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 8, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens))
    labels = ids.clone()
    labels[cu[:-1].long()] = -100          # no loss across a boundary, as the packer does
    return dict(input_ids=ids, position_ids=pos, cu_seqlens=cu, seq_idx=seq_idx), labels


def _token_losses(logits_TV, labels_T):
    return F.cross_entropy(logits_TV[:-1], labels_T[1:], reduction="none", ignore_index=-100)


def _separate_token_losses(model, block, lens):
    """Per-token losses of each conversation run alone, laid out as in the packed block."""
    out = torch.zeros(sum(lens) - 1)
    ids = block["input_ids"]
    s = 0
    for n in lens:
        if n > 1:
            logits = model(input_ids=ids[None, s:s + n], use_cache=False).logits[0]
            out[s:s + n - 1] = _token_losses(logits, ids[s:s + n])
        s += n
    return out


def _valid(labels):
    return labels[1:] != -100


def _tiny_model(family: str):
    torch.manual_seed(0)
    model = load_causal_lm(ModelConfig(family=family, local_tiny=True), seed=1)
    model.eval()
    return family, model


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3"])
def tiny(request):
    return _tiny_model(request.param)


@pytest.fixture(scope="module")
def tiny_qwen3_5():
    """The family with gated-delta-net layers only."""
    return _tiny_model("qwen3_5")


def test_packed_forward_equals_separate(tiny):
    family, model = tiny
    assert is_packing_enabled(model)
    if family == "qwen3_5":
        types = model.config.layer_types
        assert "full_attention" in types and "linear_attention" in types
    block, labels = _block(LENS, model.config.vocab_size)
    with torch.no_grad():
        packed = _token_losses(model(**packed_forward_kwargs(block)).logits[0], labels)
        alone = _separate_token_losses(model, block, LENS)
    v = _valid(labels)
    assert v.sum() == sum(LENS) - len(LENS)
    torch.testing.assert_close(packed[v], alone[v], atol=ATOL, rtol=0)


def test_packed_backward_equals_separate(tiny):
    family, model = tiny
    block, labels = _block(LENS, model.config.vocab_size, seed=3)
    params = [p for p in model.parameters() if p.requires_grad]

    model.zero_grad(set_to_none=True)
    logits = model(**packed_forward_kwargs(block)).logits[0]
    packed_loss = _token_losses(logits, labels)[_valid(labels)].sum()
    packed_loss.backward()
    packed_grads = [p.grad.clone() for p in params]

    model.zero_grad(set_to_none=True)
    alone = _separate_token_losses(model, block, LENS)
    alone_loss = alone[_valid(labels)].sum()
    alone_loss.backward()

    torch.testing.assert_close(packed_loss, alone_loss, atol=ATOL * 10, rtol=1e-6)
    worst = max(((a - p.grad).abs().max() / (p.grad.abs().max() + 1e-12)).item()
                for a, p in zip(packed_grads, params))
    # fp32: the gated-delta-net's A_log / dt_bias gradients (sums through an exp gate, with cancellation)
    # reach 2.6e-4 relative from summation order alone; in float64 they agree to 1e-7
    # (test_packed_backward_float64, below), so this bound is roundoff, not a boundary leak.
    assert worst < 1e-3, worst
    for a, p in zip(packed_grads, params):
        torch.testing.assert_close(a, p.grad, atol=ATOL, rtol=1e-4)
    model.zero_grad(set_to_none=True)


def test_position_ids_only_is_enough_when_patched(tiny):
    """TRL's padding-free batches carry only restarting position_ids: the pre-hook derives the rest."""
    family, model = tiny
    block, labels = _block(LENS, model.config.vocab_size, seed=5)
    with torch.no_grad():
        logits = model(input_ids=block["input_ids"][None], position_ids=block["position_ids"][None]).logits[0]
        alone = _separate_token_losses(model, block, LENS)
    v = _valid(labels)
    torch.testing.assert_close(_token_losses(logits, labels)[v], alone[v], atol=ATOL, rtol=0)


def test_two_rows_flattened(tiny):
    """A micro-batch of two packed blocks is laid end to end; each conversation still stands alone."""
    family, model = tiny
    rows = [[30, 34], [12, 40, 12]]
    blocks = [_block(r, model.config.vocab_size, seed=7 + i)[0] for i, r in enumerate(rows)]
    stacked = {k: torch.stack([b[k] for b in blocks]) for k in ("input_ids", "position_ids", "seq_idx")}
    stacked["cu_seqlens"] = [b["cu_seqlens"] for b in blocks]
    kw = packed_forward_kwargs(stacked)
    assert kw["input_ids"].shape == (1, 128)
    assert kw["cu_seq_lens_q"].tolist() == [0, 30, 64, 76, 116, 128]
    with torch.no_grad():
        logits = model(**kw).logits[0]
        for r, (b, lens) in enumerate(zip(blocks, rows)):
            s = r * 64
            for n in lens:
                alone = model(input_ids=b["input_ids"][None, s - r * 64:s - r * 64 + n]).logits[0]
                torch.testing.assert_close(logits[s:s + n], alone, atol=ATOL, rtol=0)
                s += n


def test_unpatched_qwen3_5_refuses_or_leaks(tiny_qwen3_5):
    """Without our patch transformers' torch path refuses cu_seqlens/seq_idx and leaks with position_ids."""
    family, model = tiny_qwen3_5
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="sdpa")
    plain.load_state_dict(model.state_dict())
    plain.eval()
    assert not is_packing_enabled(plain)
    block, labels = _block(LENS, model.config.vocab_size)
    with pytest.raises(ValueError, match="packed sequences"):
        with torch.no_grad():
            plain(**packed_forward_kwargs(block))
    with torch.no_grad():
        leaked = _token_losses(plain(input_ids=block["input_ids"][None],
                                     position_ids=block["position_ids"][None], use_cache=False).logits[0], labels)
        alone = _separate_token_losses(model, block, LENS)
    v = _valid(labels)
    assert (leaked[v] - alone[v]).abs().max() > 1e-3     # conversations bleed into each other
    # ... and the patched model on the same weights does not.
    enable_packing(plain)
    with torch.no_grad():
        fixed = _token_losses(plain(**packed_forward_kwargs(block)).logits[0], labels)
    torch.testing.assert_close(fixed[v], alone[v], atol=ATOL, rtol=0)


def test_plain_causal_run_of_the_block_leaks(tiny):
    """The comparison can see cross-conversation attention: the block without packing signals differs.
    (For pure full attention, transformers' own sdpa path also separates conversations when given
    restarting position_ids, through a dense T x T mask; the varlen path builds no such mask.)"""
    family, model = tiny
    block, labels = _block(LENS, model.config.vocab_size, seed=11)
    with torch.no_grad():
        causal = _token_losses(model(input_ids=block["input_ids"][None]).logits[0], labels)
        alone = _separate_token_losses(model, block, LENS)
    v = _valid(labels)
    assert (causal[v] - alone[v]).abs().max() > 1e-3


def test_enable_packing_is_idempotent(tiny):
    family, model = tiny
    before = [type(m) for m in model.modules()]
    hooks = len(model.model._forward_pre_hooks)
    enable_packing(model)
    assert [type(m) for m in model.modules()] == before
    assert len(model.model._forward_pre_hooks) == hooks
    assert model.config._attn_implementation == attn_mod.ATTN_NAME


def test_chunked_loss_inside_forward_matches_plain(tiny):
    """enable_chunked_loss: model(..., labels=) gives the shifted loss sum and count of the full logits."""
    family, model = tiny
    block, labels = _block(LENS, model.config.vocab_size, seed=13)
    kw = packed_forward_kwargs(block)
    with torch.no_grad():
        logits = model(**kw).logits
        ref = _token_losses(logits[0], labels)[_valid(labels)].sum()
        m = enable_chunked_loss(copy.deepcopy(model), chunk_size=16)
        out = m(**kw, labels=labels[None])
    torch.testing.assert_close(out.loss_sum, ref, atol=1e-4, rtol=1e-6)
    assert int(out.n_tokens) == int(_valid(labels).sum())
    assert out.logits is None


# ----------------------------------------------------------------- the pieces on their own

def test_segment_conv_matches_per_segment():
    torch.manual_seed(0)
    lens = [5, 1, 3, 12]
    x = torch.randn(1, 6, sum(lens))
    w = torch.randn(6, 4)
    cu = torch.tensor([0, 5, 6, 9, 21], dtype=torch.int32)
    got = segment_causal_conv1d(x, w, None, cu, activation="silu")
    s = 0
    for n in lens:
        ref = F.silu(F.conv1d(x[:, :, s:s + n], w.unsqueeze(1), padding=3, groups=6)[:, :, :n])
        torch.testing.assert_close(got[:, :, s:s + n], ref, atol=1e-6, rtol=0)
        s += n
    whole = F.silu(F.conv1d(x, w.unsqueeze(1), padding=3, groups=6)[:, :, :sum(lens)])
    assert (whole - got).abs().max() > 1e-3                        # the unsegmented conv leaks


def test_segment_gated_delta_matches_per_segment():
    torch.manual_seed(0)
    lens = [65, 2, 30]
    t = sum(lens)
    q, k = torch.randn(1, t, 2, 8), torch.randn(1, t, 2, 8)
    v = torch.randn(1, t, 4, 8)
    g = -torch.rand(1, t, 4)
    beta = torch.rand(1, t, 4)
    cu = torch.tensor([0, 65, 67, 97], dtype=torch.int32)
    got = segment_gated_delta_rule(DeltaRuleInputs(q, k, v, g, beta), cu)
    from raytune_ft.models.gated_delta import _torch_reference_gated_delta_rule

    ref_fn = _torch_reference_gated_delta_rule()
    s = 0
    for n in lens:
        ref, _ = ref_fn(q[:, s:s + n], k[:, s:s + n], v[:, s:s + n], g=g[:, s:s + n], beta=beta[:, s:s + n],
                        use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(got[:, s:s + n], ref, atol=1e-6, rtol=0)
        s += n
    whole, _ = ref_fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert (whole[:, 65:] - got[:, 65:]).abs().max() > 1e-3


@pytest.mark.parametrize("dense_limit", [8192, 16])
def test_varlen_attention_cpu_paths_match_per_conversation(monkeypatch, dense_limit):
    """Both CPU forms (block-diagonal mask, and the per-conversation loop for long blocks), with GQA."""
    monkeypatch.setattr(attn_mod, "_DENSE_MASK_MAX_TOKENS", dense_limit)
    torch.manual_seed(0)
    lens = [7, 20, 1, 12]
    t = sum(lens)
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, 2, 8), torch.randn(t, 2, 8)
    cu = torch.tensor([0, 7, 27, 28, 40], dtype=torch.int32)
    assert attn_mod.select_attention_backend("cpu") == "sdpa_blockdiag"
    got = attn_mod.varlen_attention(attn_mod.QKV(q, k, v), cu, max_len=20, scaling=0.3)
    s = 0
    for n in lens:
        qs, ks, vs = (x[s:s + n].transpose(0, 1)[None] for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1),
                                             is_causal=True, scale=0.3)[0].transpose(0, 1)
        torch.testing.assert_close(got[s:s + n], ref, atol=1e-6, rtol=0)
        s += n


def test_chunked_cross_entropy_matches_full_logits():
    """Value and both gradients equal plain F.cross_entropy on the full fp32 logits (1e-5)."""
    torch.manual_seed(0)
    b, t, d, vocab = 2, 45, 16, 97
    h = torch.randn(b, t, d, requires_grad=True)
    w = (0.5 * torch.randn(vocab, d)).requires_grad_()
    labels = torch.randint(0, vocab, (b, t))
    labels[:, :6] = -100
    labels[1, 30:] = -100
    loss, n = chunked_cross_entropy(h, w, labels, chunk_size=7)
    (loss * 0.5).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    logits = (h @ w.t()).float()
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1),
                          ignore_index=-100, reduction="sum")
    (ref * 0.5).backward()
    assert int(n) == int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(loss / n, ref / n, atol=1e-5, rtol=0)
    torch.testing.assert_close(gh, h.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(gw, w.grad, atol=1e-5, rtol=0)
    mean, _ = chunked_cross_entropy(h, w, labels, chunk_size=1000, reduction="mean")
    torch.testing.assert_close(mean, ref / n, atol=1e-5, rtol=0)


def test_packed_backward_float64_qwen3_5():
    """The gated-delta-net path in float64: packed and separate gradients agree to roundoff of the fp32
    gate that transformers keeps (1e-7 relative), for every parameter."""
    torch.manual_seed(0)
    model = load_causal_lm(ModelConfig(family="qwen3_5", local_tiny=True), seed=1, dtype=torch.float64)
    model.eval()
    block, labels = _block(LENS, model.config.vocab_size, seed=3)
    params = [p for p in model.parameters() if p.requires_grad]
    _token_losses(model(**packed_forward_kwargs(block)).logits[0], labels)[_valid(labels)].sum().backward()
    packed_grads = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    _separate_token_losses(model, block, LENS)[_valid(labels)].sum().backward()
    worst = max(((a - p.grad).abs().max() / (p.grad.abs().max() + 1e-30)).item()
                for a, p in zip(packed_grads, params))
    assert worst < 1e-6, worst


def test_chunked_loss_backward_makes_no_second_fp32_copy_of_the_head_gradient():
    """The loss keeps the lm_head's gradient in an fp32 (V, D) accumulator from its forward; its backward scales
    it by the incoming gradient in place and casts it once to the weight's dtype. A new fp32 product there was
    4.7 GiB at the 27B's vocabulary on top of the accumulator, at the backward's start. Counted: the bytes of every
    new storage an op makes during the backward (a dispatch mode; frees are not subtracted). A second backward
    through the same loss is refused (autograd sees the saved gradients changed in place), not wrong."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NewBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    self.total += t.untyped_storage().nbytes()
            return out

    vocab, d, t = 4096, 64, 40
    w = torch.randn(vocab, d, dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(1, t, d, dtype=torch.bfloat16, requires_grad=True)
    loss_sum, n = chunked_cross_entropy(h, w, torch.randint(0, vocab, (1, t)), chunk_size=16)
    loss = loss_sum / n
    with NewBytes() as counted:
        loss.backward(retain_graph=True)
    assert w.grad.dtype == torch.bfloat16
    assert counted.total < vocab * d * 4, counted.total          # the bf16 cast and small tensors only
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
