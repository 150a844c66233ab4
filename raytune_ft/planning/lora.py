"""LoRA's lines of the memory plan (plan.py), both loops.

A LoRA run keeps the base frozen in the compute dtype: no gradients and no optimizer states for it. The
adapters (r x (in + out) per adapted linear, shapes.ModelShape.lora_params) are fp32, as are their
gradients and AdamW's two states. The FSDP2 loop shards base and adapters over the workers; the TRL loop
(DDP) keeps a full copy. Activations are the full fine-tune's: the frozen base still saves what its
input-gradient matmuls need; the adapters' own (the r-wide intermediate) are left out as negligible.

Two FSDP2 lines the full fine-tune does without (`lora_fsdp2_lines`), because its one layer of fp32
weight gradients (the "fsdp gathered" line) covers the backward's transient gradients, and a LoRA
layer's fp32 gradients are the adapters' only:
  lora backward       the recomputed layer's backward holds, per adapted linear, the adapter path's
                      input gradient beside the base's and their sum: 2 x tokens x the widest linear
                      input (the MLP's down_proj) in the compute dtype (measured on CPU).
  lora allowance      a calibration, not a cause: a fraction (LORA_ALLOWANCE) of the frozen base's
                      bytes that the measured LoRA peaks held beyond every line above; the term was
                      not identified on CPU; planning/data/measured.json names the runs it was fitted on.
"""
from __future__ import annotations

from typing import Callable

from raytune_ft.planning.measured import figure
from raytune_ft.planning.shapes import ModelShape

# of the frozen base's bytes per GPU, calibrated (planning/data/measured.json names the runs it was fitted on)
LORA_ALLOWANCE = figure("lora_allowance")["values"]["fraction_of_frozen_base"]


def _fitted_on() -> str:
    runs = figure("lora_allowance")["fitted_on"]
    return " and ".join(f"{r['values']['figures.peak_gib']} GiB at {r['layers']} layers x {r['seq']:,} tokens" for r in runs)


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
    return max(sum(r * (i + o) for i, o in shape.adapted_linears(kind, targets).values())
               for kind in set(shape.layer_types))


def lora_fsdp2_lines(shape: ModelShape, train_cfg, tokens: int, compute_b: int, base_bytes: float) -> list[tuple]:
    """The FSDP2 loop's LoRA-only lines (module docstring): the adapted linears' extra input gradients in
    the backward, and the calibrated allowance on the frozen base's `base_bytes`."""
    targets = list(train_cfg.lora_target_modules)
    widest = max(i for kind in set(shape.layer_types) for i, _ in shape.adapted_linears(kind, targets).values())
    return [
        ("lora backward", 2 * tokens * widest * compute_b,
         f"2 x {tokens:,} tokens x {widest:,} (widest adapted input) x {compute_b} B: the adapter path's input "
         "gradient and the summed one, beside the base's, in the recomputed layer's backward"),
        ("lora allowance", LORA_ALLOWANCE * base_bytes,
         f"{LORA_ALLOWANCE:.0%} of the frozen base's {base_bytes / 2**30:.2f} GiB: a calibrated term (fitted on "
         f"{_fitted_on()}), its cause not identified"),
    ]
