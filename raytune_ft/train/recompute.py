"""Activation checkpointing as a resolved choice (recipe/checkpointing.py) applies to the built model.

Whole decoder layers use transformers' own switch (`gradient_checkpointing` per layer, non-reentrant): it
checkpoints the layer's forward inside FSDP2's hooks, so a recompute does not gather the layer again.
A part of a layer (the attention, the gated-delta-net mixer, the MLP) gets a subclass whose call runs
under `torch.utils.checkpoint`, outside any `Module.compile` of the part: the compiled graph stays the
same and runs again in the backward. Neither changes a parameter's name, so checkpoints and exports keep
their keys.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytune_ft.recipe.checkpointing import Checkpointing


class _Recomputed:
    """Mixed in before a part's own class: in training with gradients on, its call is checkpointed."""

    _raytune_recomputed = True

    def __call__(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            return checkpoint(super().__call__, *args, use_reentrant=False, **kwargs)
        return super().__call__(*args, **kwargs)


@functools.cache
def _recomputed_class(cls: type) -> type:
    # the original name stays the suffix: code that recognises a part by its class name still does
    return type(f"Recomputed{cls.__name__}", (_Recomputed, cls), {})


def layer_parts(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's parts by the kind a per-kind choice names them."""
    parts = {"attention": getattr(layer, "self_attn", None), "gated_delta": getattr(layer, "linear_attn", None),
             "mlp": getattr(layer, "mlp", None)}
    return {k: m for k, m in parts.items() if m is not None}


def apply_checkpointing(lm: nn.Module, layers: list[nn.Module], choice: Checkpointing) -> None:
    """Checkpoint exactly what `choice` names in the decoder `layers` of `lm` (before FSDP2 wraps them)."""
    if choice.every:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(layers):
            if not choice.whole(i) and hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = False
    for layer in layers:
        for kind, part in layer_parts(layer).items():
            if kind in choice.kinds and not getattr(part, "_raytune_recomputed", False):
                part.__class__ = _recomputed_class(type(part))


def checkpointed(layers: list[nn.Module]) -> dict[str, int]:
    """How many decoder layers are recomputed whole, and how many parts of each kind: what the model does."""
    out = {"layer": sum(bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers)}
    for layer in layers:
        for kind, part in layer_parts(layer).items():
            out[kind] = out.get(kind, 0) + int(getattr(part, "_raytune_recomputed", False))
    return out
