"""Pack tokenized conversations into fixed-length blocks with block-diagonal signals.

`pack_blocks(examples, seq_len)` takes `(ids, mask)` pairs and yields blocks of exactly `seq_len`
tokens. Each block holds whole conversations one after another, then padding:

    input_ids     int64 [seq_len]
    labels        int64 [seq_len]  token id where the mask is True, else -100; also -100 on each
                                   conversation's first token and on padding. Not shifted: the loss
                                   predicts labels[t] from position t-1, so -100 on a first token
                                   keeps the shifted loss from crossing a conversation boundary.
    position_ids  int64 [seq_len]  0, 1, 2, ... restarting in each conversation (and in the padding)
    seq_idx       int32 [seq_len]  conversation index in the block; padding is the last segment
    cu_seqlens    int32 [n_segments + 1]  segment boundaries, padding counted as the last segment

Packing: best-fit-decreasing over a bounded window of `window` conversations. When the window is
full, its conversations are sorted longest first and each goes into the open block with the least
room that still fits it. Every block is emitted except the least filled one, whose conversations go
back into the window to be packed with the next `window` arrivals: so only the very end of the
stream leaves partly filled blocks, and the stream's tail is packed (and its padding counted), never
dropped. Memory: at most `window` conversations plus one block's worth held back.

The windows ramp up: the first is `RAMP_FROM` conversations (or `window`, if smaller), each next one
twice the last, up to `window`. A run's first block then leaves after `RAMP_FROM` conversations have been
tokenized, not a full window on every rank; the price is the first few blocks' packing, best fit over
fewer conversations (a little more padding in those blocks only).
The ramp is part of the layout: a checkpoint taken before it was added resumes with a data fingerprint
mismatch, not silently on other blocks.

Policy for a conversation longer than a block (`overlong`):
  "split" (default): cut it into `seq_len`-token pieces; each piece is packed as a conversation of its
          own (positions restart at 0, its first token's label is -100 since the piece cannot see the
          previous one); later pieces keep their own loss. Counted in `conversations_split`. Keeps the
          pieces that hold an assistant token; a piece with none (a long prompt's first pieces) has
          nothing to learn from and is not trained, counted in `pieces_unsupervised` (`overlong_pieces`).
  "drop":  skip it, counted in `rows_skipped_by_reason["overlong"]`. Keeps none of it.
"""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

IGNORE_INDEX = -100
# A row's place in the training stream that is not a skip (its skip_reason column holds these): carved for the
# held-out set, or a mixture row its weight (< 1) draws no time. Counted, never trained, never a fault.
HELD_OUT = "held_out"
NOT_DRAWN = "not_drawn"
SKIP_SAMPLE = 5                           # skipped rows kept per source and reason, to show (file, row, value)


@dataclass
class DataCounters:
    """What the data path read, skipped, packed and padded; mergeable across workers.

    Every row read is one of: trained (`rows_trained`; `conversations` counts its uses, its weight's times),
    held out (`rows_held_out`), or skipped (`rows_skipped_by_reason`), in all and per source (`by_source`)."""

    rows_read: int = 0                    # input rows, each once whatever its weight
    rows_held_out: int = 0
    rows_trained: int = 0
    rows_skipped_by_reason: dict[str, int] = field(default_factory=dict)
    conversations: int = 0                # trained rows' uses: a row of weight 2 twice
    conversations_packed: int = 0         # pieces packed: a conversation, or each piece of one split
    conversations_split: int = 0          # over-long conversations cut into block-sized pieces
    pieces_unsupervised: int = 0          # pieces of those with no assistant token: not trained (module docstring)
    blocks: int = 0
    padding_tokens: int = 0
    real_tokens: int = 0
    supervised_tokens: int = 0            # labels != -100
    equalisation_padding_blocks: int = 0  # all-padding blocks a rank ran so every rank steps equally
    blocks_unsupervised: int = 0          # blocks of steps with no supervised token on any rank: not trained
    # per source (by its name): rows_read, held_out, trained, rows_skipped_by_reason, conversations, pieces,
    # tokens, blocks (the blocks holding any of its pieces)
    by_source: dict[str, dict] = field(default_factory=dict)
    # the first SKIP_SAMPLE skipped rows per source and reason: {source, file, row, reason, detail}
    skipped_rows: list[dict] = field(default_factory=list)

    def skip(self, reason: str, n: int = 1, source: str | None = None) -> None:
        self.rows_skipped_by_reason[reason] = self.rows_skipped_by_reason.get(reason, 0) + n
        if source is not None:
            mine = self.of_source(source)["rows_skipped_by_reason"]
            mine[reason] = mine.get(reason, 0) + n

    def of_source(self, name: str) -> dict:
        """The counts of one source, made on first use."""
        if name not in self.by_source:
            self.by_source[name] = {"rows_read": 0, "held_out": 0, "trained": 0, "rows_skipped_by_reason": {},
                                    "conversations": 0, "pieces": 0, "tokens": 0, "blocks": 0}
        return self.by_source[name]

    def count_row(self, source: str, reason: str = "", *, first: bool = True, where: tuple = ("", 0)) -> bool:
        """Count one row of the stream under its source: `reason` its skip reason or place (HELD_OUT,
        NOT_DRAWN; "" to train), `first` False for a weighted row's further uses (counted as uses alone),
        `where` its (file, row number). True when this use is trained."""
        mine = self.of_source(source)
        if first:
            self.rows_read += 1
            mine["rows_read"] += 1
            if reason == HELD_OUT:
                self.rows_held_out += 1
                mine["held_out"] += 1
                return False
            if reason and reason != NOT_DRAWN:
                self.skip(str(reason), source=source)
                self._sample({"source": source, "file": where[0], "row": where[1], "reason": str(reason),
                              "detail": getattr(reason, "detail", "")})
                return False
            self.rows_trained += 1
            mine["trained"] += 1
        if reason:
            return False
        self.conversations += 1
        mine["conversations"] += 1
        return True

    def _sample(self, row: dict) -> None:
        key = (row["source"], row["reason"])
        kept = [_read_order(r) for r in self.skipped_rows if (r["source"], r["reason"]) == key]
        if len(kept) < SKIP_SAMPLE or _read_order(row) < max(kept):
            self.skipped_rows = first_skipped(self.skipped_rows + [row])

    @property
    def rows_skipped(self) -> int:
        return sum(self.rows_skipped_by_reason.values())

    def merge(self, other: "DataCounters") -> "DataCounters":
        """Add `other` into self (for summing the counts of several workers); returns self."""
        for f in dataclasses.fields(self):
            if f.name == "rows_skipped_by_reason":
                for k, v in other.rows_skipped_by_reason.items():
                    self.skip(k, v)
            elif f.name == "by_source":
                _add_nested(self.by_source, other.by_source)
            elif f.name == "skipped_rows":
                self.skipped_rows = first_skipped(self.skipped_rows + other.skipped_rows)
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def since(self, earlier: "DataCounters") -> "DataCounters":
        """What was counted after `earlier` (a copy of these counters taken before)."""
        out = DataCounters()
        for f in dataclasses.fields(self):
            if f.name == "rows_skipped_by_reason":
                for k, v in self.rows_skipped_by_reason.items():
                    if n := v - earlier.rows_skipped_by_reason.get(k, 0):
                        out.skip(k, n)
            elif f.name == "by_source":
                _add_nested(out.by_source, self.by_source)
                _add_nested(out.by_source, earlier.by_source, sign=-1)
            elif f.name == "skipped_rows":
                out.skipped_rows = _without(self.skipped_rows, earlier.skipped_rows)
            else:
                setattr(out, f.name, getattr(self, f.name) - getattr(earlier, f.name))
        return out

    def copy(self) -> "DataCounters":
        return DataCounters.from_dict(self.to_dict())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DataCounters":
        import copy

        return cls(**{k: (copy.deepcopy(v) if isinstance(v, (dict, list)) else v) for k, v in d.items()})

    def as_metrics(self, prefix: str = "data/") -> dict[str, float]:
        """A flat dict of numbers (for MLflow / ray.train.report)."""
        out: dict[str, float] = {}
        for f in dataclasses.fields(self):
            if f.name in ("rows_skipped_by_reason", "by_source", "skipped_rows"):
                continue
            out[prefix + f.name] = getattr(self, f.name)
        out[prefix + "rows_skipped"] = self.rows_skipped
        for reason, n in sorted(self.rows_skipped_by_reason.items()):
            out[f"{prefix}rows_skipped/{reason}"] = n
        total = self.real_tokens + self.padding_tokens
        out[prefix + "packing_efficiency"] = self.real_tokens / total if total else 0.0
        return out


def _without(rows: list[dict], earlier: list[dict]) -> list[dict]:
    """`rows` less one copy of each of `earlier`'s."""
    left, out = list(earlier), []
    for r in rows:
        if r in left:
            left.remove(r)
        else:
            out.append(r)
    return out


def _read_order(r: dict) -> tuple:
    return r["source"], r["reason"], r["file"], r["row"]


def first_skipped(rows: list[dict]) -> list[dict]:
    """The skipped-row samples in read order (source, reason, file, row), the first SKIP_SAMPLE of each source and
    reason: the same whichever rank read which rows, and however they were merged."""
    out: list[dict] = []
    seen: dict[tuple, int] = {}
    for r in sorted(rows, key=_read_order):
        key = (r["source"], r["reason"])
        if seen.get(key, 0) < SKIP_SAMPLE:
            seen[key] = seen.get(key, 0) + 1
            out.append(r)
    return out


def _add_nested(dst: dict, src: dict, sign: int = 1) -> None:
    """Add the numbers of `src` into `dst` (times `sign`), key by key, through nested dicts."""
    for k, v in src.items():
        if isinstance(v, dict):
            _add_nested(dst.setdefault(k, {}), v, sign)
        else:
            dst[k] = dst.get(k, 0) + sign * v


def block_from_segments(segments: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int,
                        pad_id: int = 0) -> dict[str, np.ndarray]:
    """Lay out conversations `(ids, mask)` (total length <= seq_len) as one padded block."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.empty(seq_len, dtype=np.int64)
    seq_idx = np.empty(seq_len, dtype=np.int32)
    bounds = [0]
    pos = 0
    for i, (ids, mask) in enumerate(segments):
        n = len(ids)
        end = pos + n
        input_ids[pos:end] = ids
        labels[pos:end] = np.where(mask, ids, IGNORE_INDEX)
        labels[pos] = IGNORE_INDEX            # nothing in this block predicts a conversation's first token
        position_ids[pos:end] = np.arange(n)
        seq_idx[pos:end] = i
        pos = end
        bounds.append(pos)
    if pos > seq_len:
        raise ValueError(f"segments hold {pos} tokens, more than seq_len={seq_len}")
    if pos < seq_len:                         # padding: its own last segment, never supervised
        position_ids[pos:] = np.arange(seq_len - pos)
        seq_idx[pos:] = len(segments)
        bounds.append(seq_len)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "seq_idx": seq_idx, "cu_seqlens": np.asarray(bounds, dtype=np.int32)}


def padding_block(seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """A block of padding only (labels all -100): what a rank runs when its data is exhausted."""
    return block_from_segments([], seq_len, pad_id)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of indices into `lengths`) from best-fit-decreasing; ties keep arrival order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    # Open bins sorted by room left: (room, bin number); bisect finds the tightest bin that fits.
    rooms: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, (n, -1))
        if k < len(rooms):
            room, b = rooms.pop(k)
            bins[b].append(i)
            if room - n > 0:
                bisect.insort(rooms, (room - n, b))
        else:
            bins.append([i])
            if capacity - n > 0:
                bisect.insort(rooms, (capacity - n, len(bins) - 1))
    return bins


def overlong_pieces(mask: Sequence[bool], seq_len: int) -> tuple[int, int]:
    """(pieces, pieces trained) of a conversation with assistant mask `mask` under overlong="split": cut
    into `seq_len`-token pieces, a piece is trained when a token after its first is supervised."""
    mask = np.asarray(mask, dtype=bool)
    starts = range(0, len(mask), seq_len)
    return len(starts), sum(_piece_trained(mask[s:s + seq_len]) for s in starts)


def _piece_trained(mask: np.ndarray) -> bool:
    # a piece's first token is never supervised: the piece cannot see the text before it
    return bool(mask[1:].any())


RAMP_FROM = 64      # the first packing window, in conversations (module docstring)


def pack_blocks(examples: Iterable[tuple], seq_len: int, *,
                window: int = 2048, pad_id: int = 0, overlong: str = "split",
                counters: DataCounters | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Pack `(ids, mask)` conversations into `seq_len` blocks (fields and policies: module docstring).

    `examples` are `(ids, mask)` or `(ids, mask, source)`: a source's name, counted in `counters.by_source`.
    Deterministic: the same examples in the same order give the same blocks. `counters`, when given,
    receives conversations_packed / conversations_split / blocks / token counts as blocks are taken
    from the iterator (rows_read, counted by the caller, includes the packing window read ahead).
    """
    if overlong not in ("split", "drop"):
        raise ValueError(f"overlong={overlong!r}: expected 'split' or 'drop'")
    if seq_len < 2:
        raise ValueError("seq_len must be >= 2")
    c = counters if counters is not None else DataCounters()
    pending: list[tuple] = []         # (ids, mask, source or None)
    # Repack once a window of new conversations has joined the ones held back, so the held-back block
    # (at most one block's worth) never makes each arrival trigger a repack. The windows ramp up to `window`.
    span = min(window, RAMP_FROM)
    pack_at = span

    def emit(segs):
        block = block_from_segments([(s[0], s[1]) for s in segs], seq_len, pad_id)
        real = sum(len(s[0]) for s in segs)
        for tag in {s[2] for s in segs if s[2] is not None}:   # the sources': their blocks and tokens
            mine = c.of_source(tag)
            mine["blocks"] += 1
            mine["pieces"] += sum(1 for s in segs if s[2] == tag)
            mine["tokens"] += sum(len(s[0]) for s in segs if s[2] == tag)
        c.blocks += 1
        c.conversations_packed += len(segs)
        c.real_tokens += real
        c.padding_tokens += seq_len - real
        c.supervised_tokens += int((block["labels"] != IGNORE_INDEX).sum())
        return block

    def pack_pending(final: bool):
        bins = best_fit_decreasing([len(p[0]) for p in pending], seq_len)
        keep: list[int] = []
        if not final:
            # Hold back the least filled block: its conversations rejoin the window.
            fill = [sum(len(pending[i][0]) for i in b) for b in bins]
            worst = min(range(len(bins)), key=lambda b: (fill[b], b))
            keep = sorted(bins.pop(worst))
        groups = [[pending[i] for i in b] for b in bins]
        pending[:] = [pending[i] for i in keep]
        for segs in groups:       # built and counted one at a time, as they are taken: a run that stops
            yield emit(segs)      # early (train.max_steps) counts only the blocks it drew

    for ids, mask, *tagged in examples:
        tag = tagged[0] if tagged else None
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=bool)
        if len(ids) != len(mask):
            raise ValueError(f"ids and mask differ in length ({len(ids)} vs {len(mask)})")
        if len(ids) == 0:
            c.skip("empty")
            continue
        if len(ids) > seq_len:
            if overlong == "drop":
                c.skip("overlong", source=tag)
                continue
            c.conversations_split += 1
            for start in range(0, len(ids), seq_len):
                piece = (ids[start:start + seq_len], mask[start:start + seq_len], tag)
                if not _piece_trained(piece[1]):    # nothing to learn: a step of such pieces had a loss of 0
                    c.pieces_unsupervised += 1
                    continue
                if len(piece[0]) == seq_len:
                    yield emit([piece])       # a full piece is a block of its own
                else:
                    pending.append(piece)
        else:
            pending.append((ids, mask, tag))
        if len(pending) >= pack_at:
            yield from pack_pending(final=False)
            span = min(window, 2 * span)
            pack_at = len(pending) + span
    if pending:
        yield from pack_pending(final=True)
