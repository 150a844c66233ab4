"""Checkpoints of the FSDP2 loop: DCP shards for resume, a Hugging Face folder for export.

Layout of one Ray Train checkpoint directory (every rank's files merged by Ray into one folder):
    dcp/                 torch.distributed.checkpoint shards (model + optimizer), one file per rank; each
                         rank's copy of the replicated state is in its own file (train/dcp_io.py)
    train_state/rank{R}.json   this rank's schedule, data position, progress and evaluation parts
                         (train/state.py), one flat JSON object
    hf/                  (final checkpoint only) config.json, sharded *.safetensors + index, tokenizer, in the
                         base checkpoint's layout (models/layout.py)
    adapter/, base/      (LoRA, final checkpoint only) the PEFT adapter, a random base (train/lora_export.py);
                         a LoRA run's dcp/ holds the adapters and their optimizer state only
    raytune_meta.json    job, model name, family, step, final loss (read by the registry)

The JSON files' readers and writers are in train/checkpoint_meta.py (no torch at import, for the driver
and the registry) and are re-exported here.

Ray registers a checkpoint only after every worker's `report` returned, so a worker dying while
writing leaves the previous checkpoint as the latest one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

from raytune_ft.models.layout import BaseLayout
from raytune_ft.train import dcp_io
# the JSON files, torch-free for the driver and the registry: re-exported here for the loops
from raytune_ft.train.checkpoint_meta import (META_FILE, read_meta, read_meta_at, read_train_state,  # noqa: F401
                                              train_state_path, write_meta, write_train_state)
from raytune_ft.train.state import TrainState

SHARD_BYTES = 4 * 1024**3


def save_train_checkpoint(directory: str, state: TrainState, rank: int, *, process_group=None) -> None:
    """Every rank writes its DCP shard and its train-state file into `directory` (a local folder)."""
    dcp_io.save(directory, state.sharded, rank, process_group=process_group)
    write_train_state(directory, rank, state.state_dict())


def load_train_checkpoint(directory: str, state: TrainState, rank: int, *, fs: pafs.FileSystem | None = None,
                          reads: list[str] | None = None) -> None:
    """Load this rank's model + optimizer shards into the (already sharded) model and its train state into
    `state`'s parts.

    `directory` is a path on `fs` (default: the local filesystem), read where it lies: `.metadata`, this
    rank's shard file and its train-state file, nothing of the other ranks. `reads` gets the files opened.
    """
    fs, directory = _located(directory, fs)
    state.load_state_dict(read_train_state(fs, directory, rank))
    opened = dcp_io.load(fs, directory, state.sharded, rank)
    if reads is not None:
        reads.extend(opened + [train_state_path(directory, rank)])


def checkpoint_train_state(directory: str, rank: int, *, fs: pafs.FileSystem | None = None) -> dict:
    """This rank's train state in a checkpoint, without its weights (where the data stood, the counted
    schedule): what `load_train_checkpoint` returns, read alone."""
    return read_train_state(*_located(directory, fs), rank)


def _located(directory: str, fs: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    """`fs` (default: the local filesystem) and `directory` on it, absolute when it is local."""
    fs = fs or pafs.LocalFileSystem()
    return fs, directory if not isinstance(fs, pafs.LocalFileSystem) else os.path.abspath(directory)


def gathered_state(model: torch.nn.Module, keep: Callable[[str], bool] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of each entry of the model's state dict, one gathered at a time (a collective:
    every rank iterates, in the same order; ranks other than 0 may drop what they get). `keep`: the names
    to gather at all (the others are skipped on every rank alike)."""
    for key, value in model.state_dict().items():
        if keep is None or keep(key):
            yield key, value.full_tensor() if hasattr(value, "full_tensor") else value


@dataclass(frozen=True)
class HfExport:
    """What a Hugging Face folder holds besides the weights, and how they are named: the model's HF
    config, its tokenizer (None: none written), the weights' dtype, the prefix the model's names lose,
    the architecture config.json names (default: the model's class) and the base checkpoint's layout
    (models/layout.py; default: the trained model's own names)."""
    config: Any
    tokenizer: Any = None
    dtype: torch.dtype = torch.bfloat16
    prefix_strip: str = ""
    arch: str | None = None
    layout: BaseLayout | None = None


def export_hf_folder(out_dir: str, model: torch.nn.Module, export: HfExport, rank: int, *,
                     tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """Write a Hugging Face folder from an FSDP2-sharded model, one parameter gathered at a time.

    All ranks take part in each gather (a collective); only rank 0 keeps the gathered tensor, on
    the CPU, and flushes a safetensors shard every ~4 GiB, so neither a GPU nor host RAM ever holds
    the whole model. `tensors`: the (name, full tensor) stream to write instead of `gathered_state(model)`
    (a LoRA model's merged weights).
    """
    from safetensors.torch import save_file

    layout = export.layout or BaseLayout()
    hf_config, dtype, prefix_strip = export.config, export.dtype, export.prefix_strip
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_files, weight_map, total = 0, [], {}, 0

    def flush():
        nonlocal shard, shard_bytes
        if rank == 0 and shard:
            name = f"model-{len(shard_files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
            shard_files.append(name)
            for k in shard:
                weight_map[k] = name
        shard, shard_bytes = {}, 0

    def add(name: str, t: torch.Tensor) -> None:
        nonlocal shard_bytes, total
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()

    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    written: set[str] = set()
    for key, full in (gathered_state(model) if tensors is None else tensors):
        if rank != 0:
            continue
        name = key[len(prefix_strip):] if prefix_strip and key.startswith(prefix_strip) else key
        if tied and name == "lm_head.weight":
            continue
        name = layout.name(name)
        written.add(name)
        add(name, full.detach().to("cpu", dtype=dtype if full.is_floating_point() else full.dtype).contiguous())
    if rank == 0 and layout.conditional:
        for name, t in layout.untouched(written):     # the base's own tensors, as they were
            add(name, t)
    flush()
    if rank == 0:
        # rename to the HF convention model-0000i-of-0000n.safetensors
        n = len(shard_files)
        renamed = {}
        for i, old in enumerate(shard_files, 1):
            new = f"model-{i:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
            os.replace(os.path.join(out_dir, old), os.path.join(out_dir, new))
            renamed[old] = new
        if n > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        layout.write_config(out_dir, hf_config, dtype, layout.architecture or export.arch or type(model).__name__)
        if export.tokenizer is not None:
            export.tokenizer.save_pretrained(out_dir)
    if dist.is_initialized():
        dist.barrier()


__all__ = ["save_train_checkpoint", "load_train_checkpoint", "write_train_state", "export_hf_folder", "HfExport",
           "gathered_state", "write_meta", "read_meta", "read_meta_at", "read_train_state", "train_state_path",
           "META_FILE", "StateDictOptions"]
