"""The one collective context parallelism uses: a differentiable all-gather over the group."""
from __future__ import annotations

import torch
import torch.distributed as dist

from raytune_ft.models.context_parallel.layout import CPShard


class _GatherRanks(torch.autograd.Function):
    """All-gather along a new leading dimension (one row per rank); the backward hands each rank the
    sum over the group of the gradients of its row."""

    @staticmethod
    def forward(ctx, x, group, size: int, rank: int):
        ctx.group, ctx.rank, ctx.shape = group, rank, x.shape
        out = x.new_empty(size * x.numel())
        _ALL_GATHER(out, x.contiguous().reshape(-1), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            mine = grad.new_empty(ctx.shape.numel())
            _REDUCE_SCATTER(mine, grad.reshape(-1), group=ctx.group)
            mine = mine.view(ctx.shape)
        else:                            # gloo has no reduce-scatter: every rank sums all rows
            dist.all_reduce(grad, group=ctx.group)
            mine = grad[ctx.rank]
        return mine, None, None, None


# torch 2.13 renamed the flat collectives (the old names warn); torch 2.11 has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_ranks(x: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """(size, *x.shape): every rank's `x`, differentiably; `x` itself as one row when the group is one rank."""
    if shard.size == 1:
        return x[None]
    if torch.is_grad_enabled() and not x.requires_grad:
        # every rank's backward must run the collective, also where this rank's own row needs no gradient
        x = x.detach().requires_grad_()
    return _GatherRanks.apply(x, shard.group, shard.size, shard.rank)


def by_chunk(gathered: torch.Tensor, shard: CPShard) -> list[torch.Tensor]:
    """Rows of per-rank (size, 2, ...) data reordered into the 2*size chunks' sequence order."""
    return [gathered[r, slot] for r, slot in map(shard.owner, range(2 * shard.size))]
