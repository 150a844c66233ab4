"""Reading a data source into a Ray Dataset of raw rows: a hub dataset (hf://org/name, or a local
stand-in under $RAYTUNE_HF_ROOT), a local jsonl/json/parquet file or folder, or a builtin generated one.
The pipeline (pipeline.py) tokenizes what this reads; its public names are re-exported there."""
from __future__ import annotations

import fnmatch
import json
import os
from typing import Any

from raytune_ft.data.builtin import split_rows

# Offline stand-in for the hub: hf://org/name reads <root>/org/name/, laid out as the hub repo is
# (e.g. data/train_sft-00000-of-00003.parquet). Same listing and reading code as the real hub.
HF_ROOT_ENV = "RAYTUNE_HF_ROOT"
BUILTIN_DEFAULT_ROWS = 2000


def resolve_hf_parquet(repo: str, split: str, revision: str | None = None,
                       hf_root: str | None = None) -> tuple[list[str], Any]:
    """Parquet files of one split of a hub dataset repo, and the filesystem to read them with.

    Online: `HfFileSystem` at `revision` (streamed by Ray Data, never downloaded whole to one node).
    Offline (`hf_root` or $RAYTUNE_HF_ROOT): a local folder laid out like the repo. Split files are
    matched the way the hub names them: `<split>-*.parquet` or `<split>/*.parquet` anywhere in the repo.
    """
    import fsspec

    root = hf_root or os.environ.get(HF_ROOT_ENV)
    if root:
        fs = fsspec.filesystem("file")
        base = os.path.join(os.path.abspath(os.path.expanduser(root)), repo)
    else:
        from huggingface_hub import HfFileSystem

        fs = HfFileSystem()
        base = f"datasets/{repo}@{revision or 'main'}"
    files = sorted(fs.glob(f"{base}/**/*.parquet"))
    picked = [f for f in files
              if fnmatch.fnmatch(os.path.basename(f), f"{split}-*.parquet")
              or os.path.basename(f) == f"{split}.parquet"
              or os.path.basename(os.path.dirname(f)) == split]
    if not picked:
        raise FileNotFoundError(f"no parquet files for split {split!r} in hf://{repo}"
                                f"{'@' + revision if revision else ''} (looked under {base})")
    return picked, fs


def _read_source(data, split_name: str):
    """A Ray Dataset of raw rows. jsonl is read as text lines so one bad line is counted, not fatal."""
    import ray.data

    src = data.source
    if src.startswith("builtin:"):
        try:
            rows = split_rows(src, BUILTIN_DEFAULT_ROWS, data.seed, held_out=split_name != data.split)
        except ValueError as e:
            raise ValueError(f"data.source: {e}") from None
        return ray.data.from_items([{"text": json.dumps(r)} for r in rows])
    if src.startswith("hf://"):
        repo = src[len("hf://"):].removeprefix("datasets/").strip("/")
        paths, fs = resolve_hf_parquet(repo, split_name, data.revision)
        return ray.data.read_parquet(paths, filesystem=fs)
    path = os.path.expanduser(src)
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs_ in os.walk(path) for f in fs_)
        parquet = [f for f in files if f.endswith(".parquet")]
        if parquet:
            return ray.data.read_parquet(parquet)
        texts = [f for f in files if f.endswith((".jsonl", ".json"))]
        if not texts:
            raise FileNotFoundError(f"data.source: no .parquet/.jsonl/.json files under {src!r}")
        return _read_json_files(texts)
    if path.endswith(".parquet"):
        return ray.data.read_parquet(path)
    return _read_json_files([path])


def _read_json_files(files: list[str]):
    import ray.data

    lines, arrays = [], []
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(4096).lstrip()
        (arrays if head.startswith(b"[") else lines).append(f)
    parts = []
    if lines:
        parts.append(ray.data.read_text(lines, drop_empty_lines=True))
    for f in arrays:                              # a JSON array file: small by nature, parsed here
        with open(f) as fh:
            rows = json.load(fh)
        parts.append(ray.data.from_items([{"text": json.dumps(r)} for r in rows]))
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])
