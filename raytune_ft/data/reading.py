"""Reading a source (specs.SourceSpec) into a Ray Dataset of raw rows, and its first rows without Ray.

Sources: a hub dataset (hf://org/name at a revision, or a local stand-in under $RAYTUNE_HF_ROOT), an object
store prefix (s3://bucket/prefix, through the storage layer's filesystem and credentials), a local file or
folder, or a builtin generated one. Every data file of a folder is read (parquet, a JSON array, jsonl, each plain
or compressed), file after file in name order, and every row reaches the adapters in one form: its JSON text (a
jsonl line as it is, so one bad line is counted, not fatal), with its file and row number. The run reads each
file in a Ray task (`read_source`) with the same code (`iter_file_rows`) as the checks before Ray and `raytune-ft
data check` read it here (`iter_source_rows`); a file the run cannot read is refused before Ray
(`check_readable`). The pipeline (pipeline.py) tokenizes what this reads.
"""
from __future__ import annotations

import fnmatch
import io
import json
import os
from typing import Any, Iterator

from raytune_ft.data.builtin import split_rows
from raytune_ft.data.specs import (COMPRESSED, DATA_EXTENSIONS, SourceSpec, is_data_file, local_files, pick_split,
                                   splits_of)
from raytune_ft.recipe.values import RecipeError

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


# an unbuffered pyarrow stream on object storage asks the store once per read of the text layer above it (8 KiB):
# a 3 MB jsonl file took 6.3 s from a loopback S3 server, 0.19 s buffered
_STREAM_BUFFER = 1 << 20


def _open(fs, path: str):
    """A binary stream of a file, decompressed by its extension, on a pyarrow or fsspec filesystem."""
    if hasattr(fs, "open_input_stream"):
        return fs.open_input_stream(path, compression="detect", buffer_size=_STREAM_BUFFER)
    return fs.open(path, "rb", compression="infer")


def _is_array(fs, path: str) -> bool:
    """Whether a .json file holds one JSON array (rather than a row per line)."""
    with _open(fs, path) as fh:
        return fh.read(4096).lstrip().startswith(b"[")


def _is_parquet(path: str) -> bool:
    return os.path.basename(path).lower().endswith(".parquet")


def row_text(row: Any) -> str:
    """A parsed row as the JSON text a jsonl line holds: every format reaches the adapters as such text."""
    return json.dumps(row, ensure_ascii=False, default=str)


def iter_file_rows(fs, path: str) -> Iterator[tuple[int, str]]:
    """(row number, the row's JSON text) of one data file in order: a jsonl file's line numbers (blank lines
    skipped), a parquet file's or a JSON array's 1-based row index."""
    if _is_parquet(path):
        import pyarrow.parquet as pq

        n = 0
        with (fs.open_input_file(path) if hasattr(fs, "open_input_file") else fs.open(path, "rb")) as fh:
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=256):
                for row in batch.to_pylist():
                    n += 1
                    yield n, row_text(row)
    elif _is_array(fs, path):
        with _open(fs, path) as fh:
            for n, row in enumerate(json.load(fh), 1):
                yield n, row_text(row)
    else:
        with _open(fs, path) as fh:
            for n, line in enumerate(io.TextIOWrapper(fh, encoding="utf-8", errors="replace"), 1):
                if line.strip():
                    yield n, line.rstrip("\r\n")


def iter_source_rows(spec: SourceSpec, split: str, *, held_out: bool = False,
                     seed: int = 42) -> Iterator[tuple[str, int, str]]:
    """(file, row number, JSON text) of every row of a source's split, file after file in name order: what
    the run reads (`read_source`, in Ray tasks) and the checks read here."""
    if spec.kind == "builtin":
        for n, row in enumerate(split_rows(spec.source, BUILTIN_DEFAULT_ROWS, seed, held_out=held_out), 1):
            yield spec.source, n, row_text(row)
        return
    files, fs = source_files(spec, split, held_out=held_out)
    for f in files:
        for n, text in iter_file_rows(fs, f):
            yield f, n, text


RAW_COLUMNS = ("text", "file", "row")     # a raw row in the run's stream: its JSON text and where it came from
_READ_BATCH = 1024


def _raw_table(rows: list[tuple[str, int, str]]):
    import pyarrow as pa

    return pa.table({"text": pa.array([r[2] for r in rows], type=pa.string()),
                     "file": pa.array([r[0] for r in rows], type=pa.string()),
                     "row": pa.array([r[1] for r in rows], type=pa.int64())})


def _file_reader(fs):
    """A Ray Data map from file names to their rows (`iter_file_rows`), streamed out in batches."""
    def read(batch):
        for path in batch.column("file").to_pylist():
            rows = []
            for n, text in iter_file_rows(fs, path):
                rows.append((path, n, text))
                if len(rows) >= _READ_BATCH:
                    yield _raw_table(rows)
                    rows = []
            if rows:
                yield _raw_table(rows)
    return read


def read_source(spec: SourceSpec, split: str, *, held_out: bool = False, seed: int = 42,
                num_cpus: float = 0.25):
    """A Ray Dataset of one split of a source's raw rows (`RAW_COLUMNS`), in `iter_source_rows`' order: each
    file is read by a task of its own with the same code as the checks before Ray."""
    import ray.data

    if spec.kind == "builtin":
        return ray.data.from_arrow(_raw_table(list(iter_source_rows(spec, split, held_out=held_out, seed=seed))))
    files, fs = source_files(spec, split, held_out=held_out)
    ds = ray.data.from_items([{"file": f} for f in files], override_num_blocks=max(1, len(files)))
    return ds.map_batches(_file_reader(fs), batch_size=1, batch_format="pyarrow", num_cpus=num_cpus)


def iter_raw_rows(spec: SourceSpec, split: str, *, held_out: bool = False, seed: int = 42) -> Iterator[str]:
    """A source's raw rows in order, read in this process (no Ray): each row's JSON text."""
    for _, _, text in iter_source_rows(spec, split, held_out=held_out, seed=seed):
        yield text


def head_rows(spec: SourceSpec, split: str, n: int, *, seed: int = 42) -> list[Any]:
    """The first `n` raw rows of a source's split."""
    out = []
    for row in iter_raw_rows(spec, split, seed=seed):
        out.append(row)
        if len(out) >= n:
            break
    return out


# data formats the run does not read: a folder holding one is refused, not half read
_UNREAD_EXTENSIONS = (".csv", ".tsv", ".arrow", ".feather", ".avro", ".orc", ".xlsx", ".xz", ".zip", ".7z", ".tar")


def _unreadable(fs, path: str, *, probe: bool) -> str | None:
    """Why the run cannot read a data file (None: it can); `probe`: open it and read its head."""
    base = os.path.basename(path).lower()
    if ".parquet" in base and not base.endswith(".parquet"):
        return "a compressed parquet file (parquet compresses inside the file: store it as .parquet)"
    if base.endswith(_UNREAD_EXTENSIONS):
        return (f"a {base.rsplit('.', 1)[-1]} file (read: {', '.join(DATA_EXTENSIONS)}, plain or "
                f"{', '.join(COMPRESSED)})")
    if not probe:
        return None
    try:
        if _is_parquet(path):
            import pyarrow.parquet as pq

            with (fs.open_input_file(path) if hasattr(fs, "open_input_file") else fs.open(path, "rb")) as fh:
                pq.ParquetFile(fh).metadata
        else:
            with _open(fs, path) as fh:
                fh.read(4096)
    except Exception as e:  # noqa: BLE001 - any failure to open is the file's, said with its name
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'cannot be read'}"
    return None


def check_readable(spec: SourceSpec, split: str, where: str) -> None:
    """Every file of a source's split can be read by the run, or a RecipeError naming those that cannot. A
    local source's files are opened (and a folder's other files looked at); a remote one's judged by name."""
    if spec.kind in ("builtin", "hf"):          # a hub repo's files are its parquet files (hf_files)
        return
    files, fs = source_files(spec, split)
    local = spec.kind == "local"
    if local:
        root = os.path.abspath(os.path.expanduser(spec.source.removeprefix("file://")))
        if os.path.isdir(root):
            files = sorted(set(files) | {os.path.join(d, f) for d, _, names in os.walk(root) for f in names
                                         if f.lower().endswith(_UNREAD_EXTENSIONS) or
                                         (".parquet" in f.lower() and not f.lower().endswith(".parquet"))})
    bad = [(f, why) for f in files if (why := _unreadable(fs, f, probe=local))]
    if bad:
        listed = "; ".join(f"{f}: {why}" for f, why in bad[:10]) + (f"; and {len(bad) - 10} more"
                                                                     if len(bad) > 10 else "")
        raise RecipeError(f"{where}.source: {len(bad)} file(s) of {spec.source} cannot be read by the run: {listed}. "
                          "Convert or remove them (nothing of a source is left out silently)")
