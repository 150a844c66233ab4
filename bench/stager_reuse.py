"""The seconds a background save holds the loop, on one GPU without Ray: DCP's staging of an FSDP2-sharded
model and its AdamW state into pinned host memory through the checkpointer's own stager
(raytune_ft/train/checkpointer.py), N saves with the stager kept for the run (the checkpointer's policy)
against N with a new stager before every save (what the code did on torch 2.11 before the stager was kept),
and, as the peer, a synchronous DCP save of the same state into the same folder. Each save's files are
deleted once written.

    python bench/stager_reuse.py --gib 20 --saves 3 --folder /dev/shm/stager
    python bench/stager_reuse.py --cpu-check            # the same path at a tiny size on CPU (gloo)

Prints one `RESULT {...}` line: held seconds per save for each policy, the synchronous save's seconds,
and each policy's held seconds over the synchronous save's (`kept_over_sync` counts the saves after the
first: the first pins its buffers under either policy).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytune_ft.train import dcp_io  # noqa: E402
from raytune_ft.train.checkpointer import Checkpointer  # noqa: E402
from raytune_ft.train.state import TrainState  # noqa: E402


def build_state(gib: float, width: int, device: torch.device) -> tuple[TrainState, int]:
    """bf16 linear layers, sharded with fully_shard, one AdamW step taken: parameters and the two moments
    (bf16 like the parameters) add up to about `gib`. Returns the state and the parameters' bytes."""
    from torch.distributed.fsdp import fully_shard

    per_layer = width * width * 2 * 3            # bytes: weight, exp_avg, exp_avg_sq
    layers = max(1, round(gib * 2**30 / per_layer))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device, torch.bfloat16)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return TrainState(model, opt), sum(t.numel() * t.element_size() for t in model.parameters())


def staging_saver(state: TrainState, cuda: bool) -> Checkpointer:
    """The checkpointer's staging half alone (its `_stage`, `_new_stager`): no Ray Train
    storage, report or writer thread, which the held seconds do not include."""
    saver = Checkpointer.__new__(Checkpointer)
    saver.state, saver.rank, saver.save_group, saver._cuda = state, 0, None, cuda
    saver._close_copier = lambda: None
    saver.stager = saver._new_stager()
    return saver


def background_saves(saver: Checkpointer, folder: str, n: int, fresh: bool) -> list[float]:
    held = []
    for i in range(n):
        if fresh and i:                           # the policy before: a new stager, its buffers pinned again
            saver.stager.close()
            saver._close_copier()
            saver.stager = saver._new_stager()
        path = os.path.join(folder, f"{'fresh' if fresh else 'kept'}-{i}")
        t0 = time.perf_counter()
        staged = saver._stage(path)                # what the loop waits for
        held.append(round(time.perf_counter() - t0, 3))
        staged.result()                            # the write, in DCP's thread (the loop trains meanwhile)
        shutil.rmtree(path, ignore_errors=True)
    saver.stager.close()
    saver._close_copier()
    return held


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=20.0, help="parameters and AdamW moments, GiB")
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--folder", default="/dev/shm/raytune_stager")
    p.add_argument("--cpu-check", action="store_true", help="a tiny state on CPU (gloo): the path, not a figure")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.cpu_check
    if a.cpu_check:
        a.gib, a.width = 0.01, 256
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, **({"device_id": device} if cuda else {}))
    os.makedirs(a.folder, exist_ok=True)
    try:
        state, model_bytes = build_state(a.gib, a.width, device)
        sync = []
        for i in range(2):
            path = os.path.join(a.folder, f"sync-{i}")
            t0 = time.perf_counter()
            dcp_io.save(path, state.sharded, 0, process_group=None)
            sync.append(round(time.perf_counter() - t0, 3))
            shutil.rmtree(path, ignore_errors=True)
        fresh = background_saves(staging_saver(state, cuda), a.folder, a.saves, fresh=True)
        kept = background_saves(staging_saver(state, cuda), a.folder, a.saves, fresh=False)
    finally:
        dist.destroy_process_group()
    sync_s = statistics.mean(sync)
    later = kept[1:] or kept
    out = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "state_gib": round(a.gib, 2), "parameter_gib": round(model_bytes / 2**30, 2), "sync_s": sync, "fresh_held_s": fresh,
           "kept_held_s": kept, "fresh_over_sync": round(statistics.mean(fresh) / sync_s, 3),
           "kept_over_sync": round(statistics.mean(later) / sync_s, 3)}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
