"""Qwen3-4B full SFT on Capybara with the TRL SFTTrainer inside Ray Train, one H100.

90/10 train/validation split (seed 42); bf16, gradient checkpointing, batch 1 x accumulation 8,
AdamW lr 2e-5 (linear decay after 10 warmup steps), weight decay 0.01, 50 steps; evaluate and save
every 25 steps, keep 2, load the best (lowest eval loss) at the end; log every 10 steps; Liger kernels
where a GPU is present (not in the notebook: same results, less memory, faster). The final checkpoint
(model + tokenizer) is registered as `llm/v1/chat`.

    ray job submit --working-dir . -- python jobs/qwen3_4b_full.py
    python jobs/qwen3_4b_full.py --local        # tiny qwen3 model on local Ray, CPU
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytune_ft.cli import job_main  # noqa: E402
from raytune_ft.recipe.recipe import (  # noqa: E402
    on_local_cpu, DataConfig, ModelConfig, RegistryConfig, Recipe, ScalingConfig, TrackingConfig, TrainConfig)

MODEL = "Qwen/Qwen3-4B"
DATASET = "hf://trl-lib/Capybara"
SEQ_LEN = 4096          # packed block per micro-batch: Capybara conversations are mostly under 2k tokens
NUM_GPUS = 1


def recipe() -> Recipe:
    """Qwen3-4B full SFT on Capybara (90/10 split), TRL SFTTrainer on one GPU."""
    return Recipe(
        job="qwen3_4b_full",
        model=ModelConfig(name=MODEL, family="qwen3", dtype="bfloat16"),
        data=DataConfig(source=DATASET, split="train", validation_fraction=0.1, seed=42, seq_len=SEQ_LEN),
        train=TrainConfig(loop="trl", lr=2e-5, betas=(0.9, 0.999), weight_decay=0.01, warmup_steps=10,
                          schedule="linear", max_steps=50, micro_batch_size=1, grad_accum=8,
                          gradient_checkpointing=True, log_every=10, eval_every=25, checkpoint_every=25,
                          keep_checkpoints=2, load_best_at_end=True, use_liger=True,
                          # as the notebook: bf16 weights (fp32 master weights do not fit an H100:
                          # `raytune-ft plan` shows the budget)
                          master_weights="bf16"),
        scaling=ScalingConfig(num_workers=NUM_GPUS, use_gpu=True, gpus_per_node=1, cpus_per_worker=8),
        tracking=TrackingConfig(run_name="qwen3-4b-capybara-full", experiment="raytune_ft"),
        registry=RegistryConfig(name="main.default.qwen3_4b_capybara"),
    )


def local(r: Recipe) -> Recipe:
    """The same recipe on local Ray on CPU: tiny qwen3 model, generated chat data, one CPU worker."""
    on_local_cpu(r, workers=1, rows=200, seq_len=512, run_name="qwen3-4b-full-local",
                 registry_name="main.default.qwen3_4b_full_local")
    r.train.lr = 3e-3
    r.train.warmup_steps = 2
    r.train.max_steps = 8
    r.train.grad_accum = 2
    r.train.log_every = 2
    r.train.eval_every = 4
    r.train.checkpoint_every = 4
    return r


def main(argv=None) -> int:
    return job_main(recipe, local, argv, prog="jobs/qwen3_4b_full.py")


if __name__ == "__main__":
    sys.exit(main())
