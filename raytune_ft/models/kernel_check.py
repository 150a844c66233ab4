"""The start-up kernel check: every fast kernel proves itself on the GPU it is about to run on.

A training loop picks its kernels by what is installed (attention.py, gated_delta.py, Liger in the TRL
loop). Installed is not the same as right: a kernel built for another GPU, a Triton version a kernel
library has not been validated on, or a varlen call whose boundaries are ignored all run without an
error and train on wrong numbers. So, on every GPU worker before the first step, each fast path the
loop is about to use runs forward and backward on a small packed input shaped like the model (its real
head counts and dims, from the HF config the loop built): three conversations of unequal length, the
first two boundaries inside one 64-token chunk (flash-linear-attention's chunk size) and a conversation
shorter than the conv kernel. Its outputs and input gradients are compared with the reference path run
on each conversation alone in fp32, on the same (rounded) inputs; a second forward with the first
conversation's inputs replaced must leave every later conversation's outputs as they were (a leak
across a boundary shows here even when the values happen to be close).

A kernel that raises, gives wrong values or leaks is switched off for the process (attention.DISABLED_KERNELS):
the loop then uses the next candidate that passed, or the path's reference implementation, and says so
in one log line naming the kernel, its package versions, what it showed and the path used instead. The
kernels in use go to the MLflow run as the tag `raytune.kernels`. With `train.kernels=strict` a failure
stops the run instead (KernelCheckError). Across ranks the verdicts are combined (a kernel that failed on
any rank is off on all), so every rank trains with the same kernels.

The registry is a list of FastPath entries, each: the op's input case, the reference run on one
conversation, the candidates (Kernel: name + function + packages) in order of preference, and the
fallback. Tests inject their own candidates (stand-ins on CPU); `default_paths` lists what the loop would
use on this device. On CPU there is nothing to check: the reference paths are the only ones there.

    python -m raytune_ft.models.kernel_check --model qwen3.8-27b        # check this GPU, print the report
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MODES = ("check", "strict", "off")

# Conversation lengths of the check's packed input: boundaries at 45 and 48 (inside the first 64-token
# chunk of flash-linear-attention), a 3-token conversation shorter than the 4-tap conv, and a last one
# that spans three chunks.
CHECK_LENS = (45, 3, 92)

# Largest allowed ||kernel - reference|| / ||reference|| over the output and every input gradient, per
# path and compute dtype. bf16 rounding is 2^-8 = 3.9e-3 relative per element; on the H200 the varlen
# attention, the segmented conv and fla's chunk rule measured 3e-3 to 6e-3 against fp32 references at
# 8,192 tokens (bench/RESULTS.md), with independently rounded inputs. The wrong kernels this check is
# for miss by far more: causal-conv1d off by 0.4 to 0.6, a leak or a non-causal window by O(1).
TOLERANCE: dict[str, dict[torch.dtype, float]] = {
    "attention": {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4},
    "gdn_conv": {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5},
    "gdn_recurrence": {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4},
    "fused_ce": {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4},
}

TAG_IN_USE = "raytune.kernels"
TAG_OFF = "raytune.kernels_off"


class KernelCheckError(RuntimeError):
    """train.kernels=strict and a fast kernel failed the start-up check."""


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


@dataclasses.dataclass
class KernelFailure:
    path: str
    kernel: str
    what: str               # "raised" | "wrong values" | "leaks across a boundary"
    detail: str
    versions: str
    instead: str = ""
    rank: int = 0

    def line(self, title: str) -> str:
        return (f"kernel check: {self.kernel} ({title}) switched off for this run: {self.what}: {self.detail} "
                f"[{self.versions or 'no package versions known'}]; using {self.instead} instead")


@dataclasses.dataclass
class KernelReport:
    in_use: dict[str, str]
    failures: list[KernelFailure]
    seconds: float
    checked: bool
    note: str = ""
    errors: dict[str, float] = dataclasses.field(default_factory=dict)   # "path/kernel" -> worst rel error

    def tags(self) -> dict[str, str]:
        out = {TAG_IN_USE: ", ".join(f"{k}={v}" for k, v in self.in_use.items())}
        if self.failures:
            out[TAG_OFF] = "; ".join(f"{f.kernel}: {f.what}: {f.detail}"[:300] for f in self.failures)[:4000]
        return out

    def summary(self) -> str:
        how = f"checked in {self.seconds:.1f} s" if self.checked else self.note
        return f"kernels in use ({how}): " + ", ".join(f"{k}={v}" for k, v in self.in_use.items())


# ----------------------------------------------------------------- versions

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

def _cu(lens, device) -> torch.Tensor:
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
        from raytune_ft.models.gated_delta import segment_gated_delta_rule

        n = x["q"].shape[1]
        cu = torch.tensor([0, n], dtype=torch.int32)
        return segment_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, backend="torch_per_segment")

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
        labels[_cu(CHECK_LENS, device)[:-1].long()] = -100
        return Case({"h": h, "w": w, "labels": labels}, {"h": 0, "w": None, "labels": 0}, ("h", "w"),
                    out_token_axis=None)

    def reference(x):
        return F.cross_entropy(x["h"] @ x["w"].t(), x["labels"], ignore_index=-100, reduction="sum")

    return FastPath("fused_ce", "fused linear cross-entropy", make_case, reference, candidates, fallback="torch")


# -- the installed candidates

def _attention_kernels() -> list[Kernel]:
    from raytune_ft.models import attention as att

    out = []
    if att._flash_attn_varlen() is not None:
        out.append(Kernel("flash_attn", functools.partial(_varlen, backend="flash_attn"), ("flash_attn", "torch")))
    if att._torch_varlen()[0] is not None:
        out.append(Kernel("torch_varlen", functools.partial(_varlen, backend="torch_varlen"), ("torch",)))
    return out


def _varlen(x, cu, max_len, *, backend):
    from raytune_ft.models.attention import varlen_attention

    return varlen_attention(x["q"], x["k"], x["v"], cu, max_len, scaling=x["q"].shape[-1] ** -0.5, backend=backend)


def _conv_kernels() -> list[Kernel]:
    from raytune_ft.models import gated_delta as gd

    if gd._causal_conv1d_fn() is None:
        return []

    def fn(x, cu, max_len):
        return gd.segment_causal_conv1d(x["x"], x["w"], None, cu, activation="silu", backend="causal_conv1d")

    return [Kernel("causal_conv1d", fn, ("causal_conv1d", "torch"))]


def _recurrence_kernels() -> list[Kernel]:
    from raytune_ft.models import gated_delta as gd

    if gd._fla_chunk_gated_delta_rule() is None:
        return []

    def fn(x, cu, max_len):
        return gd.segment_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, backend="fla_chunk")

    return [Kernel("fla_chunk", fn, ("fla", "fla_core", "triton", "tilelang", "torch"))]


def _liger_kernels() -> list[Kernel]:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - not installed or not importable here: nothing to check
        return []

    def fn(x, cu, max_len):
        out = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum")(x["w"], x["h"], x["labels"])
        return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)

    return [Kernel("liger", fn, ("liger_kernel", "triton", "torch"))]


def has_gated_delta_net(cfg) -> bool:
    return "linear_attention" in (getattr(_text_config(cfg), "layer_types", None) or [])


def default_paths(cfg, *, liger: bool = False) -> list[FastPath]:
    """The fast paths a loop training a model of `cfg` uses on this GPU, with the installed candidates."""
    paths = [attention_path(cfg, _attention_kernels())]
    if has_gated_delta_net(cfg):
        paths += [conv_path(cfg, _conv_kernels()), recurrence_path(cfg, _recurrence_kernels())]
    if liger:
        paths.append(fused_ce_path(cfg, _liger_kernels()))
    return paths


def selected_kernels(cfg, device, *, liger: bool = False) -> dict[str, str]:
    """What the loop uses on `device` now, by the selection rules (kernels switched off skipped)."""
    from raytune_ft.models.attention import select_attention_backend
    from raytune_ft.models.gated_delta import gated_delta_backends

    out = {"attention": select_attention_backend(torch.device(device).type)}
    if has_gated_delta_net(cfg):
        b = gated_delta_backends(device)
        out.update(gdn_conv=b["conv"], gdn_recurrence=b["recurrence"])
    if liger:
        out["fused_ce"] = "liger" if torch.device(device).type == "cuda" and _liger_kernels() else "torch"
    return out


# ----------------------------------------------------------------- checking one kernel

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _cast(case: Case, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The kernel's inputs: floats in `dtype` (but keep_fp32 ones), fresh leaves, strides kept (the conv
    wants channel-last x)."""
    out = {}
    for name, t in case.inputs.items():
        if t.is_floating_point():
            t = t.detach().to(torch.float32 if name in case.keep_fp32 else dtype, copy=True)
            t.requires_grad_(name in case.grads)
        out[name] = t
    return out


def _slices(case: Case, x: dict, s: int, n: int) -> dict:
    return {k: (t if case.token_axis[k] is None else t.narrow(case.token_axis[k], s, n)) for k, t in x.items()}


def _run_reference(path: FastPath, case: Case, cand_in: dict, dout: torch.Tensor, lens) -> tuple[torch.Tensor, dict]:
    """The reference on each conversation alone, in fp32, from the same rounded values the kernel saw."""
    leaves = {}
    for k, t in cand_in.items():
        leaves[k] = t.detach().float() if t.is_floating_point() else t
        if k in case.grads:
            leaves[k].requires_grad_(True)
    outs, s = [], 0
    for n in lens:
        outs.append(path.reference(_slices(case, leaves, s, n)))
        s += n
    out = torch.cat(outs, dim=case.out_token_axis) if case.out_token_axis is not None else sum(outs)
    out.backward(dout)
    return out.detach(), {k: leaves[k].grad for k in case.grads}


def _worst_conversation(case: Case, axis_of: int | None, a: torch.Tensor, b: torch.Tensor, lens) -> str:
    if axis_of is None or len(lens) < 2:
        return ""
    errs, s = [], 0
    for n in lens:
        errs.append(_rel(a.narrow(axis_of, s, n), b.narrow(axis_of, s, n)))
        s += n
    i = max(range(len(errs)), key=lambda j: errs[j])
    return f" (worst: conversation {i + 1} of {len(lens)}, {errs[i]:.3g})"


def check_one(path: FastPath, kernel: Kernel, device: torch.device, dtype: torch.dtype,
              lens=CHECK_LENS, seed: int = 0) -> tuple[KernelFailure | None, float]:
    """Run `kernel` on the packed case of `path` and compare; (None, worst rel error) when it passes."""
    tol = TOLERANCE[path.name][dtype]
    versions = package_versions(kernel.packages)
    gen = torch.Generator(device=device).manual_seed(seed)
    case = path.make_case(device, gen)
    cu = _cu(lens, device)
    max_len = max(lens)

    def fail(what, detail):
        return KernelFailure(path.name, kernel.name, what, detail, versions), float("inf")

    x = _cast(case, dtype)
    try:
        out = kernel.fn(x, cu, max_len)
        dout = torch.randn(out.shape, generator=gen, device=device) if out.dim() else torch.ones((), device=device)
        out.float().backward(dout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any error is the finding
        return fail("raised", f"{type(e).__name__}: {_first_line(e)}")
    missing = [k for k in case.grads if x[k].grad is None]
    if tuple(out.shape) != tuple(_expected_shape(path, case, x, lens)) or missing:
        return fail("wrong values", f"output shape {tuple(out.shape)}" + (f", no gradient for {missing}" if missing else ""))
    try:
        leak = _leak(path, case, kernel, x, out, cu, max_len, lens, dtype, gen)
    except Exception as e:  # noqa: BLE001
        return fail("raised", f"{type(e).__name__} on a second call: {_first_line(e)}")
    if leak is not None and leak > tol:
        return fail("leaks across a boundary", f"redrawing conversation 1's inputs moved the later "
                    f"conversations' outputs by {leak:.3g} relative (tolerance {tol:g})")

    ref, ref_grads = _run_reference(path, case, x, dout, lens)
    worst, where = 0.0, ""
    for name, a, b, axis in [("output", out, ref, case.out_token_axis)] + [
            (f"d{k}", x[k].grad, ref_grads[k], case.token_axis[k]) for k in case.grads]:
        err = _rel(a, b)
        if not err == err or err == float("inf"):   # NaN or inf
            return fail("wrong values", f"{name} not finite")
        if err > worst:
            worst, where = err, f"{name} rel error {err:.3g}" + _worst_conversation(case, axis, a, b, lens)
    if worst > tol:
        return fail("wrong values", f"{where} > tolerance {tol:g} ({str(dtype).replace('torch.', '')})")
    return None, worst


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def _expected_shape(path, case, x, lens):
    if case.out_token_axis is None:
        return ()
    with torch.no_grad():
        n = lens[0]
        shape = list(path.reference({k: (v.float() if v.is_floating_point() else v)
                                     for k, v in _slices(case, x, 0, n).items()}).shape)
    shape[case.out_token_axis] = sum(lens)
    return shape


def _leak(path, case, kernel, x, out, cu, max_len, lens, dtype, gen) -> float | None:
    """Forward again with conversation 1's token inputs redrawn (same distribution): how far the later
    conversations' outputs moved, relative to their size. None for ops that are not per-token."""
    if case.out_token_axis is None or len(lens) < 2:
        return None
    other = _cast(path.make_case(x[next(iter(x))].device, gen), dtype)
    y = {}
    for k, t in x.items():
        t = t.detach().clone()
        ax = case.token_axis[k]
        if ax is not None and t.is_floating_point():
            t.narrow(ax, 0, lens[0]).copy_(other[k].detach().narrow(ax, 0, lens[0]))
        y[k] = t
    with torch.no_grad():
        moved = kernel.fn(y, cu, max_len)
    ax = case.out_token_axis
    rest = sum(lens) - lens[0]
    return _rel(moved.narrow(ax, lens[0], rest), out.detach().narrow(ax, lens[0], rest))


# ----------------------------------------------------------------- the check

def _agree(failed: list[bool]) -> list[int]:
    """Per kernel, the lowest rank where it failed (world size where none): one all-reduce. Without a
    process group, this rank's verdicts."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not failed:
        return [0 if f else 1 for f in failed]
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([rank if f else world for f in failed], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(r) if r < world else world for r in t.tolist()]


def check_kernels(cfg, device, *, mode: str = "check", dtype: torch.dtype = torch.bfloat16,
                  paths: list[FastPath] | None = None, liger: bool = False,
                  log_line: Callable[[str], None] | None = None,
                  tag: Callable[[str, str], None] | None = None) -> KernelReport:
    """Check the fast kernels a loop training a model of `cfg` will use on `device`, before its first step.

    mode "check": a failing kernel is switched off for this process and logged (one line each);
    "strict": a failure raises KernelCheckError; "off": nothing is run, the selection stands.
    `paths` replaces the installed candidates (tests); without it the check runs on CUDA only.
    `log_line(text)` receives the failure lines (written by one rank each) and, on rank 0, the summary;
    `tag(key, value)` receives the MLflow tags (call it with rank 0's tracking client)."""
    from raytune_ft.models.attention import disable_kernel

    if mode not in MODES:
        raise ValueError(f"train.kernels must be one of {', '.join(MODES)}; got {mode!r}")
    device = torch.device(device)
    say = log_line or log.warning
    rank = _rank()
    t0 = time.perf_counter()
    if mode == "off" or (paths is None and device.type != "cuda"):
        note = ("not checked (train.kernels=off)" if mode == "off"
                else "no GPU: the reference paths are the only ones here")
        report = KernelReport(selected_kernels(cfg, device, liger=liger), [], 0.0, checked=False, note=note)
        _finish(report, rank, say, tag)
        return report
    if paths is None:
        paths = default_paths(cfg, liger=liger)

    results: list[tuple[FastPath, Kernel, KernelFailure | None]] = []
    errors = {}
    for path in paths:
        for kernel in path.candidates:
            failure, worst = check_one(path, kernel, device, dtype)
            errors[f"{path.name}/{kernel.name}"] = worst
            results.append((path, kernel, failure))
    if device.type == "cuda":
        torch.cuda.empty_cache()

    first_failed = _agree([f is not None for _, _, f in results])
    world = _world()
    in_use, failures = {}, []
    for path in paths:
        chosen = None
        for (p, kernel, failure), who in zip(results, first_failed):
            if p is not path:
                continue
            if who < world or failure is not None:
                if failure is None:    # passed here, failed on another rank
                    failure = KernelFailure(path.name, kernel.name, "failed on another rank",
                                            f"see rank {who}'s log", package_versions(kernel.packages))
                failure.rank = who if who < world else rank
                failures.append((path, failure))
            elif chosen is None:
                chosen = kernel.name
        in_use[path.name] = chosen or path.fallback
    for path, failure in failures:
        failure.instead = in_use[path.name]
    report = KernelReport(in_use, [f for _, f in failures], time.perf_counter() - t0, checked=True, errors=errors)
    if mode == "strict" and report.failures:
        lines = "\n".join("  " + f.line(p.title).replace("switched off for this run", "failed")
                          .replace(f"; using {f.instead} instead", "") for p, f in failures)
        raise KernelCheckError(
            "train.kernels=strict: the start-up kernel check failed on this GPU:\n" + lines +
            "\nFix or remove the failing package, or set train.kernels=check to run on the paths that passed "
            "(" + ", ".join(f"{k}={v}" for k, v in in_use.items()) + ").")
    for path, failure in failures:
        disable_kernel(failure.kernel)
        if failure.rank == rank and failure.what != "failed on another rank":
            say(failure.line(path.title))
    _finish(report, rank, say, tag)
    return report


def _finish(report: KernelReport, rank: int, say, tag) -> None:
    if rank == 0:
        say(report.summary())
        if tag is not None:
            for k, v in report.tags().items():
                try:
                    tag(k, v)
                except Exception as e:  # noqa: BLE001 - tracking must never stop training
                    say(f"kernel check: could not tag the MLflow run ({type(e).__name__}: {e})")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def main(argv=None) -> int:
    """Check this machine's GPU for a model shape and print the report (and each kernel's worst error)."""
    import argparse
    import json

    from raytune_ft.models.tiny import REAL_MODELS, real_config

    p = argparse.ArgumentParser(prog="python -m raytune_ft.models.kernel_check", description=main.__doc__)
    p.add_argument("--model", default="qwen3.8-27b", choices=REAL_MODELS)
    p.add_argument("--liger", action="store_true", help="also check Liger's fused linear cross-entropy")
    p.add_argument("--strict", action="store_true")
    p.add_argument("--repeat", type=int, default=2, help="runs (the first pays the kernels' JIT compile)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cfg = real_config(args.model)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    for i in range(args.repeat):
        from raytune_ft.models.attention import reset_disabled_kernels

        reset_disabled_kernels()
        r = check_kernels(cfg, dev, mode="strict" if args.strict else "check", liger=args.liger, log_line=print)
        print("RESULT " + json.dumps({"kernel_check": args.model, "run": i + 1, "seconds": round(r.seconds, 2),
                                      "in_use": r.in_use, "off": [dataclasses.asdict(f) for f in r.failures],
                                      "worst_rel_error": {k: float(f"{v:.3g}") for k, v in r.errors.items()},
                                      "versions": package_versions(("torch", "triton", "transformers", "fla",
                                                                    "tilelang", "causal_conv1d", "flash_attn",
                                                                    "liger_kernel"))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
