"""Float8 training for the FSDP2 loop (`train.precision: fp8`), through torchao.

Only the decoder layers' big projections run their matmuls in float8: the MLP, the attention
projections and the gated-delta-net input/output projections. Embeddings, lm_head, norms, the
gated-delta-net recurrence and its conv stay in the compute dtype: they are small next to the
projections, and lm_head feeds the loss, where float8 would cost accuracy for little time.

Recipes (`train.fp8_recipe`):
- tensorwise: one scale per tensor. The weights are all-gathered by FSDP2 in float8 (half the bytes of
  bf16), their scales computed for all layers at once after each optimizer step.
- rowwise: one scale per row; more accurate, slower kernels, weights all-gathered in the compute dtype
  (torchao's float8 all-gather supports tensorwise scaling only).
- mxfp8: one scale per 32 elements, Blackwell's native block format (compute capability 10.x).

The parameters stay what they were (fp32 or bf16 master weights): torchao's float8 linears cast at
each matmul, so state dicts, DCP checkpoints and the Hugging Face export have the bf16 model's keys and
dtypes: the converted modules' state dicts hold plain tensors (see `_plain_state_dict`).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn

from raytune_ft import compat
from raytune_ft.planning.shapes import FP8_MIN_DIM, fp8_linear_filter_dims

PRECISIONS = ("bf16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise", "mxfp8")



def fp8_support_error(device: torch.device, recipe: str) -> str | None:
    """Why float8 training cannot run on `device` with `recipe` (None when it can).

    Checked on the worker at run start, where the real device is known: the driver may have no GPU."""
    if recipe not in FP8_RECIPES:
        return f"train.fp8_recipe: {recipe!r} is not one of {', '.join(FP8_RECIPES)}"
    if device.type != "cuda":
        return (f"train.precision=fp8 needs an NVIDIA GPU with float8 matmuls (compute capability 8.9 or "
                f"newer: Ada, Hopper, Blackwell); this worker runs on {device.type}. "
                "Use train.precision=bf16 here.")
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 9):
        return (f"train.precision=fp8 needs float8 matmuls (compute capability 8.9 or newer: Ada, Hopper, "
                f"Blackwell); {name} has {major}.{minor}. Use train.precision=bf16 on this GPU.")
    if recipe == "mxfp8" and major != 10:
        return (f"train.fp8_recipe=mxfp8 needs Blackwell's block-scaled float8 matmuls (compute capability "
                f"10.x); {name} has {major}.{minor}. Use train.fp8_recipe=tensorwise or rowwise.")
    try:
        import torchao  # noqa: F401
    except ImportError:
        return ("train.precision=fp8 needs torchao, which is not installed on this worker: "
                "pip install 'raytune-ft[gpu]' (or torchao) in the workers' environment.")
    return None


def check_fp8_supported(device: torch.device, recipe: str) -> None:
    """Raise RuntimeError with `fp8_support_error`'s message when float8 cannot run here."""
    msg = fp8_support_error(device, recipe)
    if msg is not None:
        raise RuntimeError(msg)


def fp8_linear_filter(recipe: str = "tensorwise", min_dim: int = FP8_MIN_DIM) -> Callable[[nn.Module, str], bool]:
    """The module filter: plain nn.Linear whose both dims are multiples of 16 (32 for mxfp8) and at
    least `min_dim`. Applied within decoder layers only (see `convert_to_fp8`)."""
    def keep(module: nn.Module, fqn: str) -> bool:
        if type(module) is not nn.Linear:   # subclasses (already converted, LoRA, ...) are left alone
            return False
        out_f, in_f = module.weight.shape
        return fp8_linear_filter_dims(in_f, out_f, recipe, min_dim)

    return keep


def fp8_config(recipe: str):
    """torchao's config for `recipe`: Float8LinearConfig (tensorwise with FSDP2 float8 all-gather,
    rowwise) or MXFP8TrainingOpConfig."""
    if recipe == "tensorwise":
        from torchao.float8 import Float8LinearConfig

        return Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    if recipe == "rowwise":
        from torchao.float8 import Float8LinearConfig

        return Float8LinearConfig.from_recipe_name("rowwise")
    if recipe == "mxfp8":
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

        return MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_RCEIL)
    raise ValueError(f"train.fp8_recipe: {recipe!r} is not one of {', '.join(FP8_RECIPES)}")


def convert_to_fp8(layers: list[nn.Module], recipe: str, *, min_dim: int = FP8_MIN_DIM,
                   config=None) -> list[str]:
    """Swap the eligible linears of each decoder layer for torchao's float8 training linears, in place.

    Call before fully_shard (FSDP2 must see the float8 weight wrappers to all-gather in float8) and
    before torch.compile. Works on meta-device layers (weights are filled after sharding). Returns the
    converted modules' names within their layer, "<layer index>.<name>"; raises if none qualifies (a
    float8 run that converts nothing is a bf16 run under another name)."""
    compat.TORCH_DTENSOR_LOCAL.check()     # plain_tensor reads it from every sharded float8 weight
    keep = fp8_linear_filter(recipe, min_dim)
    before = [{n for n, m in layer.named_modules() if keep(m, n)} for layer in layers]
    cfg = config if config is not None else fp8_config(recipe)
    if recipe == "mxfp8":
        from torchao.quantization import quantize_

        for layer in layers:
            quantize_(layer, cfg, filter_fn=keep)
    else:
        from torchao.float8 import convert_to_float8_training

        for layer in layers:
            convert_to_float8_training(layer, module_filter_fn=keep, config=cfg)
    converted = [f"{i}.{n}" for i, names in enumerate(before) for n in sorted(names)]
    for layer in layers:
        for m in layer.modules():
            if _is_fp8_linear(m):
                m.register_state_dict_post_hook(_plain_state_dict)
    if not converted:
        raise RuntimeError(f"train.precision=fp8: no decoder linear qualifies for float8 (both dims multiples "
                           f"of 16 and at least {min_dim}); this model is too small for float8 training")
    return converted


def fp8_module_names(model: nn.Module) -> list[str]:
    """Names of the modules of `model` that compute in float8 (torchao's Float8Linear, or a linear whose
    weight is an MXFP8 training wrapper)."""
    out = []
    for name, m in model.named_modules():
        w = getattr(m, "weight", None)
        if type(m).__name__ == "Float8Linear" or _is_wrapper(compat.dtensor_local(w)):
            out.append(name)
    return out


def compile_fp8_linears(layers: list[nn.Module]) -> int:
    """torch.compile each float8 linear outside the MLP (the MLP is compiled whole by the loop's
    `train.compile`): eager float8 casts are separate amax, scale and cast kernels per matmul input,
    compiled they fuse into one. Returns how many modules were compiled."""
    n = 0
    for layer in layers:
        for name, m in layer.named_modules():
            if name.split(".")[0] == "mlp" or not _is_fp8_linear(m):
                continue
            m.compile()
            n += 1
    return n


def precompute_fp8_scales(model: nn.Module, recipe: str) -> None:
    """After each optimizer step (tensorwise only): the float8 scales of all weights in one pass, so
    FSDP2's float8 all-gather of the next forward needs no per-layer amax."""
    if recipe == "tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


@contextlib.contextmanager
def linears_in_high_precision(model: nn.Module, *, keep_weights: bool = False):
    """Inside it, every float8 linear of `model` computes a plain matmul in its input's dtype, on its weight
    as the forward sees it (FSDP2's float8 all-gather hands it in float8 with its scale: dequantised).
    For the forward-only probes (held-out loss, samples), which run eagerly; training is untouched.
    `keep_weights`: the weights stay gathered and unchanged for the context's length, so each linear
    dequantises its weight once (a bf16 copy kept until the context ends)."""
    swapped = [m for m in model.modules() if _is_fp8_linear(m)]
    kept: dict[tuple, torch.Tensor] = {}
    for m in swapped:
        m.forward = functools.partial(_high_precision_forward, m, kept if keep_weights else None)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward
        kept.clear()


def float8_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights of `model`'s float8 linears."""
    return [m.weight for m in model.modules() if _is_fp8_linear(m)]


def _high_precision_forward(module: nn.Module, kept: dict | None, x: torch.Tensor) -> torch.Tensor:
    key = (id(module), x.dtype)
    w = kept.get(key) if kept is not None else None
    if w is None:
        w = module.weight
        if hasattr(w, "to_original_precision"):        # torchao's float8 tensor: the all-gathered weight
            w = w.to_original_precision()
        w = _unwrap(w).to(x.dtype)
        if kept is not None:
            kept[key] = w
    return torch.nn.functional.linear(x, w, None if module.bias is None else module.bias.to(x.dtype))


def _plain_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State dicts (DCP checkpoints, the HF export) hold the weights as plain tensors: torchao's weight
    wrappers would be pickled into DCP files (a bf16 run could not read them, and weights-only loading
    refuses them) and cannot be written by safetensors. The plain tensor shares the wrapper's storage,
    so loading in place still fills the parameter."""
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = plain_tensor(state_dict[key])


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` without torchao's training wrapper (the high-precision tensor it wraps); other tensors as
    they are. DTensors keep their placement, with a plain local tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = compat.dtensor_local(t)
        inner = _unwrap(local)
        if inner is local:
            return t
        return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return _unwrap(t)


def _unwrap(t):
    while _is_wrapper(t):
        t = compat.torchao_inner_tensor(t)
    return t


def _is_wrapper(t) -> bool:
    """Whether `t` is one of torchao's weight wrappers (torchao is imported by then where it can be one)."""
    import sys

    if t is None or "torchao" not in sys.modules:
        return False
    return isinstance(t, compat.torchao_weight_wrappers())


def _is_fp8_linear(m: nn.Module) -> bool:
    return type(m).__name__ == "Float8Linear" or (isinstance(m, nn.Linear)
                                                  and _is_wrapper(compat.dtensor_local(m.weight)))
