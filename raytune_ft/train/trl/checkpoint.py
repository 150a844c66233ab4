"""The TRL loop's checkpoints: a Hugging Face save staged in the project's layout, restored on resume.

Ray checkpoint layout (one per Hugging Face save, and a final one):
    hf/                  full fine-tune: model + tokenizer (for LoRA runs: the merged model, final only)
    adapter/             LoRA: adapter + tokenizer
    base/                LoRA on a `--local` tiny model: the random base it was trained on (nothing else
                         can rebuild it)
    trainer/             Hugging Face trainer state: optimizer, scheduler, RNG, trainer_state.json
    train_state/rank{R}.json   step, blocks this rank consumed, data fingerprint, data counters
    raytune_meta.json    job, model_name, family, step, final_loss, best_eval_loss, run_name, loop="trl"
The final checkpoint is reported last; with `train.load_best_at_end` it holds the best weights.
"""
from __future__ import annotations

import os
import shutil

from raytune_ft.recipe import Recipe
from raytune_ft.train.checkpoint import read_train_state, write_meta
from raytune_ft.train.common import WorkerLog
from raytune_ft.train.trl.base import TRAINER_FILES, write_train_state


def _link_or_copy(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.isdir(src):
        shutil.copytree(src, dst, copy_function=_link_file)
    else:
        _link_file(src, dst)


def _link_file(src: str, dst: str) -> None:
    try:
        os.link(src, dst)                  # same filesystem: no copy of multi-GB weights
    except OSError:
        shutil.copy2(src, dst)


def stage_checkpoint(src: str, dst: str, *, rank: int, lora: bool) -> None:
    """Lay a Hugging Face checkpoint folder out as the project's checkpoint: model files under hf/ (or
    adapter/), trainer state under trainer/. Rank > 0 holds only its RNG state."""
    if not os.path.isdir(src):
        return
    model_dir = os.path.join(dst, "adapter" if lora else "hf")
    for name in os.listdir(src):
        path = os.path.join(src, name)
        is_state = name in TRAINER_FILES or name.startswith("rng_state")
        if rank != 0 and not is_state:
            continue
        _link_or_copy(path, os.path.join(dst, "trainer", name) if is_state else os.path.join(model_dir, name))


def save_train_state(d: str, rank: int, step: int, blocks, metrics: dict) -> None:
    """This rank's place in the data (`blocks`: the loop's RankBlocks) at optimizer step `step`, and the
    run's tokens and seconds so far (from `metrics`, the callback's report)."""
    write_train_state(d, rank, {"step": step, "epoch": blocks.epoch, "blocks_consumed": blocks.blocks_consumed,
                                "data_fingerprint": blocks.fingerprint, "counters": blocks.counters.to_dict(),
                                "tokens_total": metrics["tokens"],
                                "run_train_seconds": metrics["run_train_seconds"],
                                "counted_steps": blocks.counted_steps})


def save_meta(d: str, recipe: Recipe, state, last: dict, *, final: bool, extra: dict | None = None) -> None:
    """raytune_meta.json for the registry, from the trainer's state."""
    losses = [h["loss"] for h in state.log_history if "loss" in h]
    write_meta(d, {
        "job": recipe.job, "model_name": recipe.model.name, "revision": recipe.model.revision,
        "family": recipe.model.family, "step": state.global_step, "final": final,
        "final_loss": losses[-1] if losses else last.get("loss"),
        "best_eval_loss": None if state.best_metric is None else float(state.best_metric),
        "best_step": state.best_global_step or None,
        "run_name": recipe.tracking.run_name, "loop": "trl",
        "lora": bool(recipe.train.lora_r), **(extra or {}),
    })


def restore_hf_checkpoint(out_dir: str, rank: int, log: WorkerLog) -> tuple[str | None, dict]:
    """Rebuild a Hugging Face checkpoint folder from the Ray checkpoint to resume from (if any).

    Returns the folder (None: start from scratch) and this rank's train state ({} when none)."""
    import ray.train

    from raytune_ft import storage

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return None, {}
    # read where it lies, only what this rank needs: model (or adapter), optimizer, scheduler, trainer state,
    # its own RNG state and train state; never the other ranks' files
    fs, root = ckpt.filesystem, ckpt.path.rstrip("/")
    st = read_train_state(fs, root, rank)
    dst = os.path.join(out_dir, f"checkpoint-{st['step']}")
    os.makedirs(dst, exist_ok=True)

    def mine(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return not name.startswith("rng_state") or name in (f"rng_state_{rank}.pth", "rng_state.pth")

    if not storage.download(fs, f"{root}/trainer", dst, only=mine):   # one listing: what it copied
        raise RuntimeError(f"checkpoint {root} has no trainer state (trainer/) to resume from")
    for sub in ("hf", "adapter"):
        storage.download(fs, f"{root}/{sub}", dst, only=mine)
    log.info(f"resuming from step {st['step']} ({st['blocks_consumed']} blocks consumed on rank {rank})")
    return dst, st


def save_final(trainer, tok, d: str, recipe: Recipe, lora: bool, base_dir: str | None, log: WorkerLog) -> None:
    """Write the deliverable: hf/ (full), or adapter/ (+ merged hf/ when train.merge_adapter) for LoRA."""
    model = trainer.model
    model = getattr(model, "module", model)      # DDP
    if not lora:
        model.config.use_cache = True
        model.save_pretrained(os.path.join(d, "hf"), safe_serialization=True)
        tok.save_pretrained(os.path.join(d, "hf"))
        return
    model.save_pretrained(os.path.join(d, "adapter"))
    tok.save_pretrained(os.path.join(d, "adapter"))
    if base_dir:
        _link_or_copy(base_dir, os.path.join(d, "base"))
    if recipe.train.merge_adapter:
        merged = model.merge_and_unload()
        merged.config.use_cache = True
        merged.save_pretrained(os.path.join(d, "hf"), safe_serialization=True)
        tok.save_pretrained(os.path.join(d, "hf"))
        log.info("merged the LoRA adapter into the base model (hf/)")
