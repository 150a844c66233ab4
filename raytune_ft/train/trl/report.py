"""The TRL loop's callback: logs to MLflow on rank 0 and reports every Hugging Face save to Ray Train as a
checkpoint in the project's layout (all ranks report: Ray merges their files into one checkpoint).

Its parts, each named: `ReportContext` (what it reports with), `Throughput` (tokens/s, MFU and memory
between train logs), `step_points` (each optimizer step's own figures), `console_line`, and
`ReportCallbackParts`, the Hugging Face events. `report_callback` joins the last with transformers'
TrainerCallback, so that importing this module imports neither TRL nor transformers.
"""
from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train import hooks
from raytune_ft.train.common import WorkerLog
from raytune_ft.train.state import Progress, TrainState
from raytune_ft.train.trl.base import Paused, not_training, ray_report, sum_over_ranks
from raytune_ft.train.trl.checkpoint import save_meta, save_train_state, stage_checkpoint, trl_train_state
from raytune_ft.train.trl.data import RankBlocks

_SHOWN = ("loss", "eval_loss", "learning_rate", "grad_norm", "mean_token_accuracy", "eval_mean_token_accuracy")


@dataclass
class ReportContext:
    """What the callback reports with. `resumed`: the train state of the checkpoint this attempt resumed
    from (None: a fresh start); `paused`: the seconds spent evaluating and saving, left out of tokens/s."""

    recipe: Recipe
    rank: int
    world: int
    log: WorkerLog
    blocks: RankBlocks
    lora: bool
    paused: Paused
    resumed: TrainState | None = None
    jit: Any = None        # the worker's JIT cache (jit_cache.JitCache), saved after the first step


class Throughput:
    """tokens/s (all ranks), per worker, MFU and peak memory over each window between train logs, with the
    time spent evaluating and checkpointing left out."""

    def __init__(self, ctx: ReportContext):
        from raytune_ft.planning.hardware import current_device_name

        self.ctx = ctx
        self.on_cuda = torch.cuda.is_available() and ctx.recipe.scaling.use_gpu
        self.device_name = current_device_name() if self.on_cuda else None
        self.window = None             # (time, paused seconds, tokens, flops) at the last train log

    def start(self) -> None:
        from raytune_ft.planning.hardware import mfu_basis

        self.window = self._now()
        self.ctx.log.mfu_basis(mfu_basis(self.device_name))

    def _now(self) -> tuple[float, float, int, float]:
        blocks = self.ctx.blocks
        return time.perf_counter(), self.ctx.paused.seconds, blocks.real_tokens, blocks.flops

    def since_last(self) -> dict[str, float]:
        """The window's figures, and a new window. A collective: every rank calls it at the same log."""
        from raytune_ft.planning.hardware import mfu_metrics

        (t, paused, tokens, flops), now = self.window, self._now()
        blocks, world = self.ctx.blocks, self.ctx.world
        dt = max(now[0] - t - (now[1] - paused), 1e-9)
        both = torch.tensor([float(now[2] - tokens), now[3] - flops], dtype=torch.float64,
                            device=blocks.flag_device)
        if dist.is_initialized():
            dist.all_reduce(both)
        self.window = now
        out = {"tokens_per_s": float(both[0]) / dt, "tokens_per_s_per_worker": float(both[0]) / dt / world}
        if blocks.flops_config is not None:
            out.update(mfu_metrics(float(both[1]) / dt, self.device_name, n_gpus=world))
        if self.on_cuda:
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out


def step_points(kept: list) -> list[dict]:
    """Each optimizer step's loss (mean over ranks, as Hugging Face logs it), grad norm and LR, from the
    trainer's (step, this rank's loss, grad norm, LR). A collective: every rank calls it at the same log."""
    if not kept:
        return []
    losses = torch.stack([loss.float().reshape(()) for _, loss, _, _ in kept])
    if dist.is_initialized():
        dist.all_reduce(losses)
        losses /= dist.get_world_size()
    points = []
    for (step, _, norm, lr), loss in zip(kept, losses.tolist()):
        p = {"step": step, "loss": loss, "learning_rate": float(lr)}
        if norm is not None:
            p["grad_norm"] = float(norm)
        points.append(p)
    return points


def with_fsdp_names(logs: dict[str, float]) -> dict[str, float]:
    """`logs` with the evaluation's figures also under the FSDP2 loop's names, so runs of both loops
    compare in MLflow."""
    if "eval_loss" in logs:
        logs["eval/loss"] = logs["eval_loss"]
        logs["eval/perplexity"] = math.exp(min(logs["eval_loss"], 700.0))
        if "eval_runtime" in logs:
            logs["eval/seconds"] = logs["eval_runtime"]
    return logs


def console_line(logs: dict[str, float]) -> str:
    """The figures of a log a person reads on the console ("" when none)."""
    shown = " | ".join(f"{k} {v:.4g}" for k, v in logs.items() if k in _SHOWN)
    if "tokens_per_s" in logs:
        shown += f" | {logs['tokens_per_s']:,.0f} tok/s"
        if logs.get("mfu"):
            shown += f" | MFU {logs['mfu']:.1%} of {logs['mfu_peak_tflops']:,.0f} TFLOP/s"
        if "peak_mem_gib" in logs:
            shown += f" | mem {logs['peak_mem_gib']:.1f} GiB"
    return shown


class ReportCallbackParts:
    """The callback's Hugging Face events (`report_callback` adds transformers' TrainerCallback as a base)."""

    def __init__(self, ctx: ReportContext):
        self.ctx = ctx
        self.t0 = time.perf_counter()
        self.last: dict[str, float] = {}
        self.history: list[dict] = []
        self.throughput = Throughput(ctx)
        self.steps: list = []          # filled by the trainer (TrainerParts.steps), emptied at each log

    def on_train_begin(self, args, state, control, **kwargs):
        self.throughput.start()

    def _kept_steps(self) -> list[dict]:
        kept, self.steps[:] = list(self.steps), []
        return step_points(kept)

    def log_remaining_steps(self, step: int) -> None:
        """The steps past the last log (every rank calls it after training)."""
        points = self._kept_steps()
        if self.ctx.rank == 0 and points:
            self.ctx.log.log_metrics({}, step, steps=points)

    def on_step_end(self, args, state, control, **kwargs):
        ctx = self.ctx
        if ctx.log.startup.done is None:
            ctx.log.first_step_done(state.global_step, args.device)
            if ctx.rank == 0 and ctx.jit is not None:    # what the first step compiled, for the next node and run
                ctx.jit.save(ctx.log.info)
        hooks.fire("trl.step_end", step=state.global_step, rank=ctx.rank, output_dir=args.output_dir,
                   resumed=ctx.resumed is not None)
        # Hugging Face saves at the end of training whatever save_steps says; with train.save_final
        # false only the checkpoint_every saves are wanted
        t = ctx.recipe.train
        if not t.save_final and state.global_step >= state.max_steps and state.global_step % t.checkpoint_every:
            control.should_save = False
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = {k: float(v) for k, v in (logs or {}).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
        points = []
        if "loss" in logs and self.throughput.window is not None:
            logs.update(self.throughput.since_last())
            points = self._kept_steps()    # MLflow gets each step; the console the window's mean
        logs = with_fsdp_names(logs)
        self.last.update(logs)
        self.history.append({"step": state.global_step, **logs})
        if self.ctx.rank == 0 and logs:
            self.ctx.log.log_metrics(logs, state.global_step, steps=points)
            if shown := console_line(logs):
                self.ctx.log.info(f"step {state.global_step}/{state.max_steps} | {shown}")

    def on_save(self, args, state, control, **kwargs):
        with not_training(self.ctx.paused):                # staging + upload: not training time
            self._report_save(args, state)

    def _report_save(self, args, state):
        from raytune_ft.train.ckpt_storage import run_storage, write_checkpoint

        ctx, step = self.ctx, state.global_step
        src = os.path.join(args.output_dir, f"checkpoint-{step}")
        with tempfile.TemporaryDirectory(prefix="raytune_trl_ckpt_") as d:
            stage_checkpoint(src, d, rank=ctx.rank, lora=ctx.lora)
            metrics = self.metrics(state)
            save_train_state(d, ctx.rank, self.train_state(step, metrics))
            if ctx.rank == 0:
                save_meta(d, ctx.recipe, state, self.last, final=False)
            ctx.log.info(f"checkpoint at step {step}")
            ctx.log.flush()       # the checkpoint's steps are in MLflow before Ray has the checkpoint
            # the upload to storage happens in ray_report; out of space is said so, not in torch's words
            write_checkpoint(lambda: ray_report(metrics, d), run_storage(), step)
        hooks.fire("trl.saved", step=step, rank=ctx.rank, output_dir=args.output_dir,
                   resumed=ctx.resumed is not None)

    def train_state(self, step: int, metrics: dict) -> TrainState:
        """The checkpoint's train state at `step`, with the run's tokens and seconds of `metrics`."""
        progress = Progress(tokens_total=metrics["tokens"], run_train_seconds=metrics["run_train_seconds"])
        return trl_train_state(step, self.ctx.blocks, progress)

    def metrics(self, state) -> dict:
        """The last logged figures, with this attempt's and the run's tokens and seconds (a collective:
        every rank calls it at the same point)."""
        before = self.ctx.resumed.progress if self.ctx.resumed is not None else Progress()
        m = dict(self.last)
        seconds = time.perf_counter() - self.t0
        attempt_tokens = int(sum_over_ranks(self.ctx.blocks.real_tokens))
        m.update({"step": state.global_step, "train_seconds": seconds, "attempt_tokens": attempt_tokens,
                  "tokens": int(before.tokens_total or 0) + attempt_tokens,
                  "run_train_seconds": float(before.run_train_seconds or 0.0) + seconds})
        if state.best_metric is not None:
            m["best_eval_loss"] = float(state.best_metric)
        m.update(self.ctx.log.startup.done or {})
        return m


def report_callback(ctx: ReportContext):
    """The callback of `ctx`: `ReportCallbackParts` as a transformers TrainerCallback."""
    from transformers import TrainerCallback

    return type("RayReportCallback", (ReportCallbackParts, TrainerCallback), {})(ctx)
