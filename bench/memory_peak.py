"""What is live at a step's memory peak, and where it was allocated: one training step under torch's CUDA memory
history (`torch.cuda.memory._record_memory_history`), its trace replayed to the moment the step's own allocations
were largest, those live then grouped by the line that allocated them (the first frame in raytune_ft, bench or
transformers, else the first frame). The bytes already allocated when the step began (weights, gradients, the
optimizer's states) are the baseline, named as one sum.

    rec["memory_peak"] = memory_peak(run_step, device)          # bench/shape.py --memory-peak
"""
from __future__ import annotations

from typing import Callable

OWN = ("raytune_ft/", "bench/", "transformers/")
FREES = ("free_requested", "free_completed")


def site(frames: list[dict]) -> str:
    """The allocating line a person reads first: the first frame in this project or transformers, else the first."""
    if not frames:
        return "?"
    frame = next((f for f in frames if any(o in f.get("filename", "") for o in OWN)), frames[0])
    name = frame.get("filename", "?")
    for marker in ("site-packages/", "raytune_ft/", "bench/"):
        if marker in name:
            name = (marker if marker != "site-packages/" else "") + name.split(marker, 1)[1]
            break
    return f"{name}:{frame.get('line', '?')} {frame.get('name', '?')}"


def _replay(trace: list[dict]):
    """(bytes allocated by the trace so far, the allocations live) after each event; one dict, updated in place."""
    live: dict[int, dict] = {}
    now = 0
    for e in trace:
        if e.get("action") == "alloc":
            live[e["addr"]] = e
            now += e["size"]
        elif e.get("action") in FREES and e.get("addr") in live:
            now -= live.pop(e["addr"])["size"]
        yield now, live


def peak_of_trace(trace: list[dict], baseline: int, top: int = 15) -> dict:
    """Replay `trace` (one device's alloc / free events) from `baseline` bytes: the peak, and the allocations
    live at it by site (GiB, largest first) with the `top` largest single ones. Two passes: the first finds the
    event of the peak, the second stops there (no copy of the live set at every new maximum)."""
    best, best_at = 0, -1
    for i, (now, _) in enumerate(_replay(trace)):
        if now > best:
            best, best_at = now, i
    at_best: dict[int, dict] = {}
    for _, live in _replay(trace[:best_at + 1]):
        at_best = live
    by_site: dict[str, int] = {}
    for e in at_best.values():
        where = site(e.get("frames", []))
        by_site[where] = by_site.get(where, 0) + e["size"]
    largest = sorted(at_best.values(), key=lambda e: -e["size"])[:top]
    gib = 2 ** 30
    return {"peak_gib": round((baseline + best) / gib, 2), "baseline_gib": round(baseline / gib, 2),
            "step_gib": round(best / gib, 2),
            "by_site_gib": {k: round(v / gib, 3) for k, v in sorted(by_site.items(), key=lambda kv: -kv[1])[:top]},
            "largest": [{"gib": round(e["size"] / gib, 3), "at": [site([f]) for f in e.get("frames", [])[:4]]}
                        for e in largest]}


# torch 2.11 (open upstream: pytorch/pytorch#179536): under the CUDA memory history, the backward's recompute of a
# torch.compile'd region inside activation checkpointing raises `SystemError: <built-in method apply of
# FunctionMeta> returned NULL` (torch 2.10 ran it). Seen here on both the 32k and the CP step, with Python-only
# stacks too (bench/NOTES.md, twelfth round). So the recorded step runs its compiled regions eagerly.
EAGER_WHY = ("compiled regions run eagerly under the memory history (torch 2.11: pytorch/pytorch#179536); the "
             "step's own compiled peak is the record's peak_gib")


def eager_regions(step: Callable[[], None]) -> Callable[[], None]:
    """`step` with every torch.compile'd region running its eager code and compiling nothing."""
    import torch

    def run() -> None:
        with torch.compiler.set_stance("force_eager"):
            step()
    return run


def memory_peak(step: Callable[[], None], device, max_entries: int = 400_000) -> dict:
    """Run `step()` once under the CUDA memory history of `device`, its compiled regions eager (EAGER_WHY);
    peak_of_trace of what it allocated."""
    import torch

    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    # Python frames only: the allocating line is all `site` reads; C++ unwinding at every allocation is the costly
    # part of the history
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        eager_regions(step)()
        torch.cuda.synchronize(device)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = torch.device(device).index or 0
    trace = snap["device_traces"][index]
    out = peak_of_trace(trace, baseline)
    out["max_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    out["trace_events"] = len(trace)
    out["trace_full"] = len(trace) >= max_entries      # the oldest events dropped: the replay starts late
    out["compiled"] = EAGER_WHY
    return out
