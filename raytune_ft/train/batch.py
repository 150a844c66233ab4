"""Packed blocks into training steps, the same number of steps on every rank: used by both loops.

Each rank streams its own disjoint share of the data (see `raytune_ft.data.pipeline`), packs it into
blocks, and `StepFeed` groups the blocks into optimizer steps. All ranks must run the same number of
steps or a collective hangs: when one rank's share runs dry before the others, the others lend it
blocks (`raytune_ft.train.lending`); only the pass's last step, once every rank is dry, is filled with
all-padding blocks (no supervised token, so no gradient), and those are counted. One tiny all-reduce
per step decides (on a CPU gloo group when the loop passes one, so the GPU never waits for it).

Resume: the order of a rank's blocks is deterministic, so a resumed run replays the blocks it had
consumed at the checkpoint (re-read and re-packed, not trained on) and continues with the next unseen
one. A running CRC32 of the token ids of every block a rank has trained on is kept in the checkpoint;
the replayed blocks must reproduce it, or the resume stops with `DataOrderChanged` instead of training
rows twice or skipping them (the layout of the shards depends on the source, the data settings and
the number of workers: keep them fixed to resume).

`StepBatch` is the FSDP2 loop's micro-batch on the device; `collate_blocks` the TRL loop's. Both lay
the blocks end to end as one row with merged boundaries (`stack_blocks`).
"""
from __future__ import annotations

import queue
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from raytune_ft.data.packing import DataCounters, padding_block
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.lending import lend, step_extent

_STACKED = ("input_ids", "labels", "position_ids", "seq_idx")


class ReadAhead:
    """A pass's blocks, read by a background thread up to `depth` blocks ahead of the loop that takes them.

    The loop opens its data before it builds the model: Ray Data's tasks start, the tokenizer loads and
    the first packing window fills while the model is built, checked and compiled, instead of inside
    the first step (`EpochFeeds` then defers a resume's replay to the first step). `open_blocks(counters)`
    is called here, in the caller's thread (it may look up the Ray Train context); only the iteration runs
    in the thread, which does no collective.

    `counters` moves with the blocks taken, not with the blocks read: the thread counts into its own
    counters and hands each block's share over with the block, so a checkpoint's counts are those of
    an unthreaded read at the same step. An error of the data path is raised where the loop takes the
    block it stopped at. `close()` stops the thread (it also ends with the pass)."""

    _END = object()

    def __init__(self, open_blocks: Callable[[DataCounters], Iterable[dict]], counters: DataCounters,
                 depth: int):
        self.counters = counters
        self._own = DataCounters()
        self._blocks = iter(open_blocks(self._own))
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._read, name="raytune-read-ahead", daemon=True)
        self._thread.start()

    def _put(self, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        seen = self._own.copy()
        try:
            for block in self._blocks:
                share, seen = self._own.since(seen), self._own.copy()
                if not self._put((block, share, None)):
                    return
            self._put((self._END, self._own.since(seen), None))
        except BaseException as e:  # noqa: BLE001 - handed to the loop, raised where it takes the next block
            self._put((self._END, self._own.since(seen), e))

    def __iter__(self) -> "ReadAhead":
        return self

    def __next__(self) -> dict:
        if self._ended:
            raise StopIteration
        block, share, error = self._q.get()
        self.counters.merge(share)
        if block is self._END:
            self._ended = True
            if error is not None:
                raise error
            raise StopIteration
        return block

    def close(self) -> None:
        self._stop.set()


class DataOrderChanged(RuntimeError):
    """The blocks replayed on resume are not the ones the checkpointed run trained on."""


def block_crc(block: dict, crc: int = 0) -> int:
    return zlib.crc32(np.ascontiguousarray(block["input_ids"]).tobytes(), crc)


def real_seq_lens(block: dict) -> np.ndarray:
    """Lengths of a block's conversations: the trailing padding segment (pad ids, nothing
    supervised), if any, is not one."""
    cu = np.asarray(block["cu_seqlens"]).astype(np.int64)
    last = int(cu[-2]) if len(cu) > 1 else 0
    if not (block["labels"][last:] != -100).any() and not block["input_ids"][last:].any():
        cu = cu[:-1]
    return np.diff(cu)


def stack_blocks(blocks: list[dict]) -> dict[str, Any]:
    """The blocks' arrays stacked (B, T), and their per-block `cu_seqlens` as a list."""
    stack: dict[str, Any] = {k: np.stack([b[k] for b in blocks]) for k in _STACKED}
    stack["cu_seqlens"] = [b["cu_seqlens"] for b in blocks]
    return stack


@dataclass
class StepBatch:
    """A micro-batch: its blocks laid end to end as one row, with merged boundaries (on the device)."""
    kwargs: dict
    labels: torch.Tensor
    n_supervised: int
    n_real: int
    seq_lens: list[int] = field(default_factory=list)

    @classmethod
    def from_blocks(cls, blocks: list[dict], device: torch.device) -> "StepBatch":
        from raytune_ft.models.gated_delta import packed_forward_kwargs

        stack = stack_blocks(blocks)
        kwargs = packed_forward_kwargs(stack, device=device)
        seq_lens = [int(n) for b in blocks for n in real_seq_lens(b)]
        labels = torch.from_numpy(stack["labels"].reshape(1, -1)).to(device, non_blocking=True)
        n_sup = int((stack["labels"][:, 1:] != -100).sum())
        return cls(kwargs, labels, n_sup, int(sum(seq_lens)), seq_lens)


def supervised(blocks: list[dict]) -> bool:
    """Whether any of `blocks` holds a supervised token (as `StepBatch.n_supervised` counts them)."""
    return any((b["labels"][1:] != -100).any() for b in blocks)


def collate_blocks(blocks: list[dict]) -> dict[str, Any]:
    """A micro-batch of packed blocks -> one row in TRL's padding-free format.

    input_ids / labels / position_ids (1, B*T); cu_seq_lens_q/k (int32 global boundaries),
    max_length_q/k, seq_idx (1, B*T): what varlen attention and the gated-delta-net layers need.
    Labels stay unshifted (the model shifts); each conversation's first label is already -100.
    """
    from raytune_ft.models.gated_delta import packed_forward_kwargs

    stack = stack_blocks(blocks)
    batch = packed_forward_kwargs(stack)
    batch.pop("use_cache", None)               # TRL sets it per call
    batch["labels"] = torch.from_numpy(stack["labels"].astype(np.int64).reshape(1, -1))
    return batch


class StepFeed:
    """One pass over this rank's blocks, `per_step` at a time, equalised across ranks.

    `blocks` is the pass from its start; `skip_blocks` of them were trained before a resume and are
    replayed (checked against `fingerprint`, the CRC the checkpoint holds). `counters` receives the
    equalisation padding this feed adds. Attributes the loops read and checkpoint: `blocks_consumed`
    (the blocks of this pass drawn from this rank's share, replayed and lent ones included) and
    `fingerprint` (of those blocks).
    """

    def __init__(self, blocks: Iterable[dict], *, steps: RankSteps, counters: DataCounters, skip_blocks: int = 0,
                 fingerprint: int | None = None, defer_replay: bool = False):
        self.per_step, self.seq_len, self.counters, self.rank = steps.per_step, steps.seq_len, counters, steps.rank
        self.flag_device = steps.flag_device or torch.device("cpu")
        self.group = steps.group
        self._it = iter(blocks)
        self._dry = False
        self.blocks_consumed = 0
        self.fingerprint = 0
        # `defer_replay`: replayed at the first `next_blocks` or `replayed()`, which every rank reaches at
        # the same point: a loop that opens its data early checks its storage first, and Ray Data's split
        # starts a pass only once every rank reads its shard, so a rank replaying blocks at once waits for a
        # rank with none to replay, which may meanwhile wait in a collective for it
        self._pending: tuple[int, int | None] | None = (skip_blocks, fingerprint)
        if not defer_replay:
            self.replayed()

    def replayed(self) -> "StepFeed":
        """This feed with the blocks trained before the resume read past (at most once); returns self."""
        if self._pending is not None:
            n, expected = self._pending
            self._pending = None
            self._replay(n, expected)
        return self

    def _replay(self, n: int, expected: int | None) -> None:
        """Read past the `n` blocks trained before the checkpoint, checking they are the same blocks."""
        for i in range(n):
            block = next(self._it, None)
            if block is None:
                raise DataOrderChanged(
                    f"rank {self.rank}: the data has {i} blocks but the checkpoint had consumed {n}; "
                    "the source or the number of workers changed since the checkpoint")
            self.fingerprint = block_crc(block, self.fingerprint)
        self.blocks_consumed = n
        if n and expected is not None and self.fingerprint != expected:
            raise DataOrderChanged(
                f"rank {self.rank}: the {n} blocks replayed on resume differ from those the checkpointed run "
                "trained on (data fingerprint mismatch): the source, its revision, data.* settings or "
                "scaling.num_workers changed. Resuming would train some conversations twice and skip "
                "others; start a new run name instead, or restore the original settings.")

    def _take(self, n: int) -> list[dict]:
        out = []
        while not self._dry and len(out) < n:
            block = next(self._it, None)
            if block is None:
                self._dry = True
            else:
                out.append(block)
        return out

    def next_blocks(self) -> list[dict] | None:
        """The next step's `per_step` blocks, or None once every rank is dry. A step in which some rank
        is dry takes blocks lent by the others (`lending.lend`); only the pass's last one pads. A step
        whose blocks hold no supervised token on any rank is read past (it would train nothing and log a
        loss of 0), its blocks counted in `counters.blocks_unsupervised`; every rank agrees on it."""
        while True:
            drawn = got = self.replayed()._take(self.per_step)
            fewest, most, anywhere = step_extent(len(got), self.flag_device, self.group, supervised(got))
            if most == 0:
                return None
            if fewest < self.per_step and dist.is_initialized():
                drawn, got = lend(got, self._take, lambda: self._dry, per_step=self.per_step,
                                  device=self.flag_device, group=self.group)
                anywhere = step_extent(len(got), self.flag_device, self.group, supervised(got))[2]
            self.blocks_consumed += len(drawn)
            for b in drawn:
                self.fingerprint = block_crc(b, self.fingerprint)
            if anywhere:
                return self._padded(got)
            self.counters.blocks_unsupervised += len(got)

    def _padded(self, got: list[dict]) -> list[dict]:
        """`got` filled up to `per_step` with all-padding blocks, counted (the pass's last step)."""
        n_fill = self.per_step - len(got)
        if n_fill:
            self.counters.equalisation_padding_blocks += n_fill
            self.counters.blocks += n_fill
            self.counters.padding_tokens += n_fill * self.seq_len
            got = got + [padding_block(self.seq_len)] * n_fill
        return got

    def __iter__(self) -> Iterator[dict]:
        """The pass block by block (the TRL loop's dataset), whole steps on every rank."""
        while (step := self.next_blocks()) is not None:
            yield from step


def feed_owned_counts(saved: DataCounters, seq_len: int) -> DataCounters:
    """Fresh counters holding only what a feed counted itself in `saved`: the all-padding blocks it added,
    the blocks of the steps it read past (no supervised token anywhere).

    A resumed pass is re-read from its start and counted again as it is replayed; only what the feed
    counted itself is kept from the checkpoint, or every resume would count the replayed rows twice."""
    n = saved.equalisation_padding_blocks
    return DataCounters(equalisation_padding_blocks=n, blocks=n, padding_tokens=n * seq_len,
                        blocks_unsupervised=saved.blocks_unsupervised)


def worker_blocks(recipe: Recipe, *, counters: DataCounters, split: str = "train",
                  epoch: int = 0) -> Iterator[dict]:
    """This worker's packed blocks of `split`, from its Ray Train dataset shard: one pass.

    Epoch 0 packs the rows in the source's order (as a one-pass run does); each later epoch shuffles
    them first with its own seed (`data.seed + epoch`), so blocks mix other conversations each epoch.
    The order is a function of the shard and the epoch only: a resumed epoch replays exactly."""
    import ray.train

    from raytune_ft.data.pipeline import iter_blocks

    shard = ray.train.get_dataset_shard(split)
    seed = recipe.data.seed + epoch if epoch else None
    return iter_blocks(shard, recipe.data, counters=counters, shuffle_seed=seed)


def pass_line(epoch: int, epoch_steps: list[int], step: int) -> str:
    """The log's line as pass `epoch` (0-based, > 0) over the data begins at optimizer step `step`."""
    return (f"pass {epoch} over the data ended at step {step} ({epoch_steps[-1]} steps); pass {epoch + 1} begins, "
            f"its rows in a new seeded order (data.seed + {epoch})")


@dataclass(frozen=True)
class RankSteps:
    """A rank's steps: `per_step` blocks of `seq_len` tokens each, taken by `rank` in step with the other ranks
    of `group` (None: the default process group), whose step flags travel on `flag_device` (None: the CPU)."""
    per_step: int
    seq_len: int
    rank: int = 0
    group: Any = None
    flag_device: Any = None


class EpochFeeds:
    """`epochs` passes over this rank's data, a `StepFeed` each, resumable inside any of them. `epochs=None`:
    pass after pass until the loop stops (`train.max_steps`, which repeats the data as transformers' does),
    or until a pass has no step (no data).

    `open_blocks(epoch, counters)` gives a pass's blocks from the start. `state` is the checkpointed
    train state (or {}): `epoch`, the current pass's `blocks_consumed` and `data_fingerprint`,
    `epoch_counters` (one per pass begun), `epoch_steps` / `epoch_fingerprints` (of finished passes),
    `steps_in_epoch`. `position()` gives the same keys back, plus `counters`: the run's total.
    """

    def __init__(self, open_blocks: Callable[[int, DataCounters], Iterable[dict]], *, epochs: int | None,
                 steps: RankSteps, state: dict, read_ahead: int = 0):
        self.open_blocks, self.epochs, self.steps = open_blocks, epochs, steps
        self.read_ahead = read_ahead          # > 0: each pass read by a `ReadAhead` thread, this many blocks ahead
        self._reader: ReadAhead | None = None
        self.epoch = int(state.get("epoch", 0))
        saved = state.get("epoch_counters") or ([state["counters"]] if state.get("counters") else [])
        self.finished = [DataCounters.from_dict(c) for c in saved[:self.epoch]]
        current = DataCounters.from_dict(saved[self.epoch]) if len(saved) > self.epoch else DataCounters()
        skip = int(state.get("blocks_consumed", 0))
        self.counters = feed_owned_counts(current, steps.seq_len) if skip else current
        self.epoch_steps = list(state.get("epoch_steps", []))
        self.epoch_fingerprints = list(state.get("epoch_fingerprints", []))
        self.steps_in_epoch = int(state.get("steps_in_epoch", 0))
        self.done = False
        self.feed = self._open(skip, state.get("data_fingerprint"))

    def _open(self, skip: int, fingerprint: int | None) -> StepFeed:
        epoch = self.epoch
        if self.read_ahead:
            self._reader = blocks = ReadAhead(lambda c: self.open_blocks(epoch, c), self.counters, self.read_ahead)
        else:
            blocks = self.open_blocks(epoch, self.counters)
        return StepFeed(blocks, steps=self.steps, counters=self.counters, skip_blocks=skip, fingerprint=fingerprint,
                        defer_replay=True)

    def next_blocks(self) -> list[dict] | None:
        """The next step's blocks, moving on to the next epoch when one ends; None after the last."""
        while not self.done:
            blocks = self.feed.next_blocks()
            if blocks is not None:
                self.steps_in_epoch += 1
                return blocks
            self.epoch_steps.append(self.steps_in_epoch)
            self.epoch_fingerprints.append(self.feed.fingerprint)   # its next_blocks() replayed it
            last = not self.steps_in_epoch if self.epochs is None else self.epoch + 1 >= self.epochs
            if last:
                self.done = True
                break
            self.finished.append(self.counters)
            self.epoch, self.counters, self.steps_in_epoch = self.epoch + 1, DataCounters(), 0
            self.feed = self._open(0, None)
        return None

    def close(self) -> None:
        """Stop the read-ahead thread of the current pass, if any (a run that ends before its data)."""
        if self._reader is not None:
            self._reader.close()

    def total_counters(self) -> DataCounters:
        total = DataCounters()
        for c in self.finished + [self.counters]:
            total.merge(c)
        return total

    def position(self) -> dict:
        """Where this rank stands in the data, for its checkpoint."""
        feed = self.feed.replayed()
        return {"epoch": self.epoch, "blocks_consumed": feed.blocks_consumed,
                "data_fingerprint": feed.fingerprint, "steps_in_epoch": self.steps_in_epoch,
                "epoch_steps": list(self.epoch_steps), "epoch_fingerprints": list(self.epoch_fingerprints),
                "epoch_counters": [c.to_dict() for c in self.finished + [self.counters]],
                "counters": self.total_counters().to_dict()}
