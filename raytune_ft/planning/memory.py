"""The memory plan's lines (bytes per GPU; the model is in planning/plan.py's docstring) under one activation
checkpointing choice: planning/plan.py sums them for the plan, and for each candidate when it resolves `auto`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from raytune_ft.planning.checkpointing import activation_elems, describe
from raytune_ft.planning.cp_comms import kv_bytes, recomputed_layers, state_summary_bytes
from raytune_ft.planning.hardware import GiB, GpuSpec
from raytune_ft.planning.lora import lora_fsdp2_lines, lora_layer_params, lora_state_lines
from raytune_ft.planning.measured import figure
from raytune_ft.planning.shapes import ModelShape
from raytune_ft.recipe.checkpointing import Checkpointing
from raytune_ft.recipe.recipe import Recipe


@dataclass
class MemoryLine:
    name: str
    bytes: float
    how: str                         # the arithmetic, in words


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:8.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / 1024**2:8.2f} MiB"


def fmt_count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f}"


def tokens_per_micro_batch(recipe: Recipe) -> int:
    t, d = recipe.train, recipe.data
    per_row = d.seq_len if (t.loop == "fsdp2" or t.packing) else (t.max_length or d.seq_len)
    return per_row * t.micro_batch_size


def tokens_per_rank(recipe: Recipe) -> int:
    """Tokens of one micro-batch a rank holds: under context parallelism its 1/C share of every block."""
    return tokens_per_micro_batch(recipe) // recipe.scaling.context_parallel


def compute_bytes(recipe: Recipe, g: GpuSpec | None) -> int:
    """Bytes of the compute dtype: bf16 on a GPU where the recipe asks for it, else fp32 (a CPU plan)."""
    return 2 if (g is not None and recipe.model.dtype == "bfloat16") else 4


def memory_lines(recipe: Recipe, shape: ModelShape, g: GpuSpec | None,
                 choice: Checkpointing) -> tuple[list[MemoryLine], list[str], int]:
    """The plan's memory lines under the checkpointing `choice`, its notes, and the trainable parameters."""
    t = recipe.train
    compute_b = compute_bytes(recipe, g)
    shard = recipe.scaling.num_workers if t.loop == "fsdp2" else 1
    lines: list[MemoryLine] = []
    notes: list[str] = []
    trainable = _state_lines(recipe, shape, compute_b, shard, lines, notes)
    acts = _activation_lines(recipe, shape, compute_b, choice, lines)
    if recipe.scaling.context_parallel > 1:
        lines += [_exchange_line(recipe, shape, compute_b, choice), _cp_allowance_line(shape)]
    _loss_lines(recipe, shape, g, compute_b, acts, lines)
    return lines, notes, trainable


def _state_lines(recipe: Recipe, shape: ModelShape, compute_b: int, shard: int, lines: list[MemoryLine],
                 notes: list[str]) -> int:
    """Params, grads, optimizer states and FSDP2's gathered units (or DDP's buckets); the trainable count."""
    t, workers, P = recipe.train, recipe.scaling.num_workers, shape.total_params
    lora = t.lora_r > 0
    if lora:   # the frozen base, fp32 adapters with their grads and AdamW states (plan_lora.py)
        trainable, state_lines = lora_state_lines(shape, t, compute_b, shard, fmt_count)
        lines += [MemoryLine(name, float(b), how) for name, b, how in state_lines]
    else:
        trainable = P
        param_b = 4 if (t.master_weights == "fp32" or compute_b == 4) else 2
        pname = "fp32" if param_b == 4 else "bf16"
        div = f" / {shard}" if shard > 1 else ""
        lines.append(MemoryLine("params", P * param_b / shard, f"{fmt_count(P)} x {param_b} B ({pname}){div}"))
        lines.append(MemoryLine("grads", P * param_b / shard, f"{pname}, as the params{div}"))
        lines.append(MemoryLine("optimizer", 2 * P * param_b / shard,
                                f"AdamW 2 states x {param_b} B ({pname}, zeros_like param){div}"))
        if param_b == 2:
            notes.append("master_weights=bf16: weights, grads and AdamW states are bf16; updates smaller than "
                         "bf16's resolution (~1e-3 relative) are lost")
        if t.loop == "trl" and param_b == 4 and compute_b == 2:
            # autocast caches the bf16 copy of every weight for the duration of the forward
            lines.append(MemoryLine("autocast copies", P * 2.0,
                                    "bf16 casts of the fp32 weights, cached by autocast during forward"))
    if t.loop == "fsdp2":
        grads = lora_layer_params(shape, t) if lora else shape.max_layer_params    # LoRA: the adapters' only
        gathered = (shape.root_params + 2 * shape.max_layer_params) * compute_b + grads * 4
        lines.append(MemoryLine("fsdp gathered", float(gathered),
                                f"root unit {fmt_count(shape.root_params)} + 2 layers x "
                                f"{fmt_count(shape.max_layer_params)} unsharded in {compute_b} B, + 1 layer of fp32 "
                                "grads before reduce-scatter"))
    elif workers > 1:
        lines.append(MemoryLine("ddp buckets", float(trainable * (4 if lora or t.master_weights == "fp32" else 2)),
                                "DDP's gradient buckets (a second copy of the trainable grads)"))
    return trainable


class _Activations(NamedTuple):
    tokens_mb: int                   # tokens per micro-batch
    recompute: float                 # elements per token of the largest unit the backward recomputes


def _activation_lines(recipe: Recipe, shape: ModelShape, compute_b: int, choice: Checkpointing,
                      lines: list[MemoryLine]) -> _Activations:
    """The activations under `choice` (and float8's casts)."""
    t, tokens_mb, cp = recipe.train, tokens_per_rank(recipe), recipe.scaling.context_parallel
    kept, recompute = activation_elems(shape, choice)
    share = f" (1/{cp} of {tokens_per_micro_batch(recipe):,}: context parallelism)" if cp > 1 else ""
    lines.append(MemoryLine("activations", (kept + recompute) * tokens_mb * compute_b,
                            f"{tokens_mb:,} tokens{share} x {fmt_count(kept + recompute)} elements x {compute_b} B "
                            f"({describe(choice)})"))
    if t.loop == "fsdp2" and t.precision == "fp8":
        from raytune_ft.planning.shapes import fp8_linear_filter_dims

        by_kind = {k: [(i, o) for i, o in shape.linears(k).values() if fp8_linear_filter_dims(i, o, t.fp8_recipe)]
                   for k in set(shape.layer_types)}
        conv = [io for ios in by_kind.values() for io in ios]
        if conv:
            x, go, w = max(i for i, _ in conv), max(o for _, o in conv), max(i * o for i, o in conv)
            casts = 2.0 * (tokens_mb * (x + go) + w)
            how = (f"1-byte casts of the largest float8 matmul's input ({tokens_mb:,} x {x:,}), output gradient "
                   f"({tokens_mb:,} x {go:,}) and weight, each with its transpose for backward ({t.fp8_recipe})")
            if t.fp8_recipe == "tensorwise":
                # FSDP2 all-gathers the converted weights in float8 (train/fp8.py): the 2 unsharded layers the
                # "fsdp gathered" line counts in the compute dtype hold those weights in 1 byte each
                saved = 2 * max(sum(i * o for i, o in ios) for ios in by_kind.values()) * (compute_b - 1)
                casts -= saved
                how += (", less the float8 all-gather's 1-byte weights in the 2 unsharded layers "
                        f"({fmt_bytes(saved).strip()})")
            lines.append(MemoryLine("float8 casts", casts, how))
    return _Activations(tokens_mb, recompute)


def _exchange_line(recipe: Recipe, shape: ModelShape, compute_b: int, choice: Checkpointing) -> MemoryLine:
    """What context parallelism adds per rank (models/context_parallel): each full-attention layer all-gathers
    the block's K and V and selects its queries' keys from them, both saved for the backward where the layer
    keeps its tensors, and the one layer the backward works on holds them again with the gathered gradient;
    each gated-delta-net layer gathers its chunks' [B | M] state summaries (fp32), with their gradient."""
    cp, tokens = recipe.scaling.context_parallel, tokens_per_micro_batch(recipe)
    kv = kv_bytes(shape, tokens, compute_b)
    kinds = list(shape.layer_types)

    def keeping(kind: str, part: str) -> int:
        return kinds.count(kind) - recomputed_layers(shape, choice, kind, part)

    kept_attn, total = keeping("full_attention", "attention"), 0.0
    how = f"K/V of the whole block ({tokens:,} tokens x {shape.kv_heads} x 2 x {shape.head_dim} x {compute_b} B)"
    if "full_attention" in kinds:
        total = (2 * kept_attn + 3) * kv
        how = (f"{how} {fmt_bytes(kv).strip()}, gathered and selected: kept by {kept_attn} attention layers, + "
               "gathered, selected and its gradient in the layer the backward works on")
    if "linear_attention" in kinds:
        summaries = state_summary_bytes(shape, cp)
        kept_gdn = keeping("linear_attention", "gated_delta")
        total += (kept_gdn + 2) * summaries
        how += (f"; state summaries of {2 * cp} chunks (fp32, {fmt_bytes(summaries).strip()} a layer): kept by "
                f"{kept_gdn} gated-delta-net layers, + gathered and its gradient")
    return MemoryLine("context-parallel exchange", float(total), how)


# calibrated once (planning/data/measured.json names the runs): the plan is built for every `auto` candidate
_CP_ALLOWANCE = figure("cp_allowance")
CP_ALLOWANCE_MIB = _CP_ALLOWANCE["values"]["mib_per_layer"]
_CP_FITTED = _CP_ALLOWANCE["fitted_on"][-1]


def _cp_allowance_line(shape: ModelShape) -> MemoryLine:
    """What CP peaks hold beyond the lines above: measured as a constant per rank whatever the block's length,
    its cause not identified; calibrated per decoder layer."""
    return MemoryLine("context-parallel allowance", float(CP_ALLOWANCE_MIB * 1024**2 * shape.n_layers),
                      f"{CP_ALLOWANCE_MIB} MiB x {shape.n_layers} layers: CP peaks measured over the lines above by a "
                      f"constant whatever the block's length (cause not identified; fitted on "
                      f"{_CP_FITTED['values']['peak_gib']} GiB at {_CP_FITTED['seq']:,} tokens, CP 8, H100)")


def _loss_lines(recipe: Recipe, shape: ModelShape, g: GpuSpec | None, compute_b: int, acts: _Activations,
                lines: list[MemoryLine]) -> None:
    """The loss's memory (and the FSDP2 LoRA lines)."""
    t, (tokens_mb, recompute) = recipe.train, acts
    V, D = shape.vocab, shape.hidden
    if t.loop == "fsdp2":
        lora = t.lora_r > 0
        chunk = min(4096, tokens_mb)
        head_grad = 0 if lora else V * D * 4       # a frozen lm_head gets no gradient accumulator
        logits = chunk * V * (4 + compute_b)
        # the loss's logits are freed before the backward recomputes its first layer: the two never coexist
        shared = min(logits, recompute * tokens_mb * compute_b)
        lines.append(MemoryLine("loss", logits - shared + head_grad + 2 * tokens_mb * D * compute_b,
                                f"chunked CE: {chunk:,} x {V:,} fp32 logits + grad (less {fmt_bytes(shared).strip()} "
                                f"freed before the first recompute), {'no' if lora else 'fp32'} lm_head grad "
                                "accumulator, final hidden + its grad"))
        shard = recipe.scaling.num_workers
        for name, b, how in (lora_fsdp2_lines(shape, t, tokens_mb, compute_b, shape.total_params * compute_b / shard)
                             if lora else ()):
            lines.append(MemoryLine(name, float(b), how))
    elif t.use_liger and g is not None:
        chunk = min(tokens_mb, 2048)
        lines.append(MemoryLine("loss", float(chunk * V * (4 + compute_b) + 2 * tokens_mb * D * compute_b),
                                f"Liger fused linear CE: ~{chunk:,}-token chunks of logits"))
    else:
        lines.append(MemoryLine("loss", float(tokens_mb * V * (compute_b + 8)),
                                f"full logits: {tokens_mb:,} x {V:,} x ({compute_b} B + fp32 upcast + fp32 grad)"))
