"""LoRA's lines of the memory plan (plan.py), both loops.

A LoRA run keeps the base frozen in the compute dtype: no gradients and no optimizer states for it. The
adapters (r x (in + out) per adapted linear, shapes.ModelShape.lora_params) are fp32, as are their
gradients and AdamW's two states. The FSDP2 loop shards base and adapters over the workers; the TRL loop
(DDP) keeps a full copy. Activations are the full fine-tune's: the frozen base still saves what its
input-gradient matmuls need; the adapters' own (the r-wide intermediate) are left out as negligible.
"""
from __future__ import annotations

from typing import Callable

from raytune_ft.shapes import ModelShape


def lora_state_lines(shape: ModelShape, train_cfg, compute_b: int, shard: int,
                     fmt: Callable[[float], str]) -> tuple[int, list[tuple]]:
    """(trainable parameters, [(line name, bytes per GPU, how)]) of a LoRA run's weights and states; `fmt`
    writes a count as the plan writes it."""
    P, r = shape.total_params, train_cfg.lora_r
    trainable = shape.lora_params(r, list(train_cfg.lora_target_modules))   # []: every linear
    div = f" / {shard}" if shard > 1 else ""
    return trainable, [
        ("params", P * compute_b / shard, f"{fmt(P)} frozen base x {compute_b} B{div}"),
        ("lora params", trainable * 4 / shard, f"{fmt(trainable)} adapter params (r={r}) x 4 B (fp32){div}"),
        ("grads", trainable * 4 / shard, f"adapter grads, fp32{div}"),
        ("optimizer", trainable * 8 / shard, f"AdamW 2 states x fp32, adapters only{div}"),
    ]


def lora_layer_params(shape: ModelShape, train_cfg) -> int:
    """The most adapter parameters of one decoder layer: the unsharded fp32 gradients FSDP2 holds before a
    layer's reduce-scatter (the frozen base has none)."""
    r, targets = train_cfg.lora_r, list(train_cfg.lora_target_modules)
    return max(sum(r * (i + o) for name, (i, o) in shape.linears(kind).items() if not targets or name in targets)
               for kind in set(shape.layer_types))
