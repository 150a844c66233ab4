"""Full attention on one rank's share: its queries over the gathered keys of their own conversations."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import raytune_ft.models.context_parallel.split_attention as split_attention
from raytune_ft.models.attention import (DISABLED_KERNELS, QKV, _flash_attn_varlen, select_attention_backend,
                                        torch_varlen_causal)
from raytune_ft.models.context_parallel.exchange import gather_ranks
from raytune_ft.models.context_parallel.layout import CPShard, Piece, zigzag_index


_DENSE_MASK_MAX = 8192 * 8192     # query x key entries above which the CPU path loops over pieces
# under "cudnn", pieces of fewer queries than this (or than a chunk, where chunks are shorter) go to one
# call of the packed path's kernel together: many short conversations would be many small calls
CUDNN_MIN_QUERIES = 1024


def select_cp_attention_backend(device) -> str:
    """The kernel CP attention uses on `device`: "cudnn" (split_attention) where cuDNN's attention runs and the
    start-up check has not switched it off, else the packed path's (attention.select_attention_backend)."""
    if (torch.device(device).type == "cuda" and "cudnn" not in DISABLED_KERNELS
            and split_attention.cudnn_attention_available()):
        return "cudnn"
    return select_attention_backend(device)


def cp_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, shard: CPShard,
                 scaling: float | None = None, backend: str | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries (T_local, H, d) over the whole block's keys of their own
    conversation: K and V (T_local, Hkv, d) are all-gathered. Returns (T_local, H, d). `backend`: the
    kernel to use (the start-up kernel check names it; default: select_cp_attention_backend's); under
    "cudnn", pieces shorter than CUDNN_MIN_QUERIES and than a chunk take the packed path's kernel."""
    d = k_THD.shape[-1]
    kv = gather_ranks(torch.cat([k_THD, v_THD], dim=-1), shard)          # (size, T_local, Hkv, 2d)
    kv = kv.reshape(-1, *kv.shape[2:])
    order = torch.cat([zigzag_index(shard.total, shard.size, r) for r in range(shard.size)])
    kv_global = torch.empty_like(kv).index_copy(0, order.to(kv.device), kv)
    k_all, v_all = kv_global[..., :d], kv_global[..., d:]
    pieces = shard.pieces(0) + shard.pieces(1)
    backend = backend or select_cp_attention_backend(q_THD.device)
    if backend == "cudnn" and (q_THD.dtype in (torch.float16, torch.bfloat16) or not q_THD.is_cuda):
        return _split_pieces(q_THD, k_all, v_all, pieces, scaling, min(CUDNN_MIN_QUERIES, shard.chunk_len))
    if _varlen(q_THD, backend):
        return _varlen_pieces(q_THD, k_all, v_all, pieces, scaling, backend)
    gqa = q_THD.shape[1] != k_all.shape[1]
    if q_THD.shape[0] * shard.total <= _DENSE_MASK_MAX:
        conversation = torch.as_tensor(np.searchsorted(shard.cu_global, np.arange(shard.total), side="right") - 1)
        idx = shard.index
        mask = ((conversation[idx][:, None] == conversation[None, :])
                & (torch.arange(shard.total)[None, :] <= idx[:, None]))
        out = F.scaled_dot_product_attention(
            q_THD.transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
            attn_mask=mask.to(q_THD.device), scale=scaling, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    outs = []
    for p in pieces:                 # a query piece sees its conversation's keys up to its last token
        nq, nk = p.end - p.start, p.global_start + p.end - p.start - p.conv_start
        ks = slice(p.conv_start, p.conv_start + nk)
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q_THD.device).tril(nk - nq)
        o = F.scaled_dot_product_attention(
            q_THD[p.start:p.end].transpose(0, 1)[None], k_all[ks].transpose(0, 1)[None],
            v_all[ks].transpose(0, 1)[None], attn_mask=mask, scale=scaling, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _varlen(q_THD, backend: str) -> bool:
    """Whether `backend` is a varlen kernel that takes `q_THD` (half precision only)."""
    return q_THD.dtype in (torch.float16, torch.bfloat16) and backend in ("flash_attn", "torch_varlen")


def _varlen_pieces(q_THD, k_all, v_all, pieces: list[Piece], scaling, backend: str):
    """A varlen kernel over the local query pieces, each with its conversation's keys up to its last
    token: causal with more keys than queries aligns bottom-right in both kernels (FlashAttention >= 2.1
    and torch's varlen_attn, which runs FlashAttention's kernel), so a query sees exactly the earlier keys."""
    dev = q_THD.device
    key_idx = torch.cat([torch.arange(p.conv_start, p.global_start + p.end - p.start) for p in pieces]).to(dev)
    q_lens = [p.end - p.start for p in pieces]
    k_lens = [p.global_start + p.end - p.start - p.conv_start for p in pieces]
    cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *np.cumsum(k_lens)], dtype=torch.int32, device=dev)
    k, v = k_all.index_select(0, key_idx), v_all.index_select(0, key_idx)
    if backend == "flash_attn":
        return _flash_attn_varlen()(q_THD, k, v, cu_q, cu_k, max(q_lens), max(k_lens), dropout_p=0.0,
                                    softmax_scale=scaling, causal=True)
    return torch_varlen_causal(QKV(q_THD, k, v), cu_q, max(q_lens), scaling, keys=(cu_k, max(k_lens)))


def _split_pieces(q_THD, k_all, v_all, pieces: list[Piece], scaling, min_queries: int):
    """Pieces of at least `min_queries` queries through split_attention (cuDNN on CUDA, its plain-torch form
    elsewhere), the rest in one call of the packed path's kernel; the rows back in local order."""
    scale = scaling if scaling is not None else q_THD.shape[-1] ** -0.5
    kernels = split_attention.KERNELS["cudnn" if q_THD.is_cuda else "math"]
    small = [p for p in pieces if p.end - p.start < min_queries]
    rest = iter([])
    if small:
        q_small = torch.cat([q_THD[p.start:p.end] for p in small])
        local = [Piece(i, i + p.end - p.start, p.global_start, p.conv_start)
                 for i, p in zip(np.cumsum([0] + [p.end - p.start for p in small]), small)]
        backend = select_attention_backend(q_THD.device)
        if _varlen(q_THD, backend):
            out = _varlen_pieces(q_small, k_all, v_all, local, scaling, backend)
        else:
            out = torch.cat([_one_piece(q_small, k_all, v_all, p, scale, kernels) for p in local])
        rest = iter(out.split([p.end - p.start for p in small]))
    outs = [next(rest) if p.end - p.start < min_queries else _one_piece(q_THD, k_all, v_all, p, scale, kernels)
            for p in pieces]
    return torch.cat(outs)


def _one_piece(q_THD, k_all, v_all, p: Piece, scale: float, kernels) -> torch.Tensor:
    ks = slice(p.conv_start, p.global_start + p.end - p.start)
    split = split_attention.Split(p.global_start - p.conv_start, scale, kernels)
    return split_attention.prefix_causal_attention(q_THD[p.start:p.end], k_all[ks], v_all[ks], split)
