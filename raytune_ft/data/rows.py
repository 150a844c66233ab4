"""Row-level steps of the data path, pure functions of rows: a raw row to messages, the held-out carve by
content hash, tokens and the assistant mask, a mixture's weights and interleaving key; and the check that
stops a pass whose skipped share is too high. pipeline.py runs them inside Ray Data maps and the workers.
"""
from __future__ import annotations

import hashlib
import json
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


def _unwrap(row: Any) -> Any:
    return row["text"] if isinstance(row, dict) and set(row) == {"text"} and isinstance(row["text"], str) else row


def tokenize_rows(rows: Iterable[Any], tokenizer, *, schema: str = "auto",
                  template_kwargs: dict | None = None, validation_fraction: float = 0.0,
                  keep: str = "all", seed: int = 42, adapter: Adapter | None = None,
                  source: int = 0) -> dict[str, list]:
    """Columns `input_ids`, `mask`, `skip_reason`, `source` for raw rows (dicts, or json text lines), or for
    rows a mixture's `adapt_rows` made (their messages, reason and source travel with them).

    `keep` is "train" / "validation" / "all": with `validation_fraction > 0`, rows whose seeded hash
    falls under the fraction are validation rows and the rest train rows; the other split's rows are
    left out (not counted: they are not this split's). A skipped row keeps a place with empty ids.
    """
    out: dict[str, list] = {"input_ids": [], "mask": [], "skip_reason": [], "source": []}
    kwargs = template_kwargs or {}
    adapt = adapter or Adapter(schema)
    for row in rows:
        if isinstance(row, dict) and "mix_key" in row:        # adapted (and carved) already: a mixture's row
            messages, reason, src = (json.loads(row["text"]) if row["text"] else None), row["skip_reason"] or None, \
                row["source"]
        else:
            row = _unwrap(row)
            (messages, reason), src = adapt(row), source
            if keep != "all" and validation_fraction > 0 and \
                    held_out_row(messages, row, validation_fraction, seed) != (keep == "validation"):
                continue
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


def adapt_rows(rows: Iterable[Any], adapter: Adapter, *, source: int, keep: str, fraction: float, seed: int,
               weight: float = 1.0) -> dict[str, list]:
    """A mixture source's rows as messages (json text; "" and the reason for a row to skip), its index and a
    seeded key that interleaves the sources when sorted by it. `weight`: each row is used floor(weight) times,
    and once more when its seeded hash falls under the fraction left (0.5: a seeded half)."""
    out: dict[str, list] = {"text": [], "skip_reason": [], "source": [], "mix_key": []}
    for row in rows:
        row = _unwrap(row)
        messages, reason = adapter(row)
        content = messages if messages is not None else repr(row)
        if keep != "all" and fraction > 0 and held_out_row(messages, row, fraction, seed) != (keep == "validation"):
            continue
        copies = int(weight) + (_split_bucket([content, "weight"], seed + source) < weight - int(weight))
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
    None while their share is at most `max_fraction` (the run's, the pre-check's and `data check`'s test)."""
    skipped = sum(reasons.values())
    if not read or skipped / read <= max_fraction:
        return None
    why = ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return (f"{skipped} of {read} rows skipped ({skipped / read:.1%}, more than data.max_skip_fraction="
            f"{max_fraction:g}): {why}. `raytune-ft data check` shows them by source; fix the rows, map their "
            "fields (data.fields, data.roles), or raise data.max_skip_fraction")
