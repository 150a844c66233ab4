"""What the FSDP2 worker's start-up imports cost on this machine, stage by stage, in the worker's order.

A warm re-submit spends most of its minute in Python imports (bench/NOTES.md, start-up): Ray, torch, the
loop's module, the tokenizer (transformers' configuration code, dynamo), the model code (transformers'
Qwen3.5 modelling, flash-linear-attention's ops), then torch.compile's set-up. This runs that sequence in
one fresh Python, times each stage, and lists the slowest imports (`python -X importtime`, cumulative), with
what decides whether imports can be fast at all: whether the packages' bytecode is cached (a read-only
site-packages without `__pycache__` recompiles every module on every start).

    python bench/worker_imports.py --tokenizer TOKENIZER        # on a GPU node (bench: python -m bench gpu imports)
    python bench/worker_imports.py --cpu                         # the same stages with the project's tiny tokenizer

Prints one `RESULT {json}` line: {"stages": {name: seconds}, "slowest": [[module, seconds], ...],
"bytecode": {...}}.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PACKAGES = ("torch", "triton", "transformers", "fla", "tilelang", "ray", "mlflow")


def bytecode_facts() -> dict:
    """Whether this Python writes bytecode, and per package: its folder, writable, and its __init__'s .pyc."""
    facts = {"dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
             "pycache_prefix": sys.pycache_prefix, "packages": {}}
    for name in PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            continue
        folder = os.path.dirname(spec.origin)
        cached = importlib.util.cache_from_source(spec.origin) if spec.origin.endswith(".py") else None
        facts["packages"][name] = {"folder": folder, "writable": os.access(folder, os.W_OK),
                                   "init_pyc": bool(cached and os.path.exists(cached))}
    return facts


def stages(tokenizer: str | None, cpu: bool) -> dict[str, float]:
    """Seconds of each stage of the worker's import sequence, in its order."""
    out: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[name] = round(now - t, 3)
        t = now

    import ray  # noqa: F401
    lap("ray")
    import torch
    lap("torch")
    import ray.train.torch  # noqa: F401
    lap("ray.train")
    import raytune_ft.train.fsdp_loop  # noqa: F401
    lap("the loop's module")
    from raytune_ft.recipe.recipe import Recipe, on_local_cpu
    from raytune_ft.models.tokenizer import tokenizer_for

    recipe = Recipe()
    if cpu:
        recipe = on_local_cpu(recipe, workers=1, rows=10, seq_len=128, run_name="imports", registry_name="a.b.c")
    elif tokenizer:
        recipe.model.tokenizer = tokenizer
    tok = tokenizer_for(recipe.model)
    lap("tokenizer")
    from raytune_ft.compat import transformers_without_torchao

    with transformers_without_torchao("bf16"):
        from raytune_ft.models import build  # noqa: F401
        from raytune_ft.models.kernel_check import check_on_worker  # noqa: F401
    if torch.cuda.is_available():
        build.import_fla_ops_only()
    from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401
    lap("model code")
    import torch._dynamo  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    lap("compile set-up")
    out["total"] = round(sum(out.values()), 3)
    out["tokenizer_class"] = type(tok).__name__
    return out


def slowest(importtime: str, n: int = 15) -> list[list]:
    """The `n` slowest imports of a `-X importtime` trace, by cumulative time, outermost first where nested."""
    rows = []
    for line in importtime.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        try:
            _, cumulative, name = line[len("import time:"):].split("|")
            rows.append((name.rstrip(), int(cumulative)))
        except ValueError:
            continue
    rows.sort(key=lambda r: -r[1])
    return [[name.strip() + (f" (depth {(len(name) - len(name.lstrip())) // 2})" if name.startswith("   ") else ""),
             round(us / 1e6, 3)] for name, us in rows[:n]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or hub id (default: the recipe's)")
    p.add_argument("--cpu", action="store_true", help="the project's tiny tokenizer, no CUDA kernels")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    o = p.parse_args(argv)
    if o.child:      # the traced process: its stages on stdout, the import trace on stderr
        print("STAGES " + json.dumps(stages(o.tokenizer, o.cpu)), flush=True)
        return 0
    argv = [sys.executable, "-X", "importtime", os.path.abspath(__file__), "--child"]
    argv += ["--cpu"] if o.cpu else (["--tokenizer", o.tokenizer] if o.tokenizer else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    got = next(json.loads(line[len("STAGES "):]) for line in proc.stdout.splitlines() if line.startswith("STAGES "))
    result = {"stages": got, "slowest": slowest(proc.stderr), "bytecode": bytecode_facts()}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
