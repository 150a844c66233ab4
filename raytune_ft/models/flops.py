"""Model FLOPs per packed block and GPU peaks, for MFU figures comparable with the seed's.

The method is the seed loop's (../shared/peers/seed000_loop.py):
  matmul params = every parameter, minus the input embedding when it is not tied to the lm_head
                  (a lookup, not a matmul); with tied weights the one matrix counts once, as the lm_head;
  FLOPs         = 6 x matmul params x tokens  +  6 x n_full_attention_layers x (heads x head_dim) x sum(len^2)
The attention term counts QK^T and PV causally (half of 2 x 2 x len^2 x d forward, x3 for training), per
conversation: varlen kernels do only the diagonal blocks of a packed block. Norm weights, conv kernels
and gates are counted in the params as the seed does (well under 0.1% of the total).

Optional, off by default so figures stay comparable with the seed's: the gated-delta-net recurrence's
own work, which is linear in tokens (`include_linear_attention=True`, see `gated_delta_flops_per_token`);
on the 27B shape it adds about 0.7% to the total.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Iterable

import torch


def _config_of(model_or_config: Any):
    return getattr(model_or_config, "config", model_or_config)


@functools.lru_cache(maxsize=32)
def _matmul_params_from_json(config_json: str, config_cls: type) -> int:
    from transformers import AutoModelForCausalLM

    cfg = config_cls.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return _matmul_params_of_model(model)


def _matmul_params_of_model(model: torch.nn.Module) -> int:
    total = sum(p.numel() for p in model.parameters())     # a tied matrix is one parameter, counted once
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    emb = model.get_input_embeddings().weight.numel()
    return int(total - (0 if tied else emb))


def matmul_params(model_or_config: Any) -> int:
    """Parameters that take part in matmuls per token (lm_head included, untied input embedding excluded).

    Takes a model (counted directly, meta or real) or a config (a meta-device model is built to count)."""
    if isinstance(model_or_config, torch.nn.Module):
        return _matmul_params_of_model(model_or_config)
    cfg = _config_of(model_or_config)
    d = cfg.to_dict()
    for k in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        d.pop(k, None)
    return _matmul_params_from_json(json.dumps(d, sort_keys=True, default=str), type(cfg))


def _layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else ["full_attention"] * cfg.num_hidden_layers


def gated_delta_flops_per_token(config, chunk_size: int = 64) -> float:
    """Training FLOPs per token of one gated-delta-net layer's recurrence (chunked algorithm), beyond its
    projections: per value head ~6*dk*dv for reading/updating the state, ~2*C*(2*dk+dv) for the intra-chunk
    products and ~C*(dk+dv) for the triangular solves, forward; x3 for forward+backward."""
    cfg = _config_of(config)
    hv = cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    fwd = hv * (6 * dk * dv + 2 * chunk_size * (2 * dk + dv) + chunk_size * (dk + dv))
    return 3.0 * fwd


def flops_per_block(config, seq_lens: Iterable[int], *, include_linear_attention: bool = False) -> float:
    """Training FLOPs (forward + backward) of one packed block whose conversations have `seq_lens` tokens."""
    cfg = _config_of(config)
    lens = [int(n) for n in seq_lens]
    tokens = sum(lens)
    types = _layer_types(cfg)
    n_full = types.count("full_attention")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 6.0 * n_full * cfg.num_attention_heads * head_dim * sum(n * n for n in lens)
    flops = 6.0 * matmul_params(cfg) * tokens + attn
    if include_linear_attention:
        flops += types.count("linear_attention") * gated_delta_flops_per_token(cfg) * tokens
    return flops


# Dense bf16 peaks per GPU, TFLOP/s.
_PEAKS = [
    # Measured on the lent H200 (torch bf16 matmul, dense): 790; NVIDIA's sheet says 989 for H100/H200 SXM.
    # The project's MFU figures use the measured value, as ../shared/GPU.md does.
    ("h200", 790.0),
    ("h100", 790.0),
    # B300 (Blackwell Ultra): NVIDIA HGX B300 datasheet, FP16/BF16 Tensor Core 36 PFLOPS for 8 GPUs *with*
    # 2:4 sparsity -> 4.5 PF sparse, 2.25 PF dense per GPU (same as B200); not measured here.
    ("b300", 2250.0),
    ("b200", 2250.0),
    ("a100", 312.0),    # NVIDIA A100 datasheet, BF16 dense
]


def gpu_peak_tflops(device_name: str | None = None) -> float:
    """Dense bf16 peak TFLOP/s of a GPU by name (e.g. torch.cuda.get_device_name()); 0.0 when unknown
    (so an MFU computed with it is obviously absent rather than wrong)."""
    if device_name is None:
        if not torch.cuda.is_available():
            return 0.0
        device_name = torch.cuda.get_device_name()
    name = device_name.lower()
    for key, peak in _PEAKS:
        if key in name:
            return peak
    return 0.0


def mfu(flops: float, seconds: float, n_gpus: int = 1, device_name: str | None = None) -> float:
    """Model FLOPs utilisation: flops / (seconds x n_gpus x peak); 0.0 when the peak is unknown."""
    peak = gpu_peak_tflops(device_name)
    if peak <= 0 or seconds <= 0:
        return 0.0
    return flops / (seconds * n_gpus * peak * 1e12)
