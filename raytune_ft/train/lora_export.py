"""The FSDP2 loop's final export: hf/ for a full fine-tune; adapter/ (+ merged hf/) for LoRA.

Layout of a LoRA run's final checkpoint (beside dcp/, train_state/ and raytune_meta.json):
    adapter/    a PEFT adapter: adapter_config.json + adapter_model.safetensors under the names PEFT writes
                for the base model (`base_model.model.<the base's module path>.lora_A.weight`) + tokenizer
    base/       a --local tiny (or random-init) base only: the weights the adapter was trained on, which
                nothing else can rebuild (the registry merges into it)
    hf/         with train.merge_adapter: base + B @ A * alpha / r, merged one linear at a time as the
                weights are gathered, so no rank or host holds the whole model
Both hf/ folders follow the base checkpoint's layout (models/layout.py): a Qwen3_5ForConditionalGeneration
base gets its own key names, vision tower and config back.
"""
from __future__ import annotations

import os
from typing import Callable, Iterator

import torch

from raytune_ft.models.layout import BaseLayout, base_layout
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.checkpoint import HfExport, export_hf_folder, gathered_state
from raytune_ft.train.lora import lora_modules, targets_of

PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
PREFIX = "lm."      # the loop's PackedCausalLM holds the HF model as `lm`


def _split_lora_key(key: str) -> tuple[str, str] | None:
    """(module path, "A" | "B" | "W") of a LoRA-wrapped linear's entry, None for any other entry."""
    for part, kind in ((".lora_A.weight", "A"), (".lora_B.weight", "B"), (".base_layer.weight", "W")):
        if key.endswith(part):
            return key[:-len(part)], kind
    return None


def merged_state(model: torch.nn.Module, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The state of the model with each adapter merged into its base linear (W + B @ A * scaling, in fp32),
    under the plain model's names; gathered one entry at a time (a collective), merged on rank 0 only."""
    adapters = dict(lora_modules(model))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in gathered_state(model):
        split = _split_lora_key(key)
        if split is None:
            yield key.replace(".base_layer.", "."), t
            continue
        module, kind = split
        parts = pending.setdefault(module, {})
        parts[kind] = t if rank == 0 else t.new_empty(0)
        if len(parts) == 3:
            del pending[module]
            merged = parts["W"] if rank != 0 else (
                parts["W"].float() + adapters[module].delta_weight(parts["A"], parts["B"]))
            yield f"{module}.weight", merged


def base_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The frozen base's state alone (adapters dropped), under the plain model's names."""
    for key, t in gathered_state(model, keep=_is_base):
        yield key.replace(".base_layer.", "."), t


def _is_base(key: str) -> bool:
    split = _split_lora_key(key)
    return split is None or split[1] == "W"


def adapter_key(param_key: str, layout: BaseLayout) -> str:
    """PEFT's name for an adapter weight of the loop's model (`lm.model.layers.0.mlp.up_proj.lora_A.weight`)."""
    module, kind = _split_lora_key(param_key)
    module = module[len(PREFIX):] if module.startswith(PREFIX) else module
    return f"{PEFT_PREFIX}{layout.module_path(module)}.lora_{kind}.weight"


def peft_config(recipe: Recipe, layout: BaseLayout):
    """The adapter's peft.LoraConfig: the recipe's rank, alpha, dropout and targets, and the base it
    adapts (name and revision; none for a tiny or random base, whose weights travel in base/)."""
    from peft import LoraConfig

    t, m = recipe.train, recipe.model
    own_base = not m.local_tiny and m.init != "random"
    return LoraConfig(r=t.lora_r, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                      target_modules=list(targets_of(t)), task_type="CAUSAL_LM", bias="none",
                      base_model_name_or_path=m.name if own_base else None,
                      revision=m.revision if own_base else None)


def write_adapter(out_dir: str, model: torch.nn.Module, recipe: Recipe, tokenizer, rank: int,
                  layout: BaseLayout) -> None:
    """Write the PEFT adapter folder (a collective: every rank gathers the adapter weights; rank 0 writes).
    The weights stay fp32, as they trained (PEFT keeps adapters in fp32 too)."""
    from safetensors.torch import save_file

    tensors = {}
    for key, t in gathered_state(model, keep=lambda key: not _is_base(key)):   # the adapters alone
        if rank == 0:
            tensors[adapter_key(key, layout)] = t.detach().to("cpu", dtype=torch.float32).contiguous()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, ADAPTER_FILE), metadata={"format": "pt"})
        peft_config(recipe, layout).save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def final_export(recipe: Recipe, model: torch.nn.Module, tokenizer, rank: int, dtype: torch.dtype,
                 log=None) -> Callable[[str], None]:
    """The final checkpoint's export (`Checkpointer.save(export=...)`), called with its hf/ folder. `model`:
    the loop's model, holding the Hugging Face model as `lm`."""
    layout = base_layout(recipe.model)
    lm = model.lm
    hf = HfExport(lm.config, tokenizer, dtype, prefix_strip=PREFIX, arch=type(lm).__name__, layout=layout)

    def export_full(folder: str) -> None:
        export_hf_folder(folder, model, hf, rank)

    def export_lora(folder: str) -> None:
        top = os.path.dirname(folder.rstrip("/"))
        write_adapter(os.path.join(top, "adapter"), model, recipe, tokenizer, rank, layout)
        if recipe.model.local_tiny or recipe.model.init == "random":
            export_hf_folder(os.path.join(top, "base"), model, hf, rank, tensors=base_state(model))
        if recipe.train.merge_adapter:
            export_hf_folder(folder, model, hf, rank, tensors=merged_state(model, rank))
            if log is not None:
                log.info("merged the LoRA adapter into the base model (hf/)")

    return export_lora if recipe.train.lora_r else export_full


def export_bytes(recipe: Recipe, model: torch.nn.Module, params: list) -> int:
    """What the final export writes, for the storage check: the model (merged or full) in the export dtype,
    the adapter alone when nothing is merged."""
    width = 2 if recipe.model.dtype == "bfloat16" else 4
    if recipe.train.lora_r and not recipe.train.merge_adapter:
        return sum(p.numel() for p in params) * width
    return sum(p.numel() for p in model.parameters()) * width
