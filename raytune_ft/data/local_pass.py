"""A training pass's data computed in this process, laid out as the run lays it out across its ranks (no Ray):
what `raytune-ft data check` counts, so that its figures are the run's for the same recipe and world size.

The run's train dataset (`pipeline.build_dataset`) is a stream of rows in a fixed order, in blocks of
`BUNDLE_ROWS` rows as its tokenizing map emits them. Ray Data's split (`pipeline.train_data_config`:
`streaming_split(equal=False)`, the order preserved, no locality hints) hands each block to the rank with the
fewest rows so far (`rank_shares`). Each rank packs its own share (`pipeline.iter_blocks`, which counts every
row), and the ranks run ceil(blocks / (world x per_step)) steps, lending each other blocks, the last step
filled with all-padding blocks (`equalisation_blocks`). Here the same row functions make the same stream
(`stream_bundles`), and the same `iter_blocks` packs and counts each share.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from raytune_ft.data.held_out import held_out_keys, split_plan
from raytune_ft.data.packing import DataCounters, overlong_pieces
from raytune_ft.data.pipeline import BUNDLE_ROWS, adapter_of, iter_blocks
from raytune_ft.data.reading import iter_source_rows
from raytune_ft.data.rows import Carve, adapt_rows, tokenize_rows
from raytune_ft.data.sources import Adapter
from raytune_ft.data.specs import SourceSpec, one_stream, source_specs


def rank_shares(bundles: list[list], world: int) -> list[list]:
    """Each rank's rows: every bundle, in order, to the rank holding the fewest rows so far (the lowest rank
    on a tie), as Ray Data's split hands them out when the order is preserved."""
    shares: list[list] = [[] for _ in range(world)]
    for bundle in bundles:
        min(shares, key=len).extend(bundle)
    return shares


def pass_steps(blocks: int, world: int, per_step: int) -> int:
    """Steps a pass of `blocks` blocks over all ranks runs (train.lending: the ranks lend each other blocks)."""
    return -(-blocks // (world * per_step))


def equalisation_blocks(blocks: int, world: int, per_step: int) -> int:
    """All-padding blocks that fill the pass's last step on every rank."""
    return pass_steps(blocks, world, per_step) * world * per_step - blocks


@dataclass
class SourceRows:
    """What a source's rows looked like before packing: formats picked, and each trained row's tokens."""
    formats: dict[str, int] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    supervised: int = 0
    limited: bool = False          # more rows than the check reads
    # pieces of the conversations longer than data.seq_len, and how many hold an assistant token (trained)
    pieces: int = 0
    pieces_trained: int = 0


def _raw_rows(spec: SourceSpec, source_split: str, data, limit: int | None, seen: SourceRows) -> list[dict]:
    """The rows `pipeline._read` gives (its `max_rows`), at most `limit`, noting the formats picked."""
    adapter, out = adapter_of(spec), []
    for file, n, text in iter_source_rows(spec, source_split, seed=data.seed):
        if spec.max_rows is not None and len(out) >= spec.max_rows:
            break
        if limit is not None and len(out) >= limit:
            seen.limited = True
            break
        out.append({"text": text, "file": file, "row": n})
        try:
            fmt = spec.schema if spec.schema != "auto" else adapter.detect(json.loads(text))
        except ValueError:
            fmt = None
        if fmt:
            seen.formats[fmt] = seen.formats.get(fmt, 0) + 1
    return out


def _rows(cols: dict[str, list]) -> list[dict]:
    return [dict(zip(cols, values)) for values in zip(*cols.values())]


def stream_bundles(data, tokenizer, *, limit: int | None = None) -> tuple[list[list[dict]], dict[str, SourceRows]]:
    """The train dataset's rows as `build_dataset` streams them, block by block, and what each source's rows
    looked like; at most `limit` rows read of each source."""
    specs = source_specs(data)
    keys, kwargs = held_out_keys(data), dict(data.template_kwargs)
    seen = {spec.name: SourceRows() for spec in specs}
    plans = []
    for spec in specs:
        source_split, carve = split_plan(spec, data, "train")
        plans.append((spec, _raw_rows(spec, source_split, data, limit, seen[spec.name]),
                      dataclasses.replace(carve, held_out=keys)))
    if one_stream(specs):
        spec, raw, carve = plans[0]
        adapter = adapter_of(spec)
    else:
        raw = []
        for i, (spec, rows, carve) in enumerate(plans):
            raw += _rows(adapt_rows(rows, adapter_of(spec), source=i, carve=carve, weight=spec.weight))
        raw.sort(key=lambda r: r["mix_key"])
        raw = raw[:data.max_rows] if data.max_rows is not None else raw
        adapter, carve = Adapter("messages"), Carve()
    bundles = [_rows(tokenize_rows(raw[i:i + BUNDLE_ROWS], tokenizer, adapter=adapter, template_kwargs=kwargs,
                                   carve=carve)) for i in range(0, len(raw), BUNDLE_ROWS)]
    for row in (r for b in bundles for r in b):
        if not row["skip_reason"] and row["copy"] == 0:
            mine = seen[specs[row["source"]].name]
            mine.lengths.append(len(row["input_ids"]))
            mine.supervised += sum(row["mask"])
            if len(row["input_ids"]) > data.seq_len:
                n, trained = overlong_pieces(row["mask"], data.seq_len)
                mine.pieces, mine.pieces_trained = mine.pieces + n, mine.pieces_trained + trained
    return bundles, seen


def local_pass(bundles: list[list[dict]], data, *, world: int, per_step: int) -> DataCounters:
    """The counters of one training pass over `bundles` on `world` ranks of `per_step` blocks a step: each
    rank's share packed and counted by `iter_blocks`, summed, with the all-padding blocks of the last step."""
    counting = dataclasses.replace(data, max_skip_fraction=1.0)      # the check reports, it does not stop
    total = DataCounters()
    for share in rank_shares(bundles, world):
        mine = DataCounters()
        for _ in iter_blocks(share, counting, counters=mine):
            pass
        total.merge(mine)
    fill = equalisation_blocks(total.blocks, world, per_step)
    total.equalisation_padding_blocks += fill
    total.blocks += fill
    total.padding_tokens += fill * data.seq_len
    return total
