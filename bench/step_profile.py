"""One training step under torch.profiler, its GPU time split by what ran: the kernels grouped by kind (matmuls,
attention, the gated-delta-net's kernels, the conv, loss, optimizer, elementwise and fused Triton kernels, copies
and casts, communication), the phases of the step (forward + backward, gradient clipping, the optimizer, the
float8 scales) by CUDA events, and the gap: the step's wall time the GPU spent on no kernel.

Kinds are read off kernel names, first match wins; an unmatched kernel counts as "other" and the top kernels are
listed by name, so a wrong guess shows."""
from __future__ import annotations

import re
from typing import Callable

# (kind, a regular expression on the kernel's name), first match wins
KINDS = [
    ("communication", r"nccl|all_?gather|reduce_?scatter"),
    ("attention", r"flash|fmha|attn|varlen"),
    ("conv", r"conv"),
    ("gated_delta", r"chunk|gated_delta|delta_rule|fwd_kernel|bwd_kernel|l2norm|recompute_w_u|solve_tril|tilelang"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("loss", r"cross_entropy|log_softmax|logsumexp|nll"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm100_|matmul|\bmm\b"),
    ("copy/cast", r"copy|cast|convert|memcpy|memset|fill"),
    ("triton fused", r"^triton_|triton"),
    ("elementwise/reduce", r"elementwise|vectorized|reduce|unrolled"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "other")


def profile_step(step: Callable[[Callable[[str], object]], None], device) -> dict:
    """Run `step(phase)` once under the profiler; `phase(name)` is a context manager the step wraps each of
    its phases in. Kernel milliseconds by kind and the top kernels, each phase's milliseconds, the gap."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile

    marks: list[tuple[str, object, object]] = []

    @contextlib.contextmanager
    def phase(name: str):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        marks.append((name, start, end))

    torch.cuda.synchronize(device)
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        first.record()
        step(phase)
        last.record()
        torch.cuda.synchronize(device)
    wall_ms = first.elapsed_time(last)
    kernels: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time > 0:
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time / 1000.0
    by_kind: dict[str, float] = {}
    for name, ms in kernels.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + ms
    busy = sum(kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"wall_ms": round(wall_ms, 1), "kernel_ms": round(busy, 1),
            "gap_ms": round(max(wall_ms - busy, 0.0), 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "by_kind_share": {k: round(v / wall_ms, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "phases_ms": {name: round(s.elapsed_time(e), 1) for name, s, e in marks},
            "top_kernels": [{"name": n[:120], "kind": kind_of(n), "ms": round(ms, 1)} for n, ms in top]}
