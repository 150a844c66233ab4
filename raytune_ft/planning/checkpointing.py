"""Activation checkpointing by plan: what each choice keeps for the backward, what it recomputes, and the
choice `auto` makes for a GPU.

Per token, a decoder layer saves for its backward (elements of the compute dtype, by part):
  norms        the RMSNorm inputs and outputs around the mixer and the MLP (4 x hidden)
  mlp          the SwiGLU MLP's gate, up, silu(gate) and product (4 x intermediate)
  attention    q (and Qwen3.5's output gate), k, v, their normed/rotated copies, the attention output, and for
               Qwen3.5 the sigmoid gate and gated output; a varlen / SDPA kernel keeps no (T x T) scores
  gated_delta  the qkv projection, its conv and silu outputs, z, the l2-normed q/k, the recurrence output, the
               gated norm's output, and the chunked recurrence's per-chunk states (fp32, one dk x dv state per
               value head every 64 tokens, counted as two compute-dtype elements each)
A layer recomputed whole keeps its input only; a recomputed part keeps nothing of its own (its input is a
norm's output, kept already). In the backward one recomputed unit at a time holds its tensors again: the
largest of them is counted once.

`auto` walks the candidates (none, each set of parts, every Nth layer, all but the first K, full) from the least
recomputed forward
FLOPs to the most and takes the first whose whole memory plan fits the GPU less its margin.
"""
from __future__ import annotations

from itertools import combinations
from typing import Callable

from raytune_ft.planning.hardware import GiB, GpuSpec, gated_delta_forward_flops
from raytune_ft.planning.shapes import ModelShape
from raytune_ft.recipe.checkpointing import FULL, KINDS, NONE, Checkpointing

# the mixer part of each layer type, as a per-kind choice names it
MIXER = {"full_attention": "attention", "linear_attention": "gated_delta"}
# every:N choices `auto` tries between the per-part ones and full
EVERY_CANDIDATES = (8, 4, 2)


def layer_parts(s: ModelShape, layer_type: str) -> dict[str, float]:
    """Elements per token one decoder layer of `layer_type` saves for backward, by part (module docstring)."""
    h, inter = s.hidden, s.intermediate
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    if layer_type == "full_attention":
        mixer = 6 * q + 3 * kv if s.family == "qwen3_5" else 3 * q + 3 * kv
    else:
        kd, vd = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
        conv = 2 * kd + vd
        mixer = 3 * conv + vd + 2 * kd + 2 * vd + 4 * s.lin_v_heads
        mixer += 2 * s.lin_v_heads * s.lin_k_dim * s.lin_v_dim / 64
    return {"norms": 4 * h, MIXER[layer_type]: mixer, "mlp": 4 * inter}


def activation_elems(s: ModelShape, choice: Checkpointing) -> tuple[float, float]:
    """(kept, recomputed): elements per token kept over all layers, and the largest unit the backward
    recomputes (0 when nothing is)."""
    kept = recomputed = 0.0
    for i, layer_type in enumerate(s.layer_types):
        parts = layer_parts(s, layer_type)
        if choice.whole(i):
            kept += s.hidden
            recomputed = max(recomputed, sum(parts.values()))
            continue
        for name, n in parts.items():
            if name in choice.kinds:
                recomputed = max(recomputed, n)
            else:
                kept += n
    return kept, recomputed


def _part_flops(s: ModelShape, layer_type: str, mean_len: float) -> dict[str, float]:
    """Forward FLOPs per token of each part of one layer (the norms' are left out: well under 1%)."""
    mlp_names = ("gate_proj", "up_proj", "down_proj")
    linears = s.linears(layer_type)
    mixer = 2.0 * sum(i * o for name, (i, o) in linears.items() if name not in mlp_names)
    if layer_type == "full_attention":   # QK^T and PV, causal, within a conversation of the mean length
        mixer += 2.0 * s.heads * s.head_dim * mean_len
    else:
        mixer += gated_delta_forward_flops(s.lin_v_heads, s.lin_k_dim, s.lin_v_dim)
    return {MIXER[layer_type]: mixer, "mlp": 2.0 * sum(i * o for name, (i, o) in linears.items() if name in mlp_names)}


def recompute_share(s: ModelShape, choice: Checkpointing, mean_len: float) -> float:
    """The fraction of the decoder layers' forward FLOPs the backward runs again under `choice`."""
    total = again = 0.0
    for i, layer_type in enumerate(s.layer_types):
        parts = _part_flops(s, layer_type, mean_len)
        total += sum(parts.values())
        again += sum(parts.values()) if choice.whole(i) else sum(n for k, n in parts.items() if k in choice.kinds)
    return again / total if total else 0.0


def candidates(s: ModelShape, mean_len: float) -> list[Checkpointing]:
    """The choices `auto` tries, least recompute first (ties: the one that keeps less first)."""
    kinds = [k for k in KINDS if k == "mlp" or any(MIXER[t] == k for t in s.layer_types)]
    out = [NONE, FULL]
    out += [Checkpointing(kinds=frozenset(c)) for r in range(1, len(kinds) + 1) for c in combinations(kinds, r)]
    out += [Checkpointing(every=n) for n in EVERY_CANDIDATES if n < s.n_layers]
    out += [Checkpointing(every=1, keep=k) for k in range(1, s.n_layers)]
    return sorted(out, key=lambda c: (round(recompute_share(s, c, mean_len), 9), activation_elems(s, c)[0]))


def choose(s: ModelShape, total_of: Callable[[Checkpointing], float], gpu: GpuSpec | None, margin: float,
           mean_len: float) -> tuple[Checkpointing, str]:
    """`auto`'s choice for `gpu` and why, in one line: the first candidate whose plan total (`total_of`) fits
    the GPU's memory less `margin`. On a CPU worker nothing is recomputed."""
    if gpu is None:
        return NONE, ("auto -> none: a CPU worker, the host's memory is not planned and recomputing saves "
                      "nothing there")
    budget = gpu.memory_bytes * (1 - margin)
    tried: list[tuple[Checkpointing, float]] = []
    for c in candidates(s, mean_len):
        total = total_of(c)
        if total <= budget:
            share = recompute_share(s, c, mean_len)
            why = (f"auto -> {c.label}: the least recompute that fits {gpu.name} ({total / GiB:.1f} of "
                   f"{budget / GiB:.1f} GiB, {margin:.0%} margin kept; the backward recomputes {share:.0%} of the "
                   "layers' forward)")
            if tried:
                last, over = tried[-1]
                why += f"; {last.label}, the next with less recompute, plans {over / GiB:.1f} GiB"
            return c, why
        tried.append((c, total))
    return FULL, (f"auto -> full: no choice fits {gpu.name} ({budget / GiB:.1f} GiB with the {margin:.0%} "
                  f"margin); full keeps the least ({total_of(FULL) / GiB:.1f} GiB)")


def describe(choice: Checkpointing) -> str:
    """What a choice recomputes, in words, for the plan's activation line."""
    if choice.kinds:
        return f"{choice.label} recomputed in every layer, the rest kept"
    if choice.every == 0:
        return "nothing recomputed: every layer's saved tensors"
    if choice.keep:
        return (f"every layer recomputed whole but the first {choice.keep} (keep:{choice.keep}), which keep their "
                "saved tensors")
    if choice.every == 1:
        return "full checkpointing: each layer's input + one layer recomputed"
    return f"every {choice.every}th layer recomputed whole (every:{choice.every}), the others keep theirs"
