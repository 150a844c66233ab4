"""What both training loops share inside a Ray Train worker: the recipe, the LR schedule, logging."""
from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Sequence

from raytune_ft import compat
from raytune_ft.recipe.recipe import Recipe, TrainConfig, recipe_from_dict
from raytune_ft.train.job_attempts import attempt_of_job, workers_asked_at
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


# the start-up phases up to the end of the first optimizer step, in the order they happen
STARTUP_PHASES = {"ray_workers": "Ray and workers", "model_build": "model build", "kernel_check": "kernel check",
                  "compile": "compile", "eval_setup": "held-out data and base-model samples",
                  "first_step": "first step"}
STARTUP_METRICS = tuple(f"startup/{p}_s" for p in STARTUP_PHASES) + ("startup/total_s",)
# `ray_workers` split at the driver's marks (`startup_marks`: epoch seconds after each, in this order) and at
# the start of the worker's process; each part is also reported, as `startup/ray_workers.<part>_s`. The job
# starts when its driver process does (the user's command), not where the run's code begins, or, under
# `ray job submit`, when Ray accepted the submission: then `submission` (to the driver's process start,
# the driver's mark "process") comes first
RAY_WORKERS_PARTS = {"submission": "job submission", "driver": "job process: imports and checks",
                     "ray_start": "Ray start", "datasets": "driver imports and datasets",
                     "tracking": "MLflow run", "scheduling": "trainer and worker scheduling",
                     "worker_setup": "worker imports and process group"}
DRIVER_MARKS = ("driver", "ray_start", "datasets", "tracking")
# `model_build` split where the worker marks it (`StartupClock.mark("model_build.<part>")`), each reported as
# `startup/model_build.<part>_s`; a part the loop does not mark is left out
MODEL_BUILD_PARTS = {"setup": "attempt set-up, JIT caches and data", "tokenizer": "tokenizer",
                     "skeleton": "model code and skeleton", "wrapping": "compile set-up and sharding",
                     "weights": "weights on the device"}
# the first step's time spent waiting for its blocks (`StartupClock.mark("first_step.data_wait", since)`),
# `startup/first_step.data_wait_s`
PHASE_PARTS = {"ray_workers": RAY_WORKERS_PARTS, "model_build": MODEL_BUILD_PARTS,
               "first_step": {"data_wait": "waiting for data"}}


def _ray_workers_parts(job_start: float, marks: dict | None, now: float,
                       asked: float | None = None) -> dict[str, float]:
    """Seconds of each `RAY_WORKERS_PARTS` part, or {} without the driver's marks or the process's start.
    `asked`: when Ray Train's controller asked for this attempt's workers."""
    if not marks or any(k not in marks for k in DRIVER_MARKS):
        return {}
    from raytune_ft.env import process_start

    created = process_start()
    if created is None:         # the parts are a diagnosis; the phase itself stays measured
        return {}
    names = [p for p in RAY_WORKERS_PARTS if p != "submission" or "process" in marks]
    points = [job_start] + ([float(marks["process"])] if "process" in marks else [])
    points += [float(marks[k]) for k in DRIVER_MARKS]
    # a process Ray had started before the job, or this attempt, asked for it counts as scheduled once asked:
    # Ray hands a new worker an idle process that has run nothing yet, which may be older than a restart
    points += [min(max(created, points[-1], asked or 0.0), now), now]
    return {part: max(0.0, b - a) for part, a, b in zip(names, points, points[1:])}


def _compile_seconds() -> float:
    """Seconds torch.compile spent compiling in this process so far (forward and backward graphs)."""
    if "torch._dynamo" not in sys.modules:      # nothing compiled: not worth importing dynamo for
        return 0.0
    calculate_time_spent, _ = compat.TORCH_DYNAMO_COUNTERS.load()
    return float(calculate_time_spent().get("total_wall_time", 0.0))


# torch.compile's cache lookups up to the first step's end, `startup/compile.<name>`: counts, not seconds.
# A warm start should find every graph
COMPILE_CACHE_COUNTERS = {"fx_cache_hits": ("inductor", "fxgraph_cache_hit"),
                          "fx_cache_misses": ("inductor", "fxgraph_cache_miss"),
                          "aot_cache_hits": ("aot_autograd", "autograd_cache_hit"),
                          "aot_cache_misses": ("aot_autograd", "autograd_cache_miss")}


def _compile_cache_counts() -> dict[str, int]:
    """This process's torch.compile cache hits and misses so far (0 each before anything compiled)."""
    if "torch._dynamo" not in sys.modules:
        return dict.fromkeys(COMPILE_CACHE_COUNTERS, 0)
    _, counters = compat.TORCH_DYNAMO_COUNTERS.load()
    return {name: int(counters[group][key]) for name, (group, key) in COMPILE_CACHE_COUNTERS.items()}


class StartupClock:
    """Where the time from the job's start to the end of the first optimizer step went.

    The phases split that span without overlap: `ray_workers` up to this clock's creation in the worker, then
    each phase and part ends where the loop marks it (`mark`); `finish()` ends `first_step`, less the
    torch.compile time inside it (`compile`)."""

    def __init__(self, job_start: float | None = None, marks: dict | None = None,
                 workers_asked: float | None = None):
        now = time.time()
        self.job_start = job_start or now
        self.seconds = dict.fromkeys(STARTUP_PHASES, 0.0)
        self.seconds["ray_workers"] = max(0.0, now - self.job_start)
        ray_parts = _ray_workers_parts(self.job_start, marks, now, workers_asked) if job_start else {}
        self.parts = {f"ray_workers.{p}": v for p, v in ray_parts.items()}   # "<phase>.<part>": seconds
        self._mark, self._inner, self._compiled = now, 0.0, _compile_seconds()
        self._cache_counts = _compile_cache_counts()
        self._part_mark, self._part_inner = now, 0.0
        self.done: dict | None = None
        self.figures: dict[str, float] = {}     # `startup/<name>` values beside the phases (`note`)
        self.attempt = 1    # Ray Train's attempt of this job: a later one's scheduling part holds the earlier ones

    def mark(self, name: str, since: float | None = None) -> None:
        """`name` (a phase of STARTUP_PHASES, or `<phase>.<part>` of PHASE_PARTS) ends now.

        Without `since`, it ran from the previous mark: a phase from the previous phase's end, a part from the
        previous part's (or phase's) end, less what marks with `since` took inside it. With `since` (epoch
        seconds), it is the block from then to now: a phase so marked is taken out of the one it ran inside
        (the kernel check out of the model build); a part adds to its phase's parts. Nothing counts once
        the clock has finished."""
        if self.done is not None:
            return
        now = time.time()
        phase, _, part = name.partition(".")
        if since is not None:
            dt = max(0.0, now - since)
            if part:
                self.parts[name] = self.parts.get(name, 0.0) + dt
            else:
                self.seconds[phase] += dt
                self._inner += dt
                self._part_inner += dt
            return
        if part:
            self.parts[name] = self.parts.get(name, 0.0) + max(0.0, now - self._part_mark - self._part_inner)
        else:
            self.seconds[phase] += max(0.0, now - self._mark - self._inner)
            self._mark, self._inner, self._compiled = now, 0.0, _compile_seconds()
        self._part_mark, self._part_inner = now, 0.0

    def note(self, prefix: str, figures: dict) -> None:
        """Figures about the start-up that are not time spans of it (e.g. the JIT cache a node unpacked),
        reported as `startup/<prefix>.<name>` beside the phases."""
        self.figures |= {f"startup/{prefix}.{k}": v for k, v in figures.items()}

    def finish(self) -> dict:
        """The start-up breakdown, `startup/<phase>_s` seconds (once: later calls return the first answer)."""
        if self.done is None:
            compiled = max(0.0, _compile_seconds() - self._compiled)
            self.seconds["compile"] += compiled
            self._inner += compiled
            self.mark("first_step")
            self.done = {f"startup/{p}_s": self.seconds[p] for p in STARTUP_PHASES}
            self.done["startup/total_s"] = self._mark - self.job_start
            self.done |= {f"startup/{p}_s": v for p, v in self.parts.items()} | self.figures
            looked_up = {k: v - self._cache_counts[k] for k, v in _compile_cache_counts().items()}
            if any(looked_up.values()):     # only where something was compiled
                self.done |= {f"startup/compile.{k}": v for k, v in looked_up.items()}
        return self.done

    def _label(self, phase: str, part: str) -> str:
        if phase == "ray_workers" and part == "scheduling" and self.attempt > 1:
            return f"earlier attempts, then attempt {self.attempt}'s trainer and worker scheduling"
        return PHASE_PARTS[phase][part]

    def line(self) -> str:
        m = self.finish()
        parts = [f"{label} {m[f'startup/{p}_s']:.1f} s" for p, label in STARTUP_PHASES.items()]
        for i, phase in enumerate(STARTUP_PHASES):
            inner = [(k.split(".", 1)[1], v) for k, v in self.parts.items() if k.startswith(phase + ".")]
            if inner:
                parts[i] += " (" + ", ".join(f"{self._label(phase, p)} {v:.1f}" for p, v in inner) + ")"
        if "startup/compile.fx_cache_hits" in m:
            c = {k.split(".", 1)[1]: int(v) for k, v in m.items() if k.startswith("startup/compile.")}
            i = list(STARTUP_PHASES).index("compile")
            parts[i] += (f" (graphs from the cache: Inductor {c['fx_cache_hits']} of "
                         f"{c['fx_cache_hits'] + c['fx_cache_misses']}, AOT autograd {c['aot_cache_hits']} of "
                         f"{c['aot_cache_hits'] + c['aot_cache_misses']})")
        return f"start-up {m['startup/total_s']:.1f} s to the end of the first step: {', '.join(parts)}"


@dataclass(frozen=True)
class JobStart:
    """When the job started (epoch seconds) and the driver's start-up marks after it (`DRIVER_MARKS`), where
    the start-up breakdown counts from; `at` None: from this clock's creation in the worker."""
    at: float | None = None
    marks: dict | None = None


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
