"""LoRA adapters for the FSDP2 loop: every linear of both Qwen3.5 layer kinds, a frozen base.

Each targeted linear of a decoder layer is replaced by `LoraLinear`, which keeps the original linear as
`base_layer` and adds `lora_A` (in -> r) and `lora_B` (r -> out), as PEFT's LoRA layer does; with one
adapter the parameter names are then the ones PEFT writes into `adapter_model.safetensors`
(`...q_proj.lora_A.weight`), so export is a rename of the prefix (train/lora_export.py).

The order in `build_fsdp_model`: the model is built on the meta device, fp8 converts the base linears
(LoRA wraps them afterwards, so fp8 never sees an adapter), `add_adapters` wraps and freezes, FSDP2
shards base and adapters together (the base in the compute dtype, the adapters in fp32 under the
mixed-precision policy), the base is filled, then `init_adapters` draws the adapters. Only the adapters
require gradients, so only they reach the optimizer and the checkpoint (train/state.ModelPart).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from raytune_ft.recipe.sections import FSDP2_LORA_TARGETS


class LoraLinear(nn.Module):
    """base_layer(x) + lora_B(lora_A(dropout(x))) * alpha / r, the adapters in their own dtype."""

    def __init__(self, base_layer: nn.Module, r: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base_layer
        device = base_layer.weight.device
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False, device=device, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r, self.alpha, self.scaling = r, alpha, alpha / r

    @property
    def weight(self) -> torch.Tensor:   # what callers of a plain linear read (dtype, device, shape)
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        # under FSDP2's policy both are the compute dtype already; a plain model runs the adapter in its own
        delta = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return out + (delta * self.scaling).to(out.dtype)

    def delta_weight(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The full-rank update B @ A * scaling (from the gathered A and B): what a merge adds."""
        return (b.float() @ a.float()) * self.scaling


def targets_of(train_cfg) -> tuple[str, ...]:
    """The linears to adapt: `train.lora_target_modules`, or every linear of both layer kinds."""
    return tuple(train_cfg.lora_target_modules) or FSDP2_LORA_TARGETS


def add_adapters(lm: nn.Module, train_cfg) -> list[str]:
    """Freeze every parameter of `lm` and wrap each targeted linear of its decoder layers in a
    LoraLinear (train.lora_r, lora_alpha, lora_dropout). Returns the wrapped modules' names."""
    from raytune_ft.models.build import decoder_layers

    for p in lm.parameters():
        p.requires_grad_(False)
    targets = targets_of(train_cfg)
    wrapped: list[str] = []
    layer_ids = {id(layer) for layer in decoder_layers(lm)}
    for layer_name, layer in lm.named_modules():
        if id(layer) not in layer_ids:
            continue
        for name, module in list(layer.named_modules()):
            parent_name, _, leaf = name.rpartition(".")
            if leaf not in targets or not isinstance(module, nn.Linear):
                continue
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, leaf, LoraLinear(module, train_cfg.lora_r, train_cfg.lora_alpha,
                                             train_cfg.lora_dropout))
            wrapped.append(f"{layer_name}.{name}")
    # every linear by default (a qwen3 or qwen2 model has no gated-delta-net ones); a named one must exist
    missing = sorted(set(train_cfg.lora_target_modules) - {w.rsplit(".", 1)[-1] for w in wrapped})
    if missing or not wrapped:
        raise ValueError(f"train.lora_target_modules: {missing} name no linear of this model's decoder layers")
    return wrapped


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    """Every LoraLinear of `model`, with its name, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]


def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's default init: lora_A Kaiming-uniform (a=sqrt(5), as nn.Linear), lora_B zeros, so the
    adapted model starts as the base. A is drawn whole on the CPU from `seed` and the adapter's index,
    and each rank copies its own rows: the same adapters at every world size."""
    from raytune_ft.models.build import _local_view

    with torch.no_grad():
        for i, (_, m) in enumerate(lora_modules(model)):
            a = m.lora_A.weight
            full = torch.empty(a.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed + i))
            local, offset, shape = _local_view(a)
            if local.numel():
                local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
            b_local, _, _ = _local_view(m.lora_B.weight)
            b_local.zero_()


def count_trainable(model: nn.Module) -> int:
    """Trainable parameters (the adapters' full sizes, whatever the sharding)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
