"""This rank's packed blocks as the trainer's dataset, and the one-row facade SFTTrainer inspects.

The trainer never tokenizes or packs: each worker reads its share of the packed blocks the FSDP2
recipe trains on (same masks, same best-fit-decreasing packing), through the same `StepFeed`
(`raytune_ft.train.batch`), so every rank runs the same number of whole optimizer steps and Hugging
Face's accumulation never leaves a partial step behind. `collate_blocks` lays a micro-batch's blocks
end to end as one row with the varlen signals, TRL's padding-free format.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch

from raytune_ft.data.packing import DataCounters, padding_block
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.batch import RankSteps, StepFeed, real_seq_lens, worker_blocks


class RankBlocks(torch.utils.data.IterableDataset):
    """This rank's packed training blocks, one epoch per iteration, whole steps and the same count on
    every rank (a `StepFeed` per pass); empty once `train.epochs` passes are done, which ends training.
    With `train.max_steps` the passes go on (each in a new seeded order) until the trainer stops at it,
    as a `max_steps` past the data does in transformers.

    The first pass of a resumed attempt (epoch `epoch`) replays the blocks the checkpoint had consumed
    and checks their fingerprint (`DataOrderChanged` when the data no longer lays out the same blocks).
    A checkpoint taken at the end of a pass (Hugging Face saves at the last step; `checkpoint_every`
    may fall on an epoch's last step) leaves nothing of that pass: the first pass goes on with the next
    epoch, or is empty after the last one (the trainer then ends at once), as the FSDP2 loop's
    `EpochFeeds` does. `peek()` starts the first pass and keeps its first block; the next iteration
    replays it, so TRL's look at a sample costs no data.
    """

    def __init__(self, recipe: Recipe, *, rank: int, flag_device: torch.device, epoch: int = 0,
                 skip_blocks: int = 0, fingerprint: int | None = None):
        self.recipe, self.rank, self.flag_device = recipe, rank, flag_device
        self.epoch = epoch                          # the epoch of the current (or next) pass
        self.counters = DataCounters()
        self.per_step = recipe.train.micro_batch_size * recipe.train.grad_accum
        self._resume = (skip_blocks, fingerprint)   # for the first pass only
        self.real_tokens = 0
        self.flops = 0.0                            # model FLOPs of the real blocks fed (set flops_config)
        self.flops_config = None
        self.counted_steps: int | None = None       # the run's counted schedule length, if it was counted
        self._pending: tuple[dict | None, Iterator[dict]] | None = None
        self._passes = 0
        self._feed: StepFeed | None = None
        self.passes_fed = 0                         # passes over the data begun, for the run's summary

    @property
    def blocks_consumed(self) -> int:
        """Real blocks of this rank trained in the current pass (the replayed ones included)."""
        return self._feed.blocks_consumed if self._feed is not None else self._resume[0]

    @property
    def fingerprint(self) -> int | None:
        return self._feed.fingerprint if self._feed is not None else self._resume[1]

    def _pass(self) -> Iterator[dict]:
        from raytune_ft.planning.hardware import flops_per_block

        skip, fingerprint = self._resume if self._passes == 0 else (0, None)
        if self._passes:
            self.epoch += 1
        self._passes += 1
        while self.recipe.train.max_steps or self.epoch < self.recipe.train.epochs:
            steps = RankSteps(self.per_step, self.recipe.data.seq_len, rank=self.rank, flag_device=self.flag_device)
            self._feed = StepFeed(worker_blocks(self.recipe, counters=self.counters, epoch=self.epoch), steps=steps,
                                  counters=self.counters, skip_blocks=skip, fingerprint=fingerprint)
            fed = False
            for block in self._feed:
                fed, self.passes_fed = True, self.epoch + 1
                lens = real_seq_lens(block)
                if len(lens):
                    self.real_tokens += int(lens.sum())
                    if self.flops_config is not None:
                        self.flops += flops_per_block(self.flops_config, lens)
                yield block
            # every rank agrees on `fed` (the feed's steps are equalised): only a resumed pass that the
            # checkpoint had finished feeds nothing, and the next epoch takes its place
            if fed or not skip:
                return
            self.epoch, skip, fingerprint = self.epoch + 1, 0, None

    def spend(self) -> None:
        """Feed nothing more: the resumed checkpoint is the run's last step (train.max_steps reached
        with data left), and Hugging Face would otherwise train one step past it."""
        self._pending = (None, iter(()))

    def peek(self) -> dict:
        """The first block of the next pass; an all-padding block, for TRL to look at only, when the
        run's data is spent (a resume from its last checkpoint: nothing is left to train)."""
        if self._pending is None:
            it = self._pass()
            self._pending = (next(it, None), it)
        return self._pending[0] if self._pending[0] is not None else padding_block(self.recipe.data.seq_len)

    def __iter__(self) -> Iterator[dict]:
        if self._pending is not None:
            first, it = self._pending
            self._pending = None
            return itertools.chain([first], it) if first is not None else it
        return self._pass()


_LIVE: dict[int, Any] = {}


def _peek_rows(key: int):
    """Generator behind the `datasets` facade TRL inspects: the peeked first block of a live stream."""
    src = _LIVE[key]
    block = src.peek() if isinstance(src, RankBlocks) else src[0]
    yield {k: block[k].tolist() for k in ("input_ids", "labels", "position_ids")}


def facade(src) -> Any:
    """A one-row `datasets.IterableDataset` for SFTTrainer's type and format checks.

    SFTTrainer accepts only `datasets` objects and looks at one row; training and evaluation read the
    real streams through the trainer's overridden dataloaders, never through this facade.
    """
    import datasets

    key = id(src)
    _LIVE[key] = src
    return datasets.IterableDataset.from_generator(_peek_rows, gen_kwargs={"key": key})


def release_facades() -> None:
    _LIVE.clear()
