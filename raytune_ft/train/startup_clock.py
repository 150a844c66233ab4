"""The start-up breakdown of a training worker: where the time from the job's start to the end of its first
optimizer step went (Ray and workers, model build, kernel check, compile, held-out data, first step), each phase
split into the parts the driver and the loop mark."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from raytune_ft import compat

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
