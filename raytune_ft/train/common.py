"""What both training loops share inside a Ray Train worker: the recipe, the LR schedule, logging."""
from __future__ import annotations

import math
import os
import sys
import time

from raytune_ft.recipe import Recipe, TrainConfig, recipe_from_dict


def recipe_from_config(config: dict) -> Recipe:
    return recipe_from_dict(config["recipe"])


def lr_at(step: int, t: TrainConfig, total_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based): linear warmup, then the schedule."""
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant" or not total_steps:
        return 1.0
    span = max(1, total_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    if t.schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * decay


def report(metrics: dict, checkpoint=None) -> None:
    """ray.train.report with only the scalar metrics (it is a barrier across workers)."""
    import ray.train

    ray.train.report({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))},
                     checkpoint=checkpoint)


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


class WorkerLog:
    """Rank 0 prints progress lines and logs metrics to MLflow; other ranks stay quiet."""

    def __init__(self, rank: int, recipe: Recipe, run_id: str | None = None):
        self.rank = rank
        self.recipe = recipe
        self.mlflow = None
        run_id = run_id or os.environ.get("RAYTUNE_MLFLOW_RUN_ID")
        if rank == 0 and run_id:
            try:
                import mlflow

                mlflow.set_tracking_uri(recipe.tracking_uri)
                self.client = mlflow.MlflowClient(recipe.tracking_uri)
                self.run_id = run_id
                self.mlflow = mlflow
            except Exception as e:  # tracking must never kill training
                self.info(f"MLflow logging off: {type(e).__name__}: {e}")

    def info(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[raytune_ft] {msg}", flush=True)

    def progress(self, m: dict, total_steps: int, elapsed: float) -> None:
        if self.rank != 0:
            return
        step = m["step"]
        eta = ""
        if total_steps:
            eta = f" | ETA {_fmt_eta(elapsed / max(step, 1) * (total_steps - step))}"
        of = f"/{total_steps}" if total_steps else ""
        mem = f" | mem {m['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in m else ""
        line = (f"step {step}{of} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | grad {m['grad_norm']:.3f} | "
                f"{m['tokens_per_s']:,.0f} tok/s | MFU {100 * m['mfu']:.1f}%{mem}{eta}")
        print(f"[raytune_ft] {line}", flush=True, file=sys.stdout)
        self.log_metrics(m, step)

    def log_metrics(self, m: dict, step: int) -> None:
        if self.mlflow is None:
            return
        try:
            from mlflow.entities import Metric

            ts = int(time.time() * 1000)
            metrics = [Metric(k, float(v), ts, step) for k, v in m.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"]
            self.client.log_batch(self.run_id, metrics=metrics)
        except Exception as e:
            self.info(f"MLflow metric logging failed ({type(e).__name__}); training goes on")

    def close(self) -> None:
        pass
