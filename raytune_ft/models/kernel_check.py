"""The start-up kernel check: every fast kernel proves itself on the GPU it is about to run on.

A training loop picks its kernels by what is installed (attention.py, gated_delta.py, Liger in the TRL
loop). Installed is not the same as right: a kernel built for another GPU, a Triton version a kernel
library has not been validated on, or a varlen call whose boundaries are ignored all run without an
error and train on wrong numbers. So, on every GPU worker before the first step, each fast path the
loop is about to use runs forward and backward on a small packed input shaped like the model (its real
head counts and dims, from the HF config the loop built): three conversations of unequal length, the
first two boundaries inside one 64-token chunk (flash-linear-attention's chunk size) and a conversation
shorter than the conv kernel. Its outputs and input gradients are compared with the reference path run
on each conversation alone in fp32, on the same (rounded) inputs; a second forward with the first
conversation's inputs replaced must leave every later conversation's outputs as they were (a leak
across a boundary shows here even when the values happen to be close).

A kernel that raises, gives wrong values or leaks is switched off for the process (attention.DISABLED_KERNELS):
the loop then uses the next candidate that passed, or the path's reference implementation, and says so
in one log line naming the kernel, its package versions, what it showed and the path used instead. The
kernels in use go to the MLflow run as the tag `raytune.kernels`. With `train.kernels=strict` a failure
stops the run instead (KernelCheckError). Across ranks the verdicts are combined (a kernel that failed on
any rank is off on all), so every rank trains with the same kernels.

What is checked is the registry of fast_paths.py (each path's input case, reference, candidates in order
of preference, fallback); tests hand in their own candidates (stand-ins on CPU, patched backends on the
GPU). On CPU there is nothing to check: the reference paths are the only ones there.

    python -m raytune_ft.models.kernel_check --model qwen3.8-27b        # check this GPU, print the report
    python -m raytune_ft.models.kernel_check --context-parallel         # and the kernels as CP calls them
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from raytune_ft.env import redact_exception
from raytune_ft.models import kernel_verdicts as verdicts
from raytune_ft.models.fast_paths import (CHECK_LENS, TOLERANCE, Case, FastPath, Kernel, cu_seqlens_of, default_paths,
                                          package_versions, selected_kernels)

log = logging.getLogger(__name__)

MODES = ("check", "strict", "off")

TAG_IN_USE = "raytune.kernels"
TAG_OFF = "raytune.kernels_off"


class KernelCheckError(RuntimeError):
    """train.kernels=strict and a fast kernel failed the start-up check."""


@dataclasses.dataclass
class KernelFailure:
    path: str
    kernel: str
    what: str               # "raised" | "wrong values" | "leaks across a boundary"
    detail: str
    versions: str
    instead: str = ""
    rank: int = 0

    def line(self, title: str) -> str:
        return (f"kernel check: {self.kernel} ({title}) switched off for this run: {self.what}: {self.detail} "
                f"[{self.versions or 'no package versions known'}]; using {self.instead} instead")


@dataclasses.dataclass
class KernelReport:
    in_use: dict[str, str]
    failures: list[KernelFailure]
    seconds: float
    checked: bool
    note: str = ""
    errors: dict[str, float] = dataclasses.field(default_factory=dict)   # "path/kernel" -> worst rel error

    def tags(self) -> dict[str, str]:
        out = {TAG_IN_USE: ", ".join(f"{k}={v}" for k, v in self.in_use.items())}
        if self.failures:
            out[TAG_OFF] = "; ".join(f"{f.kernel}: {f.what}: {f.detail}"[:300] for f in self.failures)[:4000]
        return out

    def summary(self) -> str:
        if not self.checked:
            how = self.note
        elif self.note:
            how = f"{self.note}, {self.seconds:.1f} s"
        else:
            how = f"checked in {self.seconds:.1f} s"
        return f"kernels in use ({how}): " + ", ".join(f"{k}={v}" for k, v in self.in_use.items())


@dataclasses.dataclass(frozen=True)
class KernelUse:
    """What a loop will run its kernels with: the model's HF config, the device, the compute dtype, and
    whether Liger's fused loss is on (the TRL loop)."""
    cfg: Any
    device: torch.device | str
    dtype: torch.dtype = torch.bfloat16
    liger: bool = False
    context_parallel: bool = False    # scaling.context_parallel > 1: the CP forms are checked too
    verdicts_dir: str | None = None   # where all-pass verdicts are kept and recalled (models/kernel_verdicts.py)


# ----------------------------------------------------------------- checking one kernel

@dataclasses.dataclass(frozen=True)
class _Packed:
    """The packed input a kernel was checked on: the path's case, the kernel's inputs (cast to `dtype`),
    the boundaries (cu_seqlens, the longest, each conversation's length)."""
    case: Case
    x: dict
    cu: torch.Tensor
    max_len: int
    lens: tuple
    dtype: torch.dtype


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _cast(case: Case, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The kernel's inputs: floats in `dtype` (but keep_fp32 ones), fresh leaves, strides kept (the conv
    wants channel-last x)."""
    out = {}
    for name, t in case.inputs.items():
        if t.is_floating_point():
            t = t.detach().to(torch.float32 if name in case.keep_fp32 else dtype, copy=True)
            t.requires_grad_(name in case.grads)
        out[name] = t
    return out


def _slices(case: Case, x: dict, s: int, n: int) -> dict:
    return {k: (t if case.token_axis[k] is None else t.narrow(case.token_axis[k], s, n)) for k, t in x.items()}


def _run_reference(path: FastPath, case: Case, cand_in: dict, dout: torch.Tensor, lens) -> tuple[torch.Tensor, dict]:
    """The reference on each conversation alone, in fp32, from the same rounded values the kernel saw."""
    leaves = {}
    for k, t in cand_in.items():
        leaves[k] = t.detach().float() if t.is_floating_point() else t
        if k in case.grads:
            leaves[k].requires_grad_(True)
    outs, s = [], 0
    for n in lens:
        outs.append(path.reference(_slices(case, leaves, s, n)))
        s += n
    out = torch.cat(outs, dim=case.out_token_axis) if case.out_token_axis is not None else sum(outs)
    out.backward(dout)
    return out.detach(), {k: leaves[k].grad for k in case.grads}


def _worst_conversation(case: Case, axis_of: int | None, a: torch.Tensor, b: torch.Tensor, lens) -> str:
    if axis_of is None or len(lens) < 2:
        return ""
    errs, s = [], 0
    for n in lens:
        errs.append(_rel(a.narrow(axis_of, s, n), b.narrow(axis_of, s, n)))
        s += n
    i = max(range(len(errs)), key=lambda j: errs[j])
    return f" (worst: conversation {i + 1} of {len(lens)}, {errs[i]:.3g})"


def check_one(path: FastPath, kernel: Kernel, device: torch.device, dtype: torch.dtype,
              lens=CHECK_LENS, seed: int = 0) -> tuple[KernelFailure | None, float]:
    """Run `kernel` on the packed case of `path` and compare; (None, worst rel error) when it passes."""
    tol = TOLERANCE[path.name][dtype]
    versions = package_versions(kernel.packages)
    gen = torch.Generator(device=device).manual_seed(seed)
    case = path.make_case(device, gen)
    cu = cu_seqlens_of(lens, device)
    max_len = max(lens)

    def fail(what, detail):
        return KernelFailure(path.name, kernel.name, what, detail, versions), float("inf")

    x = _cast(case, dtype)
    try:
        out = kernel.fn(x, cu, max_len)
        dout = torch.randn(out.shape, generator=gen, device=device) if out.dim() else torch.ones((), device=device)
        out.float().backward(dout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any error is the finding
        return fail("raised", f"{type(e).__name__}: {_first_line(e)}")
    missing = [k for k in case.grads if x[k].grad is None]
    if tuple(out.shape) != tuple(_expected_shape(path, case, x, lens)) or missing:
        return fail("wrong values", f"output shape {tuple(out.shape)}" + (f", no gradient for {missing}" if missing else ""))
    try:
        leak = _leak(path, kernel, _Packed(case, x, cu, max_len, tuple(lens), dtype), out, gen)
    except Exception as e:  # noqa: BLE001
        return fail("raised", f"{type(e).__name__} on a second call: {_first_line(e)}")
    if leak is not None and leak > tol:
        return fail("leaks across a boundary", f"redrawing conversation 1's inputs moved the later "
                    f"conversations' outputs by {leak:.3g} relative (tolerance {tol:g})")

    ref, ref_grads = _run_reference(path, case, x, dout, lens)
    worst, where = 0.0, ""
    for name, a, b, axis in [("output", out, ref, case.out_token_axis)] + [
            (f"d{k}", x[k].grad, ref_grads[k], case.token_axis[k]) for k in case.grads]:
        err = _rel(a, b)
        if not err == err or err == float("inf"):   # NaN or inf
            return fail("wrong values", f"{name} not finite")
        if err > worst:
            worst, where = err, f"{name} rel error {err:.3g}" + _worst_conversation(case, axis, a, b, lens)
    if worst > tol:
        return fail("wrong values", f"{where} > tolerance {tol:g} ({str(dtype).replace('torch.', '')})")
    return None, worst


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _expected_shape(path, case, x, lens):
    if case.out_token_axis is None:
        return ()
    with torch.no_grad():
        n = lens[0]
        shape = list(path.reference({k: (v.float() if v.is_floating_point() else v)
                                     for k, v in _slices(case, x, 0, n).items()}).shape)
    shape[case.out_token_axis] = sum(lens)
    return shape


def _leak(path: FastPath, kernel: Kernel, packed: _Packed, out: torch.Tensor, gen) -> float | None:
    """Forward again with conversation 1's token inputs redrawn (same distribution): how far the later
    conversations' outputs moved, relative to their size. None for ops that are not per-token."""
    case, x, lens = packed.case, packed.x, packed.lens
    if case.out_token_axis is None or len(lens) < 2:
        return None
    other = _cast(path.make_case(x[next(iter(x))].device, gen), packed.dtype)
    y = {}
    for k, t in x.items():
        t = t.detach().clone()
        ax = case.token_axis[k]
        if ax is not None and t.is_floating_point():
            t.narrow(ax, 0, lens[0]).copy_(other[k].detach().narrow(ax, 0, lens[0]))
        y[k] = t
    with torch.no_grad():
        moved = kernel.fn(y, packed.cu, packed.max_len)
    ax = case.out_token_axis
    rest = sum(lens) - lens[0]
    return _rel(moved.narrow(ax, lens[0], rest), out.detach().narrow(ax, lens[0], rest))


# ----------------------------------------------------------------- the check

def _agree(failed: list[bool], device: torch.device) -> list[int]:
    """Per kernel, the lowest rank where it failed (world size where none), over all ranks. Without a
    process group, or if the ranks checked different kernel lists (different installs), this rank's own."""
    if _world() == 1:
        return [0 if f else 1 for f in failed]
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    n = torch.tensor([len(failed), -len(failed)], dtype=torch.int64, device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    if int(n[0]) != -int(n[1]):
        log.warning("kernel check: the ranks checked different kernel lists (different installs?); each rank "
                    "keeps its own verdicts")
        return [rank if f else world for f in failed]
    if not failed:
        return []
    t = torch.tensor([rank if f else world for f in failed], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(r) for r in t.tolist()]


def _run_or_recall(use: KernelUse, paths: list[FastPath]):
    """Each candidate's (path, kernel, failure) and worst error: run here, or, when every rank holds a kept
    all-pass verdict of the same key (models/kernel_verdicts.py), recalled from it (the kept record too)."""
    device = torch.device(use.device)
    kept = verdicts.load(use.verdicts_dir, use, paths)
    # every rank recalls (none lacks a verdict) or every rank runs the check: its collectives must match
    if _agree([kept is None], device) == [_world()]:
        return [(p, k, None) for p in paths for k in p.candidates], dict(kept["errors"]), kept
    results: list[tuple[FastPath, Kernel, KernelFailure | None]] = []
    errors = {}
    for path in paths:
        for kernel in path.candidates:
            failure, worst = check_one(path, kernel, device, use.dtype)
            errors[f"{path.name}/{kernel.name}"] = worst
            results.append((path, kernel, failure))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results, errors, None


def check_kernels(use: KernelUse, *, mode: str = "check", paths: list[FastPath] | None = None,
                  log_line: Callable[[str], None] | None = None,
                  tag: Callable[[str, str], None] | None = None) -> KernelReport:
    """Check the fast kernels a loop will use (`use`: a model of `use.cfg` on `use.device`), before its first step.

    mode "check": a failing kernel is switched off for this process and logged (one line each);
    "strict": a failure raises KernelCheckError; "off": nothing is run, the selection stands.
    `paths` replaces the installed candidates (tests); without it the check runs on CUDA only.
    `log_line(text)` receives the failure lines (written by one rank each) and, on rank 0, the summary;
    `tag(key, value)` receives the MLflow tags (call it with rank 0's tracking client)."""
    from raytune_ft.models.attention import disable_kernel

    if mode not in MODES:
        raise ValueError(f"train.kernels must be one of {', '.join(MODES)}; got {mode!r}")
    cfg, device, dtype, liger = use.cfg, torch.device(use.device), use.dtype, use.liger
    say = log_line or log.warning
    rank = _rank()
    t0 = time.perf_counter()
    if mode == "off" or (paths is None and device.type != "cuda"):
        note = ("not checked (train.kernels=off)" if mode == "off"
                else "no GPU: the reference paths are the only ones here")
        report = KernelReport(selected_kernels(cfg, device, liger=liger, dtype=dtype), [], 0.0, checked=False,
                              note=note)
        _finish(report, rank, say, tag)
        return report
    if paths is None:
        paths = default_paths(cfg, liger=liger, dtype=dtype, context_parallel=use.context_parallel)

    results, errors, kept = _run_or_recall(use, paths)

    first_failed = _agree([f is not None for _, _, f in results], device)
    world = _world()
    # a kernel that failed in any path (or one of its call forms) is off in every path
    off = {kernel.name for (_, kernel, failure), who in zip(results, first_failed) if who < world or failure}
    in_use, failures = {}, []
    for path in paths:
        chosen = None
        for (p, kernel, failure), who in zip(results, first_failed):
            if p is not path:
                continue
            if who < world or failure is not None:
                if failure is None:    # passed here, failed on another rank
                    failure = KernelFailure(path.name, kernel.name, "failed on another rank",
                                            f"see rank {who}'s log", package_versions(kernel.packages))
                failure.rank = who if who < world else rank
                failures.append((path, failure))
            elif chosen is None and kernel.name not in off:
                chosen = kernel.name
        in_use[path.name] = chosen or path.fallback
    for path, failure in failures:
        failure.instead = in_use[path.name]
    report = KernelReport(in_use, [f for _, f in failures], time.perf_counter() - t0, checked=True, errors=errors,
                          note=f"verdicts of {kept['checked_at']} from the JIT cache" if kept else "")
    if not kept and not report.failures:
        verdicts.save(use.verdicts_dir, use, paths, errors, report.seconds)
    if mode == "strict" and report.failures:
        lines = "\n".join("  " + f.line(p.title).replace("switched off for this run", "failed")
                          .replace(f"; using {f.instead} instead", "") for p, f in failures)
        raise KernelCheckError(
            "train.kernels=strict: the start-up kernel check failed on this GPU:\n" + lines +
            "\nFix or remove the failing package, or set train.kernels=check to run on the paths that passed "
            "(" + ", ".join(f"{k}={v}" for k, v in in_use.items()) + ").")
    for path, failure in failures:
        disable_kernel(failure.kernel)
        if failure.rank == rank and failure.what != "failed on another rank":
            say(failure.line(path.title))
    _finish(report, rank, say, tag)
    return report


def check_on_worker(use: KernelUse, *, mode: str, log) -> KernelReport:
    """check_kernels as a training loop calls it on each Ray Train worker: `log` is the loop's WorkerLog
    (rank 0 writes through it and tags its MLflow run; another rank prints the failures it saw itself)."""
    rank = getattr(log, "rank", 0)

    def line(text: str) -> None:
        if rank == 0:
            log.info(text)
        else:
            print(f"[raytune_ft] rank {rank}: {text}", flush=True)

    tag = log.set_tag if getattr(log, "tracks", False) else None
    if use.verdicts_dir is None:        # the worker's JIT cache folder, when it has one (train/jit_cache.py)
        use = dataclasses.replace(use, verdicts_dir=os.environ.get(verdicts.VERDICTS_ENV))
    return check_kernels(use, mode=mode, log_line=line, tag=tag)


def _finish(report: KernelReport, rank: int, say, tag) -> None:
    if rank == 0:
        say(report.summary())
        if tag is not None:
            for k, v in report.tags().items():
                try:
                    tag(k, v)
                except Exception as e:  # noqa: BLE001 - tracking must never stop training
                    say(f"kernel check: could not tag the MLflow run ({redact_exception(e)})")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def main(argv=None) -> int:
    """Check this machine's GPU for a model shape and print the report (and each kernel's worst error)."""
    import argparse
    import json

    from raytune_ft.models.tiny import REAL_MODELS, real_config

    p = argparse.ArgumentParser(prog="python -m raytune_ft.models.kernel_check", description=main.__doc__)
    p.add_argument("--model", default="qwen3.8-27b", choices=REAL_MODELS)
    p.add_argument("--liger", action="store_true", help="also check Liger's fused linear cross-entropy")
    p.add_argument("--context-parallel", action="store_true",
                   help="also check the kernels as context parallelism calls them")
    p.add_argument("--strict", action="store_true")
    p.add_argument("--repeat", type=int, default=2, help="runs (the first pays the kernels' JIT compile)")
    args = p.parse_args(argv)
    from raytune_ft.console import library_log, own_lines_only

    log_file = own_lines_only(library_log("kernel_check"), preload=("transformers",))
    cfg = real_config(args.model)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for i in range(args.repeat):
        from raytune_ft.models.attention import reset_disabled_kernels

        reset_disabled_kernels()
        r = check_kernels(KernelUse(cfg, dev, liger=args.liger, context_parallel=args.context_parallel),
                          mode="strict" if args.strict else "check", log_line=print)
        print("RESULT " + json.dumps({"kernel_check": args.model, "run": i + 1, "seconds": round(r.seconds, 2),
                                      "in_use": r.in_use, "off": [dataclasses.asdict(f) for f in r.failures],
                                      "worst_rel_error": {k: float(f"{v:.3g}") for k, v in r.errors.items()},
                                      "versions": package_versions(("torch", "triton", "transformers", "fla",
                                                                    "tilelang", "causal_conv1d", "flash_attn",
                                                                    "liger_kernel"))}))
    print(f"the libraries' warnings: {log_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
