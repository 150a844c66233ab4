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

import json
import os
import shutil

from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.schedule_length import schedule_settings
from raytune_ft.train.checkpoint import read_train_state, write_meta, write_train_state
from raytune_ft.train.common import WorkerLog
from raytune_ft.train.state import DataPosition, Progress, Schedule, TrainState
from raytune_ft.train.trl.base import TRAINER_FILES


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


def trl_train_state(step: int, blocks, progress: Progress) -> TrainState:
    """The parts of the FSDP2 loop's train state (train/state.py) the TRL loop has, at optimizer step `step`:
    the schedule, this rank's place in the data (`blocks`: the loop's RankBlocks) and the run's tokens and
    seconds so far (`progress`); its history and evaluation are Hugging Face's trainer state."""
    state = TrainState()
    state.schedule = Schedule(step=step, counted_steps=blocks.counted_steps,
                              counted_for=schedule_settings(blocks.recipe) if blocks.counted_steps else None)
    state.data = DataPosition(epoch=blocks.epoch, blocks_consumed=blocks.blocks_consumed,
                              data_fingerprint=blocks.fingerprint, counters=blocks.counters.to_dict())
    state.progress = progress
    return state


def save_train_state(d: str, rank: int, state: TrainState) -> None:
    """This rank's train-state file in checkpoint folder `d`."""
    write_train_state(d, rank, state.state_dict())


def resume_state(fs, root: str, rank: int) -> TrainState:
    """The train state rank `rank` saved in the checkpoint at `root` (on `fs`), as typed parts."""
    state = TrainState()
    state.load_state_dict(read_train_state(fs, root, rank))
    return state


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


def restore_hf_checkpoint(out_dir: str, rank: int, log: WorkerLog) -> tuple[str | None, TrainState | None]:
    """Rebuild a Hugging Face checkpoint folder from the Ray checkpoint to resume from (if any).

    Returns the folder and this rank's train state (None, None: start from scratch)."""
    import ray.train

    from raytune_ft.storage import fs as storage
    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return None, None
    # read where it lies, only what this rank needs: model (or adapter), optimizer, scheduler, trainer state,
    # its own RNG state and train state; never the other ranks' files
    fs, root = ckpt.filesystem, ckpt.path.rstrip("/")
    st = resume_state(fs, root, rank)
    dst = os.path.join(out_dir, f"checkpoint-{st.step}")
    os.makedirs(dst, exist_ok=True)

    def mine(rel: str) -> bool:
        name = rel.rsplit("/", 1)[-1]
        return not name.startswith("rng_state") or name in (f"rng_state_{rank}.pth", "rng_state.pth")

    if not storage.download(fs, f"{root}/trainer", dst, only=mine):   # one listing: what it copied
        raise RuntimeError(f"checkpoint {root} has no trainer state (trainer/) to resume from")
    for sub in ("hf", "adapter"):
        storage.download(fs, f"{root}/{sub}", dst, only=mine)
    log.info(f"resuming from step {st.step} ({st.data.blocks_consumed} blocks consumed on rank {rank})")
    return dst, st


def point_at_best(dst: str, out_dir: str, step: int, rank: int, lora: bool, log: WorkerLog) -> str | None:
    """Keep `train.load_best_at_end` true across a restart: the resumed trainer state (in `dst`, the
    rebuilt checkpoint of step `step`) names its best checkpoint by a local folder of the dead attempt,
    which Hugging Face drops when it is gone, and the last weights would be registered as the best.

    Point that state at a folder of this attempt instead: `dst` when the best is the resumed step, else
    an empty `checkpoint-{best}` that `fetch_best` fills from the run's storage only if the best weights
    are loaded at the end. Returns where rank 0 finds that save in the run's storage (Ray's record of its
    checkpoints, by step); None when there is nothing to fetch. A best save Ray no longer keeps is said
    plainly, and forgotten."""
    path = os.path.join(dst, "trainer_state.json")
    with open(path) as f:
        state = json.load(f)
    best = state.get("best_global_step")
    if not state.get("best_model_checkpoint") or not best:
        return None
    source = None
    if best == step:
        state["best_model_checkpoint"] = dst
    else:
        source = _best_in_storage(best, lora)
        if source is None:
            state["best_model_checkpoint"] = None
            log.info(f"the best checkpoint so far (step {best}, eval loss {state.get('best_metric')}) is no "
                     "longer in the run's storage (Ray keeps only the latest train.keep_checkpoints): unless a "
                     "later evaluation beats it, the final checkpoint holds the last weights, not the best")
        else:
            state["best_model_checkpoint"] = os.path.join(out_dir, f"checkpoint-{best}")
            os.makedirs(state["best_model_checkpoint"], exist_ok=True)
    with open(path, "w") as f:
        json.dump(state, f)
    return source if rank == 0 else None


def _best_in_storage(step: int, lora: bool) -> str | None:
    """The model folder (hf/ or adapter/) of the run's kept checkpoint of optimizer step `step`."""
    from raytune_ft.storage import fs as storage
    from raytune_ft.train.ckpt_storage import run_location

    fs, run_path = run_location()
    reported = storage.reported_checkpoints(fs, run_path)
    for name in (reported.kept if reported else []):
        folder = f"{run_path.rstrip('/')}/{name}/{'adapter' if lora else 'hf'}"
        if (reported.metrics.get(name) or {}).get("step") == step and storage.is_dir(fs, folder):
            return folder
    return None


def fetch_best(source: str, local: str) -> bool:
    """Copy the best checkpoint's model files from the run's storage into `local` (once); whether they
    are there (Ray may have deleted that checkpoint since the attempt started)."""
    from raytune_ft.storage import fs as storage
    from raytune_ft.train.ckpt_storage import run_location

    if not has_weights(local):
        fs, _ = run_location()
        try:
            storage.download(fs, source, local)
        except FileNotFoundError:
            return False
    return has_weights(local)


def has_weights(folder: str) -> bool:
    """Whether a Hugging Face checkpoint folder holds model (or adapter) weights."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return any(n.startswith(("model", "adapter_model", "pytorch_model")) for n in names)


def save_final(trainer, tok, d: str, recipe: Recipe, base_dir: str | None, log: WorkerLog) -> None:
    """Write the deliverable: hf/ (full), or adapter/ (+ merged hf/ when train.merge_adapter) for LoRA."""
    model = trainer.model
    model = getattr(model, "module", model)      # DDP
    if not recipe.train.lora_r:
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
