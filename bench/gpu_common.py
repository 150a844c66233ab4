"""Shared pieces of the GPU benchmarks: real-shaped models with random weights, seed-like packed blocks.

Everything here drives the project's own code (raytune_ft.models / raytune_ft.train.fsdp_loop); the
benchmarks add only what a checkpoint or the data pipeline would otherwise provide.

Environment:
  SHAPE=real (default) | tiny   tiny: the same architecture family at a few dozen KB, for CPU checks
  DEVICE=cuda (default) | cpu
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

SHAPE = os.environ.get("SHAPE", "real")
DEVICE = os.environ.get("DEVICE", "cuda")


def device() -> torch.device:
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def init_single_process_group(dev: torch.device, port: int | None = None) -> None:
    """World size 1: what one Ray Train GPU worker sees (FSDP2 needs a process group). A free port by
    default: benches on different GPUs of one host run side by side (a fixed 29531 made the second one
    fail with EADDRINUSE on 2026-11-29)."""
    if dist.is_initialized():
        return
    if port is None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)


def model_config(name: str, n_layers: int | None):
    """Config of `name` ("qwen3.8-27b" | "qwen3-4b" | "qwen2-0.5b") at its real widths, cut to n_layers;
    with SHAPE=tiny the project's tiny config of the same family (vocab 512)."""
    from raytune_ft.models.tiny import real_config, tiny_config

    over = {} if n_layers is None else {"num_hidden_layers": n_layers}
    if SHAPE == "tiny":
        family = {"qwen3.8-27b": "qwen3_5", "qwen3-4b": "qwen3", "qwen2-0.5b": "qwen2"}[name]
        return tiny_config(family, 512, **over)
    return real_config(name, **over)


def build_random_lm(cfg, dev: torch.device, dtype: torch.dtype, seed: int = 0):
    """A causal LM of `cfg` with transformers' random init, built directly on `dev` in `dtype` (no CPU
    copy: a 27B cut would not fit in host memory in fp32), packing paths enabled as load_causal_lm does."""
    from transformers import AutoModelForCausalLM

    from raytune_ft.models.gated_delta import enable_packing

    torch.manual_seed(seed)
    cfg.use_cache = False
    with torch.device(dev):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    enable_packing(lm)
    return lm


def seed_lengths(seq: int, rng: np.random.Generator) -> list[int]:
    """Conversation lengths of one block exactly as ../shared/peers/seed000_loop.py draws them
    (lognormal, median 1400, clipped to 64..8192, the last one cut so the block is exactly full), so
    tokens and the attention term match the seed's run for run."""
    lens: list[int] = []
    while sum(lens) < seq:
        lens.append(int(np.clip(rng.lognormal(math.log(1400), 0.7), 64, 8192)))
    lens[-1] -= sum(lens) - seq
    if lens[-1] == 0:
        lens.pop()
    return lens


def packed_block(lens: list[int], vocab: int, rng: np.random.Generator) -> dict:
    """A block in the pipeline's format (raytune_ft.data.packing.block_from_segments), every token
    supervised except each conversation's first, random ids."""
    from raytune_ft.data.packing import block_from_segments

    segs = [(rng.integers(10, vocab - 100, size=n), np.ones(n, dtype=bool)) for n in lens]
    return block_from_segments(segs, sum(lens))


def peak_gib(dev: torch.device) -> float:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def versions() -> dict:
    """Package versions of the run (for RESULTS.md)."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for mod in ("transformers", "triton", "fla", "tilelang", "trl", "liger_kernel", "causal_conv1d", "flash_attn"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # absent is a finding too
            out[mod] = f"absent ({type(e).__name__})"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def emit(record: dict) -> None:
    """One JSON line on stdout (the call's log is grepped for them)."""
    print("RESULT " + json.dumps(record, default=str), flush=True)


class Timer:
    def __init__(self, dev):
        self.dev = dev

    def __enter__(self):
        sync(self.dev)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.dev)
        self.seconds = time.perf_counter() - self.t0
