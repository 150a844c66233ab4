"""What both training loops share inside a Ray Train worker: the recipe, the LR schedule, logging."""
from __future__ import annotations

import math
import re
import sys
import time
from typing import Sequence

from raytune_ft.recipe.recipe import Recipe, TrainConfig, recipe_from_dict
from raytune_ft.train.job_attempts import attempt_of_job, workers_asked_at
from raytune_ft.train.startup_clock import JobStart, StartupClock
from raytune_ft.tracking.mlflow_run import attempt_id, mlflow_metric_name, startup_params


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


# not charts: single values of the run's data go to the MLflow run's data.json (run.py), the start-up
# breakdown to params (`first_step_done`), each sample's seconds stay in the samples table
_NOT_CURVES = ("data/", "startup/", "samples/")
_MFU_KEYS = ("mfu", "mfu_peak_tflops", "mfu_measured_matmul")


def measured(m: dict) -> dict:
    """`m` without its MFU figures when no peak was known to measure them against (a CPU, an unknown
    GPU): a curve at 0 would read as a measurement."""
    if m.get("mfu_peak_tflops"):
        return m
    return {k: v for k, v in m.items() if k not in _MFU_KEYS}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class WorkerLog:
    """Rank 0 prints progress and logs metrics to MLflow; other ranks stay quiet.

    Progress is one line per logged step: step/total (percent), loss, lr, gradient norm, tokens/s,
    MFU, elapsed time and ETA. When the stream is a terminal the line is redrawn in place; otherwise
    (Ray worker logs, `ray job submit`, a file, a pipe) each update is a plain line with no control
    characters, so logs stay greppable and readable in any viewer.
    """

    def __init__(self, rank: int, recipe: Recipe, run_id: str | None = None, stream=None,
                 job: JobStart = JobStart(), run_key: str | None = None):
        """`run_id`: the MLflow run rank 0 logs to, or `run_key`: where a thread of rank 0 waits for it in Ray's
        key-value store (tracking.opening.await_run_id) while the loop builds and steps, its calls held by the
        sender meanwhile, and where each node's system metrics find it; neither: no tracking."""
        self.rank = rank
        self.recipe = recipe
        job_start = job.at
        asked = workers_asked_at(recipe.tracking.run_name, job_start) if job_start else None
        self.startup = StartupClock(job_start, job.marks, asked)
        self._stream = stream
        self._live = False           # a redrawn progress line is on screen (terminal only)
        self._sender = None          # rank 0's MLflow calls, made by a process of their own
        self.attempt_id = attempt_id()   # this attempt's start-up params are named after it
        if rank == 0 and job_start:
            self.startup.attempt = attempt_of_job(recipe.tracking.run_name, job_start)
        if rank == 0 and (run_id or run_key):
            from raytune_ft.tracking.sender import MlflowSender

            self._sender = MlflowSender(recipe.tracking_uri, run_id, self.info)
            if not run_id:
                self._sender.await_run(run_key)
            self.set_tag("raytune.gpu", _gpu_description(recipe.scaling.num_workers))
        from raytune_ft.train.system_metrics import start_for_node

        self._system = start_for_node(recipe, rank, run_id, run_key, self.info)

    def check_tracking(self) -> None:
        """Raise the driver's words where its MLflow run did not open (rank 0; a no-op otherwise)."""
        if self._sender is not None and self._sender.not_opened is not None:
            raise self._sender.not_opened

    @classmethod
    def of_worker(cls, rank: int, recipe: Recipe, config: dict) -> "WorkerLog":
        """A Ray Train worker's log, from the loop's config (launch.build_trainer): the run's key, the start-up
        breakdown's job start and driver marks."""
        return cls(rank, recipe, run_key=config.get("mlflow_run_key"),
                   job=JobStart(config.get("job_start"), config.get("startup_marks")))

    @property
    def tracks(self) -> bool:
        """Whether this process logs to an MLflow run (rank 0 of a tracked run)."""
        return self._sender is not None

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

    def progress(self, m: dict, total_steps: int, elapsed: float, steps: Sequence[dict] = ()) -> None:
        """Print (rank 0) and log to MLflow the metrics of a logged step, and `steps`: each optimizer
        step's own figures since the last log (see `log_metrics`)."""
        if self.rank != 0:
            return
        self.check_tracking()
        line = f"[raytune_ft] {self.progress_line(m, total_steps, elapsed)}"
        if self._is_terminal():
            # redraw in place: carriage return, the line, clear to the end of the line
            self.stream.write("\r" + plain(line) + "\x1b[K")
            self.stream.flush()
            self._live = True
        else:
            self._write_line(line)
        self.log_metrics(m, m["step"], steps)

    def set_tag(self, key: str, value: str) -> None:
        """An MLflow tag of the run (rank 0), e.g. the kernels in use."""
        if self._sender is not None:
            self._sender.call("set_tag", f"MLflow tag {key} not logged ({{error}})", key=key, value=str(value))

    def log_param(self, key: str, value: str) -> None:
        """An MLflow param of the run (rank 0), e.g. the basis of the MFU figures. A resumed run logs the same
        value again; a different one is refused by MLflow and said in the log."""
        if self._sender is not None:
            self._sender.call("log_param", f"MLflow param {key} not logged ({{error}})", key=key, value=str(value))

    def log_table(self, data: dict[str, list], artifact_file: str, fail: str) -> None:
        """Rows appended to the run's MLflow table `artifact_file` (columns of equal length); `fail`, with
        "{error}", is said where that fails."""
        if self._sender is not None:
            self._sender.call("log_table", fail, data=data, artifact_file=artifact_file)

    def mfu_basis(self, basis: str) -> None:
        """Say what the run's MFU figures are relative to: the log line and the MLflow param (both loops)."""
        self.info(f"MFU basis: {basis}")
        self.log_param("mfu_peak_basis", basis)

    def log_metrics(self, m: dict, step: int, steps: Sequence[dict] = (), skip: Sequence[str] = ()) -> None:
        """Rank 0: one MLflow batch of `m` at `step` and of `steps` (dicts with a "step" and that optimizer
        step's own loss, lr, grad norm...), each point at its own step. A key `steps` carries, or one
        named in `skip`, is not logged again from `m`: one point per step, not a window's mean beside it.
        No MFU that was not measured, no data counters; names as `tracking.mlflow_metric_name` gives them."""
        if self._sender is None:
            return
        ts = int(time.time() * 1000)
        per_step = {k for s in steps for k in s if k != "step"} | set(skip)
        metrics = [[mlflow_metric_name(k), float(v), ts, int(s["step"])] for s in steps
                   for k, v in s.items() if k != "step" and _is_number(v)]
        metrics += [[mlflow_metric_name(k), float(v), ts, step] for k, v in measured(m).items()
                    if _is_number(v) and k != "step" and k not in per_step and not k.startswith(_NOT_CURVES)]
        for i in range(0, len(metrics), 1000):          # MLflow's limit per batch
            self._sender.call("log_batch", "MLflow metric logging failed ({error}); training goes on",
                              metrics=metrics[i:i + 1000])

    def backfill(self, history: Sequence[dict]) -> None:
        """Rank 0: the checkpoint's per-step history logged where the MLflow run lacks it (tracking.sender)."""
        if self._sender is not None:
            self._sender.backfill(history)

    def first_step_done(self, step: int, device) -> dict:
        """At the end of this attempt's first optimizer step (every rank): the start-up breakdown, printed
        in one line and logged as startup.* params by rank 0; returned for the run's reports."""
        if self.startup.done is not None:
            return self.startup.done
        if getattr(device, "type", None) == "cuda":     # the step's kernels, not just their launch
            import torch

            torch.cuda.synchronize(device)
        m = self.startup.finish()
        self.info(self.startup.line())
        if self._sender is not None:    # MLflow params do not change: each attempt logs under its own names
            self._sender.call("log_batch", "MLflow params startup.* not logged ({error}); summary.json has them",
                              params=[[k, str(v)] for k, v in startup_params(m, self.attempt_id).items()])
        return m

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for rank 0's MLflow calls so far, at most `timeout` s (default the sender's REPORT_WAIT_S: what
        a hung store may cost a checkpoint report; the calls left are made later); whether all are made."""
        if self._sender is None:
            return True
        return self._sender.flush() if timeout is None else self._sender.flush(timeout)

    def close(self) -> None:
        """The end of the loop: rank 0's MLflow calls made, its sender ended."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        if self._system is not None:
            self._system.close()
            self._system = None
        if self._live:
            self.stream.write("\n")
            self.stream.flush()
            self._live = False
