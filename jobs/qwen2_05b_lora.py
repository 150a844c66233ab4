"""Qwen2-0.5B LoRA SFT on Capybara with the TRL SFTTrainer inside Ray Train, 8 GPUs data parallel.

PEFT LoRA r 8, alpha 32, dropout 0.1 on q/k/v/o/gate/up/down; AdamW lr 1e-4 x 10 on the LoRA
parameters (1e-3), linear decay after 50 warmup steps, weight decay 0.01; batch 8 x accumulation 4 per
GPU, one epoch; evaluate (on Capybara's test split) and save every 100 steps, log every 25; Liger
kernels where a GPU is present; gradient checkpointing. At the end the adapter and tokenizer are saved,
the adapter is merged into the base and the merged model is registered.

    ray job submit --working-dir . -- python jobs/qwen2_05b_lora.py
    python jobs/qwen2_05b_lora.py --local       # tiny qwen2 model on local Ray, 2 CPU workers
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytune_ft.cli import job_main  # noqa: E402
from raytune_ft.recipe.recipe import (  # noqa: E402
    on_local_cpu, DataConfig, ModelConfig, RegistryConfig, Recipe, ScalingConfig, TrackingConfig, TrainConfig)

MODEL = "Qwen/Qwen2-0.5B"
DATASET = "hf://trl-lib/Capybara"
SEQ_LEN = 2048          # tokens per packed block; 8 blocks per micro-batch
NUM_GPUS = 8
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def recipe() -> Recipe:
    """Qwen2-0.5B LoRA SFT on Capybara, TRL SFTTrainer + PEFT + Liger, 8 GPUs data parallel."""
    return Recipe(
        job="qwen2_05b_lora",
        model=ModelConfig(name=MODEL, family="qwen2", dtype="bfloat16"),
        data=DataConfig(source=DATASET, split="train", validation_split="test", seq_len=SEQ_LEN),
        train=TrainConfig(loop="trl", lr=1e-4, lora_lr_multiplier=10, betas=(0.9, 0.999), weight_decay=0.01,
                          warmup_steps=50, schedule="linear", epochs=1, max_steps=None, micro_batch_size=8,
                          grad_accum=4, gradient_checkpointing=True, log_every=25, eval_every=100,
                          checkpoint_every=100, keep_checkpoints=2, lora_r=8, lora_alpha=32, lora_dropout=0.1,
                          lora_target_modules=list(LORA_TARGETS), use_liger=True, merge_adapter=True),
        scaling=ScalingConfig(num_workers=NUM_GPUS, use_gpu=True, gpus_per_node=8, cpus_per_worker=4),
        tracking=TrackingConfig(run_name="qwen2-05b-capybara-lora", experiment="raytune_ft"),
        registry=RegistryConfig(name="main.default.qwen2_05b_capybara_lora"),
    )


def local(r: Recipe) -> Recipe:
    """The same recipe on local Ray on CPU: tiny qwen2 model, generated chat data, 2 gloo workers.
    Liger stays requested: the loop switches it off where there is no GPU and says so."""
    on_local_cpu(r, workers=2, rows=240, seq_len=256, run_name="qwen2-05b-lora-local",
                 registry_name="main.default.qwen2_05b_lora_local")
    r.data.validation_split = None
    r.data.validation_fraction = 0.1
    r.train.lr = 1e-3
    r.train.warmup_steps = 2
    r.train.max_steps = 6
    r.train.micro_batch_size = 1
    r.train.grad_accum = 2
    r.train.log_every = 2
    r.train.eval_every = 3
    r.train.checkpoint_every = 3
    return r


def main(argv=None) -> int:
    return job_main(recipe, local, argv, prog="jobs/qwen2_05b_lora.py")


if __name__ == "__main__":
    sys.exit(main())
