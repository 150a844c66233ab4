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
shares are deterministic for a given source and block layout; that is what makes "skip the first N
blocks" an exact resume.

Rows that cannot be trained on are not dropped in the Ray Data stage: they travel as rows with an
empty `input_ids` and a `skip_reason`, so the worker that receives them counts them; the counts are
summed across workers by `gather_counters`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any, Iterable, Iterator

import numpy as np

from raytune_ft.data.packing import DataCounters, pack_blocks
from raytune_ft.data.reading import BUILTIN_DEFAULT_ROWS, HF_ROOT_ENV, _read_source, resolve_hf_parquet  # noqa: F401
from raytune_ft.data.sft import SpanNotFound, render_sft
from raytune_ft.data.sources import to_messages

__all__ = ["DataCounters", "build_dataset", "iter_blocks", "read_rows", "gather_counters",
           "train_data_config", "resolve_hf_parquet", "HF_ROOT_ENV"]

SHUFFLE_WINDOWS = 4          # an epoch's shuffle buffer, in packing windows
_SPLIT_BUCKETS = 1 << 32


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

def _split_bucket(messages: Any, seed: int) -> float:
    """A number in [0, 1) fixed by the row's content and the seed: which split a row falls in."""
    key = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str).encode()
    h = hashlib.blake2b(key, digest_size=8, salt=(seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")).digest()
    return int.from_bytes(h[:4], "little") / _SPLIT_BUCKETS


def tokenize_rows(rows: Iterable[Any], tokenizer, *, schema: str = "auto",
                  template_kwargs: dict | None = None, validation_fraction: float = 0.0,
                  keep: str = "all", seed: int = 42) -> dict[str, list]:
    """Columns `input_ids`, `mask`, `skip_reason` for raw rows (dicts, or json text lines).

    `keep` is "train" / "validation" / "all": with `validation_fraction > 0`, rows whose seeded hash
    falls under the fraction are validation rows and the rest train rows; the other split's rows are
    left out (not counted: they are not this split's). A skipped row keeps a place with empty ids.
    """
    out: dict[str, list] = {"input_ids": [], "mask": [], "skip_reason": []}
    kwargs = template_kwargs or {}
    for row in rows:
        if isinstance(row, dict) and set(row) == {"text"} and isinstance(row["text"], str):
            row = row["text"]
        messages, reason = to_messages(row, schema)
        if validation_fraction > 0 and keep != "all":
            in_val = _split_bucket(messages if messages is not None else repr(row), seed) < validation_fraction
            if in_val != (keep == "validation"):
                continue
        ids: list[int] = []
        mask: list[bool] = []
        if messages is not None:
            try:
                ids, mask = render_sft(tokenizer, messages, **kwargs)
            except SpanNotFound:
                reason = "span_not_found"
            except Exception:                       # noqa: BLE001 - a template raising on a row's data
                reason = "template_error"
        out["input_ids"].append(ids if reason is None else [])
        out["mask"].append(mask if reason is None else [])
        out["skip_reason"].append(reason or "")
    return out


def _map_fn(tok_ref: _TokenizerRef, schema: str, template_kwargs: dict, fraction: float, keep: str,
            seed: int):
    import pyarrow as pa

    def fn(batch: "pa.Table") -> "pa.Table":
        cols = tokenize_rows(batch.to_pylist(), tok_ref.get(), schema=schema,
                             template_kwargs=template_kwargs, validation_fraction=fraction,
                             keep=keep, seed=seed)
        return pa.table({"input_ids": pa.array(cols["input_ids"], type=pa.list_(pa.int32())),
                         "mask": pa.array(cols["mask"], type=pa.list_(pa.bool_())),
                         "skip_reason": pa.array(cols["skip_reason"], type=pa.string())})
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
    starts a Python process and loads the tokenizer before its first row, and the first step waits for it
    (bench/NOTES.md, start-up). Ray hands a finished task's idle process to the
    job's next task of the same runtime environment, so these run in the one the map's tasks inherit from
    Ray Train's controller; the tokenizer, loaded once per process, is there when they come. A head start
    only: nothing waits for these tasks."""
    import ray

    task = ray.remote(num_cpus=num_cpus, max_retries=0,
                      runtime_env=_train_controller_env())(_load_tokenizer_here)
    for _ in range(processes):
        task.remote(tokenizer)


def build_dataset(data, tokenizer, *, split: str = "train", chat_template: str | None = None,
                  processes: int | None = None):
    """A Ray Dataset of tokenized, masked conversations of `split` ("train" or "validation").

    Columns: `input_ids` list<int32>, `mask` list<bool>, `skip_reason` string ("" for a usable row;
    otherwise the reason, with empty ids). `tokenizer` is a fast tokenizer, a path to one or a model's
    `raytune_ft.models.tokenizer.TokenizerOf` (the last two loaded once per Ray worker process);
    `chat_template` (text or a .jinja path) overrides its template.
    `processes`: how many tokenizing tasks run at once (None: as many as Ray Data schedules).
    Lazy: nothing is read until the dataset is consumed.
    """
    from ray.data import TaskPoolStrategy

    if split not in ("train", "validation"):
        raise ValueError(f"split={split!r}: expected 'train' or 'validation'")
    if split == "validation" and data.validation_split:
        source_split, keep, fraction = data.validation_split, "all", 0.0
    elif split == "validation":
        if data.validation_fraction <= 0:
            raise ValueError("no validation data: set data.validation_fraction or data.validation_split")
        source_split, keep, fraction = data.split, "validation", data.validation_fraction
    else:
        source_split, keep, fraction = data.split, "train", data.validation_fraction
    ds = _read_source(data, source_split)
    # Deterministic row order end to end: the splits, the validation carve-out and resume rely on it.
    ds.context.execution_options.preserve_order = True
    if data.max_rows is not None:
        ds = ds.limit(data.max_rows)
    fn = _map_fn(_TokenizerRef(tokenizer, chat_template), data.schema, dict(data.template_kwargs),
                 fraction, keep, data.seed)
    # at most `processes` tokenizing tasks at a time (Ray reuses their worker processes): left to itself Ray
    # Data runs one per `num_cpus_per_op` of free CPU, each a new process importing transformers and loading
    # the tokenizer, and they take the node's cores from the model build while nothing waits for their rows
    # but the first block (bench/NOTES.md, start-up)
    ds = ds.map_batches(fn, batch_format="pyarrow", batch_size=64, num_cpus=data.num_cpus_per_op,
                        zero_copy_batch=True, compute=TaskPoolStrategy(size=processes) if processes else None)
    if split == "validation" and data.validation_max_rows is not None:
        # after the carve-out: the first N held-out rows, the same ones at every evaluation
        ds = ds.limit(data.validation_max_rows)
    return ds


# ---------------------------------------------------------------- worker side

def _iter_rows(shard: Any) -> Iterator[tuple[Any, Any, str]]:
    """(ids, mask, skip_reason) from a DataIterator / Dataset shard, or an iterable of row dicts.

    Blocks are passed on as they come (`batch_size=None`, `prefetch_batches=0`): the tokenizing map makes
    them 64 rows, the first packing window's size, so the first block packs from the first tokenizing batch.
    Ray Data's prefetching (its default) holds each batch back until the next one's blocks exist, so the first
    rows came late (bench/NOTES.md, start-up). Reading ahead is the loop's
    (`train.read_ahead`, a thread that keeps two steps' blocks ready)."""
    if hasattr(shard, "iter_batches"):
        for batch in shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
            ids_col, mask_col = batch.column("input_ids"), batch.column("mask")
            reasons = batch.column("skip_reason").to_pylist()
            for i, reason in enumerate(reasons):
                if reason:
                    yield None, None, reason
                else:
                    yield (ids_col[i].values.to_numpy(zero_copy_only=False),
                           mask_col[i].values.to_numpy(zero_copy_only=False), "")
    else:
        for row in shard:
            yield row["input_ids"], row["mask"], row.get("skip_reason") or ""


def read_rows(shard: Any) -> list[dict]:
    """Every row of a small dataset shard (the held-out split) as {input_ids, mask, skip_reason} dicts,
    read once and kept: `iter_blocks` packs them, the sample prompts are cut from them."""
    return [{"input_ids": ids, "mask": mask, "skip_reason": reason} for ids, mask, reason in _iter_rows(shard)]


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

    def examples():
        for ids, mask, reason in _iter_rows(shard):
            c.rows_read += 1
            if reason:
                c.skip(reason)
                continue
            yield ids, mask

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
    import ray.train
    from ray.data import ExecutionOptions

    class _NoDropDataConfig(ray.train.DataConfig):
        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            output = [{} for _ in range(world_size)]
            for name, ds in datasets.items():
                if ds.name is None:
                    ds.set_name(name)
                ds = ds.copy(ds)
                opts: ExecutionOptions = self._resolve_execution_options(name)
                opts.preserve_order = True
                ds.context.execution_options = opts
                if name in self._datasets_to_split:
                    for i, part in enumerate(ds.streaming_split(world_size, equal=False)):
                        output[i][name] = part
                else:
                    for i in range(world_size):
                        output[i][name] = ds.iterator()
            return output

    return _NoDropDataConfig(datasets_to_split=list(datasets_to_split))
