"""The FSDP2 loop under context parallelism (`scaling.context_parallel` = C > 1): the mesh's CP groups, and
each step's micro-batches split over them.

The workers form a 2-D mesh, data-parallel x context-parallel: rank r is CP rank r % C of group r // C (a
group's ranks are neighbours, so on one node). FSDP2 shards over every rank, which is the flattened
dp x cp mesh (torchtitan's dp_shard x cp), so nothing about the sharding changes.

The data path does not change either: every rank still reads, packs, counts and checkpoints its own share
of the rows, so resume, lending and the step count work as without CP. Each step the C ranks of a group
pool the blocks they drew (a small all-gather on the host) and train all of them together, one
micro-batch of `train.micro_batch_size` blocks at a time, each split along the sequence over the group
(models/context_parallel): a group trains exactly the blocks its members read, a rank holds 1/C of each.
A step trains `num_workers x per_step` blocks whatever C is, so the loss and the gradients equal those of
the same run without CP. Tokens and FLOPs are counted by the rank that read the block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raytune_ft.train.batch import StepBatch, real_seq_lens, stack_blocks


@dataclass(frozen=True)
class CPGroup:
    """This rank's context-parallel group."""

    size: int
    rank: int           # within the group
    compute: Any        # the model's exchanges (NCCL between GPUs)
    host: Any           # the blocks' pooling (gloo, on the host)


def cp_group(size: int, device: torch.device) -> CPGroup | None:
    """This rank's CP group of `size` ranks (a collective: every rank calls it once); None for size 1."""
    if size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"scaling.context_parallel: {size} does not divide the {world} workers")
    mesh = init_device_mesh(device.type, (world // size, size), mesh_dim_names=("dp", "cp"))
    host = None
    for first in range(0, world, size):        # every rank creates every group, in the same order
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            host = group
    return CPGroup(size, rank % size, mesh.get_group("cp"), host)


def step_micro_batches(blocks: list[dict], micro_batch_size: int, device: torch.device,
                       cp: CPGroup | None) -> list[StepBatch]:
    """This rank's micro-batches for one optimizer step: its own blocks `micro_batch_size` at a time, or
    under CP its share of every block its group drew (module docstring)."""
    if cp is None:
        return [StepBatch.from_blocks(blocks[i:i + micro_batch_size], device)
                for i in range(0, len(blocks), micro_batch_size)]
    pooled: list[list[dict] | None] = [None] * cp.size
    dist.all_gather_object(pooled, blocks, group=cp.host)
    return [cp_step_batch(theirs[i:i + micro_batch_size], device, cp, owned=member == cp.rank)
            for member, theirs in enumerate(pooled) for i in range(0, len(theirs), micro_batch_size)]


def cp_step_batch(blocks: list[dict], device: torch.device, cp: CPGroup, owned: bool) -> StepBatch:
    """This rank's share of one micro-batch of `blocks` laid end to end: its tokens' forward kwargs and
    their targets (the loss taken unshifted); its tokens and sequence lengths counted when `owned`."""
    from raytune_ft.models import context_parallel as mcp
    from raytune_ft.models.gated_delta import packed_forward_kwargs

    stack = stack_blocks(blocks)
    row = packed_forward_kwargs(stack)              # the blocks as one row, with merged boundaries
    total = row["input_ids"].shape[1]
    shard = mcp.make_shard(row["cu_seq_lens_q"], total, cp.size, cp.rank, cp.compute)
    local = mcp.shard_block({"input_ids": row["input_ids"][0], "position_ids": row["position_ids"][0],
                             "labels": stack["labels"].reshape(-1)}, shard)
    kwargs = mcp.cp_forward_kwargs(local, shard, device) | {"shift": False}
    seq_lens = [int(n) for b in blocks for n in real_seq_lens(b)] if owned else []
    targets = local["targets"]
    return StepBatch(kwargs, targets[None].to(device, non_blocking=True), int((targets != -100).sum()),
                     int(sum(seq_lens)), seq_lens)
