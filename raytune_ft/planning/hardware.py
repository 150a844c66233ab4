"""GPUs and model FLOPs: the one place that knows a GPU's memory and bf16 peak and how many FLOPs a token costs.

The memory plan (plan.py), both training loops' MFU and the benchmarks read these; nothing here imports
the rest of raytune_ft, and torch / transformers are imported only to count a real model's parameters.

FLOPs follow the seed loop's method, so figures stay comparable with it:
  matmul params = every parameter, minus the input embedding when it is not tied to the lm_head
                  (a lookup, not a matmul); with tied weights the one matrix counts once, as the lm_head;
  FLOPs         = 6 x matmul params x tokens  +  6 x n_full_attention_layers x (heads x head_dim) x sum(len^2)
The attention term counts QK^T and PV causally (half of 2 x 2 x len^2 x d forward, x3 for training), per
conversation: varlen kernels do only the diagonal blocks of a packed block. Norm weights, conv kernels
and gates are counted in the params as the seed does (well under 0.1% of the total). The gated-delta-net
recurrence's own work, linear in tokens, is optional (`include_linear_attention=True`), off by default.

MFU is model FLOPs per second over the GPU's *datasheet* dense bf16 peak, the basis published MFU uses,
so a figure compares across GPUs and with other trainers. Where the bf16 matmul rate was measured on
such a GPU, `mfu_metrics` also gives the figure against that (how close to what the GPU really does).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, Iterable

GiB = 1024**3


# ------------------------------------------------------------------ GPUs

@dataclass(frozen=True)
class GpuSpec:
    """What the plan and MFU need to know about one GPU model."""

    name: str                        # the key matched in a device name: "H200" in "NVIDIA H200"
    memory_bytes: float              # what torch can allocate at most (total_memory)
    memory_source: str
    peak_bf16_tflops: float          # datasheet, dense (no 2:4 sparsity)
    peak_source: str
    measured_matmul_tflops: float | None = None   # a bf16 torch matmul timed on one, where one was
    nvlink_gb_s: float | None = None  # NVLink per GPU and direction: the datasheet's both-directions figure / 2


# Datasheet peaks are NVIDIA's dense bf16 Tensor Core figures; sheets that print the sparse figure are
# halved. Order matters: the first key found in a device name wins.
GPUS: dict[str, GpuSpec] = {
    "B300": GpuSpec("B300", 288e9, "NVIDIA HGX B300 datasheet: 288 GB HBM3e",
                    2250.0, "NVIDIA HGX B300 datasheet: FP16/BF16 Tensor Core 36 PFLOPS for 8 GPUs with "
                            "sparsity -> 2.25 PFLOPS dense per GPU (as B200; Blackwell Ultra raised FP4 only)",
                    nvlink_gb_s=900.0),             # fifth-generation NVLink, 1.8 TB/s per GPU
    "B200": GpuSpec("B200", 180e9, "NVIDIA DGX B200: 180 GB usable HBM3e",
                    2250.0, "NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS for 8 GPUs with sparsity",
                    nvlink_gb_s=900.0),             # fifth-generation NVLink, 1.8 TB/s per GPU
    "H200": GpuSpec("H200", 139 * GiB, "torch on an H200 SXM: 139 GiB usable (141 GB marketed)",
                    989.0, "NVIDIA H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity",
                    measured_matmul_tflops=790.0, nvlink_gb_s=450.0),     # NVLink 4, 900 GB/s per GPU
    "H100": GpuSpec("H100", 79.1 * GiB, "H100 SXM 80 GB: 79.1 GiB as torch reports",
                    989.0, "NVIDIA H100 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity",
                    nvlink_gb_s=450.0),             # NVLink 4, 900 GB/s per GPU
    "A100": GpuSpec("A100", 79.1 * GiB, "A100 80 GB: 79.1 GiB as torch reports",
                    312.0, "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS dense",
                    nvlink_gb_s=300.0),             # NVLink 3, 600 GB/s per GPU
}


def gpu_spec(device_name: str | None) -> GpuSpec | None:
    """The spec of a GPU by name ("NVIDIA H200", "H100", torch.cuda.get_device_name()); None when unknown."""
    if not device_name:
        return None
    key = device_name.upper().replace("NVIDIA", "").replace("-", "")
    for known, spec in GPUS.items():
        if known in key:
            return spec
    return None


def device_spec(device_name: str, total_memory: float) -> GpuSpec:
    """The spec of the GPU a worker holds: the known model's peak, and the memory torch reports for it."""
    spec = gpu_spec(device_name)
    source = f"torch: {total_memory / GiB:.1f} GiB total on this {device_name}"
    if spec is None:
        return GpuSpec(device_name, float(total_memory), source, 0.0, "unknown GPU: no bf16 peak")
    return dataclasses.replace(spec, memory_bytes=float(total_memory), memory_source=source)


def current_device_name() -> str | None:
    """torch's name of the current CUDA device, None without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def gpu_peak_tflops(device_name: str | None) -> float:
    """Datasheet dense bf16 peak TFLOP/s of a GPU by name; 0.0 when unknown, so an MFU computed with it
    is visibly absent rather than wrong."""
    spec = gpu_spec(device_name)
    return spec.peak_bf16_tflops if spec else 0.0


def mfu_basis(device_name: str | None) -> str:
    """The words that say what an MFU figure of this GPU is relative to (for log lines and MLflow params)."""
    spec = gpu_spec(device_name)
    if spec is None:
        return f"none: no bf16 peak known for {device_name or 'a CPU worker'}"
    basis = f"datasheet dense bf16 {spec.name} ({spec.peak_bf16_tflops:,.0f} TFLOP/s)"
    if spec.measured_matmul_tflops:
        basis += f"; mfu_measured_matmul over {spec.measured_matmul_tflops:,.0f} TFLOP/s measured bf16 matmul"
    return basis


def mfu_metrics(flops_per_s: float, device_name: str | None, n_gpus: int = 1) -> dict[str, float]:
    """MFU of `n_gpus` GPUs named `device_name` doing `flops_per_s` model FLOPs per second together.

    Returns floats, ready for MLflow: `mfu` over the datasheet dense bf16 peak (0.0 when the GPU is
    unknown), `mfu_peak_tflops` the per-GPU peak used, and `mfu_measured_matmul` over the measured bf16
    matmul rate where one is known. `mfu_basis(device_name)` says the same in words.

    >>> mfu_metrics(0.5 * 989e12, "NVIDIA H200")["mfu"]
    0.5
    """
    spec = gpu_spec(device_name)
    if spec is None or n_gpus <= 0:
        return {"mfu": 0.0, "mfu_peak_tflops": 0.0}
    per_gpu = flops_per_s / n_gpus
    out = {"mfu": per_gpu / (spec.peak_bf16_tflops * 1e12), "mfu_peak_tflops": spec.peak_bf16_tflops}
    if spec.measured_matmul_tflops:
        out["mfu_measured_matmul"] = per_gpu / (spec.measured_matmul_tflops * 1e12)
    return out


# ------------------------------------------------------------------ FLOPs

def training_flops(matmul_params: float, attention_width: float, seq_lens: Iterable[float]) -> float:
    """Training FLOPs (forward + backward) of conversations of lengths `seq_lens`, by the seed's method.

    attention_width: n_full_attention_layers x heads x head_dim (0 for a model without full attention).
    """
    lens = [float(n) for n in seq_lens]
    return 6.0 * matmul_params * sum(lens) + 6.0 * attention_width * sum(n * n for n in lens)


def flops_per_token(matmul_params: float, attention_width: float, mean_conversation_tokens: float) -> float:
    """Training FLOPs per token when every conversation has `mean_conversation_tokens` tokens."""
    n = float(mean_conversation_tokens)
    return training_flops(matmul_params, attention_width, [n]) / n


def _config_of(model_or_config: Any):
    return getattr(model_or_config, "config", model_or_config)


def _matmul_params_of_model(model) -> int:
    total = sum(p.numel() for p in model.parameters())     # a tied matrix is one parameter, counted once
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    emb = model.get_input_embeddings().weight.numel()
    return int(total - (0 if tied else emb))


@functools.lru_cache(maxsize=32)
def _matmul_params_from_json(config_json: str, config_cls: type) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = config_cls.from_dict(json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return _matmul_params_of_model(model)


def matmul_params(model_or_config: Any) -> int:
    """Parameters that take part in matmuls per token (lm_head included, untied input embedding excluded).

    Takes a model (counted directly, meta or real) or a config (a meta-device model is built to count)."""
    if hasattr(model_or_config, "parameters") and hasattr(model_or_config, "get_input_embeddings"):
        return _matmul_params_of_model(model_or_config)
    cfg = _config_of(model_or_config)
    d = cfg.to_dict()
    for k in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        d.pop(k, None)
    return _matmul_params_from_json(json.dumps(d, sort_keys=True, default=str), type(cfg))


def _layer_types(cfg) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else ["full_attention"] * cfg.num_hidden_layers


def attention_width(config) -> int:
    """n_full_attention_layers x heads x head_dim of a transformers config: the attention term's factor."""
    cfg = _config_of(config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return _layer_types(cfg).count("full_attention") * cfg.num_attention_heads * head_dim


def gated_delta_flops_per_token(config, chunk_size: int = 64) -> float:
    """Training FLOPs per token of one gated-delta-net layer's recurrence (chunked algorithm), beyond its
    projections: per value head ~6*dk*dv for reading/updating the state, ~2*C*(2*dk+dv) for the intra-chunk
    products and ~C*(dk+dv) for the triangular solves, forward; x3 for forward+backward."""
    cfg = _config_of(config)
    return 3.0 * gated_delta_forward_flops(cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                           cfg.linear_value_head_dim, chunk_size)


def gated_delta_forward_flops(value_heads: int, key_dim: int, value_dim: int, chunk_size: int = 64) -> float:
    """Forward FLOPs per token of one gated-delta-net recurrence (`gated_delta_flops_per_token` without the x3)."""
    dk, dv = key_dim, value_dim
    return float(value_heads * (6 * dk * dv + 2 * chunk_size * (2 * dk + dv) + chunk_size * (dk + dv)))


def flops_per_block(config, seq_lens: Iterable[int], *, include_linear_attention: bool = False,
                    adapter_params: int | None = None) -> float:
    """Training FLOPs (forward + backward) of one packed block whose conversations have `seq_lens` tokens.

    `adapter_params` (LoRA): the frozen base's forward and backward FLOPs, which has no weight gradients (2 of
    the 6 FLOPs per parameter and token dropped), plus the adapters' full training FLOPs."""
    cfg = _config_of(config)
    lens = [int(n) for n in seq_lens]
    n = matmul_params(cfg)     # a config's count builds a JSON key each call: once per block
    flops = training_flops(n, attention_width(cfg), lens)
    if adapter_params is not None:
        flops += (6.0 * adapter_params - 2.0 * n) * sum(lens)
    if include_linear_attention:
        flops += _layer_types(cfg).count("linear_attention") * gated_delta_flops_per_token(cfg) * sum(lens)
    return flops
