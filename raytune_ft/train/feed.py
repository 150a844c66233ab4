"""Feed of packed blocks into a training step, the same on every rank.

Each rank streams its own disjoint share of the data (see `raytune_ft.data.pipeline`), packs it into
blocks and groups the blocks into the step's micro-batches. All ranks must run the same number of
steps or a collective hangs: when one rank's share runs dry before the others, it feeds all-padding
blocks (no supervised token, so no gradient) until every rank is dry; those blocks are counted. A
tiny all-reduce on a CPU (gloo) group decides, so the GPU never waits for it.

Resume: the order of a rank's blocks is deterministic, so a resumed run skips the blocks it had
consumed at the checkpoint (counted in the checkpoint) and continues with the next unseen one.
The skipped blocks are re-read and re-packed (not trained on), and their rows counted afresh, so
the data counters at the end equal those of an uninterrupted run. A running CRC32 of the token ids of
every block a rank has trained on is kept in the checkpoint; the replayed blocks must reproduce it,
or the resume stops with `DataOrderChanged` instead of training rows twice or skipping them (the
layout of the shards depends on the source and the number of workers: keep both fixed to resume).
"""
from __future__ import annotations

import zlib
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from raytune_ft.recipe import Recipe


class DataOrderChanged(RuntimeError):
    """The blocks replayed on resume are not the ones the checkpointed run trained on."""


def block_crc(block: dict, crc: int = 0) -> int:
    return zlib.crc32(np.ascontiguousarray(block["input_ids"]).tobytes(), crc)


class StepFeed:
    def __init__(self, recipe: Recipe, *, rank: int, world: int, device: torch.device, skip_blocks: int = 0,
                 counters_state: dict | None = None, split: str = "train", blocks: Iterator[dict] | None = None,
                 fingerprint: int | None = None):
        from raytune_ft.data.packing import DataCounters, padding_block

        self.recipe, self.rank, self.world, self.device = recipe, rank, world, device
        self.per_step = recipe.train.grad_accum * recipe.train.micro_batch_size
        self.counters = DataCounters.from_dict(counters_state) if counters_state else DataCounters()
        self._pad = padding_block(recipe.data.seq_len)
        self.blocks_consumed = skip_blocks
        if blocks is None and skip_blocks:
            # The shard is replayed from the start of the pass and counted again as it is re-read;
            # keep from the checkpoint only what this feed counted itself (equalisation padding),
            # or every resume would count the replayed rows twice.
            self.counters = _feed_owned_counts(self.counters, recipe.data.seq_len)
        self.fingerprint = 0
        if blocks is None:
            blocks = worker_blocks(recipe, rank=rank, world=world, counters=self.counters, split=split)
            self._it = iter(blocks)
            self._replay(skip_blocks, fingerprint)
        else:  # fixed blocks (tests, benches) come already past the resume point
            self._it = iter(blocks)
            self.fingerprint = fingerprint or 0
        self._dry = False
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() and device.type == "cuda" else None

    def _replay(self, n: int, expected: int | None) -> None:
        """Read past the `n` blocks trained before the checkpoint, checking they are the same blocks."""
        for i in range(n):
            block = next(self._it, None)
            if block is None:
                raise DataOrderChanged(
                    f"rank {self.rank}: the data has {i} blocks but the checkpoint had consumed {n}; "
                    "the source or the number of workers changed since the checkpoint")
            self.fingerprint = block_crc(block, self.fingerprint)
        if n and expected is not None and self.fingerprint != expected:
            raise DataOrderChanged(
                f"rank {self.rank}: the {n} blocks replayed on resume differ from those the checkpointed run "
                "trained on (data fingerprint mismatch): the source, its revision, data.* settings or "
                "scaling.num_workers changed. Resuming would train some conversations twice and skip "
                "others; start a new run name instead, or restore the original settings.")

    def _take(self) -> list[dict]:
        out = []
        while not self._dry and len(out) < self.per_step:
            try:
                out.append(next(self._it))
            except StopIteration:
                self._dry = True
        return out

    def next_step(self):
        """The step's micro-batches (list of StepBatch), or None once every rank is dry."""
        from raytune_ft.train.fsdp_loop import StepBatch

        got = self._take()
        if dist.is_initialized():
            flag = torch.tensor([len(got)], dtype=torch.int64)
            if self._group is None and self.device.type != "cpu":
                flag = flag.to(self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            any_left = int(flag.item()) > 0
        else:
            any_left = bool(got)
        if not any_left:
            return None
        self.blocks_consumed += len(got)
        for b in got:
            self.fingerprint = block_crc(b, self.fingerprint)
        n_fill = self.per_step - len(got)
        if n_fill:
            self.counters.equalisation_padding_blocks += n_fill
            self.counters.blocks += n_fill
            self.counters.padding_tokens += n_fill * self.recipe.data.seq_len
            got = got + [self._pad] * n_fill
        mbs = self.recipe.train.micro_batch_size
        batches = [StepBatch.from_blocks(got[i:i + mbs], self.device) for i in range(0, len(got), mbs)]
        return batches

    def counters_state(self) -> dict:
        return self.counters.to_dict()

    def data_metrics(self) -> dict:
        return self.counters.as_metrics()


def _feed_owned_counts(saved, seq_len: int):
    """Fresh counters holding only the all-padding blocks `next_step` added to `saved`."""
    from raytune_ft.data.packing import DataCounters

    n = saved.equalisation_padding_blocks
    return DataCounters(equalisation_padding_blocks=n, blocks=n, padding_tokens=n * seq_len)


def worker_blocks(recipe: Recipe, *, rank: int, world: int, counters, skip_blocks: int = 0,
                  split: str = "train") -> Iterator[dict]:
    """This worker's packed blocks of `split`, from its Ray Train dataset shard."""
    import ray.train

    from raytune_ft.data.pipeline import iter_blocks

    shard = ray.train.get_dataset_shard(split)
    return iter_blocks(shard, recipe.data, world_size=world, rank=rank, counters=counters,
                       skip_blocks=skip_blocks)
