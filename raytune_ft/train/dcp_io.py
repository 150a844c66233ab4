"""DCP checkpoints of an FSDP2 model + optimizer that each rank can write and read alone, on any storage.

Two things make a rank's resume read only its own files:

- Replicated state is kept per rank. DCP de-duplicates an entry that several ranks hold (AdamW's `step`
  tensors, the param groups' hyper-parameters, any non-sharded buffer) and spreads those entries over the
  ranks' files to balance them, so on load a rank would read some of them from another rank's file. Here
  every non-DTensor leaf is saved under `rank{R}/...`: each rank writes and reads its own copy (a few kB).
- Loading goes through a DCP StorageReader over the run's pyarrow filesystem: a rank reads `.metadata`
  and the byte ranges of its own `__{R}_*.distcp` file straight from local, shared or object storage,
  one ranged read per tensor, with no download of the checkpoint.
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import Any, Iterator

import pyarrow.fs as pafs
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.tensor import DTensor

DCP_DIR = "dcp"


def _split(tree: Any) -> tuple[Any, Any]:
    """(the DTensor leaves, everything else) of a nested dict, both keeping its structure (None: empty)."""
    if isinstance(tree, DTensor):
        return tree, None
    if isinstance(tree, dict):
        sharded, local = {}, {}
        for k, v in tree.items():
            s, lo = _split(v)
            if s is not None:
                sharded[k] = s
            if lo is not None:
                local[k] = lo
        return (sharded or None), (local or None)
    return None, tree


def _merge(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a.get(k), b.get(k)) for k in {**a, **b}}
    return b


class ShardedTrainState:
    """The checkpoint's DCP parts (train/state.py: "model", "optim") as DCP sees them: sharded entries
    shared by all ranks, the rest under rank{R}. Loaded part by part in the order given."""

    def __init__(self, parts: dict[str, Any], rank: int):
        self.parts, self.rank = parts, rank

    def state_dict(self) -> dict[str, Any]:
        sharded, local = _split({name: part.state_dict() for name, part in self.parts.items()})
        return {**(sharded or {}), f"rank{self.rank}": local or {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        full = _merge({k: v for k, v in state.items() if k in self.parts}, state.get(f"rank{self.rank}")) or {}
        for name, part in self.parts.items():
            part.load_state_dict(full.get(name, {}))


class _LegacyTrainState(ShardedTrainState):
    """Checkpoints written before replicated state was kept per rank: plain {"model", "optim"}."""

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


class ArrowFileSystem(FileSystemBase):
    """DCP's filesystem interface over a pyarrow filesystem (local, shared or S3)."""

    def __init__(self, fs: pafs.FileSystem):
        self.fs = fs
        self.opened: list[str] = []           # every file opened for reading, in order

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        path = str(path)
        if "r" in mode:
            self.opened.append(path)
            with self.fs.open_input_file(path) as f:
                yield f
        else:
            with self.fs.open_output_stream(path) as f:
                yield f

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def rename(self, path, new_path) -> None:
        self.fs.move(str(path), str(new_path))

    def init_path(self, path) -> str:
        return str(path)

    def mkdir(self, path) -> None:
        self.fs.create_dir(str(path))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return self.fs.get_file_info(str(path)).type != pafs.FileType.NotFound

    def rm_file(self, path) -> None:
        self.fs.delete_file(str(path))

    def ls(self, path) -> list[str]:
        sel = pafs.FileSelector(str(path), allow_not_found=True)
        return [i.path for i in self.fs.get_file_info(sel)]


class ArrowReader(FileSystemReader):
    """A DCP StorageReader that reads a checkpoint where it lies: one ranged read per entry."""

    def __init__(self, fs: pafs.FileSystem, path: str):
        super().__init__(path)
        self.fs = ArrowFileSystem(fs)
        self.path = str(path).rstrip("/")

    def _slice_file(self, file, sinfo):
        # one request for the entry's bytes; torch.load's many small reads then stay in memory
        file.seek(sinfo.offset)
        return io.BytesIO(file.read(sinfo.length))

    @property
    def opened(self) -> list[str]:
        return self.fs.opened


def save(directory: str, parts: dict[str, Any], rank: int, *, process_group=None) -> None:
    """Every rank writes its shard of `parts` (and its copy of the replicated state) to `directory`/dcp
    (a local folder)."""
    dcp.save({"app": ShardedTrainState(parts, rank)}, checkpoint_id=os.path.join(directory, DCP_DIR),
             process_group=process_group)


def load(fs: pafs.FileSystem, checkpoint_path: str, parts: dict[str, Any], rank: int, *,
         no_dist: bool = False) -> list[str]:
    """Load this rank's part of `checkpoint_path`/dcp from `fs` into `parts` (the sharded model's, the
    optimizer's). Returns the paths of the files it opened (`.metadata` and this rank's own shard files).
    `no_dist`: plan the read on this rank alone, with no collective (a lone rank of a fake process group,
    whose gather before torch 2.13 hands back uninitialised buffers that DCP then unpickles)."""
    reader = ArrowReader(fs, f"{checkpoint_path.rstrip('/')}/{DCP_DIR}")
    md = reader.read_metadata()
    reader.opened.clear()  # read again by dcp.load; counted once from here on
    per_rank = any(k.startswith(f"app.rank{rank}.") for k in md.state_dict_metadata)
    state_cls = ShardedTrainState if per_rank else _LegacyTrainState
    dcp.load({"app": state_cls(parts, rank)}, storage_reader=reader, no_dist=no_dist)
    return list(dict.fromkeys(reader.opened))
