"""Context-parallel attention on split pieces (models/context_parallel/split_attention.py): a piece's queries over
the keys before them and their own, in two kernel calls merged by log-sum-exp, forward and backward, against
plain attention with a bottom-right causal mask. On CPU the split runs with its plain-torch kernel pair
(`KERNELS["math"]`), the same contract as cuDNN's ops; the cuDNN pair itself runs only on a GPU (the start-up
kernel check and tests/gpu prove it there)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raytune_ft.models import attention
from raytune_ft.models.context_parallel import full_attention, make_shard, split_attention, zigzag_index

H, HKV, D = 6, 2, 16


def _reference(q, k, v, n_prefix):
    """q (nq, H, d) over k/v (n_prefix + nq, Hkv, d), query i seeing keys up to n_prefix + i: SDPA, dense mask."""
    nq, nk = q.shape[0], k.shape[0]
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(n_prefix)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("n_prefix", [0, 5, 37])
def test_split_and_merge_equal_one_attention_over_all_earlier_keys(n_prefix):
    gen = torch.Generator().manual_seed(n_prefix)
    nq = 11
    q = torch.randn(nq, H, D, generator=gen)
    k, v = (torch.randn(n_prefix + nq, HKV, D, generator=gen) for _ in range(2))
    split = split_attention.Split(n_prefix, D ** -0.5, split_attention.KERNELS["math"])
    got, got_g = _grads(lambda q, k, v: split_attention.prefix_causal_attention(q, k, v, split), q, k, v)
    want, want_g = _grads(lambda q, k, v: _reference(q, k, v, n_prefix), q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_the_backward_needs_the_merged_normaliser():
    """Negative control: each part's backward from its OWN log-sum-exp (not the merged one) gives wrong dq."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, 7, D, generator=gen)
    k, v = (torch.randn(1, HKV, 12, D, generator=gen) for _ in range(2))
    math = split_attention.KERNELS["math"]
    dout = torch.randn(1, H, 7, D, generator=gen)
    part = split_attention.Part(q, k[:, :, :5], v[:, :, :5], False, D ** -0.5)
    out, lse, _ = math.forward(part)
    own = math.backward(part, dout, out, lse, None)[0]
    _, (want, _, _) = _grads(lambda q, k, v: _reference(q, k, v, 5),
                             q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))
    assert (own[0].transpose(0, 1) - want).abs().max() > 1e-2


@pytest.mark.parametrize("min_queries", [1, None])
def test_cp_attention_on_split_pieces_equals_the_sdpa_path(min_queries):
    """A group of one still splits the block into two 70-token chunks: conversation 3 crosses from the first into
    the second, so the second chunk's piece has 22 keys before it. min_queries 1: every piece through the split
    in place; None: cp_attention's own rule, the chunk-long piece in place and the three short ones gathered into
    one query tensor for one call of the packed path's varlen kernel (on CPU, which has none, the split of each)."""
    cu = torch.tensor([0, 45, 48, 140], dtype=torch.int32)
    shard = make_shard(cu, 140, 1, 0)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(140, H, D, generator=gen)
    k, v = (torch.randn(140, HKV, D, generator=gen) for _ in range(2))
    calls = []

    def split(*args):
        calls.append((args[3].end - args[3].start, args[0].shape[0]))
        return real(*args)
    real = full_attention._one_piece
    full_attention._one_piece = split
    try:
        if min_queries is None:
            got, got_g = _grads(lambda q, k, v: full_attention.cp_attention(q, k, v, shard, D ** -0.5,
                                                                             backend="cudnn"), q, k, v)
        else:
            got, got_g = _grads(lambda q, k, v: _all_split(q, k, v, shard), q, k, v)
    finally:
        full_attention._one_piece = real
    want, want_g = _grads(lambda q, k, v: full_attention.cp_attention(q, k, v, shard, D ** -0.5), q, k, v)
    assert full_attention.select_cp_attention_backend("cpu") != "cudnn"
    assert calls == ([(45, 140), (3, 140), (22, 140), (70, 140)] if min_queries else
                     [(45, 70), (3, 70), (22, 70), (70, 140)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _all_split(q, k, v, shard):
    """cp_attention's "cudnn" branch with every piece through the split (the gather of a group of one is k/v)."""
    pieces = shard.pieces(0) + shard.pieces(1)
    order = zigzag_index(shard.total, 1, 0)
    k_all, v_all = (torch.empty_like(t).index_copy(0, order, t) for t in (k, v))
    return full_attention._split_pieces(q, k_all, v_all, pieces, D ** -0.5, 1)


def test_cuda_prefers_cudnn_until_the_kernel_check_switches_it_off(monkeypatch):
    monkeypatch.setattr(split_attention, "cudnn_attention_available", lambda: True)
    try:
        assert full_attention.select_cp_attention_backend("cuda") == "cudnn"
        attention.disable_kernel("cudnn")
        assert full_attention.select_cp_attention_backend("cuda") != "cudnn"
    finally:
        attention.reset_disabled_kernels()
