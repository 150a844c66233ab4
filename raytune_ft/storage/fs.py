"""Where a run's files live: a local (or shared) folder, or object storage (`s3://bucket/prefix`).

One `Storage` names the place `tracking.storage_path` points at and the pyarrow filesystem that reaches
it. The same filesystem object goes to Ray Train (`RunConfig(storage_filesystem=...)`), to the loops'
resume (read straight from storage, each rank only its own files), to the driver (small JSON files of
a checkpoint) and to registration; every path on it is a filesystem path (`bucket/prefix/...` on S3,
an absolute path locally), and `uri()` turns one back into what a user types.

S3 endpoint and credentials come from the standard AWS environment variables of each process
(AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN
or any other source of the AWS SDK's default chain, AWS_REGION / AWS_DEFAULT_REGION). Keys are never
passed to the filesystem object: it is pickled to Ray workers and tasks, and a pickled key would travel
through Ray's object store; each node's SDK reads its own environment instead.

Storage that cannot fill silently (the plan of what a run writes is in storage_plan.py; the errors of a
full storage in storage_errors.py, re-exported here): a checkpoint folder that no report made Ray's (an attempt died between
upload and report) is an orphan that Ray never deletes, so `remove_orphans` clears them when an attempt
starts; `check_room` refuses to start a checkpoint that the free space of a local/shared filesystem cannot
hold; `disk_full_error` turns torch's or pyarrow's out-of-space failure into one that names the storage,
and `too_large_error` a file over the filesystem's or the object store's size limit into one that says so
(free space would not help there).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pyarrow.fs as pafs

from raytune_ft.storage.errors import (FileTooLargeError, StorageFullError, disk_full_error,  # noqa: F401
                                       fmt_bytes, is_disk_full, too_large_error)

# Ray Train V2 (ray/train/v2/_internal/constants.py): the checkpoint manager's record of every
# registered checkpoint, rewritten in the run folder at each registration.
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
# a run folder's record of how it ended (driver/run.py writes it; `raytune-ft runs` lists it)
SUMMARY_FILE = "summary.json"
# Ray's checkpoint folder names: checkpoint_<date_str(include_ms=True)>
CHECKPOINT_DIR = re.compile(r"^checkpoint_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}\.\d+$")
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")


# ---------------------------------------------------------------- locations and filesystems


def is_uri(path: str) -> bool:
    return "://" in str(path)


def _endpoint_from_env() -> str | None:
    for key in ENDPOINT_ENV:
        if os.environ.get(key):
            return os.environ[key]
    return None


def s3_filesystem(endpoint: str | None = None, region: str | None = None) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem for `endpoint` (default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; none: AWS).

    `endpoint` may carry a scheme: http://host:port talks plain HTTP (a local S3 server), https or none TLS.
    """
    endpoint = endpoint or _endpoint_from_env()
    region = region or next((os.environ[k] for k in REGION_ENV if os.environ.get(k)), None)
    kwargs: dict[str, Any] = {"allow_bucket_creation": True}
    if endpoint:
        parsed = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs["endpoint_override"] = parsed.netloc
        kwargs["scheme"] = parsed.scheme or "https"
        # a custom endpoint has no region lookup: without one the SDK would ask AWS for the bucket's
        kwargs["region"] = region or "us-east-1"
    elif region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


@dataclass(frozen=True)
class Storage:
    """`tracking.storage_path` resolved: the filesystem and the path of the storage root on it."""
    fs: pafs.FileSystem
    root: str            # path on `fs`: "bucket/prefix" for S3, an absolute path locally
    scheme: str          # "file" or "s3"

    @property
    def remote(self) -> bool:
        return self.scheme != "file"

    def path(self, *parts: str) -> str:
        """The filesystem path of `parts` under the storage root."""
        out = self.root.rstrip("/")
        for p in parts:
            if p:
                out = f"{out}/{str(p).strip('/')}"
        return out

    def uri(self, fs_path: str | None = None) -> str:
        """What a user types for `fs_path` (default: the root): s3://bucket/key, or the local path."""
        p = self.root if fs_path is None else fs_path
        return f"{self.scheme}://{p.lstrip('/')}" if self.remote else p


def resolve(storage_path: str, *, endpoint: str | None = None, create: bool = False) -> Storage:
    """The `Storage` of a `tracking.storage_path`, or of any path/URI below one (a checkpoint's).

    Local paths are made absolute (Ray workers run in other working directories) and `~` expanded.
    """
    path = str(storage_path)
    if path.startswith("file://"):
        path = urllib.parse.urlsplit(path).path
    if not is_uri(path):
        path = os.path.abspath(os.path.expanduser(path))
        if create:
            os.makedirs(path, exist_ok=True)
        return Storage(pafs.LocalFileSystem(), path.rstrip("/") or "/", "file")
    parsed = urllib.parse.urlsplit(path)
    if parsed.scheme not in ("s3", "s3a"):
        raise ValueError(f"storage {path!r}: only local paths and s3://bucket/prefix are supported")
    if not parsed.netloc:
        raise ValueError(f"storage {path!r}: no bucket (s3://bucket/prefix)")
    query = dict(urllib.parse.parse_qsl(parsed.query))
    endpoint = endpoint or query.get("endpoint_override") or query.get("endpoint")
    if endpoint and query.get("scheme") and "://" not in endpoint:
        endpoint = f"{query['scheme']}://{endpoint}"
    fs = s3_filesystem(endpoint, query.get("region"))
    root = f"{parsed.netloc}/{parsed.path.strip('/')}".rstrip("/")
    if create:
        fs.create_dir(root)
    return Storage(fs, root, "s3")


def for_recipe(recipe: Any, *, create: bool = False) -> Storage:
    """The storage of a `Recipe`'s `tracking.storage_path` (typed loosely: this layer sits below the recipe)."""
    return resolve(recipe.tracking.storage_path, endpoint=getattr(recipe.tracking, "storage_endpoint", None),
                   create=create)


def run_storage(recipe: Any) -> tuple[Storage, str]:
    """(storage, the run folder's path on it)."""
    st = for_recipe(recipe)
    return st, st.path(recipe.tracking.run_name)


def open_checkpoint(path_or_uri: str, fs: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path on it, URI) of a checkpoint named by a user (path or URI) or by Ray (fs + path)."""
    if fs is not None:
        scheme = "file" if isinstance(fs, pafs.LocalFileSystem) else (fs.type_name or "s3")
        st = Storage(fs, path_or_uri.rstrip("/"), scheme)
        return fs, st.root, st.uri()
    st = resolve(path_or_uri)
    return st.fs, st.root, st.uri()


# ---------------------------------------------------------------- small files


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def is_dir(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.Directory


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def read_text(fs: pafs.FileSystem, path: str) -> str:
    return read_bytes(fs, path).decode("utf-8")


def read_json(fs: pafs.FileSystem, path: str, default: Any = None) -> Any:
    """The JSON document at `path`, or `default` when there is none."""
    try:
        return json.loads(read_bytes(fs, path))
    except FileNotFoundError:
        return default


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write `path` whole: a reader never sees it half-written (a torn lease read as no owner, and a second
    job took a live run folder). On a file system the bytes go to a temporary file renamed over `path`; an
    object store's PUT replaces the object whole."""
    if not isinstance(fs, pafs.LocalFileSystem):
        with fs.open_output_stream(path) as f:
            f.write(data)
        return
    parent = path.rsplit("/", 1)[0]
    if parent and parent != path:
        fs.create_dir(parent)         # object stores need no folders (and may keep empty ones as markers)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def write_text(fs: pafs.FileSystem, path: str, text: str) -> None:
    write_bytes(fs, path, text.encode("utf-8"))


def write_json(fs: pafs.FileSystem, path: str, obj: Any) -> None:
    write_text(fs, path, json.dumps(obj, indent=2, default=str) + "\n")


def list_files(fs: pafs.FileSystem, path: str, recursive: bool = True) -> list[pafs.FileInfo]:
    """Files (not folders) under `path`; [] when it does not exist."""
    sel = pafs.FileSelector(path.rstrip("/"), allow_not_found=True, recursive=recursive)
    return [i for i in fs.get_file_info(sel) if i.type == pafs.FileType.File]


def tree_bytes(fs: pafs.FileSystem, path: str) -> int:
    """Bytes of all files under `path` (0 when it does not exist)."""
    return sum(i.size or 0 for i in list_files(fs, path))


def download(fs: pafs.FileSystem, src: str, dst: str, *, only: Callable[[str], bool] | None = None,
             chunk: int = 64 << 20) -> list[str]:
    """Copy the files under `src` (or the file `src`) to the local folder `dst`, streamed in `chunk`s, keeping
    relative paths; `only(relative_path)` picks which. Returns the relative paths copied."""
    info = fs.get_file_info(src)
    if info.type == pafs.FileType.File:
        entries = [(os.path.basename(src), src)]
    else:
        base = src.rstrip("/") + "/"
        entries = [(i.path[len(base):] if i.path.startswith(base) else i.base_name, i.path)
                   for i in list_files(fs, src)]
    copied = []
    for rel, full in entries:
        if only is not None and not only(rel):
            continue
        target = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with fs.open_input_stream(full) as fin, open(target, "wb") as fout:
            while True:
                buf = fin.read(chunk)
                if not buf:
                    break
                fout.write(buf)
        copied.append(rel)
    return copied


def upload(local: str, fs: pafs.FileSystem, dst: str) -> None:
    """Copy a local file or folder to `dst` on `fs` (plain local copies skip pyarrow's threads)."""
    if os.path.isfile(local):
        with open(local, "rb") as f:
            write_bytes(fs, dst, f.read())
        return
    fs.create_dir(dst)
    pafs.copy_files(local, dst, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs,
                    use_threads=False)


# ---------------------------------------------------------------- checkpoints of a run


def checkpoint_dirs(fs: pafs.FileSystem, run_path: str) -> list[str]:
    """Names of Ray's checkpoint_* folders in the run folder that hold files, oldest first (names sort by time).

    Read from a recursive listing: an object store may keep listing a deleted folder as an empty prefix.
    """
    base = run_path.rstrip("/") + "/"
    found = set()
    for info in list_files(fs, run_path):
        first = info.path[len(base):].split("/", 1)[0] if info.path.startswith(base) else ""
        if CHECKPOINT_DIR.match(first) and "/" in info.path[len(base):]:
            found.add(first)
    return sorted(found)


@dataclass
class Reported:
    """What Ray Train's checkpoint manager recorded in the run folder."""
    kept: list[str]              # registered checkpoints Ray still keeps, in its order
    latest: str | None           # the one a restart resumes from
    metrics: dict[str, dict]     # checkpoint name -> metrics reported with it

    @property
    def names(self) -> set[str]:
        return set(self.kept) | ({self.latest} if self.latest else set())


# how long a torn read of Ray's record is retried: its rewrite is one small write
SNAPSHOT_WAIT_S = 5.0


class TornRecordError(ValueError):
    """Ray's checkpoint record stayed unreadable (empty or cut short) for longer than a rewrite takes."""


def _read_snapshot(fs: pafs.FileSystem, path: str, wait_s: float) -> Any:
    """Ray's controller rewrites its snapshot in place (open, write, close: not a rename), so a reader on
    another process can meet it empty or half-written; such a read is retried until it parses."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return read_json(fs, path)
        except json.JSONDecodeError as e:
            if time.monotonic() >= deadline:
                raise TornRecordError(f"{path} did not parse for {wait_s:g} s (Ray rewrites it in place): {e}") from e
            time.sleep(0.05)


def reported_checkpoints(fs: pafs.FileSystem, run_path: str, wait_s: float | None = None) -> Reported | None:
    """Ray's record of the run's checkpoints (None: no checkpoint was ever registered). A record caught
    mid-rewrite is read again for up to `wait_s` seconds (default SNAPSHOT_WAIT_S); one that stays torn
    raises TornRecordError."""
    snap = _read_snapshot(fs, f"{run_path.rstrip('/')}/{SNAPSHOT_FILE}",
                          SNAPSHOT_WAIT_S if wait_s is None else wait_s)
    if snap is None:
        return None
    kept, metrics = [], {}
    for r in list(snap.get("checkpoint_results") or []) + list(snap.get("pending_training_results") or []):
        name = r["checkpoint_dir_name"].strip("/")
        if name not in kept:
            kept.append(name)
        metrics[name] = r.get("metrics") or {}
    latest = (snap.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    if latest:
        latest = latest.strip("/")
        metrics.setdefault(latest, snap["latest_checkpoint_result"].get("metrics") or {})
    return Reported(kept=kept, latest=latest, metrics=metrics)


def orphan_checkpoints(fs: pafs.FileSystem, run_path: str, protect: Iterable[str] = (),
                       log: Callable[[str], None] | None = None) -> list[str]:
    """checkpoint_* folders that no report made Ray's (left by an attempt that died between upload and report).

    `protect`: folder names that are never orphans whatever Ray's record says (the one being resumed from).
    With something to protect (an attempt resuming) and no record of Ray's, none: orphans cannot be told
    from the checkpoints Ray keeps (said through `log`). Only safe to act on while no attempt of the run is
    writing: at the start of an attempt, or before `fit`.
    """
    protect = set(protect)
    try:
        reported = reported_checkpoints(fs, run_path)
    except TornRecordError as e:
        if log is not None:
            log(f"the run's record of reported checkpoints is unreadable ({e}): unreported folders left in place")
        return []
    if reported is None and protect:
        if log is not None:
            log("no record of the run's reported checkpoints: unreported folders left in place")
        return []
    keep = (reported.names if reported else set()) | protect
    return [n for n in checkpoint_dirs(fs, run_path) if n not in keep]


def _print(msg: str) -> None:
    print(f"[raytune_ft] {msg}", flush=True)


def remove_orphans(fs: pafs.FileSystem, run_path: str, log: Callable[[str], None] = _print,
                   protect: Iterable[str] = ()) -> list[str]:
    """Delete the orphan checkpoint folders of the run (never one Ray registered, never one in `protect`);
    returns their names."""
    removed = []
    for name in orphan_checkpoints(fs, run_path, protect, log=log):
        path = f"{run_path.rstrip('/')}/{name}"
        size = tree_bytes(fs, path)
        try:
            fs.delete_dir(path)
        except FileNotFoundError:
            continue
        removed.append(name)
        log(f"removed {name}: a checkpoint an earlier attempt uploaded but never reported ({fmt_bytes(size)})")
    return removed


def latest_checkpoint_bytes(fs: pafs.FileSystem, run_path: str) -> int | None:
    """Size of the run's latest registered checkpoint, the best guess for the next one (None: no record,
    or one that stayed unreadable: the caller falls back to its own estimate)."""
    try:
        reported = reported_checkpoints(fs, run_path)
    except TornRecordError:
        return None
    if not reported or not reported.latest:
        return None
    return tree_bytes(fs, f"{run_path.rstrip('/')}/{reported.latest}") or None


# ---------------------------------------------------------------- room for the next checkpoint

def free_bytes(storage: Storage, path: str | None = None) -> int | None:
    """Free bytes where `path` (default: the root) lives, when the filesystem can say; None for object stores."""
    if storage.remote:
        return None
    p = path or storage.root
    while p and not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    try:
        return shutil.disk_usage(p or "/").free
    except OSError:
        return None


def check_room(storage: Storage, needed: int | None, *, path: str | None = None, what: str = "the next checkpoint",
               free_probe: Callable[[Storage, str | None], int | None] | None = None) -> int | None:
    """Raise StorageFullError when the storage says it has less free space than `needed`; return the free bytes."""
    if not needed:
        return None
    free = (free_probe or free_bytes)(storage, path)
    if free is not None and free < needed:
        raise StorageFullError(storage.uri(path), needed, free, what)
    return free
