"""Command line: `raytune-ft run|plan|register|runs`, and the `main()` of each jobs/*.py script.

A job is a Python file in jobs/ that defines `recipe() -> Recipe`, `local(recipe) -> Recipe` (the
--local variant) and `main(argv=None)` (which calls `job_main`). `raytune-ft run JOB` and
`python jobs/JOB.py` do the same thing.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Callable

from raytune_ft.console import is_terminal, setup_driver
from raytune_ft.env import redact
from raytune_ft.recipe.recipe import absolute_local_paths, Recipe, RecipeError, apply_overrides, validate
from raytune_ft.tracking.runs_table import DEFAULT_STORAGE, find_runs, format_runs

RecipeFn = Callable[[], Recipe]
LocalFn = Callable[[Recipe], Recipe]

EPILOG = """examples:
  raytune-ft run qwen27b_b300 --local                 tiny model, local Ray on CPU
  raytune-ft run qwen27b_b300 --set scaling.num_workers=16
  raytune-ft plan qwen3_4b_full --set train.master_weights=bf16
  raytune-ft runs --storage ./runs
  raytune-ft data check qwen27b_b300 --local --set data.source=my.jsonl
  raytune-ft register ./runs/qwen27b-local/checkpoint_<timestamp> --name main.default.qwen27b \\
      --tracking-uri sqlite:///runs/qwen27b-local/mlflow.db
  ray job submit --working-dir . -- raytune-ft run qwen27b_b300
"""


def add_job_flags(p: argparse.ArgumentParser, local_doc: str | None = None) -> argparse.ArgumentParser:
    """The flags every job takes: --local, --set (repeatable), --dry-run, --no-register. `local_doc`: the
    docstring of the job's `local(recipe)`, whose first line says what this job's --local uses."""
    uses = ((local_doc or "").strip().splitlines() or [""])[0].rstrip(".").split(": ", 1)[-1].replace("%", "%%")
    p.add_argument("--local", action="store_true", help="run on local Ray on CPU with a tiny model of the same "
                   "family and generated chat data: no GPU, no model hub, no dataset hub"
                   + (f" (this job: {uses})" * bool(uses)))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a recipe field (repeatable), e.g. --set scaling.num_workers=16")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved recipe and its memory/time plan, then exit (Ray is not started)")
    p.add_argument("--no-register", action="store_true", help="train only; skip the registration task")
    return p


def job_parser(prog: str, description: str | None = None, local_doc: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of a jobs/*.py script."""
    return add_job_flags(argparse.ArgumentParser(prog=prog, description=description), local_doc)


def resolve(recipe_fn: RecipeFn, local_fn: LocalFn, *, local: bool, overrides: list[str]) -> Recipe:
    """Build the job's recipe, apply --local and the --set overrides in that order, and validate it. The job's
    split names follow a source the overrides give (data/specs.follow_source), said on stderr."""
    from raytune_ft.data.specs import follow_source

    recipe = recipe_fn()
    if local:
        recipe = local_fn(recipe)
    job_source = recipe.data.source
    recipe = apply_overrides(recipe, overrides)
    named = {key.split("=", 1)[0].strip().removeprefix("data.").split(".")[0] for key in overrides or []
             if key.strip().startswith("data.")}
    note = follow_source(recipe.data, job_source, named)
    if note:
        print(f"[raytune_ft] {note}", file=sys.stderr, flush=True)
    return validate(absolute_local_paths(recipe))


def resolved_view(recipe: Recipe) -> dict:
    """The recipe as `--dry-run` prints it: what an empty or unset field means, said by name (the linears
    LoRA adapts, the tracking store)."""
    out = recipe.to_dict()
    t = recipe.train
    if t.lora_r and not t.lora_target_modules:
        out["train"]["lora_target_modules"] = _lora_targets(recipe)
    out["tracking"]["tracking_uri"] = recipe.tracking_uri
    return out


def _lora_targets(recipe: Recipe) -> list[str]:
    """The names of the linears LoRA adapts when train.lora_target_modules names none: every linear of every
    layer kind the model has (the FSDP2 loop's FSDP2_LORA_TARGETS among them; the TRL loop's all-linear)."""
    from raytune_ft.planning.shapes import model_shape
    from raytune_ft.recipe.sections import FSDP2_LORA_TARGETS

    try:
        shape, _ = model_shape(recipe)
    except ValueError:      # a model the plan does not know: the names the loop looks for
        return list(FSDP2_LORA_TARGETS) if recipe.train.loop == "fsdp2" else ["all-linear"]
    names = [n for kind in dict.fromkeys(shape.layer_types) for n in shape.adapted_linears(kind, [])]
    names = list(dict.fromkeys(names))
    return [n for n in FSDP2_LORA_TARGETS if n in names] if recipe.train.loop == "fsdp2" else names


def _print_plan(recipe: Recipe, **kwargs) -> None:
    try:
        from raytune_ft.planning.plan import memory_plan
    except ImportError:
        return
    try:
        plan = memory_plan(recipe, **kwargs)
        print(plan.render())
        _print_storage_plan(recipe, plan.shape)
    except ValueError as e:  # an unknown model shape or GPU: the recipe itself is fine
        print(f"(no memory plan: {redact(str(e))})")


def _print_storage_plan(recipe: Recipe, shape) -> None:
    """What the run writes to tracking.storage_path: per checkpoint, the export, the peak (`shape`: the
    model shape the memory plan just read)."""
    from raytune_ft.planning.disk import storage_plan

    print("\n".join(storage_plan(recipe, shape).lines()))


def job_main(recipe_fn: RecipeFn, local_fn: LocalFn, argv: list[str] | None = None, *, prog: str = "job") -> int:
    """Parse a job's flags, then dry-run or run it; a bad recipe exits 2 before Ray starts.

    Exit codes: 0 trained (and registered when enabled), 1 failed (an input error a worker found mid-run
    too: the line says which checkpoint is kept), 2 bad recipe, unusable storage, a check before Ray starts
    or a run folder another job holds (nothing started), 3 trained but not registered, 130 interrupted
    (Ctrl-C), 143 stopped (SIGTERM, `ray job stop`).
    """
    args = job_parser(prog, (recipe_fn.__doc__ or "").strip() or None, local_fn.__doc__).parse_args(argv)
    try:
        recipe = resolve(recipe_fn, local_fn, local=args.local, overrides=args.overrides)
    except RecipeError as e:
        print(f"error: bad recipe: {redact(str(e))}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(redact(json.dumps(resolved_view(recipe), indent=2, default=str)))   # a tracking URI may carry a password
        _print_plan(recipe)
        return 0
    # Before Ray and the libraries are imported (some switches are read at import), so the driver, the
    # local Ray it starts and the DataContext shipped with the datasets all see them
    from raytune_ft.env import keep_bytecode
    from raytune_ft.train.jit_cache import cache_root, restore_bytecode

    if keep_bytecode(cache_root(recipe), recipe.train.bytecode_cache):
        # a node with empty caches: the bytecode an earlier run left in the storage, before the imports below
        restore_bytecode(recipe, lambda line: print(f"[raytune_ft] {line}", flush=True))
    setup_driver(terminal=is_terminal(sys.stdout))
    from raytune_ft.driver.run import run

    try:
        summary = run(recipe, local=args.local, register=False if args.no_register else None)
    except BaseException as e:  # refused; Ctrl-C, SIGTERM (`ray job stop`), an error: the run closed its MLflow run
        from raytune_ft.driver.endings import exit_lines

        ending = exit_lines(e)
        if ending is None:
            raise
        code, lines = ending
        print("\n".join(lines), file=sys.stderr, flush=True)
        if code == 2:          # refused before anything started: nothing to wait for
            return code
        from raytune_ft.channel import exit_if_abandoned

        exit_if_abandoned(code)    # a store that stopped answering does not hold the exit
        return code
    print("\n".join(summary.lines()), flush=True)
    return 0 if summary.status != "trained_not_registered" else 3


# ------------------------------------------------------------------ jobs by name

def jobs_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs")


def list_jobs() -> list[str]:
    d = jobs_dir()
    if not os.path.isdir(d):
        return []
    return sorted(f[:-3] for f in os.listdir(d) if f.endswith(".py") and not f.startswith("_"))


def _no_job(message: str) -> SystemExit:
    print(f"error: {message}", file=sys.stderr)      # an input error like the others: exit code 2
    return SystemExit(2)


def _load_job(job: str):
    """A job by name (qwen27b_b300) or path (jobs/qwen27b_b300.py)."""
    path = job
    if not os.path.isfile(path):
        cand = os.path.join(jobs_dir(), job if job.endswith(".py") else f"{job}.py")
        if not os.path.isfile(cand):
            known = ", ".join(list_jobs()) or "none found"
            raise _no_job(f"no job {job!r} (looked for {path} and {cand}; jobs: {known})")
        path = cand
    spec = importlib.util.spec_from_file_location(f"raytune_job_{os.path.basename(path)[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _job_recipe(job: str, local: bool, overrides: list[str]) -> Recipe:
    mod = _load_job(job)
    if not (callable(getattr(mod, "recipe", None)) and callable(getattr(mod, "local", None))):
        raise _no_job(f"job {job!r} does not define recipe() and local(recipe)")
    return resolve(mod.recipe, mod.local, local=local, overrides=overrides)


# ------------------------------------------------------------------ register

def cli_register(argv: list[str]) -> int:
    """`raytune-ft register CHECKPOINT --name catalog.schema.model [...]`; returns the exit code.

    Runs the registration in this process (no Ray); a failure is recorded as the post-fit task records it."""
    from raytune_ft.recipe.recipe import validate_registry_name

    ap = argparse.ArgumentParser(
        prog="raytune-ft register",
        description="Register a trained checkpoint (HF folder, Ray Train checkpoint with hf/ or "
                    "adapter/) as an MLflow / Unity Catalog model, task llm/v1/chat.")
    ap.add_argument("checkpoint", help="checkpoint folder or URI (s3://...) with hf/ or adapter/, or a plain HF "
                                       "folder; Ray Train's are <storage>/<run_name>/checkpoint_<timestamp>")
    ap.add_argument("--name", required=True, help="registered model name, catalog.schema.model")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"),
                    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    ap.add_argument("--registry-uri", default=None,
                    help="databricks-uc, uc:http://host:port, or unset for the tracking store")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    ap.add_argument("--run-id", default=None, help="log under this MLflow run (the training run)")
    ap.add_argument("--in-memory", action="store_true",
                    help="load the model in RAM and log it from there (default: log the folder from disk)")
    args = ap.parse_args(argv)
    try:
        validate_registry_name(args.name, path="--name")
    except RecipeError as e:
        print(f"raytune-ft register: {redact(str(e))}", file=sys.stderr)
        return 2
    if not args.tracking_uri:
        print("raytune-ft register: --tracking-uri is required (or set MLFLOW_TRACKING_URI)", file=sys.stderr)
        return 2
    from raytune_ft.storage import fs as storage
    if storage.is_uri(args.checkpoint):        # s3://...: read where it lies, with the AWS_* environment
        st = storage.resolve(args.checkpoint)
        if not storage.list_files(st.fs, st.root):
            print(f"raytune-ft register: {args.checkpoint} holds no files", file=sys.stderr)
            return 2
    elif not os.path.isdir(args.checkpoint):
        print(f"raytune-ft register: {args.checkpoint} is not a directory", file=sys.stderr)
        return 2
    from raytune_ft.console import library_log, own_lines_only

    log_file = own_lines_only(library_log("register", per_call=True), preload=("torch", "mlflow", "transformers"))
    from raytune_ft.registry import RegistrationError, RegistryTarget, record_failure, register_checkpoint
    from raytune_ft.registry.outcome import record_registered

    try:
        result = register_checkpoint(args.checkpoint, args.name,
                                     RegistryTarget(args.tracking_uri, args.registry_uri, run_id=args.run_id),
                                     timeout_s=args.timeout, log_from_disk=not args.in_memory)
    except RegistrationError as e:
        outcome = record_failure(args.checkpoint, args.name, args.tracking_uri, args.registry_uri,
                                 e.run_id or args.run_id, str(e))
        print(f"registration failed: {outcome.error}\nthe checkpoint is unchanged; record: "
              f"{outcome.failure_file}\nretry with:\n  {outcome.retry_command}", file=sys.stderr)
        return 1
    print(f"registered {result.name} version {result.version}: {result.model_uri} (run {result.run_id})\n"
          f"the libraries' warnings: {log_file}")
    try:
        record_registered(args.checkpoint, result.name, result.version)
    except OSError as e:        # the registration stands
        print(f"the run's summary.json could not be updated ({type(e).__name__}): `raytune-ft runs` still lists "
              "the run as not registered", file=sys.stderr)
    return 0


# ------------------------------------------------------------------ the entry point

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="raytune-ft", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Fine-tune Qwen LLMs on Ray Train: run a job, plan its memory, register a checkpoint, "
                    "list runs.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    job_help = f"a job name ({', '.join(list_jobs()) or 'see jobs/'}) or a path to a job file"

    run = sub.add_parser("run", help="train a job (then register it), or --dry-run it",
                         description="Train a job on Ray: validate the recipe, fit, register the final checkpoint. "
                                     "Joins the cluster named by RAY_ADDRESS (as under `ray job submit`), else "
                                     "starts a local Ray.")
    run.add_argument("job", help=job_help)
    add_job_flags(run)

    plan = sub.add_parser("plan", help="per-GPU memory and time estimate of a job (no Ray, no GPU needed)",
                          description="Estimate per-GPU memory (params, grads, AdamW states, FSDP buffers, "
                                      "activations, loss) and the time of one pass, and say whether it fits.")
    plan.add_argument("job", help=job_help)
    plan.add_argument("--local", action="store_true", help="plan the --local variant (tiny model)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="override a recipe field (repeatable)")
    plan.add_argument("--gpu", default=None,
                      help="plan for this GPU (B300, B200, H200, H100, A100) instead of scaling.accelerator_type "
                           "or the job's default")
    plan.add_argument("--tokens-per-s-per-gpu", type=float, default=None,
                      help="assumed throughput (default: 40%% MFU of the GPU's bf16 peak)")
    plan.add_argument("--mfu", type=float, default=0.40, help="assumed MFU for the time estimate (default 0.40)")

    from raytune_ft.data.check import add_parser as add_data_parser

    add_data_parser(sub, job_help)
    sub.add_parser("register", add_help=False, help="register a checkpoint as catalog.schema.model "
                                                    "(raytune-ft register --help for its flags)")

    runs = sub.add_parser("runs", help="list recent runs: status, steps, final loss, registered version",
                          description="List runs found under the storage folders (their summary.json, or their "
                                      "MLflow store for runs that have not finished).")
    runs.add_argument("--storage", action="append", default=None, metavar="PATH",
                      help="a tracking.storage_path to look in, a folder or s3://bucket/prefix (repeatable; "
                           f"default: {', '.join(DEFAULT_STORAGE)}"
                           " and $RAYTUNE_LOCAL_STORAGE)")
    runs.add_argument("--limit", type=int, default=20, help="show at most this many runs (default 20)")
    runs.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    """`raytune-ft COMMAND ...`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "register":  # its own parser: `raytune-ft register --help` lists its flags
        return cli_register(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "run":
        mod = _load_job(args.job)
        job_argv = [f"--set={o}" for o in args.overrides]
        job_argv += [flag for flag, on in (("--local", args.local), ("--dry-run", args.dry_run),
                                           ("--no-register", args.no_register)) if on]
        return mod.main(job_argv)
    if args.command == "plan":
        try:
            recipe = _job_recipe(args.job, args.local, args.overrides)
        except RecipeError as e:
            print(f"error: bad recipe: {redact(str(e))}", file=sys.stderr)
            return 2
        from raytune_ft.planning.plan import memory_plan

        try:
            plan = memory_plan(recipe, gpu=args.gpu, tokens_per_s_per_gpu=args.tokens_per_s_per_gpu, mfu=args.mfu)
        except ValueError as e:
            print(f"error: {redact(str(e))}", file=sys.stderr)
            return 2
        print(plan.render())
        _print_storage_plan(recipe, plan.shape)
        from raytune_ft.planning.projection import plan_extras

        print("\n".join(plan_extras(recipe, plan)))
        return 0 if plan.fits else 1
    if args.command == "data":
        from raytune_ft.data.check import main as data_main

        return data_main(args, lambda: _job_recipe(args.job, args.local, args.overrides))
    if args.command == "runs":
        storages = args.storage or [*DEFAULT_STORAGE, *filter(None, [os.environ.get("RAYTUNE_LOCAL_STORAGE")])]
        rows = find_runs(list(dict.fromkeys(storages)))[: args.limit]
        try:
            if args.json:
                print(json.dumps(rows, indent=2, default=str), flush=True)
            else:
                print(format_runs(rows), flush=True)
                if not rows:
                    print(f"(looked in {', '.join(dict.fromkeys(storages))}; pass --storage PATH)", flush=True)
        except BrokenPipeError:
            # the reader stopped early (`| head`): what it read is what it wanted. Python would flush
            # stdout again at exit and fail the same way, so stdout goes to /dev/null first.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
