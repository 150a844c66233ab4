"""A rank's long query pieces on cuDNN's fused attention: each piece's keys split into the ones before it (all
visible) and its own (causal), two kernel calls merged by their log-sum-exps.

Why: at the 27B's head dim of 256 torch's varlen kernel (FlashAttention-2) runs at 45-60% of cuDNN's speed on an
H100 (bench/attention_kernels.py), and under context parallelism with long conversations attention is a
quarter of the step. cuDNN's causal mask aligns top-left and it takes no varlen packing, so a piece of `nq`
queries whose conversation started `n_prefix` tokens earlier is computed as
    softmax over [prefix keys | own keys] = merge(attn(q, prefix, all visible), attn(q, own, causal square))
with the merge out = sum_i out_i exp(lse_i - lse), lse = logaddexp(lse_1, lse_2).
The backward runs each part's kernel backward with the MERGED output and log-sum-exp: with the global
normaliser each part's probabilities are the full softmax's entries, so its dq / dk / dv are exactly the full
attention's for those keys (as ring attention does it). cuDNN shares each KV head among its query-head group.

`KERNELS["cudnn"]` calls torch's cuDNN attention ops; `KERNELS["math"]` computes the same contract in plain torch
(fp32) and is what the CPU tests run the split and merge with. full_attention.py sends only long pieces here
(CUDNN_MIN_QUERIES); the short ones go to one varlen call together (many short conversations, many small calls)."""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from raytune_ft.compat.torch_internals import cudnn_attention_ops


class Part(NamedTuple):
    """One kernel call: q (1, H, nq, d) over k/v (1, Hkv, nk, d), all keys visible or a causal square."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    scale: float


class SplitKernels(NamedTuple):
    """forward(part) -> (out, lse (1, H, nq, 1) fp32, state for the backward);
    backward(part, dout, out, lse, state) -> (dq, dk, dv), out and lse the MERGED ones."""

    forward: Callable
    backward: Callable


def _cudnn_forward(x: Part):
    res = cudnn_attention_ops()[0](x.q, x.k, x.v, None, True, 0.0, x.causal, False, scale=x.scale)
    out, lse = res[0], res[1]
    return out, lse.reshape(*lse.shape[:3], 1).float(), (lse.shape, *res[2:8])


def _cudnn_backward(x: Part, dout, out, lse, state):
    lse_shape, cu_q, cu_k, max_q, max_k, seed, offset = state      # the op's own lse shape, as it returned it
    return cudnn_attention_ops()[1](
        dout, x.q, x.k, x.v, out, lse.reshape(lse_shape), seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0,
        x.causal, scale=x.scale)[:3]


def _scores(x: Part):
    rep = x.q.shape[1] // x.k.shape[1]
    s = (x.q.float() @ x.k.float().repeat_interleave(rep, 1).transpose(-1, -2)) * x.scale
    if x.causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s, rep


def _math_forward(x: Part):
    s, rep = _scores(x)
    lse = s.logsumexp(-1, keepdim=True)
    out = (s - lse).exp() @ x.v.float().repeat_interleave(rep, 1)
    return out.to(x.q.dtype), lse, None


def _group_sum(g, rep: int):
    """(1, H, n, d) -> (1, H / rep, n, d): the gradient of a KV head shared by `rep` query heads."""
    return g.unflatten(1, (g.shape[1] // rep, rep)).sum(2)


def _math_backward(x: Part, dout, out, lse, state):
    s, rep = _scores(x)
    p = (s - lse).exp()
    dout = dout.float()
    dv = _group_sum(p.transpose(-1, -2) @ dout, rep)
    dp = dout @ x.v.float().repeat_interleave(rep, 1).transpose(-1, -2)
    ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True))
    dq = ds @ x.k.float().repeat_interleave(rep, 1) * x.scale
    dk = _group_sum(ds.transpose(-1, -2) @ x.q.float() * x.scale, rep)
    return dq.to(x.q.dtype), dk.to(x.k.dtype), dv.to(x.v.dtype)


KERNELS = {"cudnn": SplitKernels(_cudnn_forward, _cudnn_backward), "math": SplitKernels(_math_forward, _math_backward)}


class Split(NamedTuple):
    """How a piece's keys split: the first `n_prefix` all visible, the rest its own (causal)."""

    n_prefix: int
    scale: float
    kernels: SplitKernels


class _PrefixCausal(torch.autograd.Function):
    """Attention of q (1, H, nq, d) over k/v (1, Hkv, n_prefix + nq, d): every prefix key, the own keys causally."""

    @staticmethod
    def forward(ctx, q, k, v, split: Split):
        n = split.n_prefix
        parts = ([(0, n, False)] if n else []) + [(n, k.shape[2], True)]
        out = lse = None
        states = []
        for s, e, causal in parts:
            o, l, st = split.kernels.forward(Part(q, k[:, :, s:e], v[:, :, s:e], causal, split.scale))
            states.append(st)
            if out is None:
                out, lse = o.float(), l
            else:
                merged = torch.logaddexp(lse, l)
                out = out * (lse - merged).exp() + o.float() * (l - merged).exp()
                lse = merged
        out = _like(q, out)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.states, ctx.split = parts, states, split
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = _like(q, dout)
        dq, dk, dv = None, torch.empty_like(k), torch.empty_like(v)
        for (s, e, causal), st in zip(ctx.parts, ctx.states):
            part = Part(q, k[:, :, s:e], v[:, :, s:e], causal, ctx.split.scale)
            gq, gk, gv = ctx.split.kernels.backward(part, dout, out, lse, st)
            dq = gq.float() if dq is None else dq + gq.float()
            dk[:, :, s:e], dv[:, :, s:e] = gk, gv
        return dq.to(q.dtype), dk, dv, None


def _like(q, x):
    """`x` in q's dtype and memory layout (cuDNN's output takes the query's, and its backward wants the output
    and its gradient alike)."""
    y = torch.empty_like(q)
    y.copy_(x)
    return y


def prefix_causal_attention(q_THD, k_THD, v_THD, split: Split):
    """q (nq, H, d) over k/v (split.n_prefix + nq, Hkv, d): (nq, H, d)."""
    q, k, v = (t.transpose(0, 1)[None] for t in (q_THD, k_THD.contiguous(), v_THD.contiguous()))
    return _PrefixCausal.apply(q, k, v, split)[0].transpose(0, 1)


@functools.lru_cache(maxsize=None)
def cudnn_attention_available() -> bool:
    """Whether this torch has cuDNN's attention ops and a GPU they run on (the kernel check proves them)."""
    return (torch.cuda.is_available() and torch.backends.cudnn.is_available()
            and cudnn_attention_ops() is not None
            and torch.cuda.get_device_capability() >= (8, 0))
