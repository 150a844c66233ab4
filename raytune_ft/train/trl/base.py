"""What every part of the TRL loop shares: file names, schedule names, reporting.

Imports no sibling, so each part can read it without an import circle.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Files of a Hugging Face checkpoint folder that are trainer state rather than model or tokenizer.
TRAINER_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", "training_args.bin",
                 "rng_state.pth")

@dataclass
class Paused:
    """Seconds of the attempt spent evaluating and checkpointing (`not_training`), left out of tokens/s."""

    seconds: float = 0.0


@contextlib.contextmanager
def not_training(paused: Paused):
    """Add the time spent inside to `paused`."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        paused.seconds += time.perf_counter() - t0


def ray_report(metrics: dict, checkpoint_dir: str | None) -> None:
    """ray.train.report of the scalar metrics, with the folder as a checkpoint when given."""
    import ray.train

    ckpt = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
    ray.train.report({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))},
                     checkpoint=ckpt)


def sum_over_ranks(x: float) -> float:
    """`x` summed over all ranks (a collective when torch.distributed is initialised)."""
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        t = t.cuda()
    if dist.is_initialized():
        dist.all_reduce(t)
    return float(t.item())
