"""The FSDP2 loop's saves, synchronous or in the background (`train.async_checkpoint`).

A save writes every part of the train state (train/state.py) into a local folder, copies this rank's files
into a checkpoint folder of the run's storage, then reports that folder to Ray Train, which registers it
once every rank has reported. In the background mode the training loop only waits for the state to be
staged (copied to host memory: pinned on a GPU, so the copy runs at the link's speed); DCP's writer, the
train-state file and the upload then run in a thread of their own while training goes on (torchtitan's
asynchronous checkpointing, with DCP's `async_save`).

What keeps a background save safe:
- At most one is in flight: the next save, and the end of the run, wait for it first (the staging buffers
  are reused from one save to the next, so they must not be overwritten while a write reads them).
- Nothing reaches Ray Train before the files are complete: the report is made from the training thread,
  at the first step boundary where every rank's save has finished (a flag all-reduced on a CPU group, so
  the GPU never waits for it), with the folder already on storage. A worker dying before that leaves an
  unreported folder, which the next attempt clears; it resumes from the last registered checkpoint.
- A background save that failed is raised at that step boundary, on every rank.
- Its collectives (DCP's plan exchange) go through a gloo group of their own, never the training's.

Each save logs the seconds the training loop was held (`checkpoint/blocked_s`), and a background one the
seconds its write and upload took (`checkpoint/background_s`), to compare the two modes.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raytune_ft import compat
from raytune_ft.train import checkpoint as ckpt_io
from raytune_ft.train import dcp_io, hooks
from raytune_ft.train.ckpt_storage import SaveGuard
from raytune_ft.train.state import TrainState


def async_enabled(setting: str, device: torch.device) -> bool:
    """`train.async_checkpoint`: "auto" saves in the background on GPU workers only (a CPU worker's writer
    thread would take the cores its training runs on), "on" / "off" everywhere."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


@dataclass(frozen=True)
class SaveSettings:
    """How this worker saves: its rank and device, whether in the background (`async_enabled`), and the
    fields of raytune_meta.json every checkpoint of the run shares (job, model, run name)."""
    rank: int
    device: torch.device
    background: bool
    meta: dict


@dataclass
class _InFlight:
    step: int
    name: str
    metrics: dict
    future: Future
    started: float


class Checkpointer:
    """Saves `state` for the loop. Every method is a collective: every rank calls it at the same step."""

    def __init__(self, state: TrainState, guard: SaveGuard, log, settings: SaveSettings, *, storage=None,
                 report=None):
        """`storage` (Ray Train's storage context) and `report(metrics, checkpoint, folder_name)`: Ray Train's
        own by default."""
        self.state, self.guard, self.log = state, guard, log
        self.rank, self.device, self.meta = settings.rank, settings.device, settings.meta
        self.background = background = settings.background
        if storage is None:
            import ray.train

            storage = ray.train.get_context().get_storage()
        self.storage, self.report = storage, report or _ray_report
        distributed = dist.is_initialized()
        # DCP's exchange of save plans and the done flag, each on a CPU group of its own: the writer thread's
        # collectives must not interleave with the training thread's
        self.save_group = dist.new_group(backend="gloo") if distributed else None
        self.flag_group = dist.new_group(backend="gloo") if distributed and background else None
        self.in_flight: _InFlight | None = None
        self.stager = self.writer = None
        self._close_copier = lambda: None
        self._cuda = self.device.type == "cuda"
        if background:
            self.stager = self._new_stager()
            self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raytune-checkpoint")

    def _new_stager(self):
        """One DCP stager for the run: its host buffers (pinned on a GPU) are allocated by the first save
        and reused by the next ones, not allocated again inside every save while the loop waits."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=self._cuda, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=self._cuda))
        self._close_copier = compat.keep_stager_buffers(stager)    # a torch whose stager closes after each stage
        return stager

    def save(self, metrics: dict, *, final: bool = False, export=None) -> float:
        """Save the state at its step and report it with `metrics` (now, or in the background mode once its
        files are complete). `export(folder)`: writes the final checkpoint's hf/ folder (a collective).
        The final save is synchronous. Returns the seconds the loop was held."""
        t0 = time.perf_counter()
        self.wait()                            # at most one in flight
        step = self.state.step
        self.guard.check(step, final=final)
        name = self._folder_name()
        folder = tempfile.mkdtemp(prefix="raytune_ckpt_")
        train_state = self.state.state_dict()  # a copy made now: the loop goes on changing the parts
        meta = self._meta(step, final) if self.rank == 0 else None
        self.log.info(f"checkpoint at step {step}{' (final, with hf/ export)' if final else ''}"
                      f"{' (written in the background)' if self.background and not final else ''}")
        background = self.background and not final
        try:
            if background:
                staged = self.guard.write(lambda: self._stage(folder), step)
            else:
                self.guard.write(lambda: dcp_io.save(folder, self.state.sharded, self.rank,
                                                     process_group=self.save_group), step)
                if export is not None:
                    self.guard.write(lambda: export(os.path.join(folder, "hf")), step)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if background:
            started = time.perf_counter()
            future = self.writer.submit(lambda: (self._complete(folder, name, step, staged, train_state, meta),
                                                 time.perf_counter()))
            self.in_flight = _InFlight(step, name, dict(metrics), future, started)
        else:
            persisted = self._complete(folder, name, step, None, train_state, meta)
            self._report(metrics, persisted, name, step)
        blocked = time.perf_counter() - t0
        self.log.info(f"checkpoint at step {step}: the loop was held {blocked:.2f} s")
        self.log.log_metrics({"checkpoint/blocked_s": blocked}, step)
        return blocked

    def poll(self) -> None:
        """At a step boundary: report the background save once every rank's is complete; raise its error
        (on every rank) when one failed. Nothing when no save is in flight."""
        if self.in_flight is not None and self._agreed_done(wait=False):
            self._report_in_flight()

    def wait(self) -> None:
        """Wait for the background save in flight, if any, and report it (the next save, the run's end)."""
        if self.in_flight is not None:
            self._agreed_done(wait=True)
            self._report_in_flight()

    def close(self) -> None:
        """Stop the writer thread (after `wait`, or on the way out of a failed attempt) and free the staging
        buffers."""
        if self.writer is not None:
            self.writer.shutdown(wait=False, cancel_futures=True)
        if self.stager is not None:
            self.stager.close()
            self._close_copier()

    # ------------------------------------------------------------------ parts of a save

    def _folder_name(self) -> str:
        """The checkpoint folder's name, rank 0's (Ray's own naming, which the orphan clean-up knows)."""
        name = [self.storage.make_default_checkpoint_dir_name() if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(name, src=0, group=self.save_group)
        return name[0]

    def _stage(self, folder: str) -> Future:
        """Copy the DCP parts to host memory now; DCP writes them to `folder` in its own thread."""
        import torch.distributed.checkpoint as dcp

        return dcp.async_save({"app": dcp_io.ShardedTrainState(self.state.sharded, self.rank)},
                              checkpoint_id=os.path.join(folder, dcp_io.DCP_DIR), process_group=self.save_group,
                              async_stager=self.stager)

    def _complete(self, folder: str, name: str, step: int, staged: Future | None, train_state: dict,
                  meta: dict | None):
        """The rest of a save, in the writer thread for a background one: DCP's write finished, the
        train-state and meta files, this rank's files uploaded into the run's folder `name`. Returns the
        persisted checkpoint."""
        import ray.train

        try:
            if staged is not None:
                self.guard.write(staged.result, step)
            ckpt_io.write_train_state(folder, self.rank, train_state)
            if meta is not None:
                ckpt_io.write_meta(folder, meta)
            hooks.fire("checkpoint.written", step=step, rank=self.rank)
            persisted = self.guard.write(lambda: self.storage.persist_current_checkpoint(
                ray.train.Checkpoint.from_directory(folder), name), step)
            hooks.fire("checkpoint.uploaded", step=step, rank=self.rank)
            return persisted
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _agreed_done(self, *, wait: bool) -> bool:
        """Whether every rank's background save has finished (`wait`: wait for this rank's first); raises,
        on every rank, when one of them failed."""
        fut = self.in_flight.future
        if wait:
            try:
                fut.result()
            except BaseException:   # noqa: BLE001 - raised below, once every rank knows
                pass
        mine = fut.exception() if fut.done() else None
        flags = torch.tensor([0 if fut.done() else 1, 1 if mine is not None else 0], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.flag_group)
        not_done, failed = (int(x) for x in flags.tolist())
        if failed:
            step, self.in_flight = self.in_flight.step, None
            if mine is not None:
                raise mine
            raise RuntimeError(f"the step-{step} checkpoint failed in the background on another rank")
        return not not_done

    def _report_in_flight(self) -> None:
        done, self.in_flight = self.in_flight, None
        persisted, finished = done.future.result()
        background = finished - done.started
        self.log.info(f"checkpoint at step {done.step}: written and uploaded in the background in {background:.1f} s")
        self.log.log_metrics({"checkpoint/background_s": background}, done.step)
        self._report(done.metrics, persisted, done.name, done.step)

    def _report(self, metrics: dict, persisted, name: str, step: int) -> None:
        self.log.flush()       # the checkpoint's steps are in MLflow before Ray has the checkpoint
        self.report({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}, persisted, name)

    def _meta(self, step: int, final: bool) -> dict:
        history = self.state.progress.history
        return {**self.meta, "step": step, "final": final, "final_loss": history[-1]["loss"] if history else None}


def _ray_report(metrics: dict, persisted, name: str) -> None:
    """Ray Train's report of a checkpoint already in the run's folder (a barrier across the workers)."""
    import ray.train
    from ray.train import CheckpointUploadMode

    ray.train.report(metrics, checkpoint=persisted, checkpoint_dir_name=name,
                     checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
