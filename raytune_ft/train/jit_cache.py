"""The JIT caches of a worker in one fingerprinted folder, shared through the run's storage.

On a fresh GPU node the start-up kernel check and the first step spend minutes compiling Triton and
tilelang kernels, autotuning flash-linear-attention's and (with `train.compile`) running Inductor. All of
it lands in four caches; pointed at one folder on a local disk that outlives the job, a re-submit on the
same node starts warm. The folder's name is a fingerprint of the compilers' versions and the GPU, so a
cache is never read by a toolchain or a GPU it was not built for.

A second node has its own disk: after the first step rank 0 packs the folder into one tar in the storage
(`<storage>/jit_cache/<fingerprint>.tar`), and every node unpacks it at start when it has not yet. One
file, written once per run and only when something new was compiled, keeps this cheap on object storage.
The cache only ever saves time: any failure here is logged and the run goes on without it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tarfile
import tempfile
from typing import Callable

from raytune_ft import compat

# the recipe names no folder: a per-user cache on each node's local disk
DEFAULT_ROOT = "~/.cache/raytune_ft/jit"
# cache variable -> its sub-folder; FLA_CACHE_RESULTS=1 makes flash-linear-attention keep its autotune
# choices in the Triton cache, so they travel with it
CACHE_DIRS = {"TRITON_CACHE_DIR": "triton", "TILELANG_CACHE_DIR": "tilelang", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
FLA_CACHE_ENV = "FLA_CACHE_RESULTS"
VERSIONED = ("torch", "triton", "flash-linear-attention", "tilelang")
_STATE = ".raytune_jit.json"      # in the folder: the tar it was filled from and the contents uploaded last


def installed_versions() -> dict[str, str]:
    from raytune_ft.env import package_versions

    return package_versions(VERSIONED, "none")


def fingerprint(device_name: str | None, versions: dict[str, str] | None = None) -> str:
    """`<gpu>-<hash>`: the GPU's name, readable, and a hash of it with the compilers' versions."""
    versions = installed_versions() if versions is None else versions
    gpu = device_name or "cpu"
    digest = hashlib.sha256(json.dumps([gpu, sorted(versions.items())]).encode()).hexdigest()[:12]
    return f"{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}-{digest}"


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder)
            if rel != _STATE and not n.endswith(".lock"):
                out.append(rel)
    return sorted(out)


def _contents(folder: str) -> str:
    """A digest of the folder's file names and sizes: changes when anything new was compiled."""
    h = hashlib.sha256()
    for rel in _files(folder):
        with contextlib.suppress(OSError):
            h.update(f"{rel}\0{os.path.getsize(os.path.join(folder, rel))}\n".encode())
    return h.hexdigest()


@contextlib.contextmanager
def _node_lock(path: str):
    """One process per node at a time (the workers of a node share the folder)."""
    import fcntl

    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class JitCache:
    """The folder of this worker's JIT caches and, when the run has storage, the tar shared there."""

    def __init__(self, folder: str, remote: tuple | None, tar_name: str):
        self.folder = folder
        self.fs, self.remote_dir = remote if remote else (None, None)
        self.tar_path = f"{self.remote_dir.rstrip('/')}/jit_cache/{tar_name}" if remote else None

    def _state(self) -> dict:
        try:
            with open(os.path.join(self.folder, _STATE)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _write_state(self, **updates) -> None:
        state = {**self._state(), **updates}
        with open(os.path.join(self.folder, _STATE), "w") as f:
            json.dump(state, f)

    def _remote_stamp(self) -> str | None:
        """Size and modification time of the tar on the storage (None: there is none)."""
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self.tar_path)
        if info.type != pafs.FileType.File:
            return None
        return f"{info.size}:{info.mtime_ns}"

    def restore(self, log: Callable[[str], None]) -> None:
        """Unpack the storage's tar into the folder, once per tar and node."""
        if self.fs is None:
            return
        with _node_lock(self.folder + ".lock"):
            stamp = self._remote_stamp()
            if stamp is None or self._state().get("restored") == stamp:
                return
            with tempfile.TemporaryDirectory(prefix="raytune_jit_") as tmp:
                local = os.path.join(tmp, "cache.tar")
                with self.fs.open_input_stream(self.tar_path) as src, open(local, "wb") as dst:
                    while chunk := src.read(64 << 20):
                        dst.write(chunk)
                with tarfile.open(local) as tar:
                    tar.extractall(self.folder, filter="data")     # no path leaves the folder
            self._write_state(restored=stamp, uploaded=_contents(self.folder))
            log(f"JIT cache: restored {len(_files(self.folder))} files from {self.tar_path}")

    def save(self, log: Callable[[str], None]) -> bool:
        """Pack the folder into the storage's tar when it holds anything not uploaded yet (rank 0, after
        the first step). True when it uploaded; never raises."""
        if self.fs is None:
            return False
        try:
            contents = _contents(self.folder)
            if not _files(self.folder) or self._state().get("uploaded") == contents:
                return False      # nothing compiled (a CPU run), or nothing new since the last upload
            with tempfile.TemporaryDirectory(prefix="raytune_jit_") as tmp:
                local = os.path.join(tmp, "cache.tar")
                files = _files(self.folder)
                with tarfile.open(local, "w") as tar:
                    for rel in files:
                        with contextlib.suppress(OSError):   # a file a compiler is replacing right now
                            tar.add(os.path.join(self.folder, rel), arcname=rel, recursive=False)
                self._upload(local)
            self._write_state(uploaded=contents, restored=self._remote_stamp())
            log(f"JIT cache: saved {len(files)} files to {self.tar_path}")
            return True
        except Exception as e:  # noqa: BLE001 - the cache only saves time
            _skipped(log, "not saved", e)
            return False

    def _upload(self, local: str) -> None:
        import pyarrow.fs as pafs

        parent = self.tar_path.rsplit("/", 1)[0]
        if isinstance(self.fs, pafs.LocalFileSystem):
            self.fs.create_dir(parent)
        # written under another name and then renamed, so a reader never sees half a tar on a shared
        # filesystem (an object store makes the whole object visible at once anyway)
        partial = self.tar_path + ".partial" if isinstance(self.fs, pafs.LocalFileSystem) else self.tar_path
        with open(local, "rb") as src, self.fs.open_output_stream(partial) as dst:
            while chunk := src.read(64 << 20):
                dst.write(chunk)
        if partial != self.tar_path:
            self.fs.move(partial, self.tar_path)


def _skipped(log: Callable[[str], None], what: str, e: BaseException) -> None:
    from raytune_ft.env import redact_exception

    log(f"JIT cache {what} ({redact_exception(e)}); the run goes on without it")


def open_cache(root: str, device_name: str | None, *, remote: tuple | None,
               log: Callable[[str], None]) -> JitCache | None:
    """Point the cache variables the user did not set at `<root>/<fingerprint>/...` and fill the folder
    from `remote` (`(filesystem, storage folder)`) when a tar is there. None when the folder cannot be
    made; never raises."""
    fp = fingerprint(device_name)
    try:
        folder = os.path.join(os.path.abspath(os.path.expanduser(root)), fp)
        for var, sub in CACHE_DIRS.items():
            os.makedirs(os.path.join(folder, sub), exist_ok=True)
            if os.environ.get(var) is None or _inherited_default(var, os.environ[var]):
                os.environ[var] = os.path.join(folder, sub)
        os.environ.setdefault(FLA_CACHE_ENV, "1")
    except Exception as e:  # noqa: BLE001
        _skipped(log, "off", e)
        return None
    cache = JitCache(folder, remote, f"{fp}.tar")
    if os.environ.get(COMPILE_KEYS_ENV):
        _log_compile_keys(os.path.join(folder, "keys"))
    try:
        cache.restore(log)
    except Exception as e:  # noqa: BLE001 - a torn or unreadable tar: start cold
        _skipped(log, "not restored", e)
    return cache


def _inherited_default(var: str, value: str) -> bool:
    """Whether `value` is Inductor's own default folder rather than a user's choice. Inductor writes its
    default into TORCHINDUCTOR_CACHE_DIR the first time a process asks for its cache folder, and the processes
    it starts inherit it: a command-line run's driver that touched Inductor before `ray.init` handed it to its
    local workers, whose compiled graphs then went there instead of this folder, and the next `ray job submit`
    (workers started by the cluster, without it) found none of them."""
    if var != "TORCHINDUCTOR_CACHE_DIR":
        return False
    default_cache_dir = compat.TORCH_INDUCTOR_CACHE_DIR.load()
    return os.path.abspath(value) == os.path.abspath(default_cache_dir())


# a diagnosis: "1" writes the details of each torch.compile cache key this process computes (Inductor's FX graph
# key: the graph, its inputs, the configs, user-defined Triton kernels' source and configs) to
# <folder>/keys/<pid>.log, so two runs' keys can be compared where one missed the other's entries
COMPILE_KEYS_ENV = "RAYTUNE_COMPILE_KEYS"


def _log_compile_keys(folder: str) -> None:
    import logging

    os.makedirs(folder, exist_ok=True)
    handler = logging.FileHandler(os.path.join(folder, f"{os.getpid()}.log"))
    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
        lg.propagate = False        # into the file only: thousands of lines per graph


def cache_root(recipe) -> str:
    """The folder of a recipe's caches on each node: `train.cache_dir`, or the per-user default."""
    return getattr(recipe.train, "cache_dir", None) or DEFAULT_ROOT


def for_worker(recipe, device, log) -> JitCache | None:
    """`open_cache` as a training loop calls it on each Ray Train worker: the recipe's `train.cache_dir`
    (default: DEFAULT_ROOT), this worker's GPU, the run's storage root."""
    device_name = None
    try:
        import torch

        if device.type == "cuda":
            device_name = torch.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001
        pass
    remote = None
    try:
        from raytune_ft.train.ckpt_storage import run_location

        fs, run_path = run_location()
        remote = (fs, run_path.rstrip("/").rsplit("/", 1)[0])    # beside the runs: every run shares it
    except Exception as e:  # noqa: BLE001
        _skipped(log, "not shared", e)
    cache = open_cache(cache_root(recipe), device_name, remote=remote,
                       log=log)
    if cache is not None and device_name:     # a CPU run compiles nothing worth a line
        log(f"JIT caches in {cache.folder}")
    return cache
