"""The JSON files of a checkpoint (train/checkpoint.py's layout): the meta file and each rank's train state.

No torch at import: the driver reads a finished run's meta after `TorchTrainer.fit()`, the registration
task reads the meta of the checkpoint it registers, and neither loads a tensor. train/checkpoint.py
re-exports these names for the loops.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow.fs as pafs

META_FILE = "raytune_meta.json"


def train_state_path(directory: str, rank: int) -> str:
    return f"{directory.rstrip('/')}/train_state/rank{rank}.json"


def write_train_state(directory: str, rank: int, train_state: dict) -> None:
    """train_state/rank{R}.json in `directory` (a local folder)."""
    os.makedirs(os.path.join(directory, "train_state"), exist_ok=True)
    with open(os.path.join(directory, "train_state", f"rank{rank}.json"), "w") as f:
        json.dump(train_state, f)


def read_train_state(fs: pafs.FileSystem, directory: str, rank: int) -> dict:
    """This rank's train state in a checkpoint (both loops); a clear error where the checkpoint has none
    for this rank: starting one rank over while the others resume would desynchronise them."""
    from raytune_ft.storage import fs as storage
    state = storage.read_json(fs, train_state_path(directory, rank))
    if state is None:
        raise RuntimeError(f"checkpoint {directory} has no train state for rank {rank}: it was written by a run "
                           "with a different number of workers; resume with the same scaling.num_workers")
    return state


def write_meta(directory: str, meta: dict) -> None:
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=2, default=str)


def read_meta_at(fs: pafs.FileSystem, directory: str) -> dict:
    """The checkpoint's meta file read where the checkpoint lies ({} when it has none)."""
    from raytune_ft.storage import fs as storage
    return storage.read_json(fs, f"{directory.rstrip('/')}/{META_FILE}", default={}) or {}


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


__all__ = ["META_FILE", "train_state_path", "write_train_state", "read_train_state", "write_meta", "read_meta_at",
           "read_meta"]
