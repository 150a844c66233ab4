"""Row-level steps of the data path, pure functions of rows: a raw row to messages, the held-out carve by
content hash, tokens and the assistant mask, a mixture's weights and interleaving key; and the check that
stops a pass whose skipped share is too high. pipeline.py runs them inside Ray Data maps and the workers.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable

from raytune_ft.data.packing import DataCounters
from raytune_ft.data.sft import SpanNotFound, render_sft
from raytune_ft.data.sources import Adapter

_SPLIT_BUCKETS = 1 << 32


def _split_bucket(messages: Any, seed: int) -> float:
    """A number in [0, 1) fixed by the row's content and the seed: which split a row falls in."""
    return _content_hash(messages, seed) / _SPLIT_BUCKETS


def _content_hash(value: Any, seed: int, bits: int = 32) -> int:
    key = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()
    h = hashlib.blake2b(key, digest_size=8, salt=(seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")).digest()
    return int.from_bytes(h[:bits // 8], "little")


def held_out_row(messages: Any, row: Any, fraction: float, seed: int) -> bool:
    """Whether a row is one of the held-out rows carved by content hash (the same on every run and rank)."""
    return fraction > 0 and _split_bucket(messages if messages is not None else repr(row), seed) < fraction


IN_HELD_OUT = "in_held_out"      # the skip reason of a training row whose content a held-out row has


def held_out_key(messages: Any, seed: int) -> int:
    """A conversation's 64-bit content key: a training row whose key a held-out row has is not trained."""
    return _content_hash(messages, seed, bits=64)


@dataclass(frozen=True)
class Carve:
    """Which of a source's rows a split keeps. `keep` is "train" / "validation" / "all": with `fraction > 0`,
    rows whose seeded content hash falls under the fraction are validation rows and the rest train rows.
    `held_out`: the content keys (`held_out_key`) of the rows a named held-out split evaluates; a training row
    with one of them is kept as a skipped row (`in_held_out`), counted, never trained."""
    keep: str = "all"
    fraction: float = 0.0
    seed: int = 42
    held_out: frozenset = frozenset()

    def place(self, messages: Any, row: Any) -> str | None:
        """None: the row belongs to the other split (left out, not counted); "": this split's;
        `IN_HELD_OUT`: this split's, skipped for its content."""
        if self.keep != "all" and self.fraction > 0 and \
                held_out_row(messages, row, self.fraction, self.seed) != (self.keep == "validation"):
            return None
        if self.held_out and messages is not None and held_out_key(messages, self.seed) in self.held_out:
            return IN_HELD_OUT
        return ""


def _unwrap(row: Any) -> Any:
    return row["text"] if isinstance(row, dict) and set(row) == {"text"} and isinstance(row["text"], str) else row


def tokenize_rows(rows: Iterable[Any], tokenizer, *, template_kwargs: dict | None = None, carve: Carve = Carve(),
                  adapter: Adapter | None = None, source: int = 0) -> dict[str, list]:
    """Columns `input_ids`, `mask`, `skip_reason`, `source` for raw rows (dicts, or json text lines), or for
    rows a mixture's `adapt_rows` made (their messages, reason and source travel with them).

    `carve` says which rows are this split's (`Carve`); the other split's rows are left out (not counted:
    they are not this split's). A skipped row keeps a place with empty ids.
    """
    out: dict[str, list] = {"input_ids": [], "mask": [], "skip_reason": [], "source": []}
    kwargs = template_kwargs or {}
    adapt = adapter or Adapter("auto")
    for row in rows:
        if isinstance(row, dict) and "mix_key" in row:        # adapted (and carved) already: a mixture's row
            messages, reason, src = (json.loads(row["text"]) if row["text"] else None), row["skip_reason"] or None, \
                row["source"]
        else:
            row = _unwrap(row)
            (messages, reason), src = adapt(row), source
            place = carve.place(messages, row)
            if place is None:
                continue
            if place:
                messages, reason = None, place
        ids, mask, reason = render_or_reason(tokenizer, messages, reason, kwargs)
        out["input_ids"].append(ids if reason is None else [])
        out["mask"].append(mask if reason is None else [])
        out["skip_reason"].append(reason or "")
        out["source"].append(src)
    return out


def render_or_reason(tokenizer, messages, reason: str | None, template_kwargs: dict):
    """(ids, mask, None) of a conversation rendered with its chat template, or ([], [], the reason to skip)."""
    if messages is None:
        return [], [], reason
    try:
        ids, mask = render_sft(tokenizer, messages, **template_kwargs)
    except SpanNotFound:
        return [], [], "span_not_found"
    except Exception:                       # noqa: BLE001 - a template raising on a row's data
        return [], [], "template_error"
    return ids, mask, None


def adapt_rows(rows: Iterable[Any], adapter: Adapter, *, source: int, carve: Carve, weight: float = 1.0
               ) -> dict[str, list]:
    """A mixture source's rows as messages (json text; "" and the reason for a row to skip), its index and a
    seeded key that interleaves the sources when sorted by it. `carve`: which rows are this split's (`Carve`).
    `weight`: each row is used floor(weight) times, and once more when its seeded hash falls under the
    fraction left (0.5: a seeded half); a row skipped for its content (`in_held_out`) once."""
    out: dict[str, list] = {"text": [], "skip_reason": [], "source": [], "mix_key": []}
    seed = carve.seed
    for row in rows:
        row = _unwrap(row)
        messages, reason = adapter(row)
        content = messages if messages is not None else repr(row)
        place = carve.place(messages, row)
        if place is None:
            continue
        copies = int(weight) + (_split_bucket([content, "weight"], seed + source) < weight - int(weight))
        if place:
            messages, reason, copies = None, place, 1
        for copy in range(copies):
            out["text"].append(json.dumps(messages, ensure_ascii=False) if messages is not None else "")
            out["skip_reason"].append(reason or "")
            out["source"].append(source)
            out["mix_key"].append(_content_hash([content, source, copy], seed, bits=64) >> 1)
    return out


class TooManySkipped(RuntimeError):
    """More of the rows read were skipped than `data.max_skip_fraction` allows."""


class SkipCheck:
    """Stops a pass whose skipped share passes `max_fraction`: checked once `MIN_ROWS` rows are read (the
    whole pass when it is shorter), then at each skipped row."""
    MIN_ROWS = 200

    def __init__(self, max_fraction: float):
        self.max_fraction = max_fraction

    def __call__(self, c: DataCounters, final: bool = False) -> None:
        if c.rows_read < self.MIN_ROWS and not final:
            return
        why = too_many_skipped(c.rows_skipped_by_reason, c.rows_read, self.max_fraction)
        if why:
            raise TooManySkipped(why)


def too_many_skipped(reasons: dict, read: int, max_fraction: float) -> str | None:
    """Why a pass of `read` rows stops for its skipped ones (`reasons`: count by reason), with what to do;
    None while their share is at most `max_fraction` (the run's, the pre-check's and `data check`'s test).
    Rows left out for being held-out rows are not faults of the data: not in the share."""
    reasons = {k: v for k, v in reasons.items() if k != IN_HELD_OUT}
    skipped = sum(reasons.values())
    if not read or skipped / read <= max_fraction:
        return None
    why = ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return (f"{skipped} of {read} rows skipped ({skipped / read:.1%}, more than data.max_skip_fraction="
            f"{max_fraction:g}): {why}. `raytune-ft data check` shows them by source; fix the rows, map their "
            "fields (data.fields, data.roles), or raise data.max_skip_fraction")
