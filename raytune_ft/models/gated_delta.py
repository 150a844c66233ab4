"""Qwen3.5's gated-delta-net (linear attention) layers on packed blocks, without leaks.

A gated-delta-net layer carries state along the sequence in two places: a causal depthwise conv1d
(kernel 4) over q/k/v, and the gated delta recurrence. In a packed block both must restart at each
conversation's first token. transformers' own torch path cannot: in 5.24 it raises when handed
`cu_seqlens`/`seq_idx` without flash-linear-attention and causal-conv1d, and with `position_ids` alone it
silently runs the conv and the recurrence straight across conversation boundaries.

`enable_packing(model)` swaps each gated-delta-net module's class for a subclass whose forward, given
packing signals (cu_seq_lens_q, seq_idx, or restarting position_ids), computes:
- the conv per conversation: on CUDA with causal-conv1d installed, `causal_conv1d_fn(..., seq_idx=)`;
  otherwise (any device) exactly, by scattering each conversation behind K-1 zeros before a plain conv1d;
- the recurrence per conversation: on CUDA with flash-linear-attention installed,
  `chunk_gated_delta_rule(..., cu_seqlens=)`; otherwise transformers' torch reference run on each
  conversation from a zero state.
Without packing signals (generation with a cache, padded batches) it runs transformers' own forward.

The CUDA kernel branches are written against the documented APIs of causal-conv1d >= 1.5 and
flash-linear-attention >= 0.6 and are not exercised by the CPU tests here.

`enable_packing` also switches full attention to "raytune_varlen" (attention.py) and adds a forward
pre-hook on the base model that turns restarting `position_ids` (TRL's padding-free format) into
cu_seqlens/seq_idx, because transformers does not hand position_ids to the linear-attention layers.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Mapping, NamedTuple

import torch
import torch.nn.functional as F

from raytune_ft.models.attention import (ATTN_NAME, DISABLED_KERNELS, cu_seqlens_from_position_ids,
                                         cu_seqlens_from_seq_idx, normalise_cu_seqlens, note_import,
                                         packing_from_kwargs, register_varlen_attention)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------- optional CUDA kernels

@functools.lru_cache(maxsize=None)
def _causal_conv1d_fn():
    try:
        from causal_conv1d import causal_conv1d_fn  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - absent, or present and broken: note_import tells them apart
        note_import("causal_conv1d", "causal_conv1d", e)
        return None
    note_import("causal_conv1d", "causal_conv1d", None)
    return causal_conv1d_fn


# flash-linear-attention's package __init__ imports every layer and model class it ships (fla.layers,
# fla.models: dozens of modules, transformers' model classes among them) to re-export them, and `fla.ops`'
# __init__ imports every op (abc, comba, kda, rwkv7, ...); the loop needs one op and the modules. Importing
# only those keeps the worker's start-up short.
FLA_OPS = ("fla.ops.gated_delta_rule", "fla.modules")     # ours, and what transformers' Qwen3.5 code takes
FLA_BARE_PACKAGES = ("fla", "fla.ops")                    # put in place without running their __init__


def _bare_package(name: str):
    """The package `name` as a module object with its path and no __init__ run, or None where not found."""
    import importlib.util
    import pkgutil

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    package = importlib.util.module_from_spec(spec)        # the module object; its __init__ is not run
    package.__path__ = pkgutil.extend_path(list(spec.submodule_search_locations), name)
    return package


@functools.lru_cache(maxsize=None)
def import_fla_ops_only() -> bool:
    """Put flash-linear-attention's packages `FLA_BARE_PACKAGES` in place without their __init__s (each with
    its path; fla with its version), then import `FLA_OPS`. True where that worked; where an op's import
    fails that way (a release whose ops need an __init__), the partial packages are taken out again and
    False returned: the next import of fla runs it whole, as without this function. False too where fla is
    absent or imported already. Call before anything imports fla (transformers' Qwen3.5 modelling imports
    it at its own import on a CUDA machine)."""
    import importlib
    import importlib.metadata
    import sys

    if "fla" in sys.modules:
        return False
    for name in FLA_BARE_PACKAGES:
        package = _bare_package(name)
        if package is None:
            break
        if name == "fla":
            try:
                package.__version__ = importlib.metadata.version("fla-core")
            except importlib.metadata.PackageNotFoundError:
                package.__version__ = "0"
        else:
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, package)
        sys.modules[name] = package
    if "fla" not in sys.modules:
        return False
    try:
        for name in FLA_OPS:
            importlib.import_module(name)
        return True
    except Exception as e:  # noqa: BLE001 - fla imports whole instead
        log.info("flash-linear-attention's ops need its package __init__s (%s): imported whole", type(e).__name__)
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]
        return False


@functools.lru_cache(maxsize=None)
def _fla_chunk_gated_delta_rule():
    import_fla_ops_only()
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore[import-not-found]
    except Exception as e:  # noqa: BLE001 - absent, or present and broken: note_import tells them apart
        note_import("fla_chunk", "fla.ops.gated_delta_rule", e)
        return None
    note_import("fla_chunk", "fla.ops.gated_delta_rule", None)
    return chunk_gated_delta_rule


@functools.lru_cache(maxsize=None)
def _torch_reference_gated_delta_rule():
    """transformers' pure-torch chunked gated delta rule, unwrapped from its kernel-dispatch decorator
    (which would call flash-linear-attention's Triton kernel, or refuse cu_seqlens)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return inspect.unwrap(m.torch_chunk_gated_delta_rule)


def gated_delta_backends(device: str | torch.device) -> dict[str, str]:
    """Which conv and recurrence implementations packed gated-delta-net layers use on `device` (kernels
    the start-up check switched off are skipped)."""
    cuda = torch.device(device).type == "cuda"
    conv_ok = cuda and "causal_conv1d" not in DISABLED_KERNELS and _causal_conv1d_fn() is not None
    fla_ok = cuda and "fla_chunk" not in DISABLED_KERNELS and _fla_chunk_gated_delta_rule() is not None
    return {
        "conv": "causal_conv1d" if conv_ok else "torch_segmented",
        "recurrence": "fla_chunk" if fla_ok else "torch_per_segment",
    }


# ----------------------------------------------------------------- the two stateful pieces

# How the torch path of segment_causal_conv1d restarts at conversation boundaries:
#   "shifted": K shifted multiply-adds masked by each token's position in its conversation (one fused
#              kernel each way under torch.compile; no scatter/gather of the whole sequence);
#   "padded":  give every conversation K-1 zeros of its own (index_copy into a padded buffer, conv1d,
#              index_select back): the first implementation, kept for comparison (bench --conv padded).
CONV_IMPL = "shifted"


def _shifted_conv_silu(x_TC: torch.Tensor, w_KC: torch.Tensor, bias_C: torch.Tensor | None,
                       pos_T: torch.Tensor, activation: str | None) -> torch.Tensor:
    """y[t] = act(bias + sum_i w[K-1-i] * x[t-i] * (pos[t] >= i)): a depthwise causal conv that sees only
    the current conversation (pos = index within it). x (T, C) channel-last, w (K, C)."""
    ksize = w_KC.shape[0]
    y = x_TC * w_KC[ksize - 1]
    for i in range(1, ksize):
        shifted = F.pad(x_TC, (0, 0, i, 0))[:x_TC.shape[0]]     # x[t - i], zeros before the start (any T)
        y = y + shifted * w_KC[ksize - 1 - i] * (pos_T >= i).unsqueeze(-1).to(x_TC.dtype)
    if bias_C is not None:
        y = y + bias_C
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        from transformers.activations import ACT2FN

        y = ACT2FN[activation](y)
    return y


_compiled_shifted = None


def _shifted_conv(x_TC, w_KC, bias_C, pos_T, activation):
    """The compiled form on CUDA (one kernel forward, a few backward), eager elsewhere or if compile fails."""
    global _compiled_shifted
    if not x_TC.is_cuda:
        return _shifted_conv_silu(x_TC, w_KC, bias_C, pos_T, activation)
    if _compiled_shifted is None:
        _compiled_shifted = torch.compile(_shifted_conv_silu, dynamic=False)
    if _compiled_shifted is not _shifted_conv_silu:
        try:
            return _compiled_shifted(x_TC, w_KC, bias_C, pos_T, activation)
        except Exception as e:  # noqa: BLE001 - no working compiler here: eager is correct, only slower
            log.warning("raytune_ft: compiling the packed conv failed (%s: %s); running it eagerly",
                        type(e).__name__, e)
            _compiled_shifted = _shifted_conv_silu
    return _shifted_conv_silu(x_TC, w_KC, bias_C, pos_T, activation)


def segment_causal_conv1d(x_BCT: torch.Tensor, weight_CK: torch.Tensor, bias: torch.Tensor | None,
                          cu_seqlens: torch.Tensor, activation: str | None = "silu",
                          backend: str | None = None) -> torch.Tensor:
    """Depthwise causal conv1d over a flattened packed batch (B must be 1) that restarts at each
    conversation: a token never sees the previous conversation's last K-1 tokens.

    x_BCT: (1, channels, total_tokens); weight_CK: (channels, kernel); cu_seqlens: (N+1,) boundaries."""
    if x_BCT.shape[0] != 1:
        raise ValueError("segment_causal_conv1d expects the packed batch flattened to batch size 1")
    c, total = x_BCT.shape[1], x_BCT.shape[2]
    ksize = weight_CK.shape[-1]
    cu = cu_seqlens.to(device=x_BCT.device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=x_BCT.device), lens, output_size=total)
    backend = backend or gated_delta_backends(x_BCT.device)["conv"]
    if backend == "causal_conv1d":
        # causal-conv1d resets at seq_idx changes; it wants channel-last x (x.stride(1) == 1),
        # which is what in_proj(x).transpose(1, 2) already is.
        return _causal_conv1d_fn()(x_BCT, weight_CK, bias, seq_idx=seg.to(torch.int32)[None], activation=activation)
    if CONV_IMPL == "shifted":
        pos = torch.arange(total, device=x_BCT.device) - cu[:-1].index_select(0, seg)
        w = weight_CK.t().to(x_BCT.dtype)
        b = bias.to(x_BCT.dtype) if bias is not None else None
        return _shifted_conv(x_BCT[0].t(), w, b, pos, activation).t()[None]
    # Exact torch path: give every conversation K-1 zeros of its own in front, convolve without
    # padding, and read each token's output back. Output index j covers padded inputs j..j+K-1.
    shifted = torch.arange(total, device=x_BCT.device) + (seg + 1) * (ksize - 1)
    padded = x_BCT.new_zeros(1, c, total + lens.numel() * (ksize - 1))
    padded = padded.index_copy(2, shifted, x_BCT)
    out = F.conv1d(padded.to(weight_CK.dtype), weight_CK.unsqueeze(1), bias, groups=c)
    out = out.index_select(2, shifted - (ksize - 1))
    if activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(x_BCT.dtype)


class DeltaRuleInputs(NamedTuple):
    """The gated delta rule's inputs along one sequence: q/k (1, T, Hk, dk), v (1, T, Hv, dv), g/beta
    (1, T, Hv); q and k are L2-normalised inside, as Qwen3.5 does."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def rows(self, start: int, end: int) -> "DeltaRuleInputs":
        return DeltaRuleInputs(*(x[:, start:end] for x in self))


def segment_gated_delta_rule(x: DeltaRuleInputs, cu_seqlens: torch.Tensor, backend: str | None = None
                             ) -> torch.Tensor:
    """Gated delta rule over a flattened packed batch (B = 1), each conversation from a zero state.
    Returns (1, T, Hv, dv)."""
    q, k, v, g, beta = x
    backend = backend or gated_delta_backends(q.device)["recurrence"]
    if backend == "fla_chunk":
        fla = _fla_chunk_gated_delta_rule()
        out, _ = fla(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                     cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.long),
                     use_qk_l2norm_in_kernel=True)
        return out
    ref = _torch_reference_gated_delta_rule()
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        # Qwen3.5 has more value heads than key heads. Some transformers releases' reference (5.17)
        # wants q/k per value head and fails otherwise; others (5.2x) repeat_interleave
        # inside, so doing it here gives the same result on both.
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    bounds = cu_seqlens.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        o, _ = ref(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                   initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        outs.append(o)
    return torch.cat(outs, dim=1)


# ----------------------------------------------------------------- the patched layer

def _packed_gdn_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """Qwen3_5GatedDeltaNet.forward that keeps packed conversations apart (see module docstring)."""
    bsz, seq_len, _ = hidden_states.shape
    cu = packing_from_kwargs(kwargs, bsz * seq_len, hidden_states.device)
    if cu is None:
        return self._raytune_original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    # transformers < 5.2x names the cache `cache_params` (and older code `past_key_values`).
    if cache is not None or kwargs.get("cache_params") is not None or kwargs.get("past_key_values") is not None:
        raise ValueError("packed inputs (cu_seq_lens_q / seq_idx) cannot be combined with a cache: "
                         "pass use_cache=False (packed_forward_kwargs does)")
    if attention_mask is not None and attention_mask.dim() == 2:
        hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)

    # Conversations never span rows, so rows can be laid end to end: one sequence of B*T tokens.
    x = hidden_states.reshape(1, bsz * seq_len, -1)
    mixed_qkv = self.in_proj_qkv(x).transpose(1, 2)
    z = self.in_proj_z(x).reshape(1, bsz * seq_len, -1, self.head_v_dim)
    b = self.in_proj_b(x)
    a = self.in_proj_a(x)

    cp = kwargs.get("context_parallel")   # this rank holds part of the block (models/context_parallel)
    if cp is not None:
        mixed_qkv = cp.causal_conv1d(mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                     self.activation).transpose(1, 2)
    else:
        mixed_qkv = segment_causal_conv1d(mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, cu,
                                          activation=self.activation).transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(1, bsz * seq_len, -1, self.head_k_dim)
    key = key.reshape(1, bsz * seq_len, -1, self.head_k_dim)
    value = value.reshape(1, bsz * seq_len, -1, self.head_v_dim)

    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)   # fp32, as transformers does
    if cp is not None:
        core = cp.gated_delta_rule(query, key, value, g, beta)
    else:
        core = segment_gated_delta_rule(DeltaRuleInputs(query, key, value, g, beta), cu)

    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(bsz, seq_len, -1))


@functools.lru_cache(maxsize=None)
def _packed_class(cls: type) -> type:
    """A subclass of a gated-delta-net class with the packing-aware forward (one per original class)."""
    return type(f"Packed{cls.__name__}", (cls,), {
        "forward": _packed_gdn_forward,
        "_raytune_original_forward": cls.forward,
        "_raytune_packed": True,
    })


def _is_gated_delta_net(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet") and hasattr(module, "in_proj_qkv")


# ----------------------------------------------------------------- whole-model patch

def _derive_packing_hook(module, args, kwargs):
    """Base-model forward pre-hook: restarting position_ids -> cu_seqlens/seq_idx; never a cache when packed."""
    packed = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("seq_idx") is not None
    pos = kwargs.get("position_ids")
    if (not packed and pos is not None and pos.dim() == 2 and kwargs.get("attention_mask") is None
            and kwargs.get("cache", kwargs.get("past_key_values")) is None):
        cu = cu_seqlens_from_position_ids(pos)
        if cu.numel() - 1 > pos.shape[0]:              # more conversations than rows: a packed batch
            max_len = int((cu[1:] - cu[:-1]).max())
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
            packed = True
    if packed:
        kwargs["use_cache"] = False
    return args, kwargs


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embeddings + layers + final norm) of a CausalLM, i.e. `model.model`."""
    inner = getattr(model, "model", None)
    if inner is None:
        raise TypeError(f"{type(model).__name__} has no .model decoder stack")
    return getattr(inner, "language_model", inner)


def enable_packing(model: torch.nn.Module, attn_implementation: str | None = ATTN_NAME) -> torch.nn.Module:
    """Make a built Qwen3.5/Qwen3/Qwen2 CausalLM keep packed conversations apart (idempotent).

    Full attention -> "raytune_varlen" (pass attn_implementation=None to keep the model's own, e.g. sdpa,
    which also separates conversations through position_ids but with a dense T x T mask); every
    gated-delta-net layer -> the packing-aware forward; a pre-hook derives packing signals from
    restarting position_ids. Call before FSDP wrapping."""
    if attn_implementation is not None:
        register_varlen_attention()
        from raytune_ft import compat
        if compat.attn_implementation(model.config) != attn_implementation:
            model.set_attn_implementation(attn_implementation)
    n = 0
    for sub in model.modules():
        if _is_gated_delta_net(sub) and not getattr(sub, "_raytune_packed", False):
            sub.__class__ = _packed_class(type(sub))
            n += 1
    inner = base_model(model)
    if not getattr(inner, "_raytune_packing_hook", False):
        inner.register_forward_pre_hook(_derive_packing_hook, with_kwargs=True)
        inner._raytune_packing_hook = True
    if n:
        log.info("raytune_ft: %d gated-delta-net layers patched for packing", n)
    return model


def is_packing_enabled(model: torch.nn.Module) -> bool:
    """True when enable_packing has been applied (pre-hook present, gated-delta-net layers swapped)."""
    gdn_ok = all(getattr(m, "_raytune_packed", False) for m in model.modules() if _is_gated_delta_net(m))
    return bool(getattr(base_model(model), "_raytune_packing_hook", False)) and gdn_ok


def packed_forward_kwargs(block: Mapping[str, Any], device: str | torch.device | None = None) -> dict[str, Any]:
    """Forward kwargs for a packed block (or a stack of B blocks) on a packing-enabled model.

    `block` holds input_ids, position_ids, cu_seqlens (per block: boundaries within its own T tokens),
    seq_idx; tensors or lists, shape (T,) or (B, T) (cu_seqlens (N+1,) or a list of B of them). Rows are
    laid end to end into one (1, B*T) sequence with global boundaries; reshape labels the same way
    (`labels.reshape(1, -1)`). Always use_cache=False."""
    def t(x, dtype):
        return x.to(dtype) if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype)

    ids = t(block["input_ids"], torch.long)
    ids = ids.reshape(-1, ids.shape[-1])
    rows, seq_len = ids.shape
    pos = t(block["position_ids"], torch.long).reshape(rows, seq_len)
    cu_in = block.get("cu_seqlens")
    if cu_in is not None:
        if isinstance(cu_in, torch.Tensor):
            cu_rows = [cu_in] if cu_in.dim() == 1 else list(cu_in)
        elif not hasattr(cu_in[0], "__len__"):
            cu_rows = [cu_in]                         # one flat list of ints
        else:
            cu_rows = list(cu_in)
        if len(cu_rows) != rows:
            raise ValueError(f"cu_seqlens: expected one boundary list per row ({rows} rows)")
        parts = []
        for r, c in enumerate(cu_rows):
            c = normalise_cu_seqlens(t(c, torch.int32).reshape(-1), seq_len)
            parts.append(c[:-1] + r * seq_len)
        cu = torch.cat(parts + [torch.tensor([rows * seq_len], dtype=torch.int32)]).to(torch.int32)
    elif block.get("seq_idx") is not None:
        cu = cu_seqlens_from_seq_idx(t(block["seq_idx"], torch.int32).reshape(rows, seq_len))
    else:
        cu = cu_seqlens_from_position_ids(pos)
    lens = cu[1:] - cu[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int32), lens.long())
    max_len = int(lens.max())
    out = dict(input_ids=ids.reshape(1, -1), position_ids=pos.reshape(1, -1), cu_seq_lens_q=cu,
               cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len, seq_idx=seq_idx[None],
               use_cache=False)
    if device is not None:
        out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return out
