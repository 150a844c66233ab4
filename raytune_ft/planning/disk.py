"""What a run writes to `tracking.storage_path`, from the model's parameter count and the recipe.

`raytune-ft plan` and `--dry-run` print it beside the memory plan: the DCP checkpoint (weights + AdamW's
two moments in the master dtype, the per-rank train state; gradients are not saved), the final Hugging
Face export, the peak with `train.keep_checkpoints` kept and one more being written, and the local disk a
node stages a checkpoint on before its upload.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytune_ft.storage.fs import fmt_bytes

if TYPE_CHECKING:
    from raytune_ft.recipe.recipe import Recipe


@dataclass
class StoragePlan:
    """Bytes a run writes to storage, from the model's parameter count and the recipe."""
    loop: str
    params: int
    trainable: int
    checkpoint_bytes: int            # one periodic checkpoint
    final_extra_bytes: int           # what the final checkpoint adds (the Hugging Face export)
    keep: int
    parts: list[tuple[str, int, str]]
    staging_per_node: int            # local disk one node stages a checkpoint in before the upload
    workers: int

    @property
    def peak_bytes(self) -> int:
        """keep_checkpoints kept + one being written, the last of them the final one with its export."""
        return (self.keep + 1) * self.checkpoint_bytes + self.final_extra_bytes

    def lines(self) -> list[str]:
        pad = " " * 15
        out = [f"  storage      per checkpoint {fmt_bytes(self.checkpoint_bytes)}: "
               + ", ".join(f"{name} {fmt_bytes(b)} ({how})" for name, b, how in self.parts)]
        if self.final_extra_bytes:
            out.append(f"{pad}final export {fmt_bytes(self.final_extra_bytes)} (Hugging Face folder, in the final "
                       "checkpoint)")
        out.append(f"{pad}peak {fmt_bytes(self.peak_bytes)} = (train.keep_checkpoints {self.keep} + 1 being "
                   f"written) x {fmt_bytes(self.checkpoint_bytes)}"
                   + (f" + the export {fmt_bytes(self.final_extra_bytes)}" if self.final_extra_bytes else ""))
        out.append(f"{pad}local disk: up to {fmt_bytes(self.staging_per_node)} per node stages a checkpoint "
                   "before its upload")
        return out


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def storage_plan(recipe: "Recipe", shape: Any | None = None) -> StoragePlan:
    """The storage plan of `recipe` (`shape`: a plan.ModelShape, else read from the recipe's model)."""
    if shape is None:
        from raytune_ft.planning.plan import model_shape

        shape, _ = model_shape(recipe)
    t, s = recipe.train, recipe.scaling
    P = int(shape.total_params)
    compute_b = 2 if (recipe.model.dtype == "bfloat16" and s.use_gpu) else 4
    param_b = 4 if (t.master_weights == "fp32" or compute_b == 4) else 2
    export_b = 2 if recipe.model.dtype == "bfloat16" else 4
    world = max(1, s.num_workers)
    per_node = min(world, max(1, s.gpus_per_node))
    parts: list[tuple[str, int, str]] = []
    state_b = 64 * 1024 * world               # train_state/rank*.json, meta, DCP metadata: small
    if t.loop == "fsdp2" and not t.lora_r:
        trainable = P
        parts.append(("model", P * param_b, f"{_count(P)} params x {param_b} B"))
        parts.append(("optimizer", 2 * P * param_b, f"AdamW 2 states x {param_b} B"))
        parts.append(("train state", state_b, "per-rank JSON"))
        final_extra = P * export_b
        ckpt = sum(b for _, b, _ in parts)
        staging = ckpt * per_node // world + final_extra      # rank 0 stages the whole export
    elif t.lora_r:
        trainable = int(shape.lora_params(t.lora_r, t.lora_target_modules))
        parts.append(("adapter", trainable * 4, f"{_count(trainable)} LoRA params x 4 B"))
        parts.append(("optimizer", 2 * trainable * 4, "AdamW 2 states x 4 B"))
        parts.append(("trainer state" if t.loop == "trl" else "train state", state_b,
                      "scheduler, RNG, JSON" if t.loop == "trl" else "per-rank JSON"))
        final_extra = P * export_b if t.merge_adapter else 0   # the merged hf/ (the FSDP2 loop: adapters only)
        ckpt = sum(b for _, b, _ in parts)
        staging = ckpt + final_extra
    else:
        trainable = P
        parts.append(("model", P * param_b, f"{_count(P)} params x {param_b} B (hf/)"))
        parts.append(("optimizer", 2 * P * param_b, f"AdamW 2 states x {param_b} B (trainer/optimizer.pt)"))
        parts.append(("trainer state", state_b, "scheduler, RNG, JSON"))
        final_extra = 0                       # the final checkpoint is the same shape
        ckpt = sum(b for _, b, _ in parts)
        staging = ckpt
    return StoragePlan(loop=t.loop, params=P, trainable=trainable, checkpoint_bytes=int(ckpt),
                       final_extra_bytes=int(final_extra), keep=t.keep_checkpoints, parts=parts,
                       staging_per_node=int(staging), workers=world)
