"""Equal steps on every rank with as little padding as the data allows: ranks lend each other blocks.

Every rank packs its own share of the rows, and the shares can be far apart in blocks: Ray Data's
`streaming_split` hands out whole bundles of rows (a small file is one bundle, so one rank gets every
row), and conversations differ in length. All ranks must run the same steps or a collective hangs.
Until some rank runs dry, each trains its own `per_step` blocks. In a step where a rank is short, the
ranks that still have data read further and lend it the missing blocks; a step holds all-padding
blocks only once every rank is dry, so a pass pads at most `world x per_step - 1` blocks, all in its
last step, and runs `ceil(all ranks' blocks / (world x per_step))` steps (`steps_for`).

Deterministic: how many blocks each rank reads and where each lent block goes follow only from the
block counts every rank gathers, so a resumed run that replays each rank's own blocks (`StepFeed`)
lends the same blocks to the same ranks.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


def _on(device: torch.device | None) -> torch.device:
    return device or torch.device("cpu")


def step_extent(n: int, device: torch.device | None = None, group: Any = None,
                supervised: bool = False) -> tuple[int, int, bool]:
    """(fewest, most) blocks any rank holds for this step, and whether `supervised` is true on any rank: one
    small all-reduce (local without dist)."""
    if not dist.is_initialized():
        return n, n, supervised
    t = torch.tensor([n, -n, int(supervised)], dtype=torch.int64, device=_on(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return -int(t[1].item()), int(t[0].item()), bool(t[2].item())


def steps_for(n: int, per_step: int, device: torch.device | None = None, group: Any = None) -> int:
    """Steps a pass runs when this rank has `n` blocks (a collective): every rank's blocks over
    `world x per_step`, rounded up."""
    if not dist.is_initialized():
        return -(-n // per_step)
    t = torch.tensor([n], dtype=torch.int64, device=_on(device))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return -(-int(t.item()) // (per_step * dist.get_world_size(group)))


def _gather_counts(n: int, dry: bool, device: torch.device | None, group: Any) -> list[tuple[int, bool]]:
    t = torch.tensor([n, int(dry)], dtype=torch.int64, device=_on(device))
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return [(int(p[0].item()), bool(p[1].item())) for p in parts]


def lend(got: list[dict], take: Callable[[int], list[dict]], is_dry: Callable[[], bool], *, per_step: int,
         device: torch.device | None = None, group: Any = None) -> tuple[list[dict], list[dict]]:
    """A step in which some rank holds fewer than `per_step` blocks (a collective: every rank calls it).

    `got`: this rank's own blocks for the step; `take(k)`: up to k more of its own (fewer once it is
    dry, as `is_dry()` then says). Returns (the blocks this rank drew from its own share, the blocks it
    trains this step: at most `per_step`, its own first, then lent ones; fewer only when every rank is
    dry, and the caller pads). The ranks not yet dry split what is missing among them in rank order
    and read it, again until nothing is missing or every rank is dry; then each rank keeps `per_step`
    of its own and the surplus goes, in rank order, to the short ranks in rank order."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    own = list(got)
    counts = _gather_counts(len(own), is_dry(), device, group)
    while (missing := world * per_step - sum(n for n, _ in counts)) > 0:
        readers = [r for r, (_, dry) in enumerate(counts) if not dry]
        if not readers:
            break
        if me in readers:
            k = readers.index(me)
            own += take(missing // len(readers) + (k < missing % len(readers)))
        counts = _gather_counts(len(own), is_dry(), device, group)
    if all(n <= per_step for n, _ in counts):
        return own, own
    surplus: list[Any] = [None] * world
    dist.all_gather_object(surplus, own[per_step:], group=group)
    pool = [b for part in surplus for b in part]
    start = sum(max(0, per_step - n) for n, _ in counts[:me])
    mine = own[:per_step] + pool[start:start + max(0, per_step - counts[me][0])]
    return own, mine
