"""Context parallelism: one packed block split along the sequence over a group of ranks, exactly.

A block of T tokens is cut into 2C chunks of T / 2C tokens for a group of C ranks; rank r holds chunks r
and 2C-1-r ("zigzag"), so every rank holds as many early tokens (cheap under causal attention) as late
ones. Each rank keeps its tokens' ids, their positions within their conversation (rotary positions are
the global ones) and the block's global conversation boundaries (`CPShard`).

What crosses ranks, and how (one all-gather per layer, differentiable: its backward hands each rank the
gradients of its own rows, summed over the group):
- full attention: K and V of the whole block are all-gathered; each query sees the earlier keys of its
  own conversation (a block-diagonal causal mask in global token order). Per rank and layer: T x Hkv x
  2 x head_dim values received.
- the gated-delta-net conv: the last kernel-1 inputs of every chunk are all-gathered; a chunk reads its
  predecessor's, and only the tokens of its own conversation count (the conv restarts per conversation).
- the gated delta recurrence: the state is linear in the state before it, S_end = M S_start + B, with
  M the chunk's transition (decay times the delta rule's I - beta k k^T, composed over the chunk) and B
  its end state from zero. Each rank computes (B, M) of its chunks' last conversation piece in one run of
  the recurrence with the value columns [v | 0] and the start state [0 | I] (the state's value columns
  evolve independently, so the extra identity columns come out as M); the (B, M) of all 2C chunks are
  all-gathered (2C x Hv x dk x (dv + dk) fp32 values per layer, whatever T) and every rank scans them in
  sequence order (at most 2C small matmuls) for its chunks' start states, then runs its chunks from
  those states. All ranks work at once, unlike passing the state from chunk to chunk (2C chunk runs one
  after another); the price is the recurrence run up to three times on a chunk's last piece (once
  with dv + dk value columns). M is zero where a conversation starts inside the chunk, and a chunk
  whose first token starts a conversation starts from zero: no state crosses a conversation boundary.

Every rank must run the same collectives in the same order, backward included: a rank whose own rows need
no gradient still puts the gather in its graph, and the scan keeps every gathered row in it.
Each rank's parameter gradients are its share of the block's: their sum over the group (FSDP's reduction
over a mesh holding the group does it) is the gradient of the whole block.

The CUDA kernels are the ones single-rank packing uses (causal-conv1d, flash-linear-attention's
`chunk_gated_delta_rule` with an initial state and cu_seqlens, a varlen attention kernel with more keys
than queries, causal aligned bottom-right). flash-linear-attention's own context-parallel path
(`fla.ops.cp`) is not used: it assumes rank r holds the contiguous tokens [rT/C, (r+1)T/C) and takes no
initial state, so it cannot run the zigzag layout. The CUDA branches are not exercised by the CPU tests.

The loss: labels are shifted on the whole block before the split (the token after a chunk's last one may
live on another rank), so each rank's loss is taken unshifted on its own tokens; the block's loss is the
sum over the group, divided by the group's supervised-token count.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from raytune_ft.models.context_parallel.full_attention import cp_attention
from raytune_ft.models.context_parallel.layout import CPShard, Piece, make_shard, shard_block, zigzag_index
from raytune_ft.models.context_parallel.linear_attention import cp_causal_conv1d, cp_gated_delta_rule
from raytune_ft.models.gated_delta import DeltaRuleInputs

__all__ = ["CPShard", "LayerPaths", "Piece", "cp_forward_kwargs", "make_shard", "shard_block", "zigzag_index"]


class LayerPaths:
    """What a packing-enabled layer calls under context parallelism: found in the forward kwargs as
    `context_parallel` (attention.py and gated_delta.py call these methods, importing nothing from here)."""

    def __init__(self, shard: CPShard):
        self.shard = shard

    def causal_conv1d(self, x_BCT, weight_CK, bias, activation):
        return cp_causal_conv1d(x_BCT, weight_CK, bias, self.shard, activation)

    def gated_delta_rule(self, q, k, v, g, beta):
        return cp_gated_delta_rule(DeltaRuleInputs(q, k, v, g, beta), self.shard)

    def attention(self, q_THD, k_THD, v_THD, scaling):
        return cp_attention(q_THD, k_THD, v_THD, self.shard, scaling)


def cp_forward_kwargs(local: Mapping[str, torch.Tensor], shard: CPShard,
                      device: str | torch.device | None = None) -> dict[str, Any]:
    """Forward kwargs of a packing-enabled model for one rank's share (`shard_block`'s output): the
    layers find their context-parallel paths under `context_parallel`."""
    cu = shard.local_cu_seqlens()
    lens = cu[1:] - cu[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int32), lens.long())
    out = dict(input_ids=local["input_ids"][None], position_ids=local["position_ids"][None],
               cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lens.max()), max_length_k=int(lens.max()),
               seq_idx=seq_idx[None], use_cache=False)
    if device is not None:
        out = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    out["context_parallel"] = LayerPaths(shard)
    return out
