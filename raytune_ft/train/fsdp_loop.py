"""The FSDP2 training loop of the 27B recipe, run inside each Ray Train worker.

One optimizer step = `grad_accum` micro-batches of `micro_batch_size` packed blocks per rank.
The loss is the sum of per-token losses over the step's supervised tokens on all ranks, divided
by their global count (all-reduced before the first backward of the step), so a token weighs the
same whatever rank or micro-batch it lands on. FSDP2 averages gradients over ranks; each
micro-batch loss is multiplied by the world size to undo that average. Under
`scaling.context_parallel` a group of ranks trains its members' blocks together, each rank a share of
every block (train/context_parallel.py); the same normalisation holds, each rank counting its share.

Non-finite losses and gradient norms are accumulated into a device flag and checked where the
host syncs anyway (log and checkpoint steps), so the step itself never waits on the GPU.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from raytune_ft.console import libraries_to_file, library_log
from raytune_ft.data.packing import DataCounters
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train import checkpoint as ckpt_io
from raytune_ft.train import ckpt_storage, jit_cache
from raytune_ft.train.checkpointer import Checkpointer, SaveSettings, async_enabled
from raytune_ft.train.batch import EpochFeeds, RankSteps, StepBatch, pass_line, worker_blocks
from raytune_ft.train.schedule_length import (count_run_steps, needs_counting_pass, run_schedule_steps,
                                              schedule_settings, short_of_steps)
from raytune_ft.train.common import WorkerLog, lr_at, recipe_from_config, report
from raytune_ft.train.context_parallel import CPGroup, cp_group, step_micro_batches
from raytune_ft.train.evaluate import EvalAndSamples, Place, start_reading_held_out
from raytune_ft.train.fp8 import precompute_fp8_scales
from raytune_ft.train.fsdp_model import PackedCausalLM, build_fsdp_model, compile_pointwise, shard_packed_model
from raytune_ft.train.lora import count_trainable
from raytune_ft.train.lora_export import export_bytes, final_export
from raytune_ft.train.state import Progress, TrainState

# the model's parts are importable from here too (benchmarks build exactly what the loop trains)
__all__ = ["train_fsdp", "forward_backward", "clip_gradients", "StepBatch", "PackedCausalLM", "build_fsdp_model",
           "compile_pointwise", "shard_packed_model"]


def _device() -> torch.device:
    import ray.train.torch

    return ray.train.torch.get_device()


def forward_backward(model: nn.Module, micro_batches: list[StepBatch], world: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step's forward and backward passes over this rank's micro-batches.

    Returns (sum of this rank's token losses, fp32; global supervised-token count, clamped to >= 1).
    Each micro-batch's loss is divided by the global count before its backward, and multiplied by the
    world size to undo FSDP2's average over ranks, so a token weighs the same wherever it lands.
    Each micro-batch's backward reduce-scatters its gradients, which accumulate in the shards: FSDP2's
    no-sync alternative holds every parameter's unsharded gradient between micro-batches, the whole model's
    on every rank (54 GB for the 27B in bf16: out of memory under context parallelism on an H100)."""
    n_sup = torch.tensor(float(sum(mb.n_supervised for mb in micro_batches)), device=device)
    dist.all_reduce(n_sup)
    denom = n_sup.clamp(min=1.0)
    loss_sum = torch.zeros((), device=device)
    for mb in micro_batches:        # FSDP2's default: each backward reduce-scatters (nothing here turns it off)
        ls, _ = model(mb.labels, **mb.kwargs)
        (ls * world / denom).backward()
        loss_sum += ls.detach().float()
    return loss_sum, denom


def train_fsdp(config: dict) -> None:
    """Ray Train worker entry point for the FSDP2 loop."""
    import ray.train

    recipe = recipe_from_config(config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = _device()
    log = WorkerLog.of_worker(rank, recipe, config)
    t_cfg = recipe.train
    if ckpt_storage.report_if_finished(log):
        return
    # train.read_ahead: the data starts flowing first (Ray Data's split coordinator and tokenizing processes
    # start on the first read), read ahead while the attempt sets up and the model is built, checked and
    # compiled (a resume's replay waits for the first step, after the storage check); after the model when
    # the schedule's length takes a counting pass over the same shard first. Off on CPU workers: on a
    # small machine the reading takes the cores the model build needs (start-up got slower, not faster)
    feed = held_out = None
    if t_cfg.read_ahead == "on" or (t_cfg.read_ahead == "auto" and device.type == "cuda"):
        early = _checkpoint_position(rank)
        if not needs_counting_pass(recipe, early):
            feed = _open_data(recipe, config, early, rank=rank, device=device, read_ahead=True)
        held_out = start_reading_held_out(recipe, rank=rank, world=world)   # for evaluation and samples too

    # checkpoint folders of dead attempts off the storage, once the run folder's lease is found still this job's
    ckpt_storage.start_attempt(rank, config.get("lease_token"), log.info)
    jit = jit_cache.for_worker(recipe, device, log.info, log.startup)   # before anything compiles
    log.startup.mark("model_build.setup")
    model, lm, tok = build_fsdp_model(recipe, device, log)
    libraries_to_file(library_log("workers"))     # transformers' own log lines too, now that it is imported
    log.startup.mark("model_build")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t_cfg.lr, betas=tuple(t_cfg.betas), weight_decay=t_cfg.weight_decay,
                            fused=device.type == "cuda")
    guard = ckpt_storage.SaveGuard(rank, device, ckpt_storage.model_checkpoint_bytes(params),
                                   export_bytes(recipe, model, params))
    # LoRA: the checkpoints hold the adapters only; the frozen base is rebuilt from its source
    state = _resume_state(TrainState(model, opt, trainable_only=t_cfg.lora_r > 0), rank, log)
    # a storage that cannot take the next checkpoint stops the attempt here, before training to it
    guard.check_first(state.step, t_cfg)
    saver = Checkpointer(state, guard, log, SaveSettings(rank, device, async_enabled(t_cfg.async_checkpoint, device),
                                                         _meta(recipe)))
    feed = feed or _open_data(recipe, config, state.data.state_dict(), rank=rank, device=device)
    total_steps = _schedule_length(recipe, state, feed, log)
    probing = time.time()       # 0 s with train.eval_every=0 and train.sample_prompts=0
    probes = EvalAndSamples.open(recipe, tok, Place(rank, world, device), log, held_out=held_out)
    log.log_metrics(probes.at_start(model, state.evaluation, state.step), 0)   # the base model's samples
    log.startup.mark("eval_setup", since=probing)
    window = _Window(device, lm.config, world, state.progress,
                     adapter_params=count_trainable(model) if t_cfg.lora_r else None)   # LoRA: frozen-base FLOPs
    log.mfu_basis(window.mfu_basis)
    dtype = torch.bfloat16 if recipe.model.dtype == "bfloat16" else torch.float32

    export = final_export(recipe, model, tok, rank, dtype, log)     # the final checkpoint's hf/ (adapter/)

    attempt = _Attempt(recipe=recipe, rank=rank, world=world, device=device, log=log, model=model, opt=opt,
                       params=params, state=state, feed=feed, total_steps=total_steps, window=window,
                       probes=probes, saver=saver, jit=jit, export=export,
                       cp=_context_parallel(recipe, world, device, log))
    try:
        _train(attempt)
    finally:
        saver.close()


def _context_parallel(recipe: Recipe, world: int, device: torch.device, log: WorkerLog) -> CPGroup | None:
    """This rank's context-parallel group (a collective), said once in the log."""
    size = recipe.scaling.context_parallel
    if size > 1:
        log.info(f"context parallelism: groups of {size} ranks split each block into {2 * size} chunks of "
                 f"{recipe.data.seq_len // (2 * size)} tokens ({world // size} data-parallel)")
    return cp_group(size, device)


@dataclass
class _Attempt:
    """What this attempt's loop trains with, built once by `train_fsdp` (torchtitan's Trainer holds the same)."""

    recipe: Recipe
    rank: int
    world: int
    device: torch.device
    log: WorkerLog
    model: nn.Module
    opt: torch.optim.Optimizer
    params: list[nn.Parameter]          # the trained ones (requires_grad)
    state: TrainState                   # what a checkpoint holds
    feed: EpochFeeds
    total_steps: int                    # the schedule's length, 0: none needed
    window: _Window
    probes: EvalAndSamples
    saver: Checkpointer
    jit: jit_cache.JitCache | None      # what the first step compiled, saved for the next node and run
    export: Callable[[str], None]       # writes the final checkpoint's hf/ folder
    cp: CPGroup | None = None           # scaling.context_parallel's group (train/context_parallel.py)


def _train(a: _Attempt) -> None:
    """The training loop, from the attempt's first step to the run's end (`_finish`)."""
    t_cfg, total_steps = a.recipe.train, a.total_steps
    step = a.state.step
    last_metrics: dict = {}
    while total_steps == 0 or step < total_steps:
        waited = time.time()
        blocks = a.feed.next_blocks()
        a.log.startup.mark("first_step.data_wait", since=waited)   # kept until the first step ends
        if blocks is None:  # every rank's data is spent
            break
        if a.feed.steps_in_epoch == 1 and a.feed.epoch > 0:
            a.log.info(pass_line(a.feed.epoch, a.feed.epoch_steps, step))
        _optimizer_step(a, step, blocks)
        step += 1
        a.saver.poll()          # a background save that finished is reported now, one that failed raised
        if a.log.startup.done is None:
            a.log.first_step_done(step, a.device)
            if a.rank == 0 and a.jit is not None:    # what the first step compiled, for the next node and run
                a.jit.save(a.log.info)

        at_log = step % t_cfg.log_every == 0 or step == total_steps
        at_ckpt = step % t_cfg.checkpoint_every == 0 and step != total_steps
        at_eval = a.probes.eval_due(step) and step != total_steps     # the last step's comes with the end
        if at_log or at_ckpt or at_eval:
            last_metrics = _log_and_save(a, step, evaluate=at_eval, checkpoint=at_ckpt)

    a.feed.close()
    if total_steps and step < total_steps:
        a.log.info(short_of_steps(step, total_steps, a.feed.total_counters()))
    _finish(a, step, last_metrics)


def _optimizer_step(a: _Attempt, step: int, blocks: list) -> None:
    """One optimizer step from `step`: forward and backward over the step's micro-batches, clipping, the
    scheduled LR; its losses, tokens and FLOPs go into the window (on the device, no host sync)."""
    t_cfg = a.recipe.train
    mbs = t_cfg.micro_batch_size
    micro_batches = step_micro_batches(blocks, mbs, a.device, a.cp)
    loss_sum, denom = forward_backward(a.model, micro_batches, a.world, a.device)
    grad_norm = clip_gradients(a.params, t_cfg.max_grad_norm)
    lr = t_cfg.lr * lr_at(step, t_cfg, a.total_steps)
    for g in a.opt.param_groups:
        g["lr"] = lr
    a.opt.step()
    a.opt.zero_grad(set_to_none=True)
    if t_cfg.precision == "fp8":
        precompute_fp8_scales(a.model, t_cfg.fp8_recipe)
    a.window.add(step + 1, loss_sum, denom, grad_norm.detach(), lr, micro_batches)


def _log_and_save(a: _Attempt, step: int, *, evaluate: bool, checkpoint: bool) -> dict:
    """Close the window (a host sync), evaluate and sample when due, log, then checkpoint or report;
    returns the metrics of the window's last step."""
    state, feed, window = a.state, a.feed, a.window
    metrics = window.close(state.progress, a.rank)
    metrics["epoch_progress"] = step / a.total_steps if a.total_steps else 0.0
    metrics["epoch"] = feed.epoch
    _record_position(state, step, feed)
    # after the window closed: evaluation and sampling are not counted as training time
    metrics |= a.probes.run(a.model, step, state.evaluation, evaluate=evaluate, sample=checkpoint)
    a.log.progress(metrics, a.total_steps, window.elapsed(), steps=window.closed)
    if checkpoint:
        a.saver.save(metrics)
    else:
        report(metrics | feed.total_counters().as_metrics())
    # the next window starts after the report/checkpoint, so saving is not counted as training
    window.restart()
    return metrics


def _checkpoint_position(rank: int) -> dict:
    """The train state of the checkpoint Ray hands this attempt (its JSON file only: where the data stood,
    the counted schedule), or {} for a fresh start. `_resume_state` loads the same state with the weights."""
    import ray.train

    resume = ray.train.get_checkpoint()
    return {} if resume is None else ckpt_io.checkpoint_train_state(resume.path, rank, fs=resume.filesystem)


def _resume_state(state: TrainState, rank: int, log: WorkerLog) -> TrainState:
    """`state` loaded from the checkpoint Ray hands this attempt (model and optimizer too), or fresh."""
    import ray.train

    resume = ray.train.get_checkpoint()
    if resume is None:
        return state
    reads: list[str] = []   # read where it lies: the DCP metadata, this rank's shard and train state only
    ckpt_io.load_train_checkpoint(resume.path, state, rank, fs=resume.filesystem, reads=reads)
    print(f"[raytune_ft] rank {rank} resumed reading {len(reads)} files of the checkpoint: "
          f"{', '.join('/'.join(p.rsplit('/', 2)[-2:]) for p in reads)}", flush=True)
    # where each restart (Ray's, after a worker died, or a re-submit) picked the run up
    state.progress.resumed(state.step)
    log.info(f"resumed from checkpoint at step {state.step} ({state.data.blocks_consumed} blocks consumed "
             f"on rank {rank})")
    log.backfill(state.progress.history)    # steps an outage of the tracking store kept from the run
    return state


def _meta(recipe: Recipe) -> dict:
    """raytune_meta.json's fields every checkpoint of the run shares (the registry reads them)."""
    m = recipe.model
    return {"job": recipe.job, "model_name": m.name, "revision": m.revision, "family": m.family,
            "run_name": recipe.tracking.run_name, "loop": "fsdp2", "lora": recipe.train.lora_r > 0}


def clip_gradients(params: list, max_norm: float | None) -> torch.Tensor:
    """The gradients' total norm (before any clipping), clipping them to `max_norm` when it is set and
    > 0; 0 or None leaves them as they are (as Hugging Face reads 0 in the TRL loop)."""
    if max_norm:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _open_data(recipe: Recipe, config: dict, state: dict, *, rank: int, device: torch.device,
               read_ahead: bool = False) -> EpochFeeds:
    """This rank's `train.epochs` passes over its data, past what the checkpoint had consumed; with
    `train.max_steps`, as many passes as its steps take (transformers' meaning: each pass after the first
    in a new seeded order). `read_ahead`: a thread reads two steps' blocks ahead (`batch.ReadAhead`)."""
    # `blocks_by_rank` (tests, benchmarks): fixed blocks per rank instead of the Ray Data shard
    fixed = (config.get("blocks_by_rank") or {}).get(rank)

    def open_blocks(epoch: int, counters: DataCounters):
        return iter(fixed) if fixed is not None else worker_blocks(recipe, counters=counters, epoch=epoch)

    # the step flag travels on a CPU (gloo) group, so the GPU never waits for it
    group = dist.new_group(backend="gloo") if dist.is_initialized() and device.type == "cuda" else None
    per_step = recipe.train.grad_accum * recipe.train.micro_batch_size
    epochs = None if recipe.train.max_steps else recipe.train.epochs
    return EpochFeeds(open_blocks, epochs=epochs, steps=RankSteps(per_step, recipe.data.seq_len, rank, group),
                      state=state, read_ahead=2 * per_step if read_ahead else 0)


def _schedule_length(recipe: Recipe, state: TrainState, feed: EpochFeeds, log: WorkerLog) -> int:
    """Optimizer steps of the run, for an LR schedule that must know its end (0: none needed).

    `train.max_steps` when set; else, for a decaying schedule, counted: one extra pass per epoch
    (tokenize + pack, no training) counts every rank's blocks exactly as the feed will run them, so
    the schedule ends on the run's last step. A resumed attempt reads it back, or counts again when
    a setting it depends on changed (`schedule_length.run_schedule_steps`)."""
    t, schedule = recipe.train, state.schedule
    total = int(t.max_steps or 0)
    if not total and t.schedule != "constant":
        total = run_schedule_steps(recipe, schedule.state_dict(), lambda: count_run_steps(
            feed.open_blocks, feed.steps.per_step, t.epochs, group=feed.steps.group), log.info)
        schedule.counted_steps, schedule.counted_for = total, schedule_settings(recipe)
    schedule.total_steps = total
    return total


def _record_position(state: TrainState, step: int, feed: EpochFeeds) -> None:
    """Where the run stands, for the next checkpoint: step, epoch, blocks consumed, counters, fingerprint."""
    state.schedule.step = step
    state.data.load_state_dict(feed.position())


class _Window:
    """The steps since the last log: their losses (kept on the device until the host syncs anyway),
    tokens and model FLOPs, and a non-finite flag checked at each sync. Also this attempt's tokens and
    seconds, apart from the run's (a resumed run's earlier attempts are in `state`)."""

    def __init__(self, device: torch.device, model_config, world: int, progress: Progress,
                 adapter_params: int | None = None):
        from raytune_ft.planning.hardware import mfu_basis

        self.device, self.model_config, self.world = device, model_config, world
        self.adapter_params = adapter_params
        self.tokens_before = int(progress.tokens_total or 0)
        self.seconds_before = float(progress.run_train_seconds or 0.0)
        self.t_start = time.perf_counter()
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.mfu_basis = mfu_basis(self.device_name)
        if adapter_params is not None:
            self.mfu_basis += "; LoRA: FLOPs of the frozen base's forward and backward (no weight gradients) + adapters"
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.restart()

    def restart(self) -> None:
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []
        self.closed: list[dict] = []
        self.tokens, self.flops, self.t0 = 0, 0.0, time.perf_counter()

    def add(self, step: int, loss_sum, denom, grad_norm, lr: float, micro_batches: list[StepBatch]) -> None:
        from raytune_ft.planning.hardware import flops_per_block

        self.bad |= ~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)
        self.pending.append((step, loss_sum, denom, grad_norm, lr))
        for mb in micro_batches:
            self.tokens += mb.n_real
            self.flops += flops_per_block(self.model_config, mb.seq_lens, adapter_params=self.adapter_params)

    def close(self, progress: Progress, rank: int) -> dict:
        """Host sync: all-reduce the window's losses and tokens (a collective), stop on a non-finite
        value, append the steps to `progress.history`, and return the window's metrics."""
        from raytune_ft.planning.hardware import mfu_metrics

        dt = max(time.perf_counter() - self.t0, 1e-9)
        if self.pending:
            losses = torch.stack([p[1] for p in self.pending])
            dist.all_reduce(losses)
            if bool(self.bad.item()):
                raise FloatingPointError(
                    f"non-finite loss or gradient norm within steps {self.pending[0][0]}..{self.pending[-1][0]} "
                    f"(rank {rank}); stopping without saving: the last good checkpoint is kept. "
                    "Lower train.lr, check the data, or use train.master_weights=fp32.")
            for (s, _, d, gn, lr_s), loss in zip(self.pending, losses.tolist()):
                progress.history.append({"step": s, "loss": loss / float(d), "lr": lr_s, "grad_norm": float(gn)})
        # each step's own figures, for MLflow (the returned metrics are the window's last step)
        self.closed = progress.history[len(progress.history) - len(self.pending):]
        tokens_all = torch.tensor(float(self.tokens), device=self.device)
        dist.all_reduce(tokens_all)
        progress.tokens_total = (progress.tokens_total or 0) + int(tokens_all.item())
        progress.run_train_seconds = self.seconds_before + self.elapsed()
        if not self.pending:
            return {}
        tps = float(tokens_all) / dt
        last = progress.history[-1]
        m = {"step": last["step"], "loss": last["loss"], "lr": last["lr"], "grad_norm": last["grad_norm"],
             "tokens_per_s": tps, "tokens_per_s_per_worker": tps / self.world, "tokens": progress.tokens_total,
             **mfu_metrics(self.flops / dt, self.device_name)}
        if self.device.type == "cuda":
            m["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.pending = []
        return m

    def elapsed(self) -> float:
        """Seconds of this attempt so far (checkpoint saves included)."""
        return time.perf_counter() - self.t_start

    def attempt_metrics(self, progress: Progress) -> dict:
        """Tokens and seconds of this attempt and of the run, for the end-of-run report (the run's seconds
        also into `progress`, for the final checkpoint)."""
        seconds = self.elapsed()
        progress.run_train_seconds = self.seconds_before + seconds
        tokens = progress.tokens_total or 0
        return {"tokens": tokens, "attempt_tokens": tokens - self.tokens_before, "train_seconds": seconds,
                "run_train_seconds": progress.run_train_seconds}


def _finish(a: _Attempt, step: int, last_metrics: dict) -> None:
    """End of the run at `step`: the steps since the last log go into the history, then the final checkpoint
    (with the hf/ export) or, with train.save_final=false, only the final metrics; a background save still
    in flight is completed and reported first either way."""
    state, window, log, saver = a.state, a.window, a.log, a.saver
    window.close(state.progress, a.rank)
    log.log_metrics({}, step, steps=window.closed)     # steps past the last log (the data ran out first)
    _record_position(state, step, a.feed)
    history = state.progress.history
    final = dict(last_metrics)
    final.update({"step": step, "loss": history[-1]["loss"] if history else float("nan"),
                  "done": True, "passes": a.feed.epoch + 1, **window.attempt_metrics(state.progress)})
    final |= a.feed.total_counters().as_metrics() | (log.startup.done or {})
    end = a.probes.at_end(a.model, step, state.evaluation)     # the final weights' held-out loss and samples
    log.log_metrics(end, step)
    final |= end
    if a.recipe.train.save_final:
        saver.save(final, final=True, export=a.export)
    else:
        saver.wait()
        log.info("train.save_final=false: no final checkpoint or hf/ export")
        # the summary reads the end of the run from MLflow; the last step's own points are there already
        log.log_metrics(final, step, skip=("loss", "lr", "grad_norm"))
        report(final)
    log.backfill(history)      # what the store missed during this attempt, now that it may answer
    log.close()
