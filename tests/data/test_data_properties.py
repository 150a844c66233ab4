"""Property tests of the data path (issue 57, item 10): random folders of mixed formats and compression (jsonl, a
JSON array, parquet, .gz and .zst), rows in every chat format with some that cannot train (an unknown role, an
empty message, no assistant turn, a broken line), random mixtures with weights, held-out caps and named splits
whose rows repeat training rows, on 1 to 3 ranks. Every row read is trained (its weight's times), held out or
skipped with its reason; the held-out rows and the trained rows never share content; `data check` counts what
the run's ranks count; every run gives each rank the same blocks; a resume at any block or step trains the rest
exactly once.

Without Ray, the run's stream is `local_pass.stream_bundles` and each rank's share is what Ray Data's split hands
out (`ray_split`: each bundle, in order, to the rank with the fewest rows so far); the held-out set is
`build_dataset(split="validation")`'s steps run here (`held_out_set`). The slow test checks both against a real
local Ray. The edges these properties found are kept as explicit examples, run every time (WEIGHTED_ALONE, ...).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import re
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, assume, event, example, given, settings
from hypothesis import strategies as st

from raytune_ft.data.held_out import _named_split, evaluating, split_plan
from raytune_ft.data.local_pass import stream_bundles
from raytune_ft.data.packing import HELD_OUT, DataCounters
from raytune_ft.data.pipeline import BUNDLE_ROWS, iter_blocks
from raytune_ft.data.precheck import check_sources
from raytune_ft.data.reading import iter_source_rows
from raytune_ft.data.rows import IN_HELD_OUT, Carve, adapt_rows, tokenize_rows
from raytune_ft.data.sources import Adapter
from raytune_ft.data.specs import adapter_of, one_stream, source_specs
from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, validate
from tests.conftest import FIXTURES

TOKENIZER = FIXTURES / "tokenizers" / "qwen3"
# a few words, some of several tokens or bytes: conversations repeat and some prompts outgrow a block
WORDS = ("alpha", "beta", "river", "stone", "cloud", "Paris", "café", "数据", "42", "why?")
SYSTEMS = (None, "Be brief.", "You are a concise assistant.")
FILE_KINDS = ("jsonl", "json", "parquet", "jsonl.gz", "jsonl.zst", "json.gz")
SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system"}
BAD_REASONS = ("unknown_role", "empty_content", "no_assistant_turn", "invalid_json")
# examples per property: the file's fast part within ~20 s on 2 shared cores (the tokenizer's load is ~5 s of it)
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- what is written, and what each row should become

@dataclass
class Row:
    """A row written to a file: its value (a dict, or a jsonl line's text), the conversation it holds (None for
    a row that cannot train) and the reason it must be skipped with."""
    value: Any
    messages: list | None
    reason: str | None = None


@dataclass
class DataFile:
    kind: str                   # one of FILE_KINDS
    rows: list[Row]
    blank_first: bool = False   # a jsonl file's first line is blank: its rows' numbers are their lines'


@dataclass
class Source:
    name: str
    train: list[DataFile]
    test: list[DataFile] = field(default_factory=list)     # a named held-out split ("test"); [] for none
    weight: float = 1.0
    fraction: float | None = None                           # a mixture source's own validation_fraction
    one_file: bool = False                                  # the source is its one file, not a folder


@dataclass
class Case:
    sources: list[Source]
    mixture: bool               # data.sources (even of one), else data.source
    fraction: float             # data.validation_fraction
    cap: int | None             # data.validation_max_rows
    world: int
    per_step: int               # train.grad_accum (micro batch 1)
    seq_len: int
    overlong: str
    seed: int
    pack_window: int
    bundle: int                 # rows a bundle of the train stream (pipeline.BUNDLE_ROWS): small ones split small data


def _formats(messages: list[dict]) -> list[str]:
    """The formats that can hold a conversation."""
    system = messages[0]["role"] == "system"
    one = len(messages) - system == 2
    return ["messages", "sharegpt"] + ["conversation"] * (not system) + ["alpaca"] * one + \
        ["prompt_completion"] * (one and not system)


def _in_format(messages: list[dict], fmt: str) -> dict:
    """A conversation (system first, then user/assistant pairs) as a row of `fmt`."""
    if fmt == "messages":
        return {"messages": [dict(m) for m in messages]}
    if fmt == "sharegpt":
        return {"conversations": [{"from": SHAREGPT.get(m["role"], m["role"]), "value": m["content"]}
                                  for m in messages]}
    turns = [m for m in messages if m["role"] != "system"]
    if fmt == "conversation":
        return {"conversation": [{"input": u["content"], "output": a["content"]}
                                 for u, a in zip(turns[::2], turns[1::2])]}
    if fmt == "alpaca":
        system = [m["content"] for m in messages if m["role"] == "system"]
        return {"instruction": turns[0]["content"], "input": "", "output": turns[1]["content"],
                **({"system": system[0]} if system else {})}
    return {"prompt": turns[0]["content"], "completion": turns[1]["content"]}


def _bad_row(reason: str, fmt: str, words: str) -> Row:
    """A row that cannot train, in `fmt` (messages or sharegpt), skipped for `reason`."""
    if reason == "invalid_json":
        return Row('{"messages": [oops ' + words, None, reason)
    turns = {"unknown_role": [("user", words), ("robot", "beep")],
             "empty_content": [("user", " "), ("assistant", words)],
             "no_assistant_turn": [("system", "Be brief."), ("user", words)]}[reason]
    return Row(_in_format([{"role": r, "content": c} for r, c in turns], fmt), None, reason)


text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=6).map(" ".join)
long_text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=60).map(" ".join)


@st.composite
def conversations(draw) -> list[dict]:
    system = draw(st.sampled_from(SYSTEMS))
    turns = draw(st.lists(st.tuples(st.one_of(text, long_text), text), min_size=1, max_size=2))
    return [{"role": "system", "content": system}] * bool(system) + \
        [m for u, a in turns for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]


@st.composite
def data_files(draw, pool: list[list[dict]], n_valid: int, bad_first: bool = False) -> DataFile:
    """A file holding at least `n_valid` conversations of `pool` and some bad rows (one first: `bad_first`)."""
    kind = draw(st.sampled_from(FILE_KINDS))
    lines = kind.startswith("jsonl")
    whole = draw(st.sampled_from(["messages", "sharegpt"]))      # a parquet file holds one format
    index = st.integers(0, len(pool) - 1)
    picks = draw(st.lists(index, min_size=n_valid, max_size=n_valid)) + \
        draw(st.lists(st.one_of(index, st.sampled_from(BAD_REASONS)), min_size=int(n_valid < 2), max_size=5))
    picks = [draw(st.sampled_from(BAD_REASONS))] * bad_first + draw(st.permutations(picks))
    rows = []
    for p in picks:
        if isinstance(p, int):
            fmt = whole if kind == "parquet" else draw(st.sampled_from(_formats(pool[p])))
            rows.append(Row(_in_format(pool[p], fmt), pool[p]))
        else:
            reason = p if lines or p != "invalid_json" else "unknown_role"     # a broken line: jsonl only
            fmt = whole if kind == "parquet" else draw(st.sampled_from(["messages", "sharegpt"]))
            rows.append(_bad_row(reason, fmt, draw(text)))
    return DataFile(kind, rows, blank_first=lines and draw(st.booleans()))


@st.composite
def sources(draw, pool: list[list[dict]], name: str, mixture: bool) -> Source:
    """A source of 1 to 3 files (a named held-out split in some), with at least two usable rows where it carves."""
    named = draw(st.booleans())
    n_files = draw(st.integers(1, 3))
    train = [draw(data_files(pool, 2 if i == 0 else 0)) for i in range(n_files)]
    # a named split's first rows, which a cap evaluates alone, may hold no conversation
    test = [draw(data_files(pool, 1, bad_first=draw(st.booleans())))] if named else []
    one_file = not named and n_files == 1 and draw(st.booleans())
    weight = draw(st.sampled_from([1.0, 2.0, 0.5, 1.5])) if mixture else 1.0
    fraction = draw(st.sampled_from([None, None, 0.0, 0.1, 0.5])) if mixture and not named else None
    return Source(name, train, test, weight, fraction, one_file)


@st.composite
def cases(draw) -> Case:
    pool = draw(st.lists(conversations(), min_size=2, max_size=4))
    n = draw(st.integers(1, 3))
    mixture = n > 1 or draw(st.booleans())
    fraction = draw(st.sampled_from([0.0, 0.05, 0.3, 0.5]))
    return Case(sources=[draw(sources(pool, f"s{i}", mixture)) for i in range(n)], mixture=mixture,
                fraction=fraction, cap=draw(st.one_of(st.none(), st.integers(1, 6))), world=draw(st.integers(1, 3)),
                per_step=draw(st.integers(1, 2)), seq_len=draw(st.sampled_from([48, 128, 512])),
                overlong=draw(st.sampled_from(["split", "drop"])), seed=draw(st.integers(0, 3)),
                pack_window=draw(st.sampled_from([2, 8, 2048])), bundle=draw(st.sampled_from([2, 5, 64])))


# ---------------------------------------------------------------- the files and the recipe

def _write(path: Path, f: DataFile) -> dict[int, Row]:
    """Write one data file; its rows by the row number the readers give them (a jsonl line's, else 1-based)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.kind == "parquet":
        pq.write_table(pa.Table.from_pylist([r.value for r in f.rows]), path)
        return dict(enumerate(f.rows, 1))
    if f.kind.startswith("jsonl"):
        lines = [r.value if isinstance(r.value, str) else json.dumps(r.value, ensure_ascii=False) for r in f.rows]
        body = ("\n" * f.blank_first + "\n".join(lines) + "\n").encode()
    else:
        body = json.dumps([r.value for r in f.rows], ensure_ascii=False).encode()
    if f.kind.endswith(".zst"):
        with pa.CompressedOutputStream(str(path), "zstd") as out:
            out.write(body)
    else:
        with (gzip.open if f.kind.endswith(".gz") else open)(path, "wb") as out:
            out.write(body)
    return {n + 1 + f.blank_first: r for n, r in enumerate(f.rows)}


@dataclass
class Written:
    """A case on disk: the recipe's overrides, and every row by (file, row number): (source, split, Row)."""
    overrides: list[str]
    rows: dict[tuple[str, int], tuple[str, str, Row]]

    def of(self, source: str, split: str = "train") -> list[Row]:
        return [r for s, sp, r in self.rows.values() if s == source and sp == split]


def _files(src: Source, folder: Path) -> list[tuple[Path, str, DataFile]]:
    """(path, split, file) of a source: its one file, a folder named by split (train-00000-of-00002.jsonl, as the
    hub names them), or a folder of files naming no split, which is read whole."""
    if src.one_file:
        return [(folder / f"{src.name}.{src.train[0].kind}", "train", src.train[0])]
    if not src.test:
        return [(folder / f"part{i}.{f.kind}", "train", f) for i, f in enumerate(src.train)]
    return [(folder / f"{split}-{i:05d}-of-{len(fs):05d}.{f.kind}", split, f)
            for split, fs in (("train", src.train), ("test", src.test)) for i, f in enumerate(fs)]


def write_case(case: Case, root: Path) -> Written:
    rows, entries = {}, []
    for src in case.sources:
        folder = root / src.name
        folder.mkdir(parents=True)
        files = _files(src, folder)
        for path, split, f in files:
            for n, row in _write(path, f).items():
                rows[(os.path.abspath(path), n)] = (src.name, split, row)
        entry = {"source": str(files[0][0] if src.one_file else folder), "name": src.name, "weight": src.weight}
        if src.test:
            entry.update(split="train", validation_split="test")
        if src.fraction is not None:
            entry["validation_fraction"] = src.fraction
        entries.append(entry)
    common = [f"model.tokenizer={TOKENIZER}", f"data.validation_fraction={case.fraction}",
              "data.max_skip_fraction=1.0", f"data.seed={case.seed}", f"data.seq_len={case.seq_len}",
              f"data.overlong={case.overlong}", f"data.pack_window={case.pack_window}",
              f"scaling.num_workers={case.world}", f"train.grad_accum={case.per_step}", "train.micro_batch_size=1"]
    common += [f"data.validation_max_rows={case.cap}"] if case.cap is not None else []
    if case.mixture:
        return Written(common + [f"data.sources={json.dumps(entries)}"], rows)
    one = entries[0]
    named = ["data.split=train", "data.validation_split=test"] if "validation_split" in one else \
        ["data.validation_split=none"]
    return Written(common + [f"data.source={one['source']}", *named], rows)


def recipe_of(written: Written) -> Recipe:
    return validate(apply_overrides(Recipe(), written.overrides))


def settled(case: Case, root: Path) -> tuple[Written, Recipe, int | None] | None:
    """The case written and its recipe with the held-out set settled (the checks before Ray: `check_sources`), and
    the held-out rows those checks count; None when they refuse it, as they must for a cap below one row a source,
    a carved source whose distinct conversations cannot give a held-out row within its share and training rows,
    and a named split whose evaluated rows hold no conversation."""
    written = write_case(case, root)
    recipe = recipe_of(written)
    try:
        _, _, count = check_sources(recipe.data)
    except RecipeError as e:
        event(f"refused: {str(e)[:24]}")
        refused(case, written, recipe, str(e))
        return None
    event(f"{len(case.sources)} source(s), {'mixture' if case.mixture else 'one'}, "
          f"{sum(bool(s.test) for s in case.sources)} named split(s), {count} held out")
    return written, recipe, count


def refused(case: Case, written: Written, recipe: Recipe, why: str) -> None:
    """The checks before Ray refused the case for what it holds, said right."""
    specs = source_specs(recipe.data)
    shares = {i: share for i, _, share in evaluating(recipe.data, specs)}
    if why.startswith("data.validation_max_rows:"):
        assert case.cap < len(shares), why
        return
    m = re.match(r"data(?:\.sources\[(\d+)\])?(\.validation_split)?: ", why)
    assert m, why
    i = int(m.group(1) or 0)
    if m.group(2):          # the rows its named split evaluates hold no conversation: the first one named
        first = [(where, r) for where, (s, split, r) in written.rows.items()
                 if (s, split) == (case.sources[i].name, "test")][:shares[i]]
        (file, row), bad = first[0]
        assert not any(r.messages for _, r in first), why
        assert f"hold no conversation to evaluate on (first: {file} row {row}: {bad.reason}: " in why, why
        return
    m = re.search(r" has (\d+) usable row\(s\) of (\d+), (\d+) distinct conversation", why)
    assert m, why
    rows = written.of(case.sources[i].name)
    usable = [content(r.messages) for r in rows if r.messages]
    assert [int(g) for g in m.groups()] == [len(usable), len(rows), len(set(usable))], why


# ---------------------------------------------------------------- the run's steps, here

def as_rows(cols: dict[str, list]) -> list[dict]:
    return [dict(zip(cols, values)) for values in zip(*cols.values())]


def ray_split(bundles: list[list[dict]], world: int) -> list[list[dict]]:
    """The rows each rank gets: Ray Data's split (equal=False, order preserved, no locality hints) hands each bundle
    to the output with the fewest rows so far, the first such on a tie (ray's OutputSplitter)."""
    shares: list[list[dict]] = [[] for _ in range(world)]
    for bundle in bundles:
        shares[min(range(world), key=lambda r: len(shares[r]))].extend(bundle)
    return shares


def bundles_of(rows: int):
    """The train stream cut here in bundles of `rows` rows (the split's rule is the same at any size; small bundles
    give small cases several, so that the ranks' shares differ; the slow test runs the run's own size)."""
    return mock.patch("raytune_ft.data.local_pass.BUNDLE_ROWS", rows)


def stream(case: Case, data, tok) -> list[list[dict]]:
    """The run's train stream in bundles (`local_pass.stream_bundles`)."""
    with bundles_of(case.bundle):
        return stream_bundles(data, tok)[0]


def rank_blocks(case: Case, data, tok) -> tuple[list[list[dict]], list[DataCounters], list[list[dict]]]:
    """Each rank's blocks and counters (its share packed by `iter_blocks`), and its rows."""
    shares = ray_split(stream(case, data, tok), case.world)
    blocks, counters = [], []
    for share in shares:
        c = DataCounters()
        blocks.append(list(iter_blocks(share, data, counters=c)))
        counters.append(c)
    return blocks, counters, shares


def scaled(case: Case, times: int = 16) -> Case:
    """The case with each training file's rows repeated `times` times, at the run's own bundle size (BUNDLE_ROWS
    rows, as its tokenizing map emits them): several bundles for the ranks to share, several blocks a rank."""
    def more(f: DataFile) -> DataFile:
        return dataclasses.replace(f, rows=f.rows * times)

    return dataclasses.replace(case, bundle=BUNDLE_ROWS,
                               sources=[dataclasses.replace(s, train=[more(f) for f in s.train]) for s in case.sources])


def held_out_set(data, tok) -> list[dict]:
    """The rows `build_dataset(data, split="validation")` gives, by its steps run here: each source that evaluates
    read, carved (or its named split read whole) and cut to its share, tokenized, cut to data.validation_max_rows."""
    specs = source_specs(data)
    plans = [(i, spec, split_plan(spec, data, "validation"), share) for i, spec, share in evaluating(data, specs)]
    kwargs = dict(data.template_kwargs)

    def raw(spec, split):
        rows = [{"text": t, "file": f, "row": n} for f, n, t in
                iter_source_rows(spec, split, held_out=spec.validation_split is not None, seed=data.seed)]
        return rows[:spec.max_rows] if spec.max_rows is not None else rows

    if not plans:
        return []
    if one_stream(specs):
        _, spec, (split, carve), _ = plans[0]
        out = as_rows(tokenize_rows(raw(spec, split), tok, adapter=adapter_of(spec), template_kwargs=kwargs,
                                    carve=carve))
    else:
        mixed = []
        for i, spec, (split, carve), share in plans:
            part = as_rows(adapt_rows(raw(spec, split), adapter_of(spec), source=i, carve=carve, weight=1.0))
            mixed += part[:share] if share is not None else part
        out = as_rows(tokenize_rows(mixed, tok, adapter=Adapter("messages"), template_kwargs=kwargs, carve=Carve()))
    return out[:data.validation_max_rows] if data.validation_max_rows is not None else out


def content(messages: list[dict]) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def same_blocks(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder per example (hypothesis runs a test's examples in one call: tmp_path is the same for all)."""
    root = tmp_path_factory.mktemp("cases")
    return lambda: Path(tempfile.mkdtemp(dir=root))


def names_of(case: Case, data) -> dict[str, str]:
    """The case's source names -> the names the counters keep them by (a single source's: its path)."""
    return {src.name: spec.name for src, spec in zip(case.sources, source_specs(data))}


def summed(counters: list[DataCounters]) -> DataCounters:
    total = DataCounters()
    for c in counters:
        total.merge(c)
    return total


def differ(a: DataCounters, b: DataCounters) -> dict:
    """The counts that differ: {name: (a's, b's)}."""
    x, y = a.to_dict(), b.to_dict()
    return {k: (x[k], y[k]) for k in x if x[k] != y[k]}


def run_total(case: Case, counters: list[DataCounters]) -> DataCounters:
    """The run's counts: its ranks' summed, with the all-padding blocks that fill the pass's last step on every
    rank (train.lending: the ranks lend each other blocks until all are dry)."""
    total = summed(counters)
    steps = -(-total.blocks // (case.world * case.per_step))
    fill = steps * case.world * case.per_step - total.blocks
    total.blocks, total.equalisation_padding_blocks = total.blocks + fill, fill
    total.padding_tokens += fill * case.seq_len
    return total


# ---------------------------------------------------------------- the edges found: run on every test run

def _chat(user: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _jsonl(*rows: list[dict] | str) -> DataFile:
    """A jsonl file of conversations (messages) and bad rows (a reason)."""
    return DataFile("jsonl", [_bad_row(r, "messages", "alpha") if isinstance(r, str) else Row({"messages": r}, r)
                              for r in rows])


def _case(sources: list[Source], *, mixture: bool = True, fraction: float = 0.0, cap: int | None = None,
          seed: int = 0, world: int = 1) -> Case:
    return Case(sources, mixture, fraction, cap, world=world, per_step=1, seq_len=48, overlong="split", seed=seed,
                pack_window=2, bundle=64)


X, Y = _chat("alpha", "alpha"), _chat("alpha alpha", "beta")
# one source given as a mixture of one, weight 2: its rows were trained once
WEIGHTED_ALONE = _case([Source("s0", [_jsonl(X, X), _jsonl(X)], weight=2.0)])
# Y held out by s1's carve (its fraction, 0.3, unmoved) and trained by s0, whose threshold moved
IN_TWO_SOURCES = _case([Source("s0", [_jsonl(Y, Y)]), Source("s1", [_jsonl(Y, X)])], fraction=0.3, seed=1)
# the threshold moved between two rows of one conversation: the check said 1 row held out, the run held out 0
REPEATED = _case([Source("s0", [_jsonl(X, X)])], mixture=False, fraction=0.05)
# a mixture of several bundles on 3 ranks: the run's blocks after its sort were cut apart where the sort's ranges
# met (sampled at random), so its ranks' shares changed from run to run and were not the check's
MIXED_ON_RANKS = _case([Source("s0", [_jsonl(X, Y, "unknown_role", _chat("river", "stone"))], weight=1.5),
                        Source("s1", [_jsonl(Y, _chat("cloud", "Paris"))], weight=0.5),
                        Source("s2", [_jsonl(X, X)], test=[_jsonl(Y)])], fraction=0.3, world=3)
# twelve conversations packed two windows at a time and shuffled: a resume packs them in the unbroken pass's order
ONE_BY_ONE = _case([Source("s0", [_jsonl(*(_chat(f"{u} {v}", v) for u in WORDS[:4] for v in WORDS[4:7]))])],
                   mixture=False)
# a cap of 1 evaluates the named split's first row, which holds no conversation: nothing to evaluate on
SKIPPED_FIRST = _case([Source("s0", [_jsonl(X, X)]),
                       Source("s1", [_jsonl(X, X)], test=[_jsonl("unknown_role", X, X)])], cap=1)


# ---------------------------------------------------------------- (a) conservation

@FAST
@given(case=cases())
@example(case=WEIGHTED_ALONE)
def test_every_row_read_is_trained_its_weights_times_held_out_or_skipped_with_its_reason(case, tok, scratch):
    """Per source, the rows read are the rows of its files (of its training split), each once: trained, held
    out or skipped; the rows skipped for what they hold are exactly the bad rows written, by reason, and the
    skipped-row samples point at them; a trained row is used floor(weight) or ceil(weight) times."""
    got = settled(case, scratch())
    if got is None:
        return
    written, recipe, _ = got
    _, counters, _ = rank_blocks(case, recipe.data, tok)
    c = summed(counters)
    names = names_of(case, recipe.data)
    for src in case.sources:
        rows, mine = written.of(src.name), c.by_source.get(names[src.name], {})
        skipped = mine.get("rows_skipped_by_reason", {})
        assert mine.get("rows_read", 0) == len(rows), src.name
        assert mine["trained"] + mine["held_out"] + sum(skipped.values()) == len(rows), (src.name, mine)
        bad = Counter(r.reason for r in rows if r.reason)
        assert {k: v for k, v in skipped.items() if k not in (IN_HELD_OUT, "overlong")} == dict(bad), src.name
        assert case.overlong == "drop" or "overlong" not in skipped
        uses = (math.floor(src.weight) * mine["trained"], math.ceil(src.weight) * mine["trained"])
        assert uses[0] <= mine["conversations"] <= uses[1], (src.name, src.weight, mine)
    assert c.rows_read == len(written.rows) - sum(len(written.of(s.name, "test")) for s in case.sources)
    assert c.rows_read == c.rows_trained + c.rows_held_out + c.rows_skipped
    by_name = {v: k for k, v in names.items()}
    for sample in c.skipped_rows:
        source, split, row = written.rows[(sample["file"], sample["row"])]
        assert (source, split) == (by_name[sample["source"]], "train"), sample
        assert row.reason == sample["reason"] if sample["reason"] in BAD_REASONS else row.messages is not None, sample


# ---------------------------------------------------------------- (b) held-out rows never trained

@settings(FAST, max_examples=40)
@given(case=cases())
@example(case=IN_TWO_SOURCES)
@example(case=REPEATED)
@example(case=SKIPPED_FIRST)
def test_held_out_rows_and_trained_rows_never_share_content(case, tok, scratch):
    """No conversation of the held-out set (carved, a named split, a capped mixture's share) is trained, by its
    rows' content (the conversation written) and by its tokens; every source that evaluates gives at least one
    usable held-out row, and as many as the checks before Ray say; a carved source's held-out rows in the training
    stream are the rows its held-out set evaluates."""
    got = settled(case, scratch())
    if got is None:
        return
    written, recipe, count = got
    data = recipe.data
    held = held_out_set(data, tok)
    stream_rows = [r for b in stream(case, data, tok) for r in b]
    trained = [r for r in stream_rows if not r["skip_reason"]]
    evaluated = [r for r in held if not r["skip_reason"]]

    def contents(rows):
        return {content(written.rows[(r["file"], r["row"])][2].messages) for r in rows}

    shared = contents(trained) & contents(evaluated)
    assert not shared, f"trained and held out: {sorted(shared)[:3]}"
    assert not {tuple(r["input_ids"]) for r in trained} & {tuple(r["input_ids"]) for r in evaluated}
    if count is not None:
        assert len(held) == count
    specs = source_specs(data)
    for i, spec, _ in evaluating(data, specs):
        assert any(r["source"] == i for r in evaluated), f"{spec.name} evaluates no row: {held}"
        if not spec.validation_split:
            in_stream = sum(1 for r in stream_rows if r["source"] == i and r["skip_reason"] == HELD_OUT)
            assert in_stream == sum(1 for r in held if r["source"] == i), spec.name


# ---------------------------------------------------------------- (c) the check counts what the run counts

@settings(FAST, max_examples=8)      # each example draws the check's histogram
@given(case=cases())
def test_data_check_says_what_the_runs_ranks_count(case, tok, scratch):
    """`data check` (its lines: each source's rows, held out, skipped, conversations, pieces, blocks; the pass's
    blocks, all-padding blocks and steps) says what the run's ranks count: each rank's share packed by
    `iter_blocks`, the last step filled with all-padding blocks on every rank."""
    from raytune_ft.data.check import data_check, data_pass

    root = scratch()
    got = settled(case, root)
    if got is None:
        return
    written, recipe, _ = got
    ran = run_total(case, rank_blocks(case, recipe.data, tok)[1])
    steps, fill = -(-ran.blocks // (case.world * case.per_step)), ran.equalisation_padding_blocks

    fresh = recipe_of(written)           # the check settles its own recipe, as the command does
    with mock.patch("raytune_ft.models.tokenizer.tokenizer_for", return_value=tok), bundles_of(case.bundle):
        lines, _ = data_check(fresh, png=str(root / "lengths.png"))
        assert data_pass(fresh, tok, None)[0].to_dict() == ran.to_dict()
    names = names_of(case, recipe.data)
    for src in case.sources:
        c = ran.by_source.get(names[src.name], {})
        skipped = sum((c.get("rows_skipped_by_reason") or {}).values())
        at = lines.index(next(line for line in lines if line.startswith(f"source {names[src.name]}")))
        assert lines[at + 1].startswith(f"  rows             {c.get('rows_read', 0)}: {c.get('trained', 0)} to train "
                                        f"on, {c.get('held_out', 0)} held out, {skipped} skipped"), lines[at + 1]
        trained = next(line for line in lines[at:] if line.startswith("  trained "))
        assert trained == (f"  trained          {c.get('conversations', 0)} conversations, {c.get('pieces', 0)} "
                           f"pieces packed, in {c.get('blocks', 0)} blocks"), trained
    assert next(line for line in lines if line.startswith("pass ")).startswith(
        f"pass               {ran.blocks} blocks of {case.seq_len} tokens ({fill} of them all-padding, evening out "
        f"{case.world} rank(s) x {case.per_step} block(s) a step): {steps} steps;")


# ---------------------------------------------------------------- (d) the same rows on every run and rank

@FAST
@given(case=cases())
def test_every_run_gives_each_rank_the_same_rows_and_blocks(case, tok, scratch):
    """Two runs (each its recipe settled afresh, the named splits read again) give every rank the same rows and
    the same blocks; the ranks' rows are the stream's, each on one rank; the held-out set is the same."""
    got = settled(case, scratch())
    if got is None:
        return
    written, recipe, _ = got
    _named_split.cache_clear()
    again = recipe_of(written)
    check_sources(again.data)
    assert again.data == recipe.data
    first, second = rank_blocks(case, recipe.data, tok), rank_blocks(case, again.data, tok)
    for rank in range(case.world):
        assert same_blocks(first[0][rank], second[0][rank]), f"rank {rank}"
        assert first[2][rank] == second[2][rank], f"rank {rank}"
        assert first[1][rank].to_dict() == second[1][rank].to_dict(), f"rank {rank}"
    place = lambda r: (r["source"], r["file"], r["row"], r["copy"])       # noqa: E731
    bundles = stream(case, recipe.data, tok)
    assert Counter(place(r) for share in first[2] for r in share) == Counter(place(r) for b in bundles for r in b)
    assert len({place(r) for b in bundles for r in b}) == sum(map(len, bundles))
    assert held_out_set(recipe.data, tok) == held_out_set(again.data, tok)


# ---------------------------------------------------------------- (e) resume at any step

@FAST
@given(case=cases().map(lambda c: scaled(c, 2)), shuffled=st.booleans(), cut=st.floats(0, 1), step_cut=st.floats(0, 1))
@example(case=ONE_BY_ONE, shuffled=True, cut=0.5, step_cut=0.5)
def test_a_resume_at_any_block_or_step_trains_the_rest_exactly_once(case, tok, scratch, shuffled, cut, step_cut):
    """On a rank (the one with the most rows), `iter_blocks(skip_blocks=N)` after N blocks (N: `cut` of them) gives
    exactly the blocks an unbroken pass gives after them and counts the whole pass, in a later epoch's seeded
    shuffle too (`shuffled`); the pass's blocks are the ones counted; a `StepFeed` resumed at any step from the
    checkpoint's blocks consumed and fingerprint gives the unbroken pass's remaining steps."""
    from raytune_ft.train.batch import RankSteps, StepFeed, real_seq_lens

    got = settled(case, scratch())
    if got is None:
        return
    data = got[1].data
    share = max(rank_blocks(case, data, tok)[2], key=len)
    seed = data.seed + 1 if shuffled else None
    c_whole, c_rest = DataCounters(), DataCounters()
    blocks = list(iter_blocks(share, data, counters=c_whole, shuffle_seed=seed))
    n = round(cut * len(blocks))
    rest = list(iter_blocks(share, data, counters=c_rest, skip_blocks=n, shuffle_seed=seed))
    assert same_blocks(rest, blocks[n:])
    assert c_rest.to_dict() == c_whole.to_dict()
    # the pass's blocks are the ones counted: none packed and counted but not given
    assert len(blocks) == c_whole.blocks and sum(int(real_seq_lens(b).sum()) for b in blocks) == c_whole.real_tokens

    def feed(skip: int = 0, fingerprint: int | None = None) -> StepFeed:
        return StepFeed(iter_blocks(share, data, shuffle_seed=seed), steps=RankSteps(case.per_step, case.seq_len),
                        counters=DataCounters(), skip_blocks=skip, fingerprint=fingerprint)

    unbroken = feed()
    steps = list(iter(unbroken.next_blocks, None))
    k, before = round(step_cut * len(steps)), feed()
    for _ in range(k):
        before.next_blocks()
    resumed = feed(before.blocks_consumed, before.fingerprint)
    after = list(iter(resumed.next_blocks, None))
    assert len(after) == len(steps) - k and all(same_blocks(a, b) for a, b in zip(after, steps[k:]))
    assert resumed.fingerprint == unbroken.fingerprint


# ---------------------------------------------------------------- a real local Ray

@pytest.mark.slow
@pytest.mark.timeout(900)
@settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(case=cases().filter(lambda c: c.world > 1).map(scaled))
@example(case=scaled(MIXED_ON_RANKS))
def test_a_real_ray_gives_each_rank_the_rows_blocks_and_counts_computed_here(ray_local, case, tok, scratch):
    """The steps run here are the run's: `build_dataset`'s train stream split by Ray Data as the run splits it
    (streaming_split, equal=False, the order kept), each split packed by `iter_blocks` as a rank packs its shard,
    gives each rank the blocks and counts that `ray_split` over `stream_bundles` gives, and `data check` counts
    what the ranks count; its validation split is `held_out_set`. (No shrinking: each example runs Ray Data.)"""
    from raytune_ft.data.check import data_pass
    from raytune_ft.data.pipeline import build_dataset

    got = settled(case, scratch())
    assume(got is not None)
    _, recipe, _ = got
    data = recipe.data
    blocks, counters, _ = rank_blocks(case, data, tok)
    ds = build_dataset(data, str(TOKENIZER))
    ds.context.execution_options.preserve_order = True
    splits, ran = ds.streaming_split(case.world, equal=False), [None] * case.world

    sizes: list[list[int]] = [[] for _ in range(case.world)]

    class Seen:         # the split's batches as a rank reads them, their row counts noted
        def __init__(self, r: int):
            self.r = r

        def iter_batches(self, **kwargs):
            for batch in splits[self.r].iter_batches(**kwargs):
                sizes[self.r].append(batch.num_rows)
                yield batch

    def rank(r: int) -> None:
        c = DataCounters()
        ran[r] = (list(iter_blocks(Seen(r), data, counters=c)), c)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(case.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for r in range(case.world):
        assert ran[r] is not None, f"rank {r} did not finish"
        assert same_blocks(ran[r][0], blocks[r]), f"rank {r}: {len(ran[r][0])} blocks, here {len(blocks[r])}"
        assert ran[r][1].to_dict() == counters[r].to_dict(), \
            f"rank {r}: {differ(ran[r][1], counters[r])}; bundles {[len(b) for b in stream(case, data, tok)]}, {sizes}"
    assert data_pass(recipe, tok, None)[0].to_dict() == run_total(case, [c for _, c in ran]).to_dict()
    if evaluating(data, source_specs(data)):
        keys = ("input_ids", "skip_reason", "source", "file", "row")
        got_rows = [{k: (list(map(int, r[k])) if k == "input_ids" else r[k]) for k in keys}
                    for r in build_dataset(data, str(TOKENIZER), split="validation").take_all()]
        assert got_rows == [{k: r[k] for k in keys} for r in held_out_set(data, tok)]
