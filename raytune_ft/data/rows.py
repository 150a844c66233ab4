"""Row-level steps of the data path, pure functions of rows: a raw row to messages, the held-out carve by
content hash, tokens and the assistant mask, a mixture's weights and interleaving key; and the check that
stops a pass whose skipped share is too high. pipeline.py runs them inside Ray Data maps and the workers.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple

from raytune_ft.data.packing import HELD_OUT, NOT_DRAWN, DataCounters
from raytune_ft.data.sft import SpanNotFound, render_sft
from raytune_ft.data.sources import Adapter, Skip

_SPLIT_BUCKETS = 1 << 32


def _split_bucket(messages: Any, seed: int) -> float:
    """A number in [0, 1) fixed by the row's content and the seed: which split a row falls in."""
    return _content_hash(messages, seed) / _SPLIT_BUCKETS


def _content_hash(value: Any, seed: int, bits: int = 32) -> int:
    key = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()
    h = hashlib.blake2b(key, digest_size=8, salt=(seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")).digest()
    return int.from_bytes(h[:bits // 8], "little")


def held_out_row(messages: Any, row: Any, fraction: float, seed: int) -> bool:
    """Whether a row is one of the held-out rows carved by content hash (the same on every run and rank). A
    row with no conversation (`messages` None) is never carved: it is skipped, and shown, as it is."""
    return fraction > 0 and messages is not None and _split_bucket(messages, seed) < fraction


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
        """None: the row belongs to the held-out split's rows (left out of it, not counted); `HELD_OUT`: a
        training split's row the carve holds out (kept in its place, counted, never trained); "": this
        split's; `IN_HELD_OUT`: this split's, skipped for its content."""
        if self.keep != "all" and self.fraction > 0 and \
                held_out_row(messages, row, self.fraction, self.seed) != (self.keep == "validation"):
            return HELD_OUT if self.keep == "train" else None
        if self.held_out and messages is not None and held_out_key(messages, self.seed) in self.held_out:
            return IN_HELD_OUT
        return ""


def _unwrap(row: Any) -> Any:
    """A raw row of the stream ({"text", "file"?, "row"?}: reading.RAW_COLUMNS) as its text; any other as is."""
    if isinstance(row, dict) and isinstance(row.get("text"), str) and set(row) in ({"text"}, {"text", "file", "row"}):
        return row["text"]
    return row


# the tokenized stream's columns besides the ids and mask: why a row is not trained (a skip reason or a place,
# "" to train) and the value that failed, its source's index, its use (0 first; a weighted row's further uses
# 1, 2, ...), and where it was read (file, row number)
STREAM_COLUMNS = ("skip_reason", "skip_detail", "source", "copy", "file", "row")


class RowOrigin(NamedTuple):
    """Where a stream row comes from: its source's index, its use (`copy`) and where it was read (file, row)."""
    source: int
    copy: int
    file: str
    row: int


def _append(out: dict, ids, mask, reason, origin: RowOrigin) -> None:
    out["input_ids"].append(ids if not reason else [])
    out["mask"].append(mask if not reason else [])
    out["skip_reason"].append(str(reason or ""))
    out["skip_detail"].append(getattr(reason, "detail", ""))
    out["source"].append(origin.source)
    out["copy"].append(origin.copy)
    out["file"].append(origin.file)
    out["row"].append(origin.row)


def tokenize_rows(rows: Iterable[Any], tokenizer, *, template_kwargs: dict | None = None, carve: Carve = Carve(),
                  adapter: Adapter | None = None, source: int = 0) -> dict[str, list]:
    """Columns `input_ids`, `mask` and `STREAM_COLUMNS` for raw rows (reading.RAW_COLUMNS, json text lines
    or dicts), or for rows a mixture's `adapt_rows` made (their messages, reason, source, use and place travel
    with them).

    `carve` says which rows are this split's (`Carve`): the held-out split's rows are left out of the training
    split's but keep a place (`HELD_OUT`, counted), the training split's are left out of the held-out split's
    (not counted: they are not its rows). A skipped row keeps a place with empty ids.
    """
    out: dict[str, list] = {"input_ids": [], "mask": [], **{k: [] for k in STREAM_COLUMNS}}
    kwargs = template_kwargs or {}
    adapt = adapter or Adapter("auto")
    for row in rows:
        if isinstance(row, dict) and "mix_key" in row:        # adapted (and carved) already: a mixture's row
            messages = json.loads(row["text"]) if row["text"] else None
            reason = Skip(row["skip_reason"], row.get("skip_detail") or "") if row["skip_reason"] else None
            origin = RowOrigin(row["source"], row.get("copy", 0), row.get("file", ""), row.get("row", 0))
        else:
            where = (row.get("file", ""), row.get("row", 0)) if isinstance(row, dict) and "file" in row else ("", 0)
            row = _unwrap(row)
            (messages, reason), origin = adapt(row), RowOrigin(source, 0, *where)
            place = carve.place(messages, row)
            if place is None:
                continue
            if place:
                messages, reason = None, place
        ids, mask, reason = render_or_reason(tokenizer, messages, reason, kwargs)
        _append(out, ids, mask, reason, origin)
    return out


def render_or_reason(tokenizer, messages, reason: str | None, template_kwargs: dict):
    """(ids, mask, None) of a conversation rendered with its chat template, or ([], [], the reason to skip)."""
    if messages is None:
        return [], [], reason
    try:
        ids, mask = render_sft(tokenizer, messages, **template_kwargs)
    except SpanNotFound as e:
        return [], [], Skip("span_not_found", str(e))
    except Exception as e:                  # noqa: BLE001 - a template raising on a row's data
        return [], [], Skip("template_error", f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    return ids, mask, None


def adapt_rows(rows: Iterable[Any], adapter: Adapter, *, source: int, carve: Carve, weight: float = 1.0
               ) -> dict[str, list]:
    """A mixture source's rows as messages (json text; "" and the reason for a row to skip), its index and a
    seeded key that interleaves the sources when sorted by it. `carve`: which rows are this split's (`Carve`).
    `weight`: each row is used floor(weight) times, and once more when its seeded hash falls under the
    fraction left (0.5: a seeded half); a row drawn no time keeps one place (`NOT_DRAWN`); a skipped or held-out
    row has one place whatever its weight, so each row read is counted once."""
    out: dict[str, list] = {"text": [], "skip_reason": [], "skip_detail": [], "source": [], "mix_key": [],
                            "copy": [], "file": [], "row": []}
    seed = carve.seed
    for raw in rows:
        where = (raw.get("file", ""), raw.get("row", 0)) if isinstance(raw, dict) and "file" in raw else ("", 0)
        row = _unwrap(raw)
        messages, reason = adapter(row)
        content = messages if messages is not None else repr(row)
        place = carve.place(messages, row)
        if place is None:
            continue
        copies = int(weight) + (_split_bucket([content, "weight"], seed + source) < weight - int(weight))
        if place or reason:
            messages, reason, copies = None, place or reason, 1
        elif not copies:
            messages, reason, copies = None, NOT_DRAWN, 1
        for copy in range(copies):
            out["text"].append(json.dumps(messages, ensure_ascii=False) if messages is not None else "")
            out["skip_reason"].append(str(reason or ""))
            out["skip_detail"].append(getattr(reason, "detail", ""))
            out["source"].append(source)
            out["mix_key"].append(_content_hash([content, source, copy], seed, bits=64) >> 1)
            out["copy"].append(copy)
            out["file"].append(where[0])
            out["row"].append(where[1])
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
        read = c.rows_read - c.rows_held_out
        if read < self.MIN_ROWS and not final:
            return
        why = too_many_skipped(c.rows_skipped_by_reason, read, self.max_fraction, c.skipped_rows)
        if why:
            raise TooManySkipped(why)


def skipped_lines(sample: list[dict], indent: str = "  ") -> list[str]:
    """The skipped-row samples (DataCounters.skipped_rows) one a line: where, the reason and the value."""
    return [f"{indent}{r['file'] or r['source']}" + (f" row {r['row']}" if r["row"] else "")
            + f": {r['reason']}" + (f": {r['detail']}" if r["detail"] else "") for r in sample]


def too_many_skipped(reasons: dict, read: int, max_fraction: float, sample: list[dict] = ()) -> str | None:
    """Why a pass of `read` rows (held-out rows not among them) stops for its skipped ones (`reasons`: count
    by reason), with what to do and the first skipped rows (`sample`); None while their share is at most
    `max_fraction` (the run's, the pre-check's and `data check`'s test). Rows left out for being held-out
    rows are not faults of the data: not in the share."""
    reasons = {k: v for k, v in reasons.items() if k != IN_HELD_OUT}
    skipped = sum(reasons.values())
    if not read or skipped / read <= max_fraction:
        return None
    why = ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
    first = "; ".join(line.strip() for line in skipped_lines([r for r in sample if r["reason"] != IN_HELD_OUT][:5]))
    return (f"{skipped} of {read} rows skipped ({skipped / read:.1%}, more than data.max_skip_fraction="
            f"{max_fraction:g}): {why}" + (f". First skipped: {first}" if first else "")
            + ". Fix the rows, map their fields (data.fields, data.roles), or raise data.max_skip_fraction"
            + ("" if first else "; `raytune-ft data check` shows the first skipped rows of each source"))
