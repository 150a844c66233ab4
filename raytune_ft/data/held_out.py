"""The held-out rows of every kind, said the same way by the run, the checks before Ray and `raytune-ft data
check`: which rows each source holds out (`split_plan`), how many of them it evaluates (`shares`:
`data.validation_max_rows` shared among the sources that evaluate, applied after the carve), and the content
keys of the rows a named held-out split evaluates (`held_out_keys`): a training row with the same content is
not trained, but counted as skipped (`in_held_out`).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

from raytune_ft.data.reading import iter_raw_rows, iter_source_rows
from raytune_ft.data.rows import Carve, _unwrap, held_out_key, held_out_row
from raytune_ft.data.specs import SourceSpec, adapter_of, source_specs


def source_fraction(spec: SourceSpec, data) -> float:
    """The carve's fraction of one source: its own (a mixture's, settled before Ray) or the data's; 0 when the
    data carves nothing."""
    if not data.validation_fraction:
        return 0.0
    return data.validation_fraction if spec.validation_fraction is None else spec.validation_fraction


def split_plan(spec: SourceSpec, data, split: str) -> tuple[str, Carve] | None:
    """(the source's split to read, which of its rows to keep) for the `split` asked for ("train" or
    "validation"); None when the source gives no held-out rows."""
    fraction = source_fraction(spec, data)
    if split == "train":
        return spec.split, Carve("train", 0.0 if spec.validation_split else fraction, data.seed)
    if spec.validation_split:
        return spec.validation_split, Carve("all", 0.0, data.seed)
    return (spec.split, Carve("validation", fraction, data.seed)) if fraction > 0 else None


def shares(cap: int | None, n: int) -> list[int | None]:
    """How many held-out rows each of `n` sources that evaluate gives: `cap` shared equally, the first ones one
    more where it does not divide; None (all of them) without a cap."""
    if cap is None:
        return [None] * n
    return [cap // n + (i < cap % n) for i in range(n)]


def evaluating(data, specs: list[SourceSpec]) -> list[tuple[int, SourceSpec, int | None]]:
    """(index, spec, evaluated rows at most) of each source that gives held-out rows."""
    given = [(i, spec) for i, spec in enumerate(specs) if split_plan(spec, data, "validation") is not None]
    return [(i, spec, share) for (i, spec), share in zip(given, shares(data.validation_max_rows, len(given)))]


@dataclass(frozen=True)
class NamedSplit:
    """The first rows of a named held-out split that a run evaluates: their content keys, how many, and
    whether the split has more rows than are evaluated; `usable`: how many of them hold a conversation, and why
    the first one that does not is skipped."""
    keys: frozenset
    rows: int
    more: bool
    usable: int = 0
    first_skip: str = ""


def named_split(spec: SourceSpec, share: int | None, seed: int) -> NamedSplit:
    """The evaluated rows of `spec`'s named held-out split (its first `share`, or all), read here."""
    return _named_split(json.dumps(dataclasses.asdict(spec), sort_keys=True, default=str), share, seed)


@functools.lru_cache(maxsize=16)
def _named_split(spec_json: str, share: int | None, seed: int) -> NamedSplit:
    # the checks before Ray and the dataset's build both ask, in one process: the split read once
    spec = SourceSpec(**json.loads(spec_json))
    adapter, keys, n, usable, first_skip = adapter_of(spec), set(), 0, 0, ""
    for file, number, raw in iter_source_rows(spec, spec.validation_split, held_out=True, seed=seed):
        if share is not None and n == share:
            return NamedSplit(frozenset(keys), n, True, usable, first_skip)
        n += 1
        messages, why = adapter(_unwrap(raw))
        usable += messages is not None
        first_skip = first_skip or (f"{file} row {number}: {why}: {getattr(why, 'detail', '')}" if why else "")
        # a generated source's held-out rows are made apart from its training rows (builtin.split_rows)
        if messages is not None and spec.kind != "builtin":
            keys.add(held_out_key(messages, seed))
    return NamedSplit(frozenset(keys), n, False, usable, first_skip)


def _carved_keys(spec: SourceSpec, data, share: int | None) -> set[int]:
    """The content keys of the rows a source's own carve holds out and its held-out set evaluates (its first
    `share`, or all)."""
    adapter, fraction, keys, held = adapter_of(spec), source_fraction(spec, data), set(), 0
    for n, raw in enumerate(iter_raw_rows(spec, spec.split, seed=data.seed)):
        if (spec.max_rows is not None and n >= spec.max_rows) or (share is not None and held >= share):
            break
        row = _unwrap(raw)
        messages, _ = adapter(row)
        if messages is not None and held_out_row(messages, row, fraction, data.seed):
            keys.add(held_out_key(messages, data.seed))
            held += 1
    return keys


def held_out_keys(data) -> frozenset:
    """The content keys of every row a held-out set evaluates and the carve alone does not keep from training:
    a named split's evaluated rows, and the evaluated rows of each source whose carve's fraction (settled before
    Ray) is above the lowest that any source's training rows are carved at (0 for a source naming a split or
    evaluating none): a conversation in two sources falls on the same side of one threshold only. Empty when no
    source names a held-out split and every source carves at one fraction."""
    specs = source_specs(data)
    lowest = min(0.0 if s.validation_split else source_fraction(s, data) for s in specs)
    keys: set[int] = set()
    for _, spec, share in evaluating(data, specs):
        if spec.validation_split:
            keys |= named_split(spec, share, data.seed).keys
        elif source_fraction(spec, data) > lowest:
            keys |= _carved_keys(spec, data, share)
    return frozenset(keys)
