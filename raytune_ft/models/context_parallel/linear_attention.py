"""The gated-delta-net layer's two stateful pieces on one rank's share: the causal conv with its
predecessor chunks' last inputs, and the recurrence from the state the chunks before it leave."""
from __future__ import annotations

import numpy as np
import torch

from raytune_ft.models.context_parallel.exchange import by_chunk, gather_ranks
from raytune_ft.models.context_parallel.layout import CPShard
from raytune_ft.models.gated_delta import (DeltaRuleInputs, _fla_chunk_gated_delta_rule,
                                           _torch_reference_gated_delta_rule, gated_delta_backends,
                                           segment_causal_conv1d)


# ----------------------------------------------------------------- gated-delta-net: conv

def cp_causal_conv1d(x_BCT: torch.Tensor, weight_CK: torch.Tensor, bias: torch.Tensor | None, shard: CPShard,
                     activation: str | None = "silu", backend: str | None = None) -> torch.Tensor:
    """Depthwise causal conv1d of this rank's tokens (1, channels, T_local) in local order: each chunk
    reads the last kernel-1 inputs of the chunk before it (from whichever rank holds it), and restarts
    at every conversation start. `backend`: as segment_causal_conv1d's."""
    halo, n = weight_CK.shape[-1] - 1, shard.chunk_len
    if x_BCT.shape[0] != 1 or x_BCT.shape[2] != 2 * n:
        raise ValueError(f"context parallelism: expected this rank's {2 * n} tokens as one row, got "
                         f"{tuple(x_BCT.shape)} (batch, channels, tokens)")
    if halo > n:
        raise ValueError(f"a context-parallel chunk of {n} tokens is shorter than the conv's "
                         f"{halo} preceding tokens: raise data.seq_len or lower scaling.context_parallel")
    if halo == 0:
        return segment_causal_conv1d(x_BCT, weight_CK, bias, shard.local_cu_seqlens(), activation, backend)
    x_TC = x_BCT[0].t()                # channel-last, as causal-conv1d wants it
    tails = torch.stack([x_TC[n - halo:n], x_TC[2 * n - halo:]])                 # (2, halo, C)
    chunk_tails = by_chunk(gather_ranks(tails, shard), shard)
    parts, keys = [], []
    for slot, chunk in enumerate(shard.chunks):
        before = chunk_tails[chunk - 1] if chunk > 0 else tails.new_zeros(tails.shape[1:])
        parts += [before, x_TC[slot * n:(slot + 1) * n]]
        first = chunk * n - halo
        keys.append(_segment_keys(shard, slot, range(first, first + halo + n)))
    extended = torch.cat(parts).t()[None]
    keys_all = np.concatenate(keys)
    starts = np.flatnonzero(np.r_[True, keys_all[1:] != keys_all[:-1]])
    cu = torch.tensor(np.r_[starts, len(keys_all)], dtype=torch.int32)
    y = segment_causal_conv1d(extended, weight_CK, bias, cu, activation, backend)
    keep = torch.cat([torch.arange(s * (halo + n) + halo, (s + 1) * (halo + n)) for s in (0, 1)])
    return y.index_select(2, keep.to(y.device))


def _segment_keys(shard: CPShard, slot: int, tokens: range) -> np.ndarray:
    """A key per token that changes exactly where the conv must restart: at each conversation and at
    each local chunk (tokens before the block get a conversation of their own)."""
    conversation = np.searchsorted(shard.cu_global, np.asarray(tokens), side="right") - 1
    return conversation + slot * (len(shard.cu_global) + 1)


# ----------------------------------------------------------------- gated-delta-net: recurrence

def _run_pieces(x: DeltaRuleInputs, bounds: list[int], first_state: torch.Tensor | None, backend: str):
    """The gated delta rule over consecutive pieces of `x` (boundaries `bounds`, from 0 to its length),
    each from a zero state except the first, from `first_state` (1, Hv, dk, dv) when given. Returns
    (output (1, T, Hv, dv), the last piece's end state (1, Hv, dk, dv) fp32)."""
    q, k, v = x.q, x.k, x.v
    if backend == "fla_chunk":
        h0 = q.new_zeros((len(bounds) - 1, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32)
        if first_state is not None:
            h0 = torch.cat([first_state.float(), h0[1:]])
        out, final = _fla_chunk_gated_delta_rule()(
            q, k, v, g=x.g, beta=x.beta, initial_state=h0, output_final_state=True,
            cu_seqlens=torch.tensor(bounds, device=q.device, dtype=torch.long), use_qk_l2norm_in_kernel=True)
        return out, final[-1:]
    ref = _torch_reference_gated_delta_rule()
    rep = v.shape[2] // q.shape[2]
    if rep > 1:                          # as segment_gated_delta_rule does, for every transformers release
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    outs, state = [], None
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, state = ref(q[:, s:e], k[:, s:e], v[:, s:e], g=x.g[:, s:e], beta=x.beta[:, s:e],
                       initial_state=first_state if i == 0 else None, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
        outs.append(o)
    return torch.cat(outs, dim=1), state


def _chunk_summary(x: DeltaRuleInputs, shard: CPShard, slot: int, backend: str) -> torch.Tensor:
    """[B | M] (Hv, dk, dv + dk) of local chunk `slot`: B its end state from zero, M how its end state
    depends on its start state (zero when a conversation starts inside it or at its first token)."""
    chunk, last = shard.chunks[slot], shard.pieces(slot)[-1]
    hv, dk, dv = x.v.shape[2], x.q.shape[3], x.v.shape[3]
    if chunk == 2 * shard.size - 1 or not shard.carries(chunk + 1):
        return x.q.new_zeros((hv, dk, dv + dk), dtype=torch.float32)       # no chunk reads it
    piece = x.rows(last.start, last.end)
    if not (shard.carries(chunk) and shard.whole(chunk)):
        _, b_state = _run_pieces(piece, [0, last.end - last.start], None, backend)
        return torch.cat([b_state[0].float(), b_state.new_zeros((hv, dk, dk), dtype=torch.float32)], dim=-1)
    v_ext = torch.cat([piece.v, piece.v.new_zeros((*piece.v.shape[:3], dk))], dim=-1)
    eye = torch.eye(dk, device=x.q.device, dtype=torch.float32).expand(1, hv, dk, dk)
    start = torch.cat([eye.new_zeros((1, hv, dk, dv)), eye], dim=-1)
    _, state = _run_pieces(piece._replace(v=v_ext), [0, last.end - last.start], start, backend)
    return state[0].float()


def cp_gated_delta_rule(x: DeltaRuleInputs, shard: CPShard, backend: str | None = None) -> torch.Tensor:
    """The gated delta rule over this rank's tokens in local order, each chunk started from the state the
    chunks before it leave (module docstring). Returns (1, T_local, Hv, dv)."""
    backend = backend or gated_delta_backends(x.q.device)["recurrence"]
    dv, n = x.v.shape[3], shard.chunk_len
    summaries = torch.stack([_chunk_summary(x, shard, slot, backend) for slot in (0, 1)])
    rows = by_chunk(gather_ranks(summaries, shard), shard)
    carries = torch.tensor([shard.carries(c) for c in range(2 * shard.size)], device=summaries.device)
    starts: dict[int, torch.Tensor | None] = {0: None}
    state = rows[0][..., :dv]
    for chunk in range(1, max(shard.chunks) + 1):       # the scan, in sequence order
        # zeros by `where`, not a new tensor: the gathered rows stay in the graph, so every backward gathers
        starts[chunk] = torch.where(carries[chunk], state, 0.0)
        state = rows[chunk][..., :dv] + rows[chunk][..., dv:] @ starts[chunk]
    outs = []
    for slot, chunk in enumerate(shard.chunks):
        bounds = [p.start - slot * n for p in shard.pieces(slot)] + [n]
        first = starts[chunk][None] if starts[chunk] is not None else None
        outs.append(_run_pieces(x.rows(slot * n, (slot + 1) * n), bounds, first, backend)[0])
    return torch.cat(outs, dim=1)
