"""The GPU benchmarks a user runs on a GPU node: `python -m bench gpu SUBCOMMAND` (bench/README.md).

Each subcommand is a list of parts; each part is one process under its own time limit (a crash, an
out-of-memory or a hang costs that part, not the others), on the GPUs of `--gpus`. A part's output is
passed through; its `RESULT {json}` lines and the figures read from the run (summary.json, the run's
MLflow store) become a dated record in bench/results/<date>.jsonl (bench/records.py) and one `RESULT`
line of the bench's own.

The throughput runs go through Ray Train as a user's job does: jobs/qwen27b_b300.py as it ships (fp32
master weights, full activation checkpointing, train.compile, 32,768-token blocks), with random weights
of the real Qwen3.8-27B config cut to 8 layers per GPU (8.6 B parameters with fp32 weights, gradients and
AdamW state fill one H200 beside 32k activations), generated conversations, and no final checkpoint.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from bench import gpu_lora, records
from bench.figures import metric_windows, throughput_figures  # noqa: F401  (the kit's figures)

REPO = records.REPO
PY = sys.executable
SUBCOMMANDS = ("suite", "speed", "fp8", "parity", "kernel-check", "startup", "imports", "eval", "recovery",
               "lora", "all")
# a fresh node JIT-compiles the fla/tilelang/Triton kernels and the compiled layers before the first step
# (minutes); each part's limit leaves room for that
DEFAULT_TIMEOUT_S = {"suite": 560, "speed": 540, "fp8": 540, "parity": 580, "kernel-check": 300,
                     "startup": 540, "imports": 300, "eval": 540, "recovery": 580, "lora": 540}
STARTUP_KEYS = ("ray_workers_s", "model_build_s", "kernel_check_s", "compile_s", "eval_setup_s", "first_step_s",
                "total_s")
SUITE_PARTS = {"kernels": ["tests/gpu/test_packed_equality.py", "tests/gpu/test_kernel_check_gpu.py"],
               "ray": ["tests/gpu/test_fsdp_ray_gpu.py"]}


@dataclasses.dataclass
class Part:
    label: str
    argv: list[str]
    timeout_s: int
    env: dict = dataclasses.field(default_factory=dict)
    read: Callable[["Part", str, list[dict]], dict] | None = None   # (part, output, RESULT dicts) -> figures
    prepare: Callable[[], None] | None = None                       # runs just before the part (not in --dry-run)
    cleanup: Callable[[], None] | None = None                       # runs after it, however it ended
    info: dict = dataclasses.field(default_factory=dict)           # settings recorded with the figures
    bench: str = ""                                                 # the subcommand it belongs to


# ---------------------------------------------------------------- running a part

def run_process(argv: list[str], env: dict, timeout_s: int) -> tuple[int | str, str]:
    """Run `argv` in the repository root, passing its output through; (exit code or 'timeout', output).
    At the limit the whole process group goes (a Ray job's workers with it)."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", process_group=0)
    timed_out = threading.Event()

    def kill():
        timed_out.set()
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                pass

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line)
        proc.wait()
    finally:
        timer.cancel()
    sys.stdout.flush()
    return ("timeout" if timed_out.is_set() else proc.returncode), "".join(lines)


def result_lines(output: str) -> list[dict]:
    """The JSON of every `RESULT {...}` line (Ray prefixes worker lines with their actor name)."""
    out = []
    for m in re.finditer(r"RESULT (\{.*\})\s*$", output, flags=re.M):
        try:
            out.append(json.loads(m.group(1)))
        except json.JSONDecodeError:
            pass
    return out


def part_env(gpus: str | None, extra: dict) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_COLOR_PREFIX": "0", "TOKENIZERS_PARALLELISM": "false",
           **extra}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def run_parts(bench: str, parts: list[Part], opts) -> list[dict]:
    """Run (or with --dry-run print) each part; one RESULT line and one dated record per part."""
    out = []
    for part in parts:
        bench = part.bench or bench
        cmd = shlex.join(part.argv)
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in part.env.items())
        print(f"=== {bench} / {part.label}: {(shown + ' ') if shown else ''}{cmd}  (limit {part.timeout_s} s)",
              flush=True)
        if opts.dry_run:
            continue
        figures: dict = {}
        try:
            if part.prepare:
                part.prepare()
            t0 = time.time()
            code, output = run_process(part.argv, part_env(opts.gpus, part.env), part.timeout_s)
            try:
                figures = part.read(part, output, result_lines(output)) if part.read else {}
            except Exception as e:   # a run that ended early leaves less to read; the record says so
                figures = {"unreadable": f"{type(e).__name__}: {e}"}
        finally:   # after the figures are read (a Ray head the reading asks)
            if part.cleanup:
                part.cleanup()
        rec = {"bench": bench, "label": part.label, "exit": code, "seconds": round(time.time() - t0, 1),
               "gpus": opts.gpus, "command": cmd, "env": part.env, "settings": part.info, "figures": figures}
        path = records.append(opts.results, rec)
        print("RESULT " + json.dumps({k: rec[k] for k in ("bench", "label", "exit", "seconds", "figures")},
                                     default=str), flush=True)
        print(f"=== {bench} / {part.label}: exit {code}, {rec['seconds']} s; record appended to {path}", flush=True)
        out.append(rec)
    return out


# ---------------------------------------------------------------- reading a Ray Train run

def run_summary(storage: str, run_name: str) -> dict:
    with open(os.path.join(storage, run_name, "summary.json")) as f:
        return json.load(f)


def shipped_figures(summary: dict) -> dict:
    """A run with evaluation, samples and checkpoints as shipped: the training steps alone (`throughput_figures`)
    and end to end, from the end of the first window (its compiles left out) to the last metric the run logged
    (the end's held-out loss and samples): tokens over wall seconds, and the seconds that were not steps."""
    import mlflow

    from raytune_ft.tracking.mlflow_run import mlflow_metric_name

    fig = throughput_figures(summary)
    client = mlflow.MlflowClient(summary["tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    tokens = sorted(client.get_metric_history(summary["mlflow_run_id"], mlflow_metric_name("tokens")),
                    key=lambda m: (m.step, m.timestamp))
    if not tokens:
        return fig | {"end_to_end": "no tokens metric"}
    first = tokens[0]
    # the nodes' system metrics go on until the run is ended, after the loop: not the loop's end
    last_ms = max(m.timestamp for m in run.data._metric_objs if not m.key.startswith("system/"))
    wall = (last_ms - first.timestamp) / 1000.0
    done = max(m.value for m in tokens)
    steps_s = (done - first.value) / fig["tok_s"] if fig.get("tok_s") else None
    fig["end_to_end_tok_s"] = round((done - first.value) / wall) if wall > 0 else None
    fig["end_to_end_seconds"] = round(wall, 1)
    if steps_s is not None:
        fig["end_to_end_not_steps_s"] = round(wall - steps_s, 1)
    # the samples' seconds are in the run's samples.json table and the log, not in its metrics
    hist = client.get_metric_history(summary["mlflow_run_id"], mlflow_metric_name("eval/seconds"))
    by_step = {m.step: round(m.value, 1) for m in hist}      # the final report repeats the last step's
    fig["eval_seconds"] = [by_step[k] for k in sorted(by_step)]
    if fig.get("tok_s") and fig.get("end_to_end_tok_s"):
        fig["end_to_end_over_steps"] = round(fig["end_to_end_tok_s"] / fig["tok_s"], 3)
    return fig


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def eval_figures(summary: dict) -> dict:
    """Every evaluation or sampling time the run recorded: summary.json's fields and the MLflow metrics whose
    name says eval/validation/sample and seconds."""
    pattern = re.compile(r"(eval|validation|sample).*(seconds|_s)$")
    fig = {k: v for k, v in _flat(summary).items() if pattern.search(k.lower()) and isinstance(v, (int, float))}
    try:
        import mlflow

        client = mlflow.MlflowClient(summary["tracking_uri"])
        run = client.get_run(summary["mlflow_run_id"])
        fig.update({f"mlflow.{k}": v for k, v in run.data.metrics.items() if pattern.search(k.lower())})
    except Exception as e:   # the summary's fields still stand
        fig["mlflow"] = f"unreadable ({type(e).__name__})"
    fig["best_loss"] = summary.get("best_loss")
    if len(fig) == 1:
        fig["note"] = "no eval/sample seconds recorded by this version of the loop"
    return fig


# where the machine's own compilers keep their caches when no variable points elsewhere (the job points
# Triton's, tilelang's and Inductor's into train.cache_dir); `startup --part cold/storage` removes them all, and
# the job's own default folder (train/jit_cache.DEFAULT_ROOT)
LOCAL_CACHE_DIRS = ("~/.triton", "~/.tilelang", "~/.cache/tilelang", "~/.nv/ComputeCache", "~/.cache/flashinfer")


def clear_local_caches() -> list[str]:
    """Remove this machine's default compiler caches and Inductor's default folder; the ones removed."""
    import getpass

    from raytune_ft.train.jit_cache import DEFAULT_ROOT

    folders = [os.path.expanduser(d) for d in (*LOCAL_CACHE_DIRS, DEFAULT_ROOT)]
    folders.append(os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    gone = [d for d in folders if os.path.isdir(d)]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


def stored_cache_sets(storage: str) -> dict:
    """The cache sets in the run storage (`<storage>/jit_cache/*.tar`, the bytecode's in `bytecode/`):
    name -> MiB."""
    from raytune_ft.train.jit_cache import BytecodeSet, JitCache

    out = {}
    for sub in (JitCache.SETS, BytecodeSet.SETS):
        folder = os.path.join(storage, sub)
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        out.update({n: round(os.path.getsize(os.path.join(folder, n)) / 2**20, 1) for n in names if n.endswith(".tar")})
    return out


def startup_side_by_side(cold: dict, warm: dict) -> dict:
    """summary.json's `startup` dicts of the cold and the warm run, key by key."""
    c, w = cold.get("startup") or {}, warm.get("startup") or {}
    if not c and not w:
        return {"note": "summary.json has no 'startup' dict (this version of the loop does not record it)"}
    keys = [k for k in STARTUP_KEYS if k in c or k in w] + sorted((set(c) | set(w)) - set(STARTUP_KEYS))
    return {k: {"cold": c.get(k), "warm": w.get(k)} for k in keys}


# ---------------------------------------------------------------- the parts of each subcommand

class Kit:
    """The parts of each subcommand for one set of options (GPUs, work folder, assets, CPU smoke)."""

    def __init__(self, opts):
        self.o = opts
        self.n_gpus = max(1, len(opts.gpus.split(","))) if opts.gpus else 0
        self.work = opts.workdir
        self.storage = os.path.join(self.work, "runs")
        self.stamp = time.strftime("%Y%m%d-%H%M%S")

    def limit(self, bench: str) -> int:
        return self.o.timeout or DEFAULT_TIMEOUT_S[bench]

    # -- the 27B recipe cut, through Ray Train
    def layers(self) -> int:
        return self.o.layers or min(64, 8 * max(1, self.n_gpus))

    def model_dir(self) -> str:
        return os.path.join(self.work, f"qwen3.8-27b-{self.layers()}layers")

    def write_model_config(self) -> None:
        if self.o.cpu_smoke or os.path.isdir(self.model_dir()):
            return
        from raytune_ft.models.tiny import real_config

        real_config("qwen3.8-27b", num_hidden_layers=self.layers()).save_pretrained(self.model_dir())

    def job_argv(self, run_name: str, steps: int, extra: list[str], as_shipped: bool = False) -> list[str]:
        """`as_shipped`: held-out loss and samples as the recipe ships them (its prompts, its lengths), at a
        checkpoint every `--ckpt-every` steps; otherwise training alone (start-up, imports, eval's own)."""
        if as_shipped:
            ckpt = self.ckpt_every(steps)
            probes = ["--set", f"train.eval_every={ckpt or steps // 2}", "--set", f"train.checkpoint_every={ckpt or 1000}"]
            if not self.o.cpu_smoke:     # generated data has no held-out split of its own: 5% held out
                probes += ["--set", "data.validation_split=none", "--set", "data.validation_fraction=0.05"]
        else:
            probes = ["--set", "train.checkpoint_every=1000", "--set", "train.eval_every=0",
                      "--set", "train.sample_prompts=0"]
        common = ["--set", "train.save_final=false",
                  "--set", "registry.enabled=false", "--set", f"tracking.storage_path={self.storage}",
                  "--set", f"tracking.run_name={run_name}", "--set", f"train.max_steps={steps}",
                  "--set", f"train.log_every={self.o.log_every}", *probes,
                  # one JIT cache folder for the kit's runs (start-up's pair brings a fresh one of its own): a
                  # run after the first does not spend its time limit compiling what an earlier one compiled
                  "--set", f"train.cache_dir={os.path.join(self.work, 'jit-cache')}"]
        if self.o.cpu_smoke:   # the same recipe's --local form: tiny qwen3_5, local Ray on CPU
            return [PY, "jobs/qwen27b_b300.py", "--local", "--no-register", *common, *extra, *self.user_settings()]
        n = self.n_gpus
        rows = max(800, 80 * n * steps)   # ~2,000 conversations fill 64 blocks of 32k: some to spare
        argv = [PY, "jobs/qwen27b_b300.py", "--no-register", "--set", f"model.name={self.model_dir()}",
                "--set", "model.init=random", "--set", "model.revision=none",
                "--set", f"data.source=builtin:lognormal:{rows}", "--set", "data.revision=none",
                "--set", f"scaling.num_workers={n}", "--set", f"scaling.gpus_per_node={n}", *common]
        if self.o.tokenizer:
            argv += ["--set", f"model.tokenizer={self.o.tokenizer}"]
        if self.o.chat_template:
            argv += ["--set", f"model.chat_template={self.o.chat_template}"]
        return argv + extra + self.user_settings()

    def ckpt_every(self, steps: int) -> int:
        """speed and fp8's checkpoint interval: `--ckpt-every`, by default one checkpoint half-way (0: none)."""
        return steps // 2 if self.o.ckpt_every is None else self.o.ckpt_every

    def user_settings(self) -> list[str]:
        """The command line's `--set KEY=VALUE`s, last, so they win over the kit's own."""
        return [a for kv in self.o.set for a in ("--set", kv)]

    def recipe_run(self, bench: str, label: str, extra: list[str], read, steps: int | None = None,
                   env: dict | None = None, as_shipped: bool = False) -> Part:
        name = f"bench-{label}-{self.stamp}"
        steps = steps or self.o.steps
        info = {"run_name": name, "storage": self.storage, "steps": steps, "log_every": self.o.log_every}
        if as_shipped:
            info |= {"eval_and_samples": "as shipped", "eval_every": self.ckpt_every(steps) or steps // 2,
                     "checkpoint_every": self.ckpt_every(steps) or None}
        if not self.o.cpu_smoke:
            info |= {"model": "Qwen3.8-27B config", "layers": self.layers(), "gpus": self.n_gpus, "seq_len": 32768,
                     "master_weights": "fp32", "init": "random"}
        for kv in self.o.set:
            key, _, value = kv.partition("=")
            info["master_weights" if key == "train.master_weights" else key] = value
        return Part(label, self.job_argv(name, steps, extra, as_shipped), self.limit(bench), env=env or {},
                    read=lambda p, out, res: read(run_summary(self.storage, name)),
                    prepare=self.write_model_config, info=info)

    def speed(self) -> list[Part]:
        return [self.recipe_run("speed", "bf16", [], shipped_figures, as_shipped=True)]

    def fp8(self) -> list[Part]:
        parts = []
        for precision in self.o.precisions.split(","):
            if precision == "bf16":
                parts.append(self.recipe_run("fp8", "bf16", [], shipped_figures, as_shipped=True))
            elif self.o.cpu_smoke:
                print("fp8: float8 needs a Hopper or newer GPU; the CPU smoke runs the bf16 half only")
            else:
                parts.append(self.recipe_run("fp8", f"fp8-{self.o.fp8_recipe}",
                                             ["--set", "train.precision=fp8",
                                              "--set", f"train.fp8_recipe={self.o.fp8_recipe}"], shipped_figures,
                                             as_shipped=True))
        return parts

    def recovery(self) -> list[Part]:
        """A run whose training worker is SIGKILLed once its first checkpoint is registered (bench/recovery.py):
        the seconds from the kill to the next attempt's first step."""
        every = 2
        part = self.recipe_run("recovery", "kill", ["--set", f"train.checkpoint_every={every}",
                                                    "--set", "scaling.max_failures=1", "--set", "train.log_every=1"],
                               lambda summary: {}, steps=max(self.o.steps, 3 * every))
        run_dir = os.path.join(self.storage, part.info["run_name"])
        part.argv = [PY, "bench/recovery.py", "--run-dir", run_dir, "--timeout", str(self.limit("recovery")), "--",
                     *part.argv]
        part.read = lambda p, out, res: res[-1] if res else {}
        part.info["checkpoint_every"] = every
        return [part]

    def startup(self) -> list[Part]:
        if self.o.part == "resubmit":
            return self.resubmit()
        # the same storage and JIT/compile caches for both runs, each in a fresh process: the second finds
        # what the first compiled. The job's own cache folder (train.cache_dir), fresh for this bench: the
        # cold run fills it. `--part cold` and `--part warm` run one each, in two invocations with the same
        # --workdir (the warm one reads the cold one's folder and summary there)
        which = ("cold", "warm") if self.o.part == "all" else (self.o.part,)
        if any(w not in ("cold", "warm", "storage") for w in which):
            raise SystemExit(f"startup --part: cold, warm, storage, resubmit or all, not {self.o.part}")
        folder = "jit-cache-" + (self.stamp if self.o.part == "all" else "startup")
        cache = ["--set", f"train.cache_dir={os.path.join(self.work, folder)}"]
        cold_file = os.path.join(self.work, "startup-cold.json")
        steps = min(self.o.steps, 4)

        def prepare():
            self.write_model_config()
            if which not in (("cold",), ("storage",)):
                return
            # a fresh node: an empty cache folder and no other compiler cache on the machine (the storage's set
            # stays); a CPU smoke run leaves this machine's own caches alone
            shutil.rmtree(os.path.join(self.work, folder), ignore_errors=True)
            for gone in [] if self.o.cpu_smoke else clear_local_caches():
                print(f"startup {which[0]}: removed {gone}", flush=True)

        def keep(label):
            def read(summary):
                if label == "cold":     # kept for the warm run, in this invocation or a later one
                    with open(cold_file, "w") as f:
                        json.dump(summary, f)
                    return {"startup": summary.get("startup")}
                cold = {}
                if os.path.isfile(cold_file):
                    with open(cold_file) as f:
                        cold = json.load(f)
                fig = {"startup": summary.get("startup"), "cold_vs_warm": startup_side_by_side(cold, summary)}
                if label == "storage":
                    fig["storage_sets"] = stored_cache_sets(self.storage)
                return fig
            return read

        parts = [self.recipe_run("startup", w, cache, keep(w), steps=steps) for w in which]
        for p in parts:
            p.prepare = prepare
        return parts

    def resubmit(self) -> list[Part]:
        """The warm start as a user re-submits a job: a Ray head started once (`ray start --head`, its
        dashboard on loopback), then two `ray job submit --working-dir . -- python jobs/qwen27b_b300.py` on it,
        with the start-up pair's JIT cache folder (run `--part cold` first, with the same --workdir). The
        figures: the run's breakdown (from Ray's acceptance of the submission) and `submit_to_first_step_s`,
        from the moment `ray job submit` is started."""
        # on CPU, logical CPUs above the cores (as the job's --local Ray has): two training workers and Ray
        # Data's tasks on a 2-core machine
        cpus = max(8, 2 * (os.cpu_count() or 2)) if self.o.cpu_smoke else None
        head = RayHead(self.n_gpus, cpus)
        cache = ["--set", f"train.cache_dir={os.path.join(self.work, 'jit-cache-startup')}"]
        steps = min(self.o.steps, 4)
        parts = []
        for i in (1, 2):
            label = f"resubmit-{i}"
            part = self.recipe_run("startup", label, cache, lambda summary: {}, steps=steps)
            sid = part.info['run_name']
            part.argv = [PY, "-m", "ray.scripts.scripts", "job", "submit", "--address", head.address,
                         "--submission-id", sid, "--working-dir", REPO, "--", *part.argv]
            part.env = {"RAY_AUTH_MODE": "token"}
            submitted: dict = {}

            def prepare(first=(i == 1), submitted=submitted):
                self.write_model_config()
                if first:
                    head.start(part_env(self.o.gpus, {"RAY_AUTH_MODE": "token"}))
                submitted["cli"] = time.time()

            def read(p, out, res, name=part.info["run_name"], sid=sid, submitted=submitted):
                summary = run_summary(self.storage, name)
                startup = summary.get("startup") or {}
                fig = {"startup": startup, "submission_id": sid}
                accepted = head.job_start_time(sid)
                if accepted is not None and "total_s" in startup:
                    # `ray job submit`'s own start (its imports, the working directory's upload) is the gap
                    # between the command's start and Ray's acceptance; the run counts from the acceptance
                    fig["submit_command_s"] = round(accepted - submitted["cli"], 3)
                    fig["submit_to_first_step_s"] = round(accepted - submitted["cli"] + startup["total_s"], 3)
                return fig

            part.prepare, part.read = prepare, read
            if i == 2:
                part.cleanup = head.stop
            parts.append(part)
        return parts

    def eval(self) -> list[Part]:
        every = max(1, self.o.steps // 2)
        extra = ["--set", "data.validation_split=none", "--set", "data.validation_fraction=0.05",
                 "--set", f"train.eval_every={every}",
                 "--set", f"train.sample_prompts={self.o.sample_prompts}"]
        return [self.recipe_run("eval", "eval-sample", extra, eval_figures)]

    # -- the GPU test suite, the start-up check, loss parity
    def suite(self) -> list[Part]:
        parts = []
        names = list(SUITE_PARTS) if self.o.part == "all" else [self.o.part]
        if any(n not in SUITE_PARTS for n in names):
            raise SystemExit(f"suite --part: {', '.join(SUITE_PARTS)} or all, not {self.o.part}")
        if self.o.cpu_smoke:   # on CPU every GPU test is skipped with its reason
            names = ["kernels"]
        for name in names:
            junit = os.path.join(self.work, f"suite-{name}-{self.stamp}.xml")
            limit = self.limit("suite")
            argv = [PY, "-m", "pytest", "-m", "gpu", *SUITE_PARTS[name], "-v", "-s", "-ra", "-p", "no:cacheprovider",
                    f"--timeout={max(30, limit - 20)}", f"--junitxml={junit}"]
            parts.append(Part(f"suite-{name}", argv, limit, read=lambda p, out, res, j=junit: junit_counts(j, res),
                              prepare=lambda: os.makedirs(self.work, exist_ok=True)))
        return parts

    def imports(self) -> list[Part]:
        """The worker's import sequence, stage by stage (bench/worker_imports.py), twice in fresh processes: the
        first may read the files from disk, the second from the page cache, as a re-submit does (once with
        --cpu-smoke)."""
        argv = [PY, "bench/worker_imports.py"]
        argv += ["--cpu"] if self.o.cpu_smoke else (["--tokenizer", self.o.tokenizer] if self.o.tokenizer else [])
        def read(p, out, res):
            return res[-1] if res else {}

        # the CPU smoke checks the wiring once each way (a fresh bytecode folder needs a second process to be
        # read): 3 fresh processes, not 5 (~10 s each on 2 cores)
        plain, kept = ((1,), (1, 2)) if self.o.cpu_smoke else ((1, 2), (1, 2, 3))
        parts = [Part(f"imports-{i}", argv, self.limit("imports"), read=read) for i in plain]
        # then as a job's processes start where the image writes no bytecode (env.keep_bytecode): a fresh
        # folder filled by the first, read by the next ones; the same as above where Python writes its own
        folder = os.path.join(self.work, "imports-bytecode")
        bytecode = {"PYTHONPYCACHEPREFIX": folder, "PYTHONDONTWRITEBYTECODE": ""}
        for i in kept:
            part = Part(f"imports-bytecode-{i}", argv, self.limit("imports"), env=bytecode, read=read)
            if i == 1:
                part.prepare = lambda: shutil.rmtree(folder, ignore_errors=True)
            parts.append(part)
        return parts

    def kernel_check(self) -> list[Part]:
        shapes = [("qwen3.8-27b", []), ("qwen3-4b", ["--liger"])]
        if self.o.cpu_smoke:
            shapes = shapes[1:]
        return [Part(f"kernel-check-{m}", [PY, "-m", "raytune_ft.models.kernel_check", "--model", m, *flags,
                                           "--repeat", "2"], self.limit("kernel-check"),
                     read=lambda p, out, res: {"runs": [r for r in res if "kernel_check" in r]})
                for m, flags in shapes]

    def parity(self) -> list[Part]:
        out = os.path.join(self.work, f"parity-{self.stamp}")
        if self.o.cpu_smoke:
            argv = [PY, "bench/fp8_parity.py", "--steps", "6", "--log-every", "2", "--warmup", "2", "--cpu-check",
                    "--builtin-rows", "200", "--out", out]
            env = {"SHAPE": "tiny", "DEVICE": "cpu"}
        else:
            argv = [PY, "bench/fp8_parity.py", "--stdlib-rows", "9000", "--builtin-rows", "0", "--lr", "3e-4",
                    "--steps", str(self.o.parity_steps), "--recipes", "tensorwise,rowwise", "--bf16-seeds", "2",
                    "--out", out]
            if self.o.tokenizer:
                argv += ["--tokenizer", self.o.tokenizer]
            if self.o.rows:
                argv += ["--rows", *self.o.rows]
            env = {}
        return [Part("parity", argv, self.limit("parity"), env=env,
                     read=lambda p, o, res: {"compare": next((r["compare"] for r in res if "compare" in r), None),
                                             "out": out},
                     prepare=lambda: os.makedirs(out, exist_ok=True))]

    def parts(self, bench: str) -> list[Part]:
        if bench == "all":   # fp8's bf16 run is speed's figure
            return [p for b in ("suite", "kernel-check", "fp8", "parity", "startup", "imports", "eval")
                    for p in self.parts(b)]
        parts = {"suite": self.suite, "speed": self.speed, "fp8": self.fp8, "parity": self.parity,
                 "kernel-check": self.kernel_check, "startup": self.startup, "imports": self.imports,
                 "eval": self.eval, "recovery": self.recovery, "lora": lambda: gpu_lora.parts(self)}[bench]()
        for p in parts:
            p.bench = bench
        return parts


class RayHead:
    """A Ray head of the bench's own (`ray start --head`, token authentication with the user's token, dashboard and
    job server on loopback, free ports, a temp folder of its own), stopped by its processes (`ray stop` would
    stop every Ray of the machine)."""

    def __init__(self, gpus: int, cpus: int | None = None):
        import socket

        def free() -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        # Ray's sockets live in its temp folder and a socket path has at most 107 bytes: a short folder of
        # its own under the system's temporary folder, not the (maybe long) work folder
        self.temp, self.gpus, self.cpus = "", gpus, cpus
        self.ports = {k: free() for k in ("port", "dashboard-port", "dashboard-agent-listen-port",
                                         "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")}
        self.address = f"http://127.0.0.1:{self.ports['dashboard-port']}"

    def start(self, env: dict) -> None:
        self.temp = tempfile.mkdtemp(prefix="raytune-head-")
        # as the README's cluster commands: with RAY_AUTH_MODE=token `ray start` needs a token and makes none;
        # this makes ~/.ray/auth_token where there is none (a fresh node) and prints it, so not to the log
        subprocess.run([PY, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120, check=False)
        argv = [PY, "-m", "ray.scripts.scripts", "start", "--head", "--node-ip-address=127.0.0.1",
                "--dashboard-host=127.0.0.1", "--disable-usage-stats", f"--temp-dir={self.temp}",
                *(f"--{k}={v}" for k, v in self.ports.items())]
        if self.gpus:
            argv.append(f"--num-gpus={self.gpus}")
        if self.cpus:
            argv.append(f"--num-cpus={self.cpus}")
        print("=== ray head: " + shlex.join(argv), flush=True)
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"ray start failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        self._wait_for_job_agent(env)

    def _wait_for_job_agent(self, env: dict, timeout_s: float = 180) -> None:
        """The job server and the node's job agent come up after `ray start` returns; a submit before the agent
        listens answers "No available agent to submit job"."""
        import socket

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.ports["dashboard-agent-listen-port"]), timeout=2).close()
            except OSError:
                time.sleep(1)
                continue
            out = subprocess.run([PY, "-m", "ray.scripts.scripts", "job", "list", "--address", self.address],
                                 env=env, capture_output=True, text=True, timeout=120)
            if out.returncode == 0:
                return
            time.sleep(2)
        print("=== ray head: the job server did not answer `ray job list` in time; submitting anyway", flush=True)

    def job_start_time(self, submission_id: str) -> float | None:
        """When Ray accepted the submission (epoch seconds), from its job server."""
        try:
            os.environ.setdefault("RAY_AUTH_MODE", "token")
            from ray.job_submission import JobSubmissionClient

            info = JobSubmissionClient(self.address).get_job_info(submission_id)
            return info.start_time / 1000.0 if info.start_time else None
        except Exception as e:  # noqa: BLE001 - the run's own breakdown still stands
            print(f"=== ray head: could not read job {submission_id}: {type(e).__name__}: {e}", flush=True)
            return None

    def stop(self) -> None:
        if self.temp:
            stop_ray_head(self.temp)


def stop_ray_head(temp: str) -> list:
    """Kill the processes of the Ray head whose temp folder is `temp`, and only those (`ray stop` would stop
    every Ray of the machine): its own, found by the folder on their command lines, and their children (Ray's
    workers retitle themselves `ray::...`). Killed at once, as a head of a bench or a test keeps nothing (SIGTERM
    let the GCS and the dashboard wind down for 5-20 s); the processes still alive 10 s later are returned."""
    import psutil

    mine = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(temp) in arg for arg in (p.info["cmdline"] or [])):
                mine.update({q.pid: q for q in [p, *p.children(recursive=True)]})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in mine.values():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return psutil.wait_procs(list(mine.values()), timeout=10)[1]


def junit_counts(path: str, results: list[dict]) -> dict:
    """passed / failed / errors / skipped from pytest's junit report, and the tests' own RESULT lines."""
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    skipped_why = set()
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {c.tag: c for c in case}
        if "failure" in kinds:
            counts["failed"] += 1
        elif "error" in kinds:
            counts["errors"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
            skipped_why.add(kinds["skipped"].get("message", ""))
        else:
            counts["passed"] += 1
    return {**counts, "skip_reasons": sorted(skipped_why), "test_results": results}


# ---------------------------------------------------------------- options

def visible_gpus() -> str | None:
    """Every GPU nvidia-smi lists, as CUDA_VISIBLE_DEVICES would name them; None without one."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    ids = [line.strip() for line in text.splitlines() if line.strip()]
    return ",".join(ids) or None


def add_arguments(p) -> None:
    p.add_argument("bench", choices=SUBCOMMANDS)
    p.add_argument("--gpus", default=None, help="GPUs to use, as CUDA_VISIBLE_DEVICES names them (default: every "
                   "GPU nvidia-smi lists); the recipe runs use one Ray Train worker per GPU")
    p.add_argument("--dry-run", action="store_true", help="print each part's command and exit")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the same paths at a tiny shape on CPU (recipe runs use the job's --local form)")
    p.add_argument("--timeout", type=int, default=None,
                   help="seconds per part (default per subcommand: 300-580, above a fresh node's JIT compiles)")
    p.add_argument("--results", default=os.environ.get("BENCH_RESULTS", records.DEFAULT_RESULTS_DIR),
                   help="folder of the dated records (<date>.jsonl)")
    p.add_argument("--workdir", default=None, help="run storage, caches, model config, parity curves "
                   "(default: a new folder under the system's temporary folder)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the 27B cut (default 8 per GPU)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe setting for every recipe run, after the kit's own (e.g. --layers 16 --set "
                        "train.master_weights=bf16 fits the 16-layer cut on one H200)")
    p.add_argument("--steps", type=int, default=8, help="steps of each recipe run (the first window is left out)")
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=None, help="speed, fp8: a checkpoint with the held-out loss "
                   "and samples every N steps (default: half the steps; 0: no checkpoint, the held-out loss at half)")
    p.add_argument("--precisions", default="bf16,fp8", help="fp8: which runs of the pair (bf16, fp8 or both)")
    p.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "mxfp8"])
    p.add_argument("--lora-seq", type=int, default=32768, help="lora: the 64-layer LoRA run's block length")
    p.add_argument("--part", default="all",
                   choices=["all", *SUITE_PARTS, "cold", "warm", "storage", "resubmit", "pair", "real"],
                   help="suite: which files (kernels, ray); startup: which run (cold, warm: two invocations with "
                        "one --workdir; storage: after cold, a fresh node (as cold, every local cache removed) with the "
                        "storage's set kept; resubmit: after cold, two `ray job submit`s on a Ray head it starts); "
                        "lora: the cut's pair (full SFT, LoRA) or the real 64 layers alone")
    p.add_argument("--parity-steps", type=int, default=300)
    p.add_argument("--assets", default=os.path.join(REPO, ".bench-assets"),
                   help="a folder with tokenizer/, chat_template.jinja and rows/*.jsonl for nodes without hub "
                        "access (used where present)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: ASSETS/tokenizer, "
                   "else the recipe's)")
    p.add_argument("--chat-template", default=None)
    p.add_argument("--rows", nargs="*", default=None, help="parity: JSONL chat files (default: ASSETS/rows/*.jsonl)")
    p.add_argument("--sample-prompts", default="4",
                   help="eval: train.sample_prompts (N held-out conversations, or a .jsonl file of prompts)")


def resolve(opts) -> None:
    """Defaults that depend on the machine and the assets folder."""
    if opts.cpu_smoke:
        opts.gpus = None
    elif opts.gpus is None or opts.gpus == "all":
        opts.gpus = visible_gpus()
    a = opts.assets
    if opts.tokenizer is None and os.path.isdir(os.path.join(a, "tokenizer")):
        opts.tokenizer = os.path.join(a, "tokenizer")
    if opts.chat_template is None and os.path.isfile(os.path.join(a, "chat_template.jinja")):
        opts.chat_template = os.path.join(a, "chat_template.jinja")
    if opts.rows is None:
        opts.rows = sorted(glob.glob(os.path.join(a, "rows", "*.jsonl")))
    if opts.workdir is None:
        opts.workdir = (os.path.join(tempfile.gettempdir(), "raytune_bench") if opts.dry_run
                        else tempfile.mkdtemp(prefix="raytune_bench_"))


def main(opts) -> int:
    resolve(opts)
    if not opts.cpu_smoke and not opts.gpus and not opts.dry_run:
        print("no GPU found (nvidia-smi lists none): run with --cpu-smoke to check the paths on CPU, "
              "or --dry-run to see the commands", file=sys.stderr)
        return 2
    kit = Kit(opts)
    recs = run_parts(opts.bench, kit.parts(opts.bench), opts)
    if opts.bench in ("fp8", "all") and not opts.dry_run:
        tps = {r["label"].split("-")[0]: r["figures"].get("tok_s") for r in recs if r["bench"] == "fp8"}
        if tps.get("bf16") and tps.get("fp8"):
            ratio = {"bench": "fp8", "label": "ratio", "fp8_over_bf16": round(tps["fp8"] / tps["bf16"], 3)}
            print("RESULT " + json.dumps(ratio), flush=True)
            records.append(opts.results, {**ratio, "gpus": opts.gpus, "figures": tps})
    if opts.bench == "lora" and not opts.dry_run:
        gpu_lora.compare(recs, opts)
    return 0 if all(r["exit"] == 0 for r in recs) else 1
