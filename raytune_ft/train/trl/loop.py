"""`train_trl`: the Ray Train worker entry point of the TRL recipes (full fine-tune or LoRA).

Steps are equal on every rank (see `raytune_ft.train.batch`). Without `train.max_steps` the number of
steps is counted first (one extra pass over the data) so the LR schedule knows its length.

Evaluation: every rank evaluates the whole validation set (the validation dataset reaches each worker
unsplit). Ranks then agree on the eval loss without equalisation padding biasing it; the cost is
duplicated evaluation work on multi-worker runs, small next to training for the recipes here.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raytune_ft.data.packing import DataCounters
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.batch import collate_blocks, worker_blocks
from raytune_ft.train.schedule_length import count_run_steps, run_schedule_steps, short_of_steps
from raytune_ft.train.common import WorkerLog, recipe_from_config
from raytune_ft.train.state import TrainState
from raytune_ft.train.trl.base import Paused, ray_report
from raytune_ft.train.trl.checkpoint import (point_at_best, restore_hf_checkpoint, save_final, save_meta,
                                             save_train_state)
from raytune_ft.train.trl.data import RankBlocks, facade, release_facades
from raytune_ft.train.trl.report import ReportContext, report_callback
from raytune_ft.train.trl.trainer import TrainerParts, trainer_class


@dataclass(frozen=True)
class _Worker:
    """This worker in the attempt: the recipe, its rank among `world`, its log, whether it trains on a GPU,
    and the device the loop's flags are all-reduced on (the GPU under NCCL)."""
    recipe: Recipe
    rank: int
    world: int
    log: WorkerLog
    on_gpu: bool
    flag_device: torch.device

    @property
    def compute_bf16(self) -> bool:
        return self.on_gpu and self.recipe.model.dtype == "bfloat16"


@dataclass(frozen=True)
class _Model:
    """The model built for the attempt (its weights in `dtype`), its tokenizer, whether Liger's fused loss is in
    use, the attempt's output folder, and a random base kept for a LoRA adapter (None: a named base)."""
    lm: Any
    tok: Any
    dtype: torch.dtype
    liger: bool
    out_dir: str
    base_dir: str | None


@dataclass(frozen=True)
class _Start:
    """Where the attempt starts: the checkpoint's train state (a fresh start's parts without one), the
    folder Hugging Face resumes from, an earlier attempt's best checkpoint, the blocks and the step count."""
    state: TrainState
    resumed: TrainState | None
    resume_dir: str | None
    best_source: str | None
    train_blocks: RankBlocks
    eval_blocks: list
    max_steps: int


def train_trl(config: dict) -> None:
    """Ray Train worker entry point for the TRL recipes (full fine-tune or LoRA)."""
    import ray.train
    import ray.train.torch

    from raytune_ft.train.ckpt_storage import report_if_finished, start_attempt
    from raytune_ft.train.jit_cache import for_worker

    recipe = recipe_from_config(config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log = WorkerLog.of_worker(rank, recipe, config)
    if report_if_finished(log):   # the final checkpoint is the latest: it stays the run's result
        return

    # checkpoint folders of dead attempts off the storage, once the run folder's lease is found still this job's
    start_attempt(rank, config.get("lease_token"), log.info)
    jit = for_worker(recipe, ray.train.torch.get_device(), log.info, log.startup)   # before anything compiles
    flag_device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
    worker = _Worker(recipe, rank, world, log, recipe.scaling.use_gpu and torch.cuda.is_available(), flag_device)
    model = _build_model(worker)
    start = _start(worker, model)
    trainer, callback = _build_trainer(worker, model, start, jit)
    trainer.train(resume_from_checkpoint=start.resume_dir)
    _finish(worker, model, start, trainer, callback)


def _build_model(w: _Worker) -> _Model:
    """The tokenizer and the model, built on the worker's device, its kernels checked; the output folder."""
    import ray.train.torch

    from raytune_ft.models.build import load_causal_lm
    from raytune_ft.models.gated_delta import enable_packing
    from raytune_ft.models.kernel_check import KernelUse, check_on_worker

    recipe, log, t = w.recipe, w.log, w.recipe.train
    tok = _tokenizer(recipe, log)
    # weights in bf16 only when the recipe asks for bf16 master weights; fp32 weights train under
    # bf16 autocast (TrainingArguments(bf16=True)), so AdamW updates are not lost to bf16 rounding
    dtype = torch.bfloat16 if (w.compute_bf16 and t.master_weights == "bf16") else torch.float32
    torch.manual_seed(t.seed)
    # built straight on the worker's GPU: a random init or a checkpoint read of a 4B model on the host
    # takes minutes; the Trainer finds it already in place
    build_device = ray.train.torch.get_device() if w.on_gpu else torch.device("cpu")
    lm = load_causal_lm(recipe.model, tokenizer_vocab_size=len(tok), device=build_device, dtype=dtype,
                        seed=t.seed)
    enable_packing(lm)                             # idempotent: varlen attention + packed gated-delta-net
    if not recipe.model.local_tiny:
        lm.config.name_or_path = recipe.model.name   # what a LoRA adapter names as its base
    lm.config.use_cache = False
    log.startup.mark("model_build")
    # every fast kernel, and Liger's fused loss where it would be used, proves itself on this GPU first
    checking = time.time()
    kernels = check_on_worker(KernelUse(lm.config, build_device, torch.bfloat16 if w.compute_bf16 else torch.float32,
                                        liger=_use_liger(recipe, w.on_gpu, log)), mode=t.kernels, log=log)
    log.startup.mark("kernel_check", since=checking)

    out_dir = tempfile.mkdtemp(prefix=f"raytune_trl_rank{w.rank}_")
    base_dir = None
    if t.lora_r and (recipe.model.local_tiny or recipe.model.init == "random") and w.rank == 0:
        # a random base (tiny, or init="random"): keep it, so the adapter can be loaded and merged later
        base_dir = os.path.join(out_dir, "base")
        lm.save_pretrained(base_dir)
        tok.save_pretrained(base_dir)
    return _Model(lm, tok, dtype, kernels.in_use.get("fused_ce") == "liger", out_dir, base_dir)


def _start(w: _Worker, model: _Model) -> _Start:
    """The checkpoint restored (if any), this rank's blocks from where it stopped, and the run's step count."""
    recipe, log, t = w.recipe, w.log, w.recipe.train
    resume_dir, resumed = restore_hf_checkpoint(model.out_dir, w.rank, log)
    start = resumed or TrainState()            # a fresh start's parts: step 0, no data consumed
    best_source = point_at_best(resume_dir, model.out_dir, start.step, w.rank, t.lora_r > 0, log) if (
        resume_dir and t.load_best_at_end) else None
    train_blocks = RankBlocks(recipe, rank=w.rank, flag_device=w.flag_device, epoch=start.data.epoch or 0,
                              skip_blocks=start.data.blocks_consumed, fingerprint=start.data.data_fingerprint)
    train_blocks.flops_config = model.lm.config
    eval_blocks = _validation_blocks(recipe, log)

    max_steps = int(t.max_steps or 0)
    if not max_steps:      # Hugging Face needs the length of a stream it cannot measure, whatever the schedule
        max_steps = max(1, run_schedule_steps(recipe, start.schedule.state_dict(), lambda: count_run_steps(
            lambda e, c: worker_blocks(recipe, counters=c, epoch=e), train_blocks.per_step, t.epochs,
            flag_device=w.flag_device), log.info))
        train_blocks.counted_steps = max_steps      # saved with the train state: a resumed attempt reads it back
    if start.step >= max_steps:
        train_blocks.spend()
        log.info(f"the checkpoint is at step {start.step} of {max_steps}: nothing left to train")
    return _Start(start, resumed, resume_dir, best_source, train_blocks, eval_blocks, max_steps)


def _build_trainer(w: _Worker, model: _Model, start: _Start, jit):
    """The SFTTrainer of the attempt and its report callback; the storage checked for a first checkpoint."""
    from raytune_ft.console import libraries_to_file, library_log
    from raytune_ft.train.ckpt_storage import SaveGuard, model_checkpoint_bytes

    recipe, log, t = w.recipe, w.log, w.recipe.train
    libraries_to_file(library_log("workers"))     # transformers' own log lines too, now that it is imported
    paused = Paused()
    callback = report_callback(ReportContext(recipe=recipe, rank=w.rank, world=w.world, log=log,
                                             blocks=start.train_blocks, lora=t.lora_r > 0, paused=paused,
                                             resumed=start.resumed, jit=jit))
    # room for a checkpoint checked before each save (the trainable parameters are known once PEFT wrapped them)
    parts = TrainerParts(recipe, start.train_blocks, start.eval_blocks, paused, callback.steps,
                         guard_for=lambda m: SaveGuard(w.rank, w.flag_device, model_checkpoint_bytes(
                             p for p in m.parameters() if p.requires_grad)), best_source=start.best_source)
    trainer = trainer_class()(
        parts, model=model.lm, args=_sft_config(recipe, model.out_dir, start.max_steps, on_gpu=w.on_gpu,
                                                bf16=w.compute_bf16, liger=model.liger),
        train_dataset=facade(start.train_blocks),
        eval_dataset=facade(start.eval_blocks) if start.eval_blocks else None,
        processing_class=model.tok, data_collator=collate_blocks, peft_config=_peft_config(recipe),
        callbacks=[callback])
    # the loop's callback prints each log as a line of its own: the trainer's printer would print it again
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for printer in (PrinterCallback, ProgressCallback):
        while trainer.pop_callback(printer) is not None:
            pass
    trainer.raytune_guard.check_first(start.state.step, t)   # a storage that cannot take one stops here
    if t.lora_r:
        n_train = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        log.info(f"LoRA r={t.lora_r} alpha={t.lora_alpha} on {t.lora_target_modules or 'all-linear'}: "
                 f"{n_train:,} trainable parameters, LR {t.lr:g} x {t.lora_lr_multiplier:g}")
    log.info(f"TRL SFTTrainer: {start.max_steps} steps, {w.world} worker(s) x {t.micro_batch_size} blocks x "
             f"{t.grad_accum} accumulation, {model.dtype}, gradient checkpointing {t.gradient_checkpointing}")
    return trainer, callback


def _finish(w: _Worker, model: _Model, start: _Start, trainer, callback) -> None:
    """After training: the lines that say what was trained and loaded, the final checkpoint (or none)."""
    recipe, log, t = w.recipe, w.log, w.recipe.train
    state = trainer.state
    if state.global_step < start.max_steps:
        log.info(short_of_steps(state.global_step, start.max_steps, start.train_blocks.counters))
    callback.log_remaining_steps(state.global_step)
    weights_step = trainer.raytune_best_loaded or state.global_step
    if t.load_best_at_end and trainer.raytune_best_loaded:
        log.info(f"loaded the best checkpoint: step {weights_step}, eval loss {state.best_metric:.4f}")
    elif t.load_best_at_end and state.best_global_step:
        log.info(f"the best checkpoint (step {state.best_global_step}) could not be loaded: the final "
                 f"checkpoint holds the last weights, step {weights_step}, not the best")

    # the final checkpoint: the weights the trainer holds now (the best ones with load_best_at_end)
    metrics = callback.metrics(state)
    metrics["done"], metrics["passes"] = True, start.train_blocks.passes_fed
    losses = [h["loss"] for h in state.log_history if "loss" in h]
    if losses:
        metrics["loss"] = losses[-1]
    if not t.save_final:
        log.info("train.save_final=false: no final checkpoint")
        # the summary reads the end of the run from MLflow; the last step's own points are there already
        log.log_metrics(metrics, state.global_step, skip=("loss", "grad_norm", "learning_rate"))
        ray_report(metrics, None)
    else:
        with tempfile.TemporaryDirectory(prefix="raytune_trl_final_") as d:
            if w.rank == 0:
                save_final(trainer, model.tok, d, recipe, model.base_dir, log)
                save_meta(d, recipe, state, callback.last, final=True, extra={"weights_step": weights_step})
            save_train_state(d, w.rank, callback.train_state(state.global_step, metrics))
            ray_report(metrics, d)
    shutil.rmtree(model.out_dir, ignore_errors=True)
    release_facades()
    log.close()      # rank 0's MLflow calls made before the trainer's fit returns


def _tokenizer(recipe: Recipe, log: WorkerLog):
    from raytune_ft.models.build import tokenizer_for

    tok = tokenizer_for(recipe.model)
    if not tok.chat_template:
        from raytune_ft.models.tiny import CHATML_TEMPLATE

        tok.chat_template = CHATML_TEMPLATE
        log.info("the tokenizer has no chat template: using ChatML")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else "<|endoftext|>"
        log.info(f"the tokenizer has no pad token: using {tok.pad_token!r}")
    return tok


def _use_liger(recipe: Recipe, on_gpu: bool, log: WorkerLog) -> bool:
    if not recipe.train.use_liger:
        return False
    if not on_gpu:
        log.info("Liger kernels: off (no GPU here; they are Triton kernels). The same job runs without them.")
        return False
    if importlib.util.find_spec("liger_kernel") is None:
        log.info("Liger kernels: off (liger-kernel is not installed; pip install 'raytune-ft[gpu]')")
        return False
    log.info("Liger kernels: on (GPU present)")
    return True


def _validation_blocks(recipe: Recipe, log: WorkerLog) -> list:
    """The whole validation set as blocks (every rank evaluates all of it), when the recipe evaluates."""
    if not recipe.train.eval_every:
        return []
    blocks = list(worker_blocks(recipe, counters=DataCounters(), split="validation"))
    if not blocks:
        raise RuntimeError("the validation split produced no blocks: nothing to evaluate on")
    log.info(f"validation: {len(blocks)} blocks of {recipe.data.seq_len} tokens (every rank "
             "evaluates all of them)")
    return blocks


def _peft_config(recipe: Recipe):
    t = recipe.train
    if not t.lora_r:
        return None
    from peft import LoraConfig

    return LoraConfig(r=t.lora_r, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                      target_modules=list(t.lora_target_modules) or "all-linear", task_type="CAUSAL_LM")


def _sft_config(recipe: Recipe, out_dir: str, max_steps: int, *, on_gpu: bool, bf16: bool, liger: bool):
    """The SFTConfig of the recipe: its optimizer, schedule, logging, eval and save settings."""
    from trl import SFTConfig

    t = recipe.train
    eval_steps = t.eval_every or None
    return SFTConfig(
        output_dir=out_dir, max_steps=max_steps, num_train_epochs=t.epochs,
        per_device_train_batch_size=t.micro_batch_size, per_device_eval_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum, learning_rate=t.lr, weight_decay=t.weight_decay,
        # Hugging Face reads 0 as no clipping; the schedule is the recipe's own (trainer.recipe_scheduler)
        adam_beta1=t.betas[0], adam_beta2=t.betas[1], max_grad_norm=t.max_grad_norm or 0.0,
        warmup_steps=t.warmup_steps,
        logging_steps=t.log_every, eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps,
        save_strategy="steps", save_steps=t.checkpoint_every, save_total_limit=t.keep_checkpoints,
        load_best_model_at_end=t.load_best_at_end, metric_for_best_model="eval_loss" if eval_steps else None,
        greater_is_better=False if eval_steps else None,
        bf16=bf16, use_cpu=not on_gpu,
        gradient_checkpointing=t.gradient_checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
        use_liger_kernel=liger, seed=t.seed, report_to="none", disable_tqdm=True,
        remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True}, packing=False,
        padding_free=False, max_length=None, dataloader_num_workers=0, ignore_data_skip=True,
        ddp_find_unused_parameters=False, save_only_model=False,
    )
