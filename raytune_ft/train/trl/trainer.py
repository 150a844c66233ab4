"""The SFTTrainer subclass that reads pre-packed blocks, and the callback that logs and reports to Ray.

Both classes are built by functions so that importing this module does not import TRL or transformers.
"""
from __future__ import annotations

import math
import os
import tempfile
import time

import torch
import torch.distributed as dist

from raytune_ft import compat
from raytune_ft.recipe import Recipe, TrainConfig
from raytune_ft.train import hooks
from raytune_ft.train.batch import collate_blocks
from raytune_ft.train.ckpt_storage import SaveGuard
from raytune_ft.train.common import WorkerLog, lr_at
from raytune_ft.train.trl.base import not_training, ray_report, sum_over_ranks
from raytune_ft.train.trl.checkpoint import (fetch_best, has_weights, save_meta, save_train_state,
                                             stage_checkpoint)
from raytune_ft.train.trl.data import RankBlocks


def trainer_class():
    from torch.utils.data import DataLoader
    from trl import SFTTrainer

    class RayBlocksSFTTrainer(SFTTrainer):
        """SFTTrainer reading pre-packed blocks: plain DataLoaders (no accelerate re-sharding: each rank's
        stream is already its own share) and AdamW with a separate LR for LoRA parameters."""

        raytune_train_blocks: RankBlocks
        raytune_eval_blocks: list
        raytune_recipe: Recipe

        raytune_pause: dict           # seconds spent evaluating and saving (not training)
        raytune_guard: SaveGuard      # room for each save checked first; out of space said so

        # where rank 0 fetches a best checkpoint of an earlier attempt from (trl.checkpoint.point_at_best)
        raytune_best_source: str | None = None
        raytune_best_loaded: int | None = None     # the step whose weights `_load_best_model` loaded
        # each optimizer step's (step, this rank's loss, grad norm, LR) until the callback logs them
        raytune_steps: list
        _raytune_loss_before = None
        _raytune_step_kept = -1

        def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
            """Hugging Face's, after keeping this step's own figures for MLflow: it logs the mean of
            `logging_steps` steps, and its `tr_loss` grows by each step's loss until a log resets it."""
            step = self.state.global_step
            # also called at an epoch's end, for the same step, and for the resumed step itself when a
            # resumed attempt has nothing left to train (its loss was logged by the attempt that trained it)
            if step > max(self._raytune_step_kept, self._globalstep_last_logged):
                before = self._raytune_loss_before
                loss = tr_loss.detach().clone() if before is None else tr_loss.detach() - before
                lr = kwargs.get("learning_rate")
                self.raytune_steps.append((step, loss, grad_norm, self._get_learning_rate() if lr is None else lr))
                self._raytune_step_kept = step
            super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)
            self._raytune_loss_before = tr_loss.detach().clone()

        def _load_best_model(self):
            """Hugging Face's, once the best checkpoint's files are here (fetched from the run's storage
            when an earlier attempt saved it); records whether the best weights were loaded."""
            best = self.state.best_model_checkpoint
            if self.raytune_best_source and not fetch_best(self.raytune_best_source, best):
                return
            if has_weights(best):
                super()._load_best_model()
                self.raytune_best_loaded = self.state.best_global_step

        def evaluate(self, *args, **kwargs):
            with not_training(self.raytune_pause):
                return super().evaluate(*args, **kwargs)

        def _save_checkpoint(self, *args, **kwargs):
            save, step = super()._save_checkpoint, self.state.global_step
            with not_training(self.raytune_pause):
                self.raytune_guard.check(step)
                return self.raytune_guard.write(lambda: save(*args, **kwargs), step)

        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(self.raytune_train_blocks, batch_size=self.args.per_device_train_batch_size,
                              collate_fn=collate_blocks, num_workers=0)

        def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
            return DataLoader(self.raytune_eval_blocks, batch_size=self.args.per_device_eval_batch_size,
                              collate_fn=collate_blocks, shuffle=False, num_workers=0)

        def create_scheduler(self, num_training_steps: int, optimizer=None):
            """The recipe's schedule (`lr_at`, as the FSDP2 loop), not Hugging Face's own: warmup, then
            decay to `train.min_lr_ratio` on the last step, for every schedule."""
            if self.lr_scheduler is None:
                self.lr_scheduler = recipe_scheduler(optimizer or self.optimizer, self.raytune_recipe.train,
                                                     num_training_steps)
                self._created_lr_scheduler = True
            return self.lr_scheduler

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                t = self.raytune_recipe.train
                decay = set(self.get_decay_parameter_names(self.model))
                groups: dict[tuple[float, float], list] = {}
                for name, p in self.model.named_parameters():
                    if not p.requires_grad:
                        continue
                    lr = t.lr * (t.lora_lr_multiplier if "lora_" in name else 1.0)
                    wd = t.weight_decay if name in decay else 0.0
                    groups.setdefault((lr, wd), []).append(p)
                params = [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]
                self.optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas),
                                                   fused=self.args.device.type == "cuda")
            return self.optimizer

    return compat.check_trainer_internals(RayBlocksSFTTrainer)


def recipe_scheduler(optimizer, train: TrainConfig, total_steps: int):
    """A LambdaLR that sets each parameter group's LR to its peak x `lr_at(step)`."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lambda step: lr_at(step, train, total_steps))


_SHOWN = ("loss", "eval_loss", "learning_rate", "grad_norm", "mean_token_accuracy", "eval_mean_token_accuracy")


def report_callback(recipe: Recipe, rank: int, log: WorkerLog, train_blocks: RankBlocks, lora: bool,
                    pause: dict, world: int, resumed: dict | None = None):
    """The callback; `resumed` is the train state of the checkpoint this attempt resumed from ({}: none)."""
    resumed = resumed or {}
    from transformers import TrainerCallback

    from raytune_ft.hardware import current_device_name, mfu_basis, mfu_metrics

    on_cuda = torch.cuda.is_available() and recipe.scaling.use_gpu
    device_name = current_device_name() if on_cuda else None

    class RayReportCallback(TrainerCallback):
        """Logs to MLflow on rank 0 and reports every Hugging Face save to Ray Train as a checkpoint in
        the project's layout (all ranks report: Ray merges their files into one checkpoint)."""

        def __init__(self):
            self.t0 = time.perf_counter()
            self.last: dict[str, float] = {}
            self.history: list[dict] = []
            self.window = None             # (time, paused seconds, tokens, flops) at the last train log
            self.steps: list = []          # filled by the trainer (its raytune_steps), emptied at each log
            self.jit = None                # the worker's JIT cache (jit_cache.JitCache), saved after step 1

        def on_train_begin(self, args, state, control, **kwargs):
            self.window = (time.perf_counter(), pause["s"], train_blocks.real_tokens, train_blocks.flops)
            log.mfu_basis(mfu_basis(device_name))

        def throughput(self) -> dict[str, float]:
            """tokens/s (all ranks), per worker, MFU and peak memory since the last train log; evaluation
            and checkpoint time excluded. A collective: every rank calls it at the same log."""
            t, paused, tokens, flops = self.window
            now = time.perf_counter()
            dt = max(now - t - (pause["s"] - paused), 1e-9)
            both = torch.tensor([float(train_blocks.real_tokens - tokens), train_blocks.flops - flops],
                                dtype=torch.float64, device=train_blocks.flag_device)
            if dist.is_initialized():
                dist.all_reduce(both)
            self.window = (now, pause["s"], train_blocks.real_tokens, train_blocks.flops)
            out = {"tokens_per_s": float(both[0]) / dt, "tokens_per_s_per_worker": float(both[0]) / dt / world}
            if train_blocks.flops_config is not None:
                out.update(mfu_metrics(float(both[1]) / dt, device_name, n_gpus=world))
            if on_cuda:
                out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            return out

        def step_points(self) -> list[dict]:
            """Each optimizer step's loss (mean over ranks, as Hugging Face logs it), grad norm and LR since
            the last log. A collective: every rank calls it at the same log."""
            kept, self.steps[:] = list(self.steps), []
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

        def log_remaining_steps(self, step: int) -> None:
            """The steps past the last log (every rank calls it after training)."""
            points = self.step_points()
            if rank == 0 and points:
                log.log_metrics({}, step, steps=points)

        def on_step_end(self, args, state, control, **kwargs):
            if log.startup.done is None:
                log.first_step_done(state.global_step, args.device)
                if rank == 0 and self.jit is not None:    # what the first step compiled, for the next node and run
                    self.jit.save(log.info)
            hooks.fire("trl.step_end", step=state.global_step, rank=rank, output_dir=args.output_dir,
                       resumed=bool(resumed))
            # Hugging Face saves at the end of training whatever save_steps says; with train.save_final
            # false only the checkpoint_every saves are wanted
            if (not recipe.train.save_final and state.global_step >= state.max_steps
                    and state.global_step % recipe.train.checkpoint_every):
                control.should_save = False
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = {k: float(v) for k, v in (logs or {}).items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)}
            points = []
            if "loss" in logs and self.window is not None:
                logs.update(self.throughput())
                points = self.step_points()    # MLflow gets each step; the console the window's mean
            if "eval_loss" in logs:     # the FSDP2 loop's names, so runs of both loops compare in MLflow
                logs["eval/loss"] = logs["eval_loss"]
                logs["eval/perplexity"] = math.exp(min(logs["eval_loss"], 700.0))
                if "eval_runtime" in logs:
                    logs["eval/seconds"] = logs["eval_runtime"]
            self.last.update(logs)
            self.history.append({"step": state.global_step, **logs})
            if rank == 0 and logs:
                log.log_metrics(logs, state.global_step, steps=points)
                shown = " | ".join(f"{k} {v:.4g}" for k, v in logs.items() if k in _SHOWN)
                if "tokens_per_s" in logs:
                    shown += f" | {logs['tokens_per_s']:,.0f} tok/s"
                    if logs.get("mfu"):
                        shown += f" | MFU {logs['mfu']:.1%} of {logs['mfu_peak_tflops']:,.0f} TFLOP/s"
                    if "peak_mem_gib" in logs:
                        shown += f" | mem {logs['peak_mem_gib']:.1f} GiB"
                if shown:
                    log.info(f"step {state.global_step}/{state.max_steps} | {shown}")

        def on_save(self, args, state, control, **kwargs):
            with not_training(pause):                     # staging + upload: not training time
                self._report_save(args, state)

        def _report_save(self, args, state):
            src = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            with tempfile.TemporaryDirectory(prefix="raytune_trl_ckpt_") as d:
                stage_checkpoint(src, d, rank=rank, lora=lora)
                metrics = self.metrics(state, train_blocks)
                save_train_state(d, rank, state.global_step, train_blocks, metrics)
                if rank == 0:
                    save_meta(d, recipe, state, self.last, final=False)
                log.info(f"checkpoint at step {state.global_step}")
                log.flush()       # the checkpoint's steps are in MLflow before Ray has the checkpoint
                # the upload to storage happens in ray_report; out of space is said so, not in torch's words
                from raytune_ft.train.ckpt_storage import run_storage, write_checkpoint

                write_checkpoint(lambda: ray_report(metrics, d), run_storage(), state.global_step)
            hooks.fire("trl.saved", step=state.global_step, rank=rank, output_dir=args.output_dir,
                       resumed=bool(resumed))

        def metrics(self, state, blocks: RankBlocks) -> dict:
            """The last logged figures, with this attempt's and the run's tokens and seconds (a
            collective: every rank calls it at the same point)."""
            m = {k: v for k, v in self.last.items()}
            seconds = time.perf_counter() - self.t0
            attempt_tokens = int(sum_over_ranks(blocks.real_tokens))
            m.update({"step": state.global_step, "train_seconds": seconds, "attempt_tokens": attempt_tokens,
                      "tokens": int(resumed.get("tokens_total", 0)) + attempt_tokens,
                      "run_train_seconds": float(resumed.get("run_train_seconds", 0.0)) + seconds})
            if state.best_metric is not None:
                m["best_eval_loss"] = float(state.best_metric)
            m.update(log.startup.done or {})
            return m

    return RayReportCallback()
