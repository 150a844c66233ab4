"""Full attention over packed blocks: each conversation attends only to itself, causally.

A packed block holds several conversations back to back; `cu_seqlens` (int32, N+1 boundaries over the
flattened batch) says where each starts. This module registers one attention function with transformers'
`AttentionInterface` under the name "raytune_varlen"; models built by `raytune_ft.models.build` use it for
their full-attention layers. It picks a kernel by device:

- "flash_attn": FlashAttention-2's `flash_attn_varlen_func` (CUDA, when the package is installed);
- "torch_varlen": PyTorch's `torch.nn.attention.varlen.varlen_attn` (CUDA, bf16/fp16) with
  window_size=(-1, 0), which is what makes it causal (the function has no is_causal argument);
- "sdpa_blockdiag": SDPA with a block-diagonal causal mask built from cu_seqlens (CPU, and fp32 on CUDA).

The varlen kernels compute only the diagonal blocks, so cost grows with the sum of each conversation's
length squared, not with the block length squared as with a dense mask.

How transformers (5.17-5.24) hands us the packing signals: `model(input_ids, position_ids=...,
cu_seq_lens_q=..., cu_seq_lens_k=..., max_length_q=..., max_length_k=..., seq_idx=...)` forwards every
extra keyword through the decoder layers into `attention_interface(module, q, k, v, mask, **kwargs)`
(Qwen3/Qwen2/Qwen3.5 attention), and into the gated-delta-net layers' forward (see gated_delta.py).
Because "raytune_varlen" is not in transformers' mask registry, the model builds no dense mask: we get
`attention_mask=None` (or the caller's 2D padding mask, untouched).
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ATTN_NAME = "raytune_varlen"
_DENSE_MASK_MAX_TOKENS = 8192     # CPU path: above this, loop over conversations instead of a T x T mask

# Kernels switched off in this process because the start-up check (kernel_check.py) found them wrong or
# failing on this GPU; every backend choice here and in gated_delta.py skips them.
DISABLED_KERNELS: set[str] = set()


def disable_kernel(name: str) -> None:
    """Switch a kernel ("flash_attn", "torch_varlen", "causal_conv1d", "fla_chunk", ...) off for this process."""
    DISABLED_KERNELS.add(name)
    _backend_for.cache_clear()


def reset_disabled_kernels() -> None:
    DISABLED_KERNELS.clear()
    _backend_for.cache_clear()


# Why a kernel's package is installed but does not import (a shared library missing, a build for another torch),
# written by the kernel's own lazy import; the start-up check reports it (fast_paths._unimportable). An absent
# package is not written: nothing is wrong there.
IMPORT_FAILURES: dict[str, str] = {}


def note_import(kernel: str, module: str, error: Exception | None) -> None:
    """Keep (or, where the import worked or the package is absent, forget) why `module` did not import."""
    IMPORT_FAILURES.pop(kernel, None)
    package = module.split(".")[0]
    if error is None or (isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == package):
        return
    IMPORT_FAILURES[kernel] = (f"{package} is installed but `import {module}` fails: {type(error).__name__}: "
                               f"{str(error)[:300]}")


# ----------------------------------------------------------------- packing signals

def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 boundaries over the flattened (B*T) tokens: a conversation starts wherever the position
    does not follow the previous one (or at the start of a row)."""
    pos = position_ids.reshape(position_ids.shape[0], -1)
    b, t = pos.shape
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    idx = torch.nonzero(starts.reshape(-1), as_tuple=False).flatten()
    end = torch.tensor([b * t], device=pos.device, dtype=idx.dtype)
    return torch.cat([idx, end]).to(torch.int32)


def cu_seqlens_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """int32 boundaries over the flattened tokens from a per-token conversation index (B, T) or (T,)."""
    s = seq_idx.reshape(-1, seq_idx.shape[-1])
    b, t = s.shape
    starts = torch.ones_like(s, dtype=torch.bool)
    starts[:, 1:] = s[:, 1:] != s[:, :-1]
    idx = torch.nonzero(starts.reshape(-1), as_tuple=False).flatten()
    end = torch.tensor([b * t], device=s.device, dtype=idx.dtype)
    return torch.cat([idx, end]).to(torch.int32)


def normalise_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Check boundaries against the number of tokens; a trailing remainder (padding) becomes its own segment."""
    cu = cu_seqlens.reshape(-1).to(torch.int32)
    if cu.is_cuda:
        # Reading the ends back would stall the GPU queue in every layer; on the device we trust
        # the producers (packed_forward_kwargs and the base-model pre-hook), which checked on the host.
        return cu
    last = int(cu[-1])
    if int(cu[0]) != 0 or last > total:
        raise ValueError(f"cu_seqlens must start at 0 and end at most at the {total} tokens of the "
                         f"flattened batch; got {cu.tolist()[:4]}...{last}")
    if last < total:
        cu = torch.cat([cu, cu.new_tensor([total])])
    return cu


def packing_from_kwargs(kwargs: dict, total: int, device: torch.device) -> torch.Tensor | None:
    """The cu_seqlens (int32, on `device`) a layer should use, from what the model forwarded; None when
    the batch is not packed."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        cu = kwargs.get("cu_seqlens")
    if cu is not None:
        return normalise_cu_seqlens(cu.to(device), total)
    seq_idx = kwargs.get("seq_idx")
    if seq_idx is not None:
        return cu_seqlens_from_seq_idx(seq_idx.to(device))
    pos = kwargs.get("position_ids")
    if pos is not None and pos.dim() == 2 and pos.numel() == total:
        cu = cu_seqlens_from_position_ids(pos.to(device))
        if cu.numel() - 1 > pos.shape[0]:          # more conversations than rows: packed
            return cu
    return None


def _max_len(kwargs: dict, cu: torch.Tensor) -> int:
    m = kwargs.get("max_length_q")
    if m is not None:
        return int(m)
    return int((cu[1:] - cu[:-1]).max())


# ----------------------------------------------------------------- backends

@functools.lru_cache(maxsize=None)
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - not installed, or built against another torch
        note_import("flash_attn", "flash_attn", e)
        return None
    note_import("flash_attn", "flash_attn", None)
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def _torch_varlen():
    """torch.nn.attention.varlen.varlen_attn and the keyword names this torch version accepts."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def select_attention_backend(device: str | torch.device) -> str:
    """The kernel full attention uses on `device`: "flash_attn", "torch_varlen" or "sdpa_blockdiag".

    Chosen and logged once per device type ("cpu" and torch.device("cpu") are one). (fp32 inputs on CUDA still
    go to SDPA: the varlen kernels are half-precision only.)"""
    return _backend_for(torch.device(device).type)


@functools.lru_cache(maxsize=None)
def _backend_for(device_type: str) -> str:
    if device_type == "cuda" and "flash_attn" not in DISABLED_KERNELS and _flash_attn_varlen() is not None:
        choice = "flash_attn"
    elif device_type == "cuda" and "torch_varlen" not in DISABLED_KERNELS and _torch_varlen()[0] is not None:
        choice = "torch_varlen"
    else:
        choice = "sdpa_blockdiag"
    log.info("raytune_ft: packed full attention on %s uses %s", device_type, choice)
    return choice


def _sdpa_blockdiag(q, k, v, cu, scaling):
    """q (1, H, T, d), k/v (1, Hkv, T, d): SDPA where token i sees token j iff same conversation and j <= i."""
    total = q.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if total <= _DENSE_MASK_MAX_TOKENS:
        seg = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=q.device), (cu[1:] - cu[:-1]).long(),
                                      output_size=total)
        pos = torch.arange(total, device=q.device)
        mask = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    outs = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        outs.append(F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                                                   is_causal=True, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


class QKV(NamedTuple):
    """Queries (total_tokens, heads, head_dim) and keys/values (total_tokens, kv_heads, head_dim) of a flattened
    packed batch (GQA when fewer kv heads)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


_NATIVE_GQA: dict[tuple, bool] = {}


def _native_gqa_ok(fn, x: QKV, cu, max_len: int, kw: dict, keys: tuple | None = None) -> bool:
    """Whether this torch's varlen_attn takes fewer key/value heads than query heads as they are.

    Torch versions before `enable_gqa` existed (2.11) pass k/v straight to the flash kernel, which
    shares each KV head among its query-head group; repeating k/v 6x for Qwen3.5 costs memory traffic in
    every full-attention layer, and under context parallelism 6x the gathered keys and their gradients.
    Checked once per (heads, kv heads, head_dim, dtype) against the repeated result on the first call
    (forward only, no grad) and logged; any error or mismatch keeps the repeat. `keys`: (cu_k, max_k) where
    there are more keys than queries (the CP form); default the queries' own."""
    q, k, v = x
    cu_k, max_k = keys or (cu, max_len)
    key = (q.shape[1], k.shape[1], q.shape[2], q.dtype)
    if key not in _NATIVE_GQA:
        rep = q.shape[1] // k.shape[1]
        try:
            with torch.no_grad():
                native = fn(q, k, v, cu, cu_k, max_len, max_k, **kw)
                ref = fn(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), cu, cu_k,
                         max_len, max_k, **kw)
                err = float((native.float() - ref.float()).abs().max())
            ok = err <= 1e-3 * max(1.0, float(ref.float().abs().max()))
            why = f"max difference {err:.2e} from the repeated k/v"
        except Exception as e:  # noqa: BLE001 - any refusal means: repeat
            ok, why = False, f"{type(e).__name__}: {e}"
        _NATIVE_GQA[key] = ok
        log.info("raytune_ft: varlen_attn with %d query / %d kv heads: %s (%s)", q.shape[1], k.shape[1],
                 "native GQA" if ok else "k/v repeated", why)
    return _NATIVE_GQA[key]


def torch_varlen_causal(x: QKV, cu_q, max_q: int, scaling: float | None = None,
                        keys: tuple | None = None) -> torch.Tensor:
    """torch's varlen_attn, causal, as this torch version takes it: the scale as a keyword or folded into q,
    fewer KV heads through `enable_gqa`, as they are where the kernel shares them (`_native_gqa_ok`), else
    repeated. `keys`: (cu_k, max_k) where there are more keys than queries (causal aligns bottom-right: the CP
    form); default the queries' own."""
    fn, params = _torch_varlen()
    cu_k, max_k = keys or (cu_q, max_q)
    kw: dict[str, Any] = {"window_size": (-1, 0)}      # (-1, 0) is causal; the default (-1, -1) is not
    q, k, v = x
    if scaling is not None:
        if "scale" in params:
            kw["scale"] = scaling
        else:                                           # older signature: fold the scale into q
            q = q * (scaling * q.shape[-1] ** 0.5)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif not _native_gqa_ok(fn, QKV(q, k, v), cu_q, max_q, kw, keys=(cu_k, max_k)):
            rep = q.shape[1] // k.shape[1]            # 6x the keys and their gradients: the last resort
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def varlen_attention(x: QKV, cu_seqlens, max_len: int, scaling: float | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """Causal attention within each conversation of a flattened packed batch.

    x: q (total_tokens, heads, head_dim), k/v (total_tokens, kv_heads, head_dim) (GQA when fewer);
    cu_seqlens: int32 (N+1,). Returns (total_tokens, heads, head_dim)."""
    q_THD, k_THD, v_THD = x
    backend = backend or select_attention_backend(q_THD.device.type)
    half = q_THD.dtype in (torch.float16, torch.bfloat16)
    cu = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    if backend == "flash_attn" and half:
        return _flash_attn_varlen()(q_THD, k_THD, v_THD, cu, cu, max_len, max_len,
                                    dropout_p=0.0, softmax_scale=scaling, causal=True)
    if backend == "torch_varlen" and half:
        return torch_varlen_causal(x, cu, max_len, scaling)
    out = _sdpa_blockdiag(q_THD.transpose(0, 1)[None], k_THD.transpose(0, 1)[None],
                          v_THD.transpose(0, 1)[None], cu, scaling)
    return out[0].transpose(0, 1)


def raytune_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface function: query (B, H, T, d), key/value (B, Hkv, T, d) ->
    ((B, T, H, d), None). Packed batches (cu_seq_lens_q / seq_idx / restarting position_ids) go through
    `varlen_attention`; anything else (plain or padded batches, generation) through causal SDPA."""
    b, h, t, d = query.shape
    kv_len = key.shape[2]
    cp = kwargs.get("context_parallel")   # this rank holds part of the block (models/context_parallel)
    if cp is not None:
        if b != 1 or kv_len != t:
            raise ValueError("context parallelism takes one packed row per rank and no cache")
        out = cp.attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scaling)
        return out[None], None
    cu = packing_from_kwargs(kwargs, b * t, query.device) if kv_len == t else None
    if cu is not None:
        q = query.transpose(1, 2).reshape(b * t, h, d)
        k = key.transpose(1, 2).reshape(b * t, key.shape[1], d)
        v = value.transpose(1, 2).reshape(b * t, value.shape[1], d)
        out = varlen_attention(QKV(q, k, v), cu, _max_len(kwargs, cu), scaling)
        return out.reshape(b, t, h, d), None
    # Not packed: ordinary causal attention, honouring a padding mask if there is one.
    gqa = h != key.shape[1]
    mask = attention_mask
    if mask is not None and mask.dim() == 2:       # (B, kv) padding mask: combine with causal
        pad = mask[:, None, None, :].bool()
        causal = torch.ones(t, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - t)
        mask = pad & causal[None, None]
    if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         is_causal=mask is None and t > 1, enable_gqa=gqa,
                                         dropout_p=dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def register_varlen_attention() -> str:
    """Register "raytune_varlen" with transformers' AttentionInterface (idempotent); returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, raytune_varlen_attention)
    return ATTN_NAME


register_varlen_attention()
