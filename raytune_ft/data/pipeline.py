"""The Ray Data pipeline: read a source (reading.py), tokenize and mask each conversation, and, inside each Ray
Train worker, pack that worker's share into fixed blocks with every rank running the same steps.

Driver side (before `TorchTrainer.fit`):

    train_ds = build_dataset(recipe.data, tokenizer, split="train")
    val_ds   = build_dataset(recipe.data, tokenizer, split="validation")
    TorchTrainer(..., datasets={"train": train_ds, "validation": val_ds},
                 dataset_config=train_data_config())

Worker side (inside the train loop):

    counters = DataCounters()
    blocks = iter_blocks(ray.train.get_dataset_shard("train"), data, counters=counters)
    feed = StepFeed(blocks, ...)       # raytune_ft.train.batch: equal steps on every rank
    metrics.update(gather_counters(counters).as_metrics())   # every rank calls it (a collective)

Sharding. `train_data_config()` splits the train dataset with `streaming_split(equal=False)`:
Ray Train's default (`equal=True`) makes the shares equal by dropping rows, silently. Unequal shares
are instead evened out at the block level by the loops' `StepFeed`: the splitter hands out whole bundles
(a small file is one bundle, so one rank may get every row), and a rank that runs dry is lent blocks by
the others (train/lending.py); only the pass's last step pads with all-padding blocks (labels all -100,
no gradient signal), counted in `equalisation_padding_blocks`. With `preserve_order=True` and no
locality hints, Ray's splitter hands each bundle to the consumer with the fewest rows so far, so the
shares are deterministic for a given source and block layout (blocks of `BUNDLE_ROWS` rows); that is what
makes "skip the first N blocks" an exact resume, and what `local_pass` computes for `raytune-ft data check`.

Rows that are not trained are not dropped in the Ray Data stage: a skipped row, a row the carve holds out
and a mixture row its weight draws no time travel as rows with an empty `input_ids` and a `skip_reason` (a
reason, or `packing.HELD_OUT` / `NOT_DRAWN`), with their file and row number, so the worker that receives
them counts each row read once (`DataCounters.count_row`); the counts are summed across workers by
`gather_counters`.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any, Iterable, Iterator

import numpy as np

from raytune_ft.data.held_out import evaluating, held_out_keys, split_plan
from raytune_ft.data.packing import HELD_OUT, NOT_DRAWN, DataCounters, pack_blocks
from raytune_ft.data.reading import BUILTIN_DEFAULT_ROWS, HF_ROOT_ENV, read_source, resolve_hf_parquet  # noqa: F401
from raytune_ft.data.rows import Carve, SkipCheck, TooManySkipped, _split_bucket, adapt_rows, tokenize_rows  # noqa: F401
from raytune_ft.data.rows import STREAM_COLUMNS
from raytune_ft.data.sources import Adapter, Skip
from raytune_ft.data.specs import SourceSpec, adapter_of, one_stream, source_specs  # noqa: F401

__all__ = ["DataCounters", "build_dataset", "iter_blocks", "read_rows", "gather_counters",
           "train_data_config", "resolve_hf_parquet", "HF_ROOT_ENV"]

SHUFFLE_WINDOWS = 4          # an epoch's shuffle buffer, in packing windows
BUNDLE_ROWS = 64             # rows per block of the train dataset: the unit Ray Data's split hands a rank


# ---------------------------------------------------------------- tokenizer in Ray tasks

@functools.lru_cache(maxsize=4)
def _tokenizer_from_path(path: str, chat_template: str | None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.expanduser(path))
    if chat_template:
        tok.chat_template = _read_template(chat_template)
    return tok


def _read_template(template: str) -> str:
    """A template given as a file path is read; anything else is the template text itself."""
    if "{" not in template and os.path.isfile(os.path.expanduser(template)):
        with open(os.path.expanduser(template)) as f:
            return f.read()
    return template


class _TokenizerRef:
    """What a Ray task carries to get the tokenizer: a path or a model's `TokenizerOf` (each loaded once
    per process, so the processes that only pass the datasets on never import transformers), or the
    object itself."""

    def __init__(self, tokenizer: Any, chat_template: str | None):
        self.of = None
        if isinstance(tokenizer, (str, os.PathLike)):
            self.path, self.obj = os.fspath(tokenizer), None
            self.chat_template = chat_template
        elif hasattr(tokenizer, "load") and not chat_template:     # raytune_ft.models.tokenizer.TokenizerOf
            self.path, self.obj, self.of, self.chat_template = None, None, tokenizer, None
        else:
            if hasattr(tokenizer, "load"):
                tokenizer = tokenizer.load()
            self.path, self.obj = None, tokenizer
            if chat_template:                      # do not mutate the caller's tokenizer
                import copy
                self.obj = copy.copy(tokenizer)
                self.obj.chat_template = _read_template(chat_template)
            self.chat_template = None

    def get(self):
        if self.of is not None:
            return self.of.load()
        return self.obj if self.obj is not None else _tokenizer_from_path(self.path, self.chat_template)


# ---------------------------------------------------------------- tokenize + mask (a Ray Data map)

_TYPES = {"skip_reason": "string", "skip_detail": "string", "source": "int32", "copy": "int32", "file": "string",
          "row": "int64", "text": "string", "mix_key": "int64"}


def _columns(cols: dict[str, list]):
    import pyarrow as pa

    return pa.table({"input_ids": pa.array(cols["input_ids"], type=pa.list_(pa.int32())),
                     "mask": pa.array(cols["mask"], type=pa.list_(pa.bool_())),
                     **{k: pa.array(cols[k], type=getattr(pa, _TYPES[k])()) for k in STREAM_COLUMNS}})


def _cancelled_quietly() -> None:
    """A tokenizing task that Ray Data cancels when a job ends (`ray job stop`, Ctrl-C, the pass done) is
    interrupted with KeyboardInterrupt; where that lands inside a finalizer (the tokenizer's regex objects),
    Python prints "Exception ignored in ..." with a traceback into the job's log, though nothing failed.
    Those are dropped in the tokenizing processes; any other unraisable exception goes to the hook before."""
    before = sys.unraisablehook
    if getattr(before, "raytune_quiet", False):
        return

    def hook(unraisable):
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            before(unraisable)

    hook.raytune_quiet = True
    sys.unraisablehook = hook


def _map_fn(tok_ref: _TokenizerRef, adapter: Adapter, template_kwargs: dict, carve: Carve, source: int = 0):
    def fn(batch):
        _cancelled_quietly()
        return _columns(tokenize_rows(batch.to_pylist(), tok_ref.get(), adapter=adapter,
                                      template_kwargs=template_kwargs, carve=carve, source=source))
    return fn


def _adapt_fn(adapter: Adapter, source: int, carve: Carve, weight: float):
    import pyarrow as pa

    def fn(batch):
        _cancelled_quietly()
        cols = adapt_rows(batch.to_pylist(), adapter, source=source, carve=carve, weight=weight)
        return pa.table({k: pa.array(v, type=getattr(pa, _TYPES[k])()) for k, v in cols.items()})
    return fn


def _load_tokenizer_here(tokenizer) -> None:
    tokenizer.load()


def _train_controller_env() -> dict:
    """The runtime environment Ray Train's controller runs in (its `env_vars`), which the dataset manager,
    Ray Data's split coordinator and the tokenizing tasks inherit. The job's defaults are in the environment
    already (train/launch.start_tokenizing: env.ray_train_defaults)."""
    from raytune_ft import compat
    env_vars_to_propagate, warn_env_var, warn_default = compat.RAY_TRAIN_CONSTANTS.load()
    env_vars = env_vars_to_propagate()
    env_vars.setdefault(warn_env_var, warn_default)
    return {"env_vars": env_vars}


def start_tokenizing_processes(tokenizer, processes: int, num_cpus: float) -> None:
    """Start `processes` Ray worker processes that load `tokenizer` (a `TokenizerOf`) ahead of the datasets.

    The tokenizing map's first tasks start only when a training worker first reads, at the end of a chain of
    new processes (Ray Train's controller, its dataset manager, Ray Data's split coordinator), and each then
    starts a Python process and loads the tokenizer before its first row, and the first step waits for it.
    Ray hands a finished task's idle process to the job's next task of the same runtime environment, so these
    run in the one the map's tasks inherit from Ray Train's controller; the tokenizer, loaded once per process,
    is there when they come. A head start only: nothing waits for these tasks."""
    import ray

    task = ray.remote(num_cpus=num_cpus, max_retries=0,
                      runtime_env=_train_controller_env())(_load_tokenizer_here)
    for _ in range(processes):
        task.remote(tokenizer)


_split_plan = split_plan      # the name data check reads it by


def _read(spec: SourceSpec, data, source_split: str, held_out: bool):
    ds = read_source(spec, source_split, held_out=held_out, seed=data.seed, num_cpus=data.num_cpus_per_op)
    # Deterministic row order end to end: the splits, the validation carve-out and resume rely on it.
    ds.context.execution_options.preserve_order = True
    return ds.limit(spec.max_rows) if spec.max_rows is not None else ds


def build_dataset(data, tokenizer, *, split: str = "train", chat_template: str | None = None,
                  processes: int | None = None):
    """A Ray Dataset of tokenized, masked conversations of `split` ("train" or "validation").

    Columns: `input_ids` list<int32>, `mask` list<bool>, `skip_reason` string ("" for a usable row;
    otherwise the reason or the row's place, with empty ids), `skip_detail` string (the value that failed),
    `source` int32 (the source's index in a mixture), `copy` int32 (a weighted row's use: 0 the first),
    `file` string and `row` int64 (where the row was read). `tokenizer` is
    a fast tokenizer, a path to one or a model's `raytune_ft.models.tokenizer.TokenizerOf` (the last two
    loaded once per Ray worker process); `chat_template` (text or a .jinja path) overrides its template.
    `processes`: how many tokenizing tasks run at once (None: as many as Ray Data schedules).

    A mixture (`data.sources`): each source is read, turned into messages and carved apart, its rows used
    `weight` times; the training rows of all sources are then ordered by a seeded key (a sort: the first
    block waits for every source's rows to be read) and cut into blocks of a fixed row count, so the
    order and the ranks' shares are the same on every run. Lazy: nothing is read until the dataset is consumed.

    Held-out rows (data/held_out.py): each source that evaluates gives its share of `data.validation_max_rows`,
    taken after its carve. A training row with the content of a row a named held-out split evaluates is a
    skipped row (`in_held_out`); those rows' content keys are read here, in this process, for "train".
    """
    from ray.data import TaskPoolStrategy

    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}: expected 'train' or 'validation'")
    specs = source_specs(data)
    tok = _TokenizerRef(tokenizer, chat_template)
    compute = dict(batch_format="pyarrow", batch_size=64, num_cpus=data.num_cpus_per_op, zero_copy_batch=True,
                   compute=TaskPoolStrategy(size=processes) if processes else None)
    if split == "train":
        keys, plans = held_out_keys(data), []
        for i, spec in enumerate(specs):
            source_split, carve = split_plan(spec, data, split)
            plans.append((i, spec, (source_split, dataclasses.replace(carve, held_out=keys)), None))
    else:
        plans = [(i, spec, split_plan(spec, data, split), share) for i, spec, share in evaluating(data, specs)]
    if not plans:
        raise ValueError("no validation data: set data.validation_fraction or data.validation_split")
    if one_stream(specs):
        i, spec, (source_split, carve), _ = plans[0]
        ds = _read(spec, data, source_split, split == "validation" and spec.validation_split is not None)
        if split == "train":        # the bundles Ray Data's split hands the ranks: local_pass.rank_shares
            ds = ds.repartition(target_num_rows_per_block=BUNDLE_ROWS, strict=True)
        # at most `processes` tokenizing tasks at a time (Ray reuses their worker processes): left to itself Ray
        # Data runs one per `num_cpus_per_op` of free CPU, each a new process importing transformers and
        # loading the tokenizer, and they take the node's cores from the model build while nothing waits for
        # their rows but the first block
        ds = ds.map_batches(_map_fn(tok, adapter_of(spec), dict(data.template_kwargs), carve), **compute)
    else:
        ds = _mixture(data, plans, split)
        ds = ds.map_batches(_map_fn(tok, Adapter("messages"), dict(data.template_kwargs), Carve()), **compute)
    if split == "validation" and data.validation_max_rows is not None:
        # after the carve-out: the first N held-out rows, the same ones at every evaluation
        ds = ds.limit(data.validation_max_rows)
    return ds


def _as_they_are(batch):
    return batch


def _mixture(data, plans: list, split: str):
    """A mixture's sources read, turned into messages and carved, each a validation split's share after its
    carve (`held_out.shares`); the training rows ordered by their seeded key, in blocks of a fixed row count."""
    parts = []
    for i, spec, (source_split, carve), share in plans:
        raw = _read(spec, data, source_split, split == "validation" and spec.validation_split is not None)
        part = raw.map_batches(_adapt_fn(adapter_of(spec), i, carve, spec.weight if split == "train" else 1.0),
                               batch_format="pyarrow", batch_size=64, num_cpus=data.num_cpus_per_op)
        parts.append(part.limit(share) if share is not None else part)
    ds = parts[0].union(*parts[1:]) if len(parts) > 1 else parts[0]
    ds.context.execution_options.preserve_order = True
    if split == "train":
        # Ray's sort samples its range boundaries at random, so its blocks differ from run to run: the
        # fixed-size blocks after it make the ranks' shares (and a resume's skipped blocks) the same. Ray fuses
        # the map after a sort into its reduce tasks, which would cut each range apart: a pass-through map takes
        # that place, so the repartition cuts the whole sorted stream
        ds = ds.sort("mix_key").map_batches(_as_they_are, batch_format="pyarrow", batch_size=None,
                                            num_cpus=data.num_cpus_per_op)
        ds = ds.repartition(target_num_rows_per_block=BUNDLE_ROWS, strict=True)
        if data.max_rows is not None:
            ds = ds.limit(data.max_rows)
    return ds


# ---------------------------------------------------------------- worker side

def _iter_rows(shard: Any) -> Iterator[dict]:
    """Rows {input_ids, mask, *STREAM_COLUMNS} from a DataIterator / Dataset shard, or an iterable of row dicts
    (missing columns: a first use of source 0, read from nowhere). A skipped row's ids and mask are None.

    Blocks are passed on as they come (`batch_size=None`, `prefetch_batches=0`): the tokenizing map makes
    them 64 rows, the first packing window's size, so the first block packs from the first tokenizing batch.
    Ray Data's prefetching (its default) holds each batch back until the next one's blocks exist, so the first
    block would wait for several tokenizing batches instead of one. Reading ahead is the loop's
    (`train.read_ahead`, a thread that keeps two steps' blocks ready)."""
    empty = {"skip_reason": "", "skip_detail": "", "source": 0, "copy": 0, "file": "", "row": 0}
    if hasattr(shard, "iter_batches"):
        for batch in shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
            ids_col, mask_col = batch.column("input_ids"), batch.column("mask")
            cols = {k: batch.column(k).to_pylist() for k in STREAM_COLUMNS if k in batch.column_names}
            for i in range(batch.num_rows):
                row = {**empty, **{k: v[i] for k, v in cols.items()}}
                trained = not row["skip_reason"]
                row["input_ids"] = ids_col[i].values.to_numpy(zero_copy_only=False) if trained else None
                row["mask"] = mask_col[i].values.to_numpy(zero_copy_only=False) if trained else None
                yield row
    else:
        for row in shard:
            yield {**empty, **{k: v for k, v in row.items() if v is not None}}


def read_rows(shard: Any) -> list[dict]:
    """Every row of a small dataset shard (the held-out split) as {input_ids, mask, skip_reason, ...} dicts,
    read once and kept: `iter_blocks` packs them, the sample prompts are cut from them."""
    return list(_iter_rows(shard))


def iter_blocks(shard: Any, data, *, counters: DataCounters | None = None, skip_blocks: int = 0,
                pad_id: int = 0, shuffle_seed: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Pack this worker's rows into `data.seq_len` blocks (see `pack_blocks`), counting as it goes.

    `shard` is `ray.train.get_dataset_shard("train")` (already this rank's share), a Dataset, or an
    iterable of row dicts.

    Resume: `skip_blocks=N` re-reads and re-packs the first N blocks without yielding them (their
    tokenization is paid again; nothing is trained twice), then continues. Exact when the rank sees
    the same rows in the same order, which `build_dataset` + `train_data_config` provide. Counters
    include the replayed blocks, i.e. they count from the start of the pass.

    `shuffle_seed`: shuffle the usable conversations before packing, through a buffer of
    `SHUFFLE_WINDOWS x data.pack_window` of them (an epoch after the first); the same seed and rows
    give the same order.
    """
    c = counters if counters is not None else DataCounters()
    # a single source's name is its `data.source` (specs.source_specs)
    names = [s.name for s in source_specs(data)] if data.sources else [str(getattr(data, "source", "data"))]
    check = SkipCheck(data.max_skip_fraction)

    def examples():
        for row in _iter_rows(shard):
            reason = Skip(row["skip_reason"], row["skip_detail"]) if row["skip_reason"] else ""
            if not reason and data.overlong == "drop" and len(row["input_ids"]) > data.seq_len:
                reason = Skip("overlong", f"{len(row['input_ids']):,} tokens, data.seq_len {data.seq_len:,}")
            if c.count_row(names[row["source"]], reason, first=row["copy"] == 0, where=(row["file"], row["row"])):
                yield row["input_ids"], row["mask"], names[row["source"]]
            elif reason not in ("", HELD_OUT, NOT_DRAWN):
                check(c)
        check(c, final=True)

    stream = examples()
    if shuffle_seed is not None:
        stream = _buffer_shuffle(stream, shuffle_seed, SHUFFLE_WINDOWS * data.pack_window)
    for n, block in enumerate(pack_blocks(stream, data.seq_len, window=data.pack_window,
                                          pad_id=pad_id, overlong=data.overlong, counters=c)):
        if n >= skip_blocks:
            yield block


def _buffer_shuffle(items: Iterable[Any], seed: int, buffer: int) -> Iterator[Any]:
    """A seeded streaming shuffle: hold `buffer` items; each arrival swaps in for a random held one,
    which is emitted; the rest go out in a random order at the end. Memory: `buffer` items."""
    rng = np.random.default_rng(seed)
    held: list[Any] = []
    for item in items:
        if len(held) < buffer:
            held.append(item)
            continue
        i = int(rng.integers(buffer))
        held[i], item = item, held[i]
        yield item
    for i in rng.permutation(len(held)):
        yield held[i]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def gather_counters(counters: DataCounters, group: Any = None) -> DataCounters:
    """Counters summed over all ranks (a collective: every rank must call it); local without dist."""
    dist = _dist()
    if dist is None:
        return DataCounters().merge(counters)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, counters.to_dict(), group=group)
    total = DataCounters()
    for p in parts:
        total.merge(DataCounters.from_dict(p))
    return total


def train_data_config(datasets_to_split: Any = ("train",)):
    """A `ray.train.DataConfig` that splits without dropping rows and in a deterministic order.

    Pass it as `TorchTrainer(dataset_config=train_data_config())`. Splits `datasets_to_split` with
    `streaming_split(equal=False)`; the others (validation) reach every worker whole.
    """
    from ray.data import ExecutionOptions

    from raytune_ft import compat

    class _NoDropDataConfig(compat.ray_data_config()):    # its private parts checked here, at the run's start
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output = [{} for _ in range(world_size)]
            for name, ds in datasets.items():
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                opts: ExecutionOptions = compat.RAY_DATA_CONFIG_OPTIONS.read(self)(name)
                opts.preserve_order = True
                ds.context.execution_options = opts
                if name in compat.RAY_DATA_CONFIG_SPLIT.read(self):
                    for i, part in enumerate(ds.streaming_split(world_size, equal=False)):
                        output[i][name] = part
                else:
                    for i in range(world_size):
                        output[i][name] = ds.iterator()
            return output

    return _NoDropDataConfig(datasets_to_split=list(datasets_to_split))
