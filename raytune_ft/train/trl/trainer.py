"""The SFTTrainer subclass that reads pre-packed blocks (the callback that logs and reports to Ray: report.py).

The class is built by a function so that importing this module does not import TRL or transformers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from raytune_ft import compat
from raytune_ft.recipe.recipe import Recipe, TrainConfig
from raytune_ft.train.batch import collate_blocks
from raytune_ft.train.ckpt_storage import SaveGuard
from raytune_ft.train.common import lr_at
from raytune_ft.train.trl.base import Paused, not_training
from raytune_ft.train.trl.checkpoint import fetch_best, has_weights
from raytune_ft.train.trl.data import RankBlocks


@dataclass(frozen=True)
class TrainerParts:
    """What the TRL loop hands its SFTTrainer besides Hugging Face's own arguments: the recipe, this rank's
    training blocks and the validation blocks, the seconds spent evaluating and saving (not training), the
    list each optimizer step's (step, this rank's loss, grad norm, LR) goes to until the callback logs it,
    the save guard made for the trainer's model (its trainable parameters are known once PEFT wrapped it),
    and where rank 0 fetches a best checkpoint of an earlier attempt from (trl.checkpoint.point_at_best)."""

    recipe: Recipe
    train_blocks: RankBlocks
    eval_blocks: list
    pause: Paused
    steps: list
    guard_for: Callable[[torch.nn.Module], SaveGuard]
    best_source: str | None = None


def trainer_class():
    from torch.utils.data import DataLoader
    from trl import SFTTrainer

    class RayBlocksSFTTrainer(SFTTrainer):
        """SFTTrainer reading pre-packed blocks: plain DataLoaders (no accelerate re-sharding: each rank's
        stream is already its own share) and AdamW with a separate LR for LoRA parameters."""

        raytune_best_loaded: int | None = None     # the step whose weights `_load_best_model` loaded
        _raytune_loss_before = None
        _raytune_step_kept = -1

        def __init__(self, parts: TrainerParts, **kwargs):
            super().__init__(**kwargs)
            self.raytune_parts = parts
            self.raytune_guard = parts.guard_for(self.model)   # room for each save checked first

        def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
            """Hugging Face's, after keeping this step's own figures for MLflow: it logs the mean of
            `logging_steps` steps, and its `tr_loss` grows by each step's loss until a log resets it."""
            step = self.state.global_step
            # also called at an epoch's end, for the same step, and for the resumed step itself when a
            # resumed attempt has nothing left to train (its loss was logged by the attempt that trained it)
            if step > max(self._raytune_step_kept, compat.TRAINER_LAST_LOGGED.read(self)):
                before = self._raytune_loss_before
                loss = tr_loss.detach().clone() if before is None else tr_loss.detach() - before
                lr = kwargs.get("learning_rate")
                lr = self._get_learning_rate() if lr is None else lr
                self.raytune_parts.steps.append((step, loss, grad_norm, lr))
                self._raytune_step_kept = step
            super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)
            self._raytune_loss_before = tr_loss.detach().clone()

        def _load_best_model(self):
            """Hugging Face's, once the best checkpoint's files are here (fetched from the run's storage
            when an earlier attempt saved it); records whether the best weights were loaded."""
            best, source = self.state.best_model_checkpoint, self.raytune_parts.best_source
            if source and not fetch_best(source, best):
                return
            if has_weights(best):
                super()._load_best_model()
                self.raytune_best_loaded = self.state.best_global_step

        def evaluate(self, *args, **kwargs):
            with not_training(self.raytune_parts.pause):
                return super().evaluate(*args, **kwargs)

        def _save_checkpoint(self, *args, **kwargs):
            save, step = super()._save_checkpoint, self.state.global_step
            with not_training(self.raytune_parts.pause):
                self.raytune_guard.check(step)
                return self.raytune_guard.write(lambda: save(*args, **kwargs), step)

        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(self.raytune_parts.train_blocks, batch_size=self.args.per_device_train_batch_size,
                              collate_fn=collate_blocks, num_workers=0)

        def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
            return DataLoader(self.raytune_parts.eval_blocks, batch_size=self.args.per_device_eval_batch_size,
                              collate_fn=collate_blocks, shuffle=False, num_workers=0)

        def create_scheduler(self, num_training_steps: int, optimizer=None):
            """The recipe's schedule (`lr_at`, as the FSDP2 loop), not Hugging Face's own: warmup, then
            decay to `train.min_lr_ratio` on the last step, for every schedule."""
            if self.lr_scheduler is None:
                self.lr_scheduler = recipe_scheduler(optimizer or self.optimizer, self.raytune_parts.recipe.train,
                                                     num_training_steps)
                compat.TRAINER_SCHEDULER_CREATED.write(self, True)
            return self.lr_scheduler

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = recipe_optimizer(self.model, self.raytune_parts.recipe.train,
                                                  set(self.get_decay_parameter_names(self.model)),
                                                  fused=self.args.device.type == "cuda")
            return self.optimizer

    return compat.check_trainer_internals(RayBlocksSFTTrainer)


def recipe_optimizer(model: torch.nn.Module, t: TrainConfig, decay: set[str], *, fused: bool) -> torch.optim.AdamW:
    """AdamW over `model`'s trainable parameters, grouped by LR (LoRA's x `train.lora_lr_multiplier`) and
    weight decay (`decay`: the names Hugging Face decays)."""
    groups: dict[tuple[float, float], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lr = t.lr * (t.lora_lr_multiplier if "lora_" in name else 1.0)
        wd = t.weight_decay if name in decay else 0.0
        groups.setdefault((lr, wd), []).append(p)
    params = [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]
    return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), fused=fused)


def recipe_scheduler(optimizer, train: TrainConfig, total_steps: int):
    """A LambdaLR that sets each parameter group's LR to its peak x `lr_at(step)`."""
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lambda step: lr_at(step, train, total_steps))
