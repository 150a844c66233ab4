"""Context parallelism's communication per optimizer step and rank, from the model and the mesh, and its time
at the GPU's NVLink bandwidth against the step's compute. `raytune-ft plan` prints it under CP.

A group of C ranks trains, each step, the blocks its C members drew (train/context_parallel.py): C x
grad_accum micro-batches, each split over the group. What models/context_parallel exchanges for one
micro-batch of T tokens, each rank holding T/C of them:
  full attention    one all-gather per layer of the rank's [K | V] (T/C x kv heads x 2 x head dim, in the
                    compute dtype); its backward a reduce-scatter of the gathered gradient, the same size
  gated-delta-net   two all-gathers per layer: the last kernel-1 conv inputs of each of the rank's two chunks
                    (2 x (kernel-1) x conv channels) and each chunk's [B | M] state summary (2 x value heads x
                    key dim x (value dim + key dim), fp32); their backwards the same sizes
A layer part that activation checkpointing recomputes gathers again in the recompute. A ring all-gather or
reduce-scatter moves (C-1)/C of the whole gathered tensor through each rank's link, one direction.

The exchanges are on the critical path: a layer waits for its gather (nothing is prefetched), so their time
adds to the step's compute rather than hiding under it; each is also a collective's fixed cost, counted at
COLLECTIVE_LATENCY_S, an assumption (NCCL's small-message latency inside one NVLink node is tens of
microseconds), not a measurement. FSDP2's own all-gathers and reduce-scatters of the parameters, prefetched
and overlapped, are the projection's (projection.py) and share the same links.
"""
from __future__ import annotations

from dataclasses import dataclass

from raytune_ft.planning.hardware import GpuSpec
from raytune_ft.planning.shapes import ModelShape
from raytune_ft.recipe.checkpointing import Checkpointing

COLLECTIVE_LATENCY_S = 30e-6      # assumed per collective (see the module docstring)


@dataclass(frozen=True)
class CpStep:
    """A rank's step under context parallelism: the group's size, a micro-batch's tokens before the split, the
    micro-batches each rank draws a step, and the compute dtype's bytes."""
    cp: int
    tokens: int
    grad_accum: int = 1
    compute_b: int = 2


@dataclass(frozen=True)
class CpExchange:
    """Context parallelism's traffic of one optimizer step on one rank, and its time where the GPU is known."""
    attention_bytes: float          # through the rank's link, K/V gathers and their gradients
    state_bytes: float              # the gated-delta-net's conv inputs and state summaries, and their gradients
    collectives: int
    how: str
    link_gb_s: float | None = None  # the GPU's NVLink bandwidth per direction
    compute_s: float | None = None  # the step's compute at the plan's throughput

    @property
    def bytes(self) -> float:
        return self.attention_bytes + self.state_bytes

    def seconds_at(self, link_gb_s: float) -> float:
        """The exchange's time over a link of `link_gb_s` GB/s per direction, each collective's fixed cost added."""
        return self.bytes / (link_gb_s * 1e9) + self.collectives * COLLECTIVE_LATENCY_S

    @property
    def seconds(self) -> float | None:
        return self.seconds_at(self.link_gb_s) if self.link_gb_s else None

    def lines(self) -> list[str]:
        gb = 1e9
        out = [f"  CP traffic   {self.bytes / gb:,.2f} GB per step and rank: K/V {self.attention_bytes / gb:,.2f} GB, "
               f"gated-delta-net conv inputs and states {self.state_bytes / gb:,.2f} GB, in {self.collectives:,} "
               f"collectives ({self.how})"]
        if self.seconds is None:
            out.append("  CP time      not estimated: no NVLink bandwidth known for this GPU (or a CPU plan)")
            return out
        took = (f"{self.seconds * 1e3:,.0f} ms at {self.link_gb_s:,.0f} GB/s NVLink per direction, + "
                f"{COLLECTIVE_LATENCY_S * 1e6:.0f} us assumed per collective")
        if self.compute_s:
            share = self.seconds / self.compute_s
            verdict = ("small beside compute" if share < 0.05 else "a visible share of the step" if share < 0.25
                       else "a large share of the step: fewer CP ranks, or a longer block per rank")
            out.append(f"  CP time      {took}; the step's compute {self.compute_s:,.1f} s at the plan's throughput: "
                       f"+{share:.1%}, on the critical path (not overlapped): {verdict}")
        else:
            out.append(f"  CP time      {took}; no throughput to compare with")
        return out


def recomputed_layers(shape: ModelShape, choice: Checkpointing, kind: str, part: str) -> int:
    """How many layers of `kind` recompute `part` (whole, or that part) under `choice`."""
    return sum(1 for i, k in enumerate(shape.layer_types) if k == kind and (choice.whole(i) or part in choice.kinds))


def kv_bytes(shape: ModelShape, tokens: int, compute_b: int) -> int:
    """An attention layer's gathered [K | V] for a block of `tokens` tokens."""
    return tokens * shape.kv_heads * 2 * shape.head_dim * compute_b


def state_summary_bytes(shape: ModelShape, cp: int) -> int:
    """A gated-delta-net layer's gathered [B | M] state summaries: two chunks a rank, fp32."""
    return 2 * cp * shape.lin_v_heads * shape.lin_k_dim * (shape.lin_v_dim + shape.lin_k_dim) * 4


def cp_exchange(shape: ModelShape, step: CpStep, choice: Checkpointing, gpu: GpuSpec | None = None,
                tokens_per_s: float | None = None) -> CpExchange:
    """The traffic of one step of a rank in a CP group of `step.cp` ranks: cp x grad_accum micro-batches of
    `step.tokens` tokens (before the split), each layer part recomputed as `choice` says (module docstring);
    `tokens_per_s`: the rank's training rate, for the step's compute (each rank computes 1/cp of cp x
    grad_accum micro-batches: tokens x grad_accum tokens a step)."""
    cp, tokens, grad_accum, compute_b = step.cp, step.tokens, step.grad_accum, step.compute_b
    micro_batches = cp * grad_accum
    ring = (cp - 1) / cp
    kv = kv_bytes(shape, tokens, compute_b)
    n_attn, re_attn = shape.n_full_attention, recomputed_layers(shape, choice, "full_attention", "attention")
    attention = (2 * n_attn + re_attn) * kv * ring
    halo = max(shape.conv_kernel - 1, 0)
    conv_channels = 2 * shape.lin_k_heads * shape.lin_k_dim + shape.lin_v_heads * shape.lin_v_dim
    tails = 2 * cp * halo * conv_channels * compute_b
    summaries = state_summary_bytes(shape, cp)
    n_gdn, re_gdn = shape.n_linear_attention, recomputed_layers(shape, choice, "linear_attention", "gated_delta")
    states = (2 * n_gdn + re_gdn) * (tails + summaries) * ring
    collectives = micro_batches * ((2 * n_attn + re_attn) + 2 * (2 * n_gdn + re_gdn))
    how = (f"{n_attn} attention layers x (gather + gradient{f', {re_attn} recomputed' if re_attn else ''}) of "
           f"{kv / 1e6:,.0f} MB; {n_gdn} gated-delta-net layers x (gather + gradient"
           f"{f', {re_gdn} recomputed' if re_gdn else ''}) of {(tails + summaries) / 1e6:,.1f} MB; x (C-1)/C = "
           f"{ring:.3f}; x {micro_batches} micro-batches a step (the group's {cp} members' blocks"
           + (f", {grad_accum} each" if grad_accum > 1 else "") + ")")
    link = gpu.nvlink_gb_s if gpu is not None else None
    compute = tokens * grad_accum / tokens_per_s if tokens_per_s else None
    return CpExchange(attention * micro_batches, states * micro_batches, collectives, how, link, compute)
