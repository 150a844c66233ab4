"""The run's storage as a training worker sees it: where the run folder is, what the latest checkpoint says,
orphans of dead attempts cleared, and room for the next checkpoint checked before it is written.

Both loops call `start_attempt` first thing: rank 0 removes the checkpoint folders an earlier attempt
uploaded but never reported (Ray neither tracks nor deletes them), so storage holds at most
`keep_checkpoints` registered folders plus the one being written, however often a worker dies in the
checkpoint window. `SaveGuard` checks, on filesystems that can say their free space, that the next
checkpoint fits (the size of the previous one, or the model's own estimate for the first), all ranks
agreeing before any of them writes, and turns an out-of-space failure while saving into a
StorageFullError that names the storage, the bytes needed and the bytes free.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from raytune_ft.storage import lease

from raytune_ft.storage import fs as storage
from raytune_ft.env import redact_exception
from raytune_ft.train import hooks


def run_location() -> tuple[pafs.FileSystem, str]:
    """(filesystem, run folder path on it) of this Ray Train run."""
    import ray.train

    sc = ray.train.get_context().get_storage()
    return sc.storage_filesystem, sc.experiment_fs_path


def run_storage() -> storage.Storage:
    fs, run_path = run_location()
    return storage.Storage(fs, run_path, "file" if isinstance(fs, pafs.LocalFileSystem) else "s3")


def latest_meta() -> dict:
    """The meta file of the checkpoint this attempt resumes from ({} when none), read where it lies."""
    import ray.train

    from raytune_ft.train.checkpoint_meta import read_meta_at

    ckpt = ray.train.get_checkpoint()
    return read_meta_at(ckpt.filesystem, ckpt.path) if ckpt is not None else {}


def finished_step() -> int | None:
    """The step of the run's final checkpoint when that is the latest one (the run is complete), else None."""
    meta = latest_meta()
    return int(meta.get("step") or 0) if meta.get("final") else None


def report_if_finished(log) -> bool:
    """When the run's latest checkpoint is its final one (a finished run submitted again, or a worker lost
    after the final checkpoint was registered), report the run done and return True: that checkpoint stays
    its result, exported and registered once. `log`: the loop's WorkerLog."""
    import ray.train

    step = finished_step()
    if step is None:
        return False
    log.info(f"the run already ended at step {step} (its final checkpoint is the latest): nothing to train; "
             "use a new tracking.run_name to train again")
    ray.train.report({"step": step, "done": True, "already_finished": True})
    log.close()
    return True


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def start_attempt(rank: int, lease_token: str | None, log: Callable[[str], None] = storage._print) -> list[str]:
    """Rank 0 removes orphan checkpoint folders of earlier attempts (never one Ray registered); all wait.

    Safe here: no attempt of this run is writing, the previous one's workers are gone, and the run folder's
    lease is still this job's (checked first: RunFolderInUse when another job took it over), so no other
    job's attempt is writing either. `lease_token`: the lease's token, from the loop's config (None: none is
    checked)."""
    import ray.train

    removed: list[str] = []
    if rank == 0:
        fs, run_path = run_location()
        lease.check_owner(fs, run_path, lease_token, uri=run_storage().uri())
        ckpt = ray.train.get_checkpoint()
        resuming = ckpt.path.rstrip("/").rsplit("/", 1)[-1] if ckpt is not None else None
        try:
            removed = storage.remove_orphans(fs, run_path, log=log, protect=[resuming] if resuming else [])
        except (OSError, ValueError) as e:  # housekeeping: a storage hiccup or a torn record must not stop the run
            log(f"could not clear unreported checkpoints: {redact_exception(e)}")
    _barrier()
    return removed


def _probe(st: storage.Storage, step: int) -> int | None:
    return hooks.value("storage.free_bytes", storage.free_bytes(st), step=step)


def _same_device(a: str, b: str) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def model_checkpoint_bytes(params) -> int:
    """Bytes DCP writes for these parameters with AdamW: the weights and two moments of their dtype."""
    return sum(3 * p.numel() * p.element_size() for p in params)


class SaveGuard:
    """Room for the next checkpoint, checked before writing it; out-of-space failures reported in plain words."""

    def __init__(self, rank: int, device: torch.device, first_estimate: int, export_estimate: int = 0):
        self.rank, self.device = rank, device
        self.first_estimate, self.export_estimate = int(first_estimate), int(export_estimate)
        self.st = run_storage()
        self.needed: int | None = None
        self.free: int | None = None

    def _decide(self, step: int, final: bool) -> tuple[int, int, int]:
        free = _probe(self.st, step)
        extra = self.export_estimate if final else 0
        if free is None:   # the storage cannot say (an object store): no listing of the last checkpoint for nothing
            return self.first_estimate + extra, -1, 0
        needed = (storage.latest_checkpoint_bytes(self.st.fs, self.st.root) or self.first_estimate) + extra
        if not self.st.remote and _same_device(tempfile.gettempdir(), self.st.root):
            needed *= 2   # each rank stages its part on the same disk before Ray copies it into the run folder
        return needed, free, int(free < needed)

    def check(self, step: int, final: bool = False) -> None:
        """Raise StorageFullError on every rank when the storage says the step's checkpoint will not fit."""
        decision = torch.zeros(3, dtype=torch.float64,
                               device=self.device if self.device.type == "cuda" else "cpu")
        if self.rank == 0:
            decision[:] = torch.tensor(self._decide(step, final), dtype=torch.float64)
        if dist.is_initialized():
            dist.broadcast(decision, src=0)
        needed, free, full = (int(x) for x in decision.tolist())
        self.needed, self.free = needed, (None if free < 0 else free)
        if full:
            raise storage.StorageFullError(self.st.uri(), needed, self.free,
                                           what=f"the step-{step} checkpoint{' with its export' if final else ''}")

    def check_first(self, step: int, t) -> None:
        """Check the attempt's first save before any training: the next periodic checkpoint, or the final one
        where the run ends before that (`t`: the recipe's train section). Nothing when the attempt saves nothing."""
        nxt = step + t.checkpoint_every
        if t.max_steps and nxt >= t.max_steps:
            if getattr(t, "save_final", True):
                self.check(t.max_steps, final=True)
            return
        self.check(nxt)

    def write(self, fn: Callable[[], Any], step: int) -> Any:
        """Run a save or an upload; an out-of-space failure in it comes out as a StorageFullError."""
        return write_checkpoint(fn, self.st, step, self.needed, self.free)


def write_checkpoint(fn: Callable[[], Any], st: "storage.Storage", step: int, needed: int | None = None,
                     free: int | None = None) -> Any:
    """Run the step's save or upload to `st`; an out-of-space failure in it comes out as a
    StorageFullError naming the storage (with the bytes needed and free where they are known), a file over
    the storage's size limit as a FileTooLargeError."""
    try:
        return fn()
    except BaseException as e:
        what = f"the step-{step} checkpoint"
        err = (storage.disk_full_error(e, st.uri(), needed, free, what=what)
               or storage.too_large_error(e, st.uri(), what))
        if err is not None and err is not e:
            raise err from e
        raise
