"""The fast paths a training loop uses and their candidate kernels: the registry the start-up kernel
check (kernel_check.py) walks.

Each FastPath says how to build a small packed input shaped like the model (its real head counts and
dims, from the HF config), the reference run on ONE conversation (plain torch, fp32), the candidate
kernels in order of preference (Kernel: name, a function over the packed input, the packages whose
versions identify it) and the path used when none passes. `default_paths(cfg)` lists the candidates
installed here, in the order attention.py and gated_delta.py pick them; tests build paths with their
own candidates (CPU stand-ins, patched backends).

Paths: "attention" (flash_attn, torch_varlen; else sdpa_blockdiag), "gdn_conv" (causal_conv1d; else the
project's torch conv), "gdn_recurrence" (fla_chunk; else transformers' torch delta rule per
conversation), "fused_ce" (Liger's fused linear cross-entropy where the TRL loop uses it; else torch).
Under context parallelism the same kernels are also called the way models/context_parallel calls them
("cp_attention", "cp_gdn_conv", "cp_gdn_recurrence", `cp_paths`): on a group of one, whose block still
splits into two chunks, so the recurrence starts a chunk from a carried state, the conv reads the chunk
before it, and attention runs with more keys than queries; a CP candidate carries its kernel's name, so a
failure switches that kernel off for both forms. CP attention's first candidate, where cuDNN's attention runs,
is its own: "cudnn" (models/context_parallel/split_attention.py).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from typing import Callable

import torch
import torch.nn.functional as F

# Conversation lengths of the check's packed input: boundaries at 45 and 48 (inside the first 64-token
# chunk of flash-linear-attention), a 3-token conversation shorter than the 4-tap conv, and a last one
# that spans three chunks.
CHECK_LENS = (45, 3, 92)

# Largest allowed ||kernel - reference|| / ||reference|| over the output and every input gradient, per
# path and compute dtype. bf16 rounding is 2^-8 = 3.9e-3 relative per element, and a correct kernel
# differs from an fp32 reference by a few of those (bench/RESULTS.md). The wrong kernels this check is for
# miss by far more: a leak or a non-causal window by O(1).
TOLERANCE: dict[str, dict[torch.dtype, float]] = {
    "attention": {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4},
    "gdn_conv": {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5},
    "gdn_recurrence": {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4},
    "fused_ce": {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4},
}
TOLERANCE.update({f"cp_{name}": TOLERANCE[name] for name in ("attention", "gdn_conv", "gdn_recurrence")})

@dataclasses.dataclass
class Kernel:
    """A candidate for a fast path: `fn(inputs, cu_seqlens, max_len) -> output` on the packed input."""
    name: str
    fn: Callable[[dict, torch.Tensor, int], torch.Tensor]
    packages: tuple[str, ...] = ()


@dataclasses.dataclass
class Case:
    """The packed input of one path: fp32 values on the device, which axis of each is the token axis
    (None: shared by every conversation, e.g. a weight), which take gradients, which stay fp32."""
    inputs: dict[str, torch.Tensor]
    token_axis: dict[str, int | None]
    grads: tuple[str, ...]
    keep_fp32: tuple[str, ...] = ()
    out_token_axis: int | None = 0         # None: the output is a sum over tokens (a loss)


@dataclasses.dataclass
class FastPath:
    """One fast path of the loop: how to build its case, the reference run on ONE conversation, the
    candidates in order of preference and the path used when none passes."""
    name: str
    title: str
    make_case: Callable[[torch.device, torch.Generator], Case]
    reference: Callable[[dict], torch.Tensor]
    candidates: list[Kernel]
    fallback: str


_DISTRIBUTIONS = {"flash_attn": "flash-attn", "fla": "flash-linear-attention", "fla_core": "fla-core",
                  "causal_conv1d": "causal-conv1d", "liger_kernel": "liger-kernel"}


def package_versions(packages: tuple[str, ...]) -> str:
    """"torch 2.11.0+cu130, triton 3.6.0, ..." for the import names given (missing ones left out)."""
    out = []
    for mod in packages:
        try:
            ver = importlib.metadata.version(_DISTRIBUTIONS.get(mod, mod))
        except importlib.metadata.PackageNotFoundError:
            try:
                ver = getattr(__import__(mod), "__version__", None)
            except Exception:  # noqa: BLE001 - not importable: nothing to report
                ver = None
        if ver:
            out.append(f"{mod} {ver}")
    return ", ".join(out)


# ----------------------------------------------------------------- the loop's fast paths

def cu_seqlens_of(lens, device) -> torch.Tensor:
    import itertools

    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


def _text_config(cfg):
    return getattr(cfg, "text_config", None) or cfg


def attention_path(cfg, candidates: list[Kernel]) -> FastPath:
    """Full attention over packed conversations: (T, H, d) q and (T, Hkv, d) k/v, causal per conversation."""
    c = _text_config(cfg)
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    total = sum(CHECK_LENS)

    def make_case(device, gen):
        q, k, v = (torch.randn(total, h, dim, generator=gen, device=device) for h in (heads, kv_heads, kv_heads))
        return Case({"q": q, "k": k, "v": v}, {"q": 0, "k": 0, "v": 0}, ("q", "k", "v"))

    def reference(x):
        q, k, v = (x[n].transpose(0, 1)[None] for n in "qkv")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dim ** -0.5,
                                             enable_gqa=heads != kv_heads)
        return out[0].transpose(0, 1)

    return FastPath("attention", "full attention", make_case, reference, candidates, fallback="sdpa_blockdiag")


def conv_path(cfg, candidates: list[Kernel]) -> FastPath:
    """The gated-delta-net's depthwise causal conv over q/k/v channels: x (1, C, T) stored channel-last."""
    c = _text_config(cfg)
    channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    ksize = c.linear_conv_kernel_dim
    total = sum(CHECK_LENS)

    def make_case(device, gen):
        x = torch.randn(1, total, channels, generator=gen, device=device).transpose(1, 2)
        w = torch.randn(channels, ksize, generator=gen, device=device) * ksize ** -0.5
        return Case({"x": x, "w": w}, {"x": 2, "w": None}, ("x", "w"), out_token_axis=2)

    def reference(x):
        out = F.conv1d(x["x"], x["w"][:, None], padding=ksize - 1, groups=channels)[:, :, :x["x"].shape[2]]
        return F.silu(out)

    return FastPath("gdn_conv", "gated-delta-net conv", make_case, reference, candidates, fallback="torch_segmented")


def recurrence_path(cfg, candidates: list[Kernel]) -> FastPath:
    """The gated delta rule: q/k (1, T, Hk, dk), v (1, T, Hv, dv), g (fp32, as the layer passes it) and
    beta (1, T, Hv); each conversation from a zero state."""
    c = _text_config(cfg)
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    total = sum(CHECK_LENS)

    def make_case(device, gen):
        q = torch.randn(1, total, hk, dk, generator=gen, device=device)
        k = torch.randn(1, total, hk, dk, generator=gen, device=device)
        v = torch.randn(1, total, hv, dv, generator=gen, device=device)
        # log decays as Qwen3.5 makes them (-exp(A_log) * softplus(.)): between about -0.05 and -2.7
        g = -torch.rand(1, total, hv, generator=gen, device=device).mul(4).exp().mul(0.05)
        beta = torch.rand(1, total, hv, generator=gen, device=device).sigmoid()
        return Case({"q": q, "k": k, "v": v, "g": g, "beta": beta}, dict.fromkeys("q k v g beta".split(), 1),
                    ("q", "k", "v", "g", "beta"), keep_fp32=("g",), out_token_axis=1)

    def reference(x):
        from raytune_ft.models.gated_delta import DeltaRuleInputs, segment_gated_delta_rule

        n = x["q"].shape[1]
        cu = torch.tensor([0, n], dtype=torch.int32)
        return segment_gated_delta_rule(DeltaRuleInputs(x["q"], x["k"], x["v"], x["g"], x["beta"]), cu,
                                        backend="torch_per_segment")

    return FastPath("gdn_recurrence", "gated-delta-net recurrence", make_case, reference, candidates,
                    fallback="torch_per_segment")


def fused_ce_path(cfg, candidates: list[Kernel]) -> FastPath:
    """The fused linear cross-entropy: hidden (T, D) x lm_head (V, D) -> summed token loss, first token
    of each conversation ignored (-100) as the packed labels have it."""
    c = _text_config(cfg)
    hidden, vocab = c.hidden_size, c.vocab_size
    total = sum(CHECK_LENS)

    def make_case(device, gen):
        h = torch.randn(total, hidden, generator=gen, device=device)
        w = torch.randn(vocab, hidden, generator=gen, device=device) * hidden ** -0.5
        labels = torch.randint(0, vocab, (total,), generator=gen, device=device)
        labels[cu_seqlens_of(CHECK_LENS, device)[:-1].long()] = -100
        return Case({"h": h, "w": w, "labels": labels}, {"h": 0, "w": None, "labels": 0}, ("h", "w"),
                    out_token_axis=None)

    def reference(x):
        return F.cross_entropy(x["h"] @ x["w"].t(), x["labels"], ignore_index=-100, reduction="sum")

    return FastPath("fused_ce", "fused linear cross-entropy", make_case, reference, candidates, fallback="torch")


# -- the installed candidates

FLA_PACKAGES = ("fla", "fla_core", "triton", "tilelang", "torch")


def _unimportable(name: str, packages: tuple[str, ...]) -> list[Kernel]:
    """[a candidate that raises why its package does not import] where the kernel's own lazy import found the
    package installed but broken (attention.IMPORT_FAILURES: a shared library missing, e.g. tilelang without
    z3-solver under flash-linear-attention; a build for another torch), else []. The check then reports it off
    with its error, where the loop would otherwise run its fallback without a word."""
    from raytune_ft.models.attention import IMPORT_FAILURES

    why = IMPORT_FAILURES.get(name)
    if why is None:
        return []

    def fn(x, cu, max_len):
        raise ImportError(why)

    return [Kernel(name, fn, packages)]


def _attention_kernels() -> list[Kernel]:
    from raytune_ft.models import attention as att

    out = []
    if att._flash_attn_varlen() is not None:
        out.append(Kernel("flash_attn", functools.partial(_varlen, backend="flash_attn"), ("flash_attn", "torch")))
    else:
        out += _unimportable("flash_attn", ("flash_attn", "torch"))
    if att._torch_varlen()[0] is not None:
        out.append(Kernel("torch_varlen", functools.partial(_varlen, backend="torch_varlen"), ("torch",)))
    return out


def _varlen(x, cu, max_len, *, backend):
    from raytune_ft.models.attention import QKV, varlen_attention

    return varlen_attention(QKV(x["q"], x["k"], x["v"]), cu, max_len, scaling=x["q"].shape[-1] ** -0.5,
                            backend=backend)


def _conv_kernels() -> list[Kernel]:
    from raytune_ft.models import gated_delta as gd

    if gd._causal_conv1d_fn() is None:
        return _unimportable("causal_conv1d", ("causal_conv1d", "torch"))

    def fn(x, cu, max_len):
        return gd.segment_causal_conv1d(x["x"], x["w"], None, cu, activation="silu", backend="causal_conv1d")

    return [Kernel("causal_conv1d", fn, ("causal_conv1d", "torch"))]


def _recurrence_kernels() -> list[Kernel]:
    from raytune_ft.models import gated_delta as gd

    if gd._fla_chunk_gated_delta_rule() is None:
        return _unimportable("fla_chunk", FLA_PACKAGES)

    def fn(x, cu, max_len):
        return gd.segment_gated_delta_rule(gd.DeltaRuleInputs(x["q"], x["k"], x["v"], x["g"], x["beta"]), cu,
                                           backend="fla_chunk")

    return [Kernel("fla_chunk", fn, FLA_PACKAGES)]


def _liger_kernels() -> list[Kernel]:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - not installed or not importable here: nothing to check
        return []

    def fn(x, cu, max_len):
        out = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum")(x["w"], x["h"], x["labels"])
        return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

    return [Kernel("liger", fn, ("liger_kernel", "triton", "torch"))]


# -- the context-parallel forms (models/context_parallel) on a group of one

def _cp_only_kernels() -> list[Kernel]:
    """Kernels only the CP form of a path uses: cuDNN's attention on split pieces (before the varlen ones)."""
    from raytune_ft.models.context_parallel.split_attention import cudnn_attention_available

    return ([Kernel("cudnn", functools.partial(_cp_attention, backend="cudnn"), ("torch",))]
            if cudnn_attention_available() else [])


def _one_rank_shard(cu: torch.Tensor, total: int):
    from raytune_ft.models.context_parallel import make_shard

    return make_shard(cu.cpu(), total, 1, 0)


def _cp_attention(x, cu, max_len, *, backend):
    from raytune_ft.models.context_parallel.full_attention import cp_attention

    return cp_attention(x["q"], x["k"], x["v"], _one_rank_shard(cu, x["q"].shape[0]),
                        scaling=x["q"].shape[-1] ** -0.5, backend=backend)


def _cp_conv(x, cu, max_len, *, backend):
    from raytune_ft.models.context_parallel.linear_attention import cp_causal_conv1d

    return cp_causal_conv1d(x["x"], x["w"], None, _one_rank_shard(cu, x["x"].shape[2]), activation="silu",
                            backend=backend)


def _cp_recurrence(x, cu, max_len, *, backend):
    from raytune_ft.models.context_parallel.linear_attention import cp_gated_delta_rule
    from raytune_ft.models.gated_delta import DeltaRuleInputs

    return cp_gated_delta_rule(DeltaRuleInputs(x["q"], x["k"], x["v"], x["g"], x["beta"]),
                               _one_rank_shard(cu, x["q"].shape[1]), backend=backend)


def cp_paths(cfg, kernels: list[Kernel]) -> list[FastPath]:
    """The context-parallel forms of the model's paths, each with the CP call of every kernel in `kernels`
    that serves the packed path of the same kind (the installed ones, or a test's by name)."""
    def forms(path: FastPath, form, fallback: str) -> FastPath:
        cands = [Kernel(k.name, functools.partial(form, backend=k.name), k.packages) for k in kernels
                 if k.name in _SERVES[path.name]]
        return FastPath(f"cp_{path.name}", f"{path.title}, context-parallel", path.make_case, path.reference,
                        cands, fallback)

    out = [forms(attention_path(cfg, []), _cp_attention, "sdpa_pieces")]
    if has_gated_delta_net(cfg):
        out += [forms(conv_path(cfg, []), _cp_conv, "torch_segmented"),
                forms(recurrence_path(cfg, []), _cp_recurrence, "torch_per_segment")]
    return out


# the kernels each packed path can use, by name: a CP form calls the same kernel through its own code
_SERVES = {"attention": ("cudnn", "flash_attn", "torch_varlen", "sdpa_blockdiag"), "gdn_conv": ("causal_conv1d", "torch_segmented"),
           "gdn_recurrence": ("fla_chunk", "torch_per_segment")}


def has_gated_delta_net(cfg) -> bool:
    return "linear_attention" in (getattr(_text_config(cfg), "layer_types", None) or [])


HALF = (torch.bfloat16, torch.float16)


def default_paths(cfg, *, liger: bool = False, dtype: torch.dtype = torch.bfloat16,
                  context_parallel: bool = False) -> list[FastPath]:
    """The fast paths a loop training a model of `cfg` in `dtype` uses on this GPU, with the installed
    candidates (the varlen attention kernels take half precision only: fp32 goes to SDPA); under
    context parallelism also their CP forms (`cp_paths`)."""
    paths = [attention_path(cfg, _attention_kernels() if dtype in HALF else [])]
    if has_gated_delta_net(cfg):
        paths += [conv_path(cfg, _conv_kernels()), recurrence_path(cfg, _recurrence_kernels())]
    if context_parallel:
        paths += cp_paths(cfg, [*(_cp_only_kernels() if dtype in HALF else []),
                                *[k for p in paths for k in p.candidates]])
    if liger:
        paths.append(fused_ce_path(cfg, _liger_kernels()))
    return paths


def selected_kernels(cfg, device, *, liger: bool = False, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """What the loop uses on `device` in `dtype` now, by the selection rules (kernels switched off skipped)."""
    from raytune_ft.models.attention import select_attention_backend
    from raytune_ft.models.gated_delta import gated_delta_backends

    attn = select_attention_backend(torch.device(device).type)
    out = {"attention": attn if dtype in HALF else "sdpa_blockdiag"}
    if has_gated_delta_net(cfg):
        b = gated_delta_backends(device)
        out.update(gdn_conv=b["conv"], gdn_recurrence=b["recurrence"])
    if liger:
        out["fused_ce"] = "liger" if torch.device(device).type == "cuda" and _liger_kernels() else "torch"
    return out
