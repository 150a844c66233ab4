"""The forward-only probes of a run (held-out loss, sample generations): how they run the trained model.

They run eagerly, even where `train.compile` compiled the layers: each generation step has a length of its
own, and through the compiled modules every new length recompiles the training step's graphs.

They keep the weights gathered. Under FSDP2 every forward all-gathers each layer's weights and frees them
after it: a decode step of a few tokens reads every weight two to three times (the shard, the gathered copy
and the matmul's read), and with float8 training the gathered weights are cast to float8 and back on every
forward as well, twice bf16's traffic. Where the whole unsharded model fits beside what the device holds,
every FSDP2 module keeps its parameters gathered for the probe's length (one all-gather per module) and the
float8 linears dequantise their weight once: a probe's forward reads each weight once. Where it does not fit
(a single GPU near its limit), the probe gathers per forward as training does. Every rank takes the same way.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

HEADROOM_FRACTION = 0.10        # of the device's memory kept free beside the gathered weights
HEADROOM_MIN_BYTES = 4 << 30    # ... and at least this (a probe's own activations: a 32k-token forward, no grad)


@contextlib.contextmanager
def probe_uncompiled(model) -> Iterator[None]:
    """Inside it, torch.compile'd modules run their eager code and compile nothing (the training step's
    graphs stay as they are); `model`'s weights stay gathered where they fit (`weights_gathered`), and its
    float8 linears run as plain matmuls on their dequantised weight (`fp8.linears_in_high_precision`):
    eager, float8's casts go through torchao's tensor subclass op by op."""
    from raytune_ft.train.fp8 import linears_in_high_precision

    with torch.compiler.set_stance("force_eager"), weights_gathered(model) as kept, \
            linears_in_high_precision(model, keep_weights=kept):
        yield


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def gathered_bytes(model) -> int:
    """An upper bound of the bytes `model` takes gathered: its parameters in their own dtype (an fp32 master
    weight, gathered in bf16 for the compute, counted at 4 bytes), a dequantised copy of each float8 linear's
    weight, and twice the largest FSDP2 module's own parameters (its all-gather's input and output buffers,
    alive beside the gathered parameters while it gathers)."""
    from raytune_ft.train.fp8 import float8_weights

    seen: set[int] = set()
    largest = 0
    for m in reversed(fsdp_modules(model)):     # the nested modules before those that hold them
        own = [p for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        largest = max(largest, sum(p.numel() * p.dtype.itemsize for p in own))
    return sum(p.numel() * p.dtype.itemsize for p in model.parameters()) + 2 * largest + \
        sum(w.numel() * 2 for w in float8_weights(model))


def free_bytes(device: torch.device) -> tuple[int, int]:
    """(bytes free for new tensors, the device's total): the caching allocator's unused reserve counted free."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def fits_gathered(model) -> bool:
    """Whether the whole model gathered fits beside what the device holds now, with headroom; agreed by
    every rank (one rank short of memory sends them all the per-forward way)."""
    from raytune_ft.train.lending import step_extent

    device = next(model.parameters()).device
    free, total = free_bytes(device)
    ok = gathered_bytes(model) + max(HEADROOM_MIN_BYTES, int(HEADROOM_FRACTION * total)) <= free
    return bool(step_extent(int(ok), device)[0])       # the fewest over the ranks: all fit, or none keeps


@contextlib.contextmanager
def weights_gathered(model) -> Iterator[bool]:
    """Inside it, `model`'s FSDP2 modules keep their weights gathered after a forward, where they fit
    (`fits_gathered`); on leaving, each is resharded and gets back its own setting. Yields whether they do."""
    from raytune_ft import compat
    modules = fsdp_modules(model)
    if not modules or not fits_gathered(model):
        yield False
        return
    with compat.fsdp_kept_unsharded(modules):
        yield True
