"""Reading a source (specs.SourceSpec) into a Ray Dataset of raw rows, and its first rows without Ray.

Sources: a hub dataset (hf://org/name at a revision, or a local stand-in under $RAYTUNE_HF_ROOT), an object
store prefix (s3://bucket/prefix, through the storage layer's filesystem and credentials), a local file or
folder, or a builtin generated one. Ray Data reads the files in parallel; jsonl is read as text lines so one
bad line is counted, not fatal. `head_rows` reads the first rows in this process (the checks before Ray
starts, `raytune-ft data check`). The pipeline (pipeline.py) tokenizes what this reads.
"""
from __future__ import annotations

import fnmatch
import io
import json
import os
from typing import Any, Iterator

from raytune_ft.data.builtin import split_rows
from raytune_ft.data.specs import SourceSpec, is_data_file, local_files, pick_split, splits_of

# Offline stand-in for the hub: hf://org/name reads <root>/org/name/, laid out as the hub repo is
# (e.g. data/train_sft-00000-of-00003.parquet). Same listing and reading code as the real hub.
HF_ROOT_ENV = "RAYTUNE_HF_ROOT"
BUILTIN_DEFAULT_ROWS = 2000


def hf_repo(src: str) -> str:
    return src[len("hf://"):].removeprefix("datasets/").strip("/")


def hf_files(repo: str, revision: str | None = None, hf_root: str | None = None) -> tuple[list[str], str, Any]:
    """The parquet files of a hub dataset repo, the repo's root on the filesystem, and the filesystem
    (`HfFileSystem` at `revision`, streamed by Ray Data; offline: a local folder laid out like the repo)."""
    import fsspec

    root = hf_root or os.environ.get(HF_ROOT_ENV)
    if root:
        fs = fsspec.filesystem("file")
        base = os.path.join(os.path.abspath(os.path.expanduser(root)), repo)
    else:
        from huggingface_hub import HfFileSystem

        fs = HfFileSystem()
        base = f"datasets/{repo}@{revision or 'main'}"
    return sorted(fs.glob(f"{base}/**/*.parquet")), base, fs


def hf_splits(repo: str, revision: str | None = None) -> list[str]:
    """The splits a hub dataset repo's parquet files make."""
    files, base, _ = hf_files(repo, revision)
    return list(splits_of(files, base))


def resolve_hf_parquet(repo: str, split: str, revision: str | None = None,
                       hf_root: str | None = None) -> tuple[list[str], Any]:
    """Parquet files of one split of a hub dataset repo, and the filesystem to read them with. Split files
    are matched the way the hub names them: `<split>-*.parquet` or `<split>/*.parquet` anywhere in the repo."""
    files, base, fs = hf_files(repo, revision, hf_root)
    picked = [f for f in files
              if fnmatch.fnmatch(os.path.basename(f), f"{split}-*.parquet")
              or os.path.basename(f) == f"{split}.parquet"
              or os.path.basename(os.path.dirname(f)) == split]
    if not picked:
        raise FileNotFoundError(f"no parquet files for split {split!r} in hf://{repo}"
                                f"{'@' + revision if revision else ''} (splits: "
                                f"{', '.join(splits_of(files, base)) or 'none'})")
    return picked, fs


def source_files(spec: SourceSpec, split: str, *, held_out: bool = False) -> tuple[list[str], Any]:
    """The files of one split of a file-based source and the filesystem they are on (pyarrow's or fsspec's).
    A folder whose files name no split is one split: the training rows."""
    if spec.kind == "hf":
        return resolve_hf_parquet(hf_repo(spec.source), split, spec.revision)
    if spec.kind == "remote":
        import pyarrow.fs as pafs

        from raytune_ft.storage import fs as storage
        st = storage.resolve(spec.source)
        info = st.fs.get_file_info(st.root)
        if info.type == pafs.FileType.File:
            files, root = [st.root], os.path.dirname(st.root)
        else:
            files = [i.path for i in storage.list_files(st.fs, st.root) if is_data_file(i.base_name)]
            root = st.root
        if not files:
            raise FileNotFoundError(f"no .jsonl/.json/.parquet files under {spec.source}")
        single = info.type == pafs.FileType.File
        return (files if single else pick_split(files, root, split, "data.source", single_ok=not held_out)), st.fs
    import pyarrow.fs as pafs

    path = os.path.abspath(os.path.expanduser(spec.source.removeprefix("file://")))
    files = local_files(path)
    if os.path.isfile(path):
        return files, pafs.LocalFileSystem()
    return pick_split(files, path, split, "data.source", single_ok=not held_out), pafs.LocalFileSystem()


def _open(fs, path: str):
    """A binary stream of a file, decompressed by its extension, on a pyarrow or fsspec filesystem."""
    if hasattr(fs, "open_input_stream"):
        return fs.open_input_stream(path, compression="detect")
    return fs.open(path, "rb", compression="infer")


def _is_array(fs, path: str) -> bool:
    """Whether a .json file holds one JSON array (rather than a row per line)."""
    with _open(fs, path) as fh:
        return fh.read(4096).lstrip().startswith(b"[")


def read_source(spec: SourceSpec, split: str, *, held_out: bool = False, seed: int = 42):
    """A Ray Dataset of one split of a source's raw rows: dicts (parquet) or {"text": a json line}."""
    import ray.data

    if spec.kind == "builtin":
        rows = split_rows(spec.source, BUILTIN_DEFAULT_ROWS, seed, held_out=held_out)
        return ray.data.from_items([{"text": json.dumps(r)} for r in rows])
    files, fs = source_files(spec, split, held_out=held_out)
    parquet = [f for f in files if ".parquet" in os.path.basename(f)]
    if parquet:
        return ray.data.read_parquet(parquet, filesystem=fs)
    lines, arrays = [], []
    for f in files:
        (arrays if _is_array(fs, f) else lines).append(f)
    parts = []
    if lines:
        parts.append(ray.data.read_text(lines, filesystem=fs, drop_empty_lines=True))
    for f in arrays:                              # a JSON array file: small by nature, parsed here
        with _open(fs, f) as fh:
            parts.append(ray.data.from_items([{"text": json.dumps(r)} for r in json.load(fh)]))
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


def iter_raw_rows(spec: SourceSpec, split: str, *, held_out: bool = False, seed: int = 42) -> Iterator[Any]:
    """A source's raw rows in order, read in this process (no Ray): dicts, or json text lines."""
    if spec.kind == "builtin":
        yield from split_rows(spec.source, BUILTIN_DEFAULT_ROWS, seed, held_out=held_out)
        return
    files, fs = source_files(spec, split, held_out=held_out)
    for f in files:
        if ".parquet" in os.path.basename(f):
            import pyarrow.parquet as pq

            with (fs.open_input_file(f) if hasattr(fs, "open_input_file") else fs.open(f, "rb")) as fh:
                for batch in pq.ParquetFile(fh).iter_batches(batch_size=256):
                    yield from batch.to_pylist()
        elif _is_array(fs, f):
            with _open(fs, f) as fh:
                yield from json.load(fh)
        else:
            with _open(fs, f) as fh:
                for line in io.TextIOWrapper(fh, encoding="utf-8", errors="replace"):
                    if line.strip():
                        yield line


def head_rows(spec: SourceSpec, split: str, n: int, *, seed: int = 42) -> list[Any]:
    """The first `n` raw rows of a source's split."""
    out = []
    for row in iter_raw_rows(spec, split, seed=seed):
        out.append(row)
        if len(out) >= n:
            break
    return out
