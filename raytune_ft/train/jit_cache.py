"""The JIT caches of a worker in one fingerprinted folder, shared through the run's storage.

On a fresh GPU node the start-up kernel check and the first step spend minutes compiling Triton and
tilelang kernels, autotuning flash-linear-attention's and (with `train.compile`) running Inductor. All of
it lands in four caches, and the kernel check keeps its all-pass verdicts beside them
(models/kernel_verdicts.py); pointed at one folder on a local disk that outlives the job, a re-submit on the
same node starts warm. The folder's name is a fingerprint (train/jit_fingerprint.py: the GPU model, the
driver, the compilers' and kernel libraries' versions, the model's widths), so a cache is never read by a
toolchain or a GPU it was not built for.

A second node has its own disk: after the first step rank 0 packs the folder into one tar in the storage
(`<storage>/jit_cache/<fingerprint>.tar`) with the fingerprint beside it (`<fingerprint>.json`), and every node
with the same fingerprint unpacks it at start, before anything compiles, when it has not yet. A set whose
fingerprint differs is never loaded: a node that finds none of its own says in one line what the nearest
set was built for, and compiles its own. One file, written once per run and only when something new was
compiled, keeps this cheap on object storage. The cache only ever saves time: any failure here is logged
and the run goes on without it.

Python's own bytecode travels the same way where the job keeps it (env.keep_bytecode: an image that writes
none, `<cache_dir>/bytecode`): a node with empty caches otherwise compiles Ray, MLflow, transformers and torch
from source in the driver and in every worker, ~30 s of a fresh node's start. Its set (`BytecodeSet`,
`<storage>/jit_cache/bytecode/`) is keyed by the interpreter and the large packages' versions; the driver
unpacks it before its own imports (`restore_bytecode`), rank 0 saves it with the JIT set. A module compiled
from other sources is never used: Python checks each file against its source's size and time and compiles
again where they differ.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tarfile
import tempfile
import time
from typing import Callable

from raytune_ft import compat
from raytune_ft.models.kernel_verdicts import VERDICTS_ENV
from raytune_ft.train.jit_fingerprint import Fingerprint, fingerprint, model_widths

# the recipe names no folder: a per-user cache on each node's local disk
DEFAULT_ROOT = "~/.cache/raytune_ft/jit"
# cache variable -> its sub-folder; FLA_CACHE_RESULTS=1 makes flash-linear-attention keep its autotune
# choices in the Triton cache, so they travel with it
CACHE_DIRS = {"TRITON_CACHE_DIR": "triton", "TILELANG_CACHE_DIR": "tilelang", "TORCHINDUCTOR_CACHE_DIR": "inductor",
              VERDICTS_ENV: "kernel_check"}       # the kernel check's all-pass verdicts (models/kernel_verdicts.py)
FLA_CACHE_ENV = "FLA_CACHE_RESULTS"
_STATE = ".raytune_jit.json"      # in the folder: the tar it was filled from and the contents uploaded last


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

    SETS = "jit_cache"          # the sets' folder under the storage root
    LABEL = "JIT cache"

    def __init__(self, folder: str, remote: tuple | None, fp: Fingerprint):
        self.folder = folder
        self.fp = fp
        self.fs, self.remote_dir = remote if remote else (None, None)
        self.sets_dir = f"{self.remote_dir.rstrip('/')}/{self.SETS}" if remote else None
        self.tar_path = f"{self.sets_dir}/{fp.name}.tar" if remote else None
        self.key_path = f"{self.sets_dir}/{fp.name}.json" if remote else None
        self.restored: dict | None = None     # what `restore` unpacked: files, MiB, seconds (None: nothing)
        self.companions: list[JitCache] = []  # saved with this one (the node's bytecode set)

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
        """Unpack the storage's set of this node's fingerprint into the folder, once per tar and node; a set
        whose stored fingerprint is not this node's is said in one line and never loaded."""
        if self.fs is None:
            return
        with _node_lock(self.folder + ".lock"):
            stamp = self._remote_stamp()
            if stamp is None:
                self._say_no_set(log)
                return
            if self._state().get("restored") == stamp:     # this tar, its key checked when it was unpacked or saved
                return
            built_for = self._stored_key(self.key_path)
            if built_for != self.fp:     # no key beside the tar, or another under the same name: never loaded
                what = "; ".join(self.fp.differences(built_for)) if built_for else "no fingerprint beside it"
                log(f"{self.LABEL}: {self.tar_path} not loaded: {what}")
                return
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="raytune_jit_") as tmp:
                local = os.path.join(tmp, "cache.tar")
                with self.fs.open_input_stream(self.tar_path) as src, open(local, "wb") as dst:
                    while chunk := src.read(64 << 20):
                        dst.write(chunk)
                fetched = time.perf_counter() - start
                with tarfile.open(local) as tar:
                    tar.extractall(self.folder, filter="data")     # no path leaves the folder
                size = os.path.getsize(local)
            self._write_state(restored=stamp, uploaded=_contents(self.folder))
            self.restored = {"files": len(_files(self.folder)), "mib": round(size / 2**20, 1),
                             "download_s": round(fetched, 2), "restore_s": round(time.perf_counter() - start, 2)}
            r = self.restored
            log(f"{self.LABEL}: restored {r['files']} files ({r['mib']} MiB) from {self.tar_path} in "
                f"{r['restore_s']} s ({r['download_s']} s of it the download)")

    def _stored_key(self, path: str) -> Fingerprint | None:
        """The fingerprint a set's JSON holds; None when there is none or it is not one."""
        try:
            with self.fs.open_input_stream(path) as f:
                return Fingerprint.from_dict(json.loads(f.read()))
        except (OSError, ValueError):
            return None

    def _say_no_set(self, log: Callable[[str], None]) -> None:
        """One line when the storage holds sets, none of them this node's: what the nearest was built for."""
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.sets_dir, allow_not_found=True))
        keys = [k for i in infos if i.path.endswith(".json") and (k := self._stored_key(i.path)) is not None]
        if not keys:
            return
        nearest = min(keys, key=lambda k: len(self.fp.differences(k)))
        log(f"{self.LABEL}: none of the {len(keys)} set(s) in {self.sets_dir} is this node's ({self.fp.name}); "
            f"not loaded: the nearest, {nearest.name}, was built for {'; '.join(self.fp.differences(nearest))}")

    def save(self, log: Callable[[str], None]) -> bool:
        """Pack the folder into the storage's tar when it holds anything not uploaded yet (rank 0, after
        the first step), then the companions'. True when this one uploaded; never raises."""
        saved = self._save(log)
        for other in self.companions:
            other.save(log)
        return saved

    def _save(self, log: Callable[[str], None]) -> bool:
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
                self._upload(local, self.tar_path)
                with open(os.path.join(tmp, "key.json"), "w") as f:
                    json.dump(self.fp.as_dict(), f, indent=1)
                self._upload(f.name, self.key_path)     # after the tar: a set is whole once its key is there
            self._write_state(uploaded=contents, restored=self._remote_stamp())
            log(f"{self.LABEL}: saved {len(files)} files to {self.tar_path}")
            return True
        except Exception as e:  # noqa: BLE001 - the cache only saves time
            _skipped(log, "not saved", e, self.LABEL)
            return False

    def _upload(self, local: str, path: str) -> None:
        import pyarrow.fs as pafs

        if isinstance(self.fs, pafs.LocalFileSystem):
            self.fs.create_dir(self.sets_dir)
        # written under another name and then renamed, so a reader never sees half a file on a shared
        # filesystem (an object store makes the whole object visible at once anyway)
        partial = path + ".partial" if isinstance(self.fs, pafs.LocalFileSystem) else path
        with open(local, "rb") as src, self.fs.open_output_stream(partial) as dst:
            while chunk := src.read(64 << 20):
                dst.write(chunk)
        if partial != path:
            self.fs.move(partial, path)


def _skipped(log: Callable[[str], None], what: str, e: BaseException, label: str = JitCache.LABEL) -> None:
    from raytune_ft.env import redact_exception

    log(f"{label} {what} ({redact_exception(e)}); the run goes on without it")


def open_cache(root: str, fp: Fingerprint, *, remote: tuple | None,
               log: Callable[[str], None]) -> JitCache | None:
    """Point the cache variables the user did not set at `<root>/<fingerprint>/...` and fill the folder
    from `remote` (`(filesystem, storage folder)`) when a set of the same fingerprint is there. None when the
    folder cannot be made; never raises."""
    try:
        folder = os.path.join(os.path.abspath(os.path.expanduser(root)), fp.name)
        for var, sub in CACHE_DIRS.items():
            os.makedirs(os.path.join(folder, sub), exist_ok=True)
            if os.environ.get(var) is None or _inherited_default(var, os.environ[var]):
                os.environ[var] = os.path.join(folder, sub)
        os.environ.setdefault(FLA_CACHE_ENV, "1")
    except Exception as e:  # noqa: BLE001
        _skipped(log, "off", e)
        return None
    cache = JitCache(folder, remote, fp)
    if os.environ.get(COMPILE_KEYS_ENV):
        _log_compile_keys(os.path.join(folder, "keys"))
    try:
        cache.restore(log)
    except Exception as e:  # noqa: BLE001 - a torn or unreadable tar: start cold
        _skipped(log, "not restored", e)
    return cache


class BytecodeSet(JitCache):
    """The node's bytecode folder (`<cache root>/bytecode`) and its set in the storage (module docstring)."""

    SETS = "jit_cache/bytecode"
    LABEL = "Bytecode cache"


# the packages whose modules make most of a job's bytecode: a set built under other versions is not loaded
BYTECODE_VERSIONED = ("torch", "transformers", "ray", "pyarrow", "mlflow", "mlflow-skinny", "datasets", "trl", "peft")


def bytecode_fingerprint(versions: dict[str, str] | None = None) -> Fingerprint:
    """The interpreter (its bytecode tag and machine) and the versions of BYTECODE_VERSIONED."""
    import platform
    import sys

    from raytune_ft.env import package_versions

    versions = package_versions(BYTECODE_VERSIONED, "none") if versions is None else versions
    return Fingerprint(f"bytecode {sys.implementation.cache_tag} {platform.machine()}", "none",
                       tuple(sorted(versions.items())), "python bytecode")


def open_bytecode(root: str, remote: tuple | None, log: Callable[[str], None],
                  fp: Fingerprint | None = None) -> BytecodeSet | None:
    """The bytecode set of `root`'s folder, filled from `remote` where the storage holds one of this node's
    fingerprint; None where this process keeps no bytecode there (Python writes its own, bytecode_cache off, or
    a PYTHONPYCACHEPREFIX of the user's). Never raises."""
    from raytune_ft.env import bytecode_folder

    folder = bytecode_folder(root)
    if os.environ.get("PYTHONPYCACHEPREFIX") != folder:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        cache = BytecodeSet(folder, remote, fp or bytecode_fingerprint())
        cache.restore(log)
    except Exception as e:  # noqa: BLE001 - only a faster start is lost
        _skipped(log, "not restored", e, BytecodeSet.LABEL)
        return None
    return cache


def restore_bytecode(recipe, log: Callable[[str], None]) -> BytecodeSet | None:
    """The driver's part, before its own imports: the storage's bytecode set of this node, unpacked into the
    folder keep_bytecode pointed Python at (cli.py). Ray's processes and the workers started on this node
    after it find it there."""
    try:
        from raytune_ft.storage import fs as storage

        st = storage.for_recipe(recipe)
        remote = (st.fs, st.root)
    except Exception as e:  # noqa: BLE001
        _skipped(log, "not shared", e, BytecodeSet.LABEL)
        return None
    return open_bytecode(cache_root(recipe), remote, log)


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


def for_worker(recipe, device, log, startup=None) -> JitCache | None:
    """`open_cache` as a training loop calls it on each Ray Train worker: the recipe's `train.cache_dir`
    (default: DEFAULT_ROOT), this worker's fingerprint (its GPU, the recipe's model), the run's storage root.
    `startup`: the worker's start-up clock (train/startup_clock.py), told what a restored set brought."""
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
    cache = open_cache(cache_root(recipe), fingerprint(device_name, model=model_widths(recipe)), remote=remote,
                       log=log)
    bytecode = open_bytecode(cache_root(recipe), remote, log) if cache is not None else None
    if bytecode is not None:      # a node the driver is not on fills its folder here; rank 0 saves it with the set
        cache.companions.append(bytecode)
    if cache is not None and device_name:     # a CPU run compiles nothing worth a line
        log(f"JIT caches in {cache.folder}")
    if cache is not None and cache.restored and startup is not None:    # a node that started from the storage's set
        startup.note("jit_cache", cache.restored)
    return cache
