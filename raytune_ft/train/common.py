"""What both training loops share inside a Ray Train worker: the recipe, the LR schedule, logging."""
from __future__ import annotations

import math
import os
import re
import sys
import time

from raytune_ft.recipe import Recipe, TrainConfig, recipe_from_dict


def recipe_from_config(config: dict) -> Recipe:
    return recipe_from_dict(config["recipe"])


def lr_at(step: int, t: TrainConfig, total_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based) of `total_steps`: linear warmup,
    then the schedule, whose last step (total_steps - 1) trains at the floor `min_lr_ratio`; past the
    end the LR stays at the floor. Both loops use it (the TRL loop through `recipe_scheduler`)."""
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant" or not total_steps:
        return 1.0
    span = max(1, total_steps - t.warmup_steps - 1)
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
    """h:mm:ss for an ETA or an elapsed time."""
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


# ANSI escapes and C0/C1 control characters except the newline: never in a log file
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def plain(text: str) -> str:
    """`text` without control characters or ANSI escapes (a tab becomes a space)."""
    return _CONTROL.sub("", text.replace("\t", " "))


def _gpu_description(n_workers: int) -> str:
    """What the run trains on, for the MLflow tag raytune.gpu: e.g. '8 x NVIDIA B300', '2 x CPU (no GPU)'."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{n_workers} x {torch.cuda.get_device_name(torch.cuda.current_device())}"
    except Exception:
        pass
    return f"{n_workers} x CPU (no GPU)"


class WorkerLog:
    """Rank 0 prints progress and logs metrics to MLflow; other ranks stay quiet.

    Progress is one line per logged step: step/total (percent), loss, lr, gradient norm, tokens/s,
    MFU, elapsed time and ETA. When the stream is a terminal the line is redrawn in place; otherwise
    (Ray worker logs, `ray job submit`, a file, a pipe) each update is a plain line with no control
    characters, so logs stay greppable and readable in any viewer.
    """

    def __init__(self, rank: int, recipe: Recipe, run_id: str | None = None, stream=None):
        self.rank = rank
        self.recipe = recipe
        self.mlflow = None
        self._stream = stream
        self._live = False           # a redrawn progress line is on screen (terminal only)
        run_id = run_id or os.environ.get("RAYTUNE_MLFLOW_RUN_ID")
        if rank == 0 and run_id:
            try:
                import mlflow

                mlflow.set_tracking_uri(recipe.tracking_uri)
                self.client = mlflow.MlflowClient(recipe.tracking_uri)
                self.run_id = run_id
                self.mlflow = mlflow
                self.client.set_tag(run_id, "raytune.gpu", _gpu_description(recipe.scaling.num_workers))
            except Exception as e:  # tracking must never kill training
                from raytune_ft.env import redact_exception

                self.info(f"MLflow logging off: {redact_exception(e)}")

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stdout

    def _is_terminal(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):
            return False

    def _write_line(self, text: str) -> None:
        if self._live:                # finish the redrawn progress line before a normal line
            self.stream.write("\n")
            self._live = False
        self.stream.write(plain(text) + "\n")
        self.stream.flush()

    def info(self, msg: str) -> None:
        if self.rank == 0:
            self._write_line(f"[raytune_ft] {msg}")

    @staticmethod
    def progress_line(m: dict, total_steps: int, elapsed: float) -> str:
        """The progress text of metrics `m` (step, loss, lr, grad_norm, tokens_per_s, mfu, ...)."""
        step = m["step"]
        parts = [f"step {step}/{total_steps} ({100 * step / total_steps:.0f}%)" if total_steps else f"step {step}",
                 f"loss {m['loss']:.4f}"]
        if "lr" in m:
            parts.append(f"lr {m['lr']:.2e}")
        if "grad_norm" in m:
            parts.append(f"grad norm {m['grad_norm']:.3f}")
        if "tokens_per_s" in m:
            parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
        if m.get("mfu"):
            peak = f" of {m['mfu_peak_tflops']:,.0f} TFLOP/s" if m.get("mfu_peak_tflops") else ""
            parts.append(f"MFU {100 * m['mfu']:.1f}%{peak}")
        elif "mfu" in m:
            parts.append("MFU n/a (no GPU peak)")   # on CPU, or a GPU without a known peak
        if "peak_mem_gib" in m:
            parts.append(f"mem {m['peak_mem_gib']:.1f} GiB")
        timing = f"elapsed {_fmt_eta(elapsed)}"
        if total_steps and step < total_steps:
            timing += f", ETA {_fmt_eta(elapsed / max(step, 1) * (total_steps - step))}"
        parts.append(timing)
        return " | ".join(parts)

    def progress(self, m: dict, total_steps: int, elapsed: float) -> None:
        """Print (rank 0) and log to MLflow the metrics of a logged step."""
        if self.rank != 0:
            return
        line = f"[raytune_ft] {self.progress_line(m, total_steps, elapsed)}"
        if self._is_terminal():
            # redraw in place: carriage return, the line, clear to the end of the line
            self.stream.write("\r" + plain(line) + "\x1b[K")
            self.stream.flush()
            self._live = True
        else:
            self._write_line(line)
        self.log_metrics(m, m["step"])

    def log_param(self, key: str, value: str) -> None:
        """An MLflow param of the run (rank 0), e.g. the basis of the MFU figures."""
        if self.mlflow is None:
            return
        try:
            self.client.log_param(self.run_id, key, value)
        except Exception as e:   # a resumed run logs the same value again; a different one is refused
            self.info(f"MLflow param {key} not logged ({type(e).__name__})")

    def mfu_basis(self, basis: str) -> None:
        """Say what the run's MFU figures are relative to: the log line and the MLflow param (both loops)."""
        self.info(f"MFU basis: {basis}")
        self.log_param("mfu_peak_basis", basis)

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
        if self._live:
            self.stream.write("\n")
            self.stream.flush()
            self._live = False
