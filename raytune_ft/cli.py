"""Command line: `raytune-ft run|plan|register|runs`, and the `main()` of each jobs/*.py script."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Callable

from raytune_ft.recipe import Recipe, RecipeError, apply_overrides, validate

RecipeFn = Callable[[], Recipe]
LocalFn = Callable[[Recipe], Recipe]


def job_parser(prog: str, description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--local", action="store_true",
                   help="run on local Ray on CPU with a tiny model of the same family and bundled data")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a recipe field (repeatable), e.g. --set scaling.num_workers=16")
    p.add_argument("--dry-run", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--no-register", action="store_true", help="train only; skip the registration task")
    return p


def resolve(recipe_fn: RecipeFn, local_fn: LocalFn, *, local: bool, overrides: list[str]) -> Recipe:
    recipe = recipe_fn()
    if local:
        recipe = local_fn(recipe)
    return validate(apply_overrides(recipe, overrides))


def job_main(recipe_fn: RecipeFn, local_fn: LocalFn, argv: list[str] | None = None, *, prog: str = "job") -> int:
    """Parse a job's flags, then dry-run or run it; a bad recipe exits 2 before Ray starts."""
    args = job_parser(prog, (recipe_fn.__doc__ or "").strip() or None).parse_args(argv)
    try:
        recipe = resolve(recipe_fn, local_fn, local=args.local, overrides=args.overrides)
    except RecipeError as e:
        print(f"error: bad recipe: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(recipe.to_json())
        try:
            from raytune_ft.plan import memory_plan

            print(memory_plan(recipe).render())
        except ImportError:
            pass
        return 0
    from raytune_ft.run import run

    summary = run(recipe, local=args.local, register=False if args.no_register else None)
    print("\n".join(summary.lines()), flush=True)
    return 0 if summary.status != "trained_not_registered" else 3


def _load_job(job: str):
    """A job by name (qwen27b_b300) or path (jobs/qwen27b_b300.py)."""
    path = job
    if not os.path.exists(path):
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cand = os.path.join(here, "jobs", job if job.endswith(".py") else f"{job}.py")
        if not os.path.exists(cand):
            raise SystemExit(f"error: no job {job!r} (looked for {path} and {cand})")
        path = cand
    spec = importlib.util.spec_from_file_location(f"raytune_job_{os.path.basename(path)[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: raytune-ft {run JOB [--local] [--set k=v ...] [--dry-run] | register CHECKPOINT --name c.s.m}"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "run":
        if not rest:
            print(usage, file=sys.stderr)
            return 2
        return _load_job(rest[0]).main(rest[1:])
    if cmd == "register":
        from raytune_ft.registry import cli_register

        return cli_register(rest)
    print(f"error: unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
