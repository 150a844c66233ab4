"""Qwen3.8-27B full SFT on UltraChat 200k: one pass, one 8xB300 node, plain PyTorch FSDP2.

32,768-token packed blocks per GPU, loss on assistant tokens only, no attention across packed
conversations; AdamW lr 1e-5, betas 0.9/0.95, no weight decay; loss logged every 100 steps.

    ray job submit --working-dir . -- python jobs/qwen27b_b300.py
    python jobs/qwen27b_b300.py --local        # tiny qwen3_5 model on local Ray, CPU
    python jobs/qwen27b_b300.py --set data.mixture=ultrachat_capybara    # UltraChat and Capybara mixed
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from raytune_ft.cli import job_main  # noqa: E402
from raytune_ft.recipe.recipe import (  # noqa: E402
    on_local_cpu, DataConfig, ModelConfig, RegistryConfig, Recipe, ScalingConfig, TrackingConfig, TrainConfig)

MODEL = "Qwen/Qwen3.8-27B"
MODEL_REVISION = "1d4bf0f2ff6012fd82039f2fa52739d0dd7c60c0"
DATASET = "hf://HuggingFaceH4/ultrachat_200k"
DATASET_REVISION = "8049631c405ae6576f93f445c6b8166f76f5505a"
SEQ_LEN = 32_768
NUM_GPUS = 8
CHECKPOINT_EVERY = 200
# Held-out loss at every checkpoint on the first 1,000 conversations of UltraChat's own test split, and
# 4 of them answered greedily (up to 128 tokens) beside the base model's answers: `raytune-ft plan` states
# what both cost.
EVAL_SPLIT, EVAL_ROWS = "test_sft", 1000
SAMPLE_PROMPTS, SAMPLE_MAX_NEW_TOKENS = 4, 128
# The UltraChat/Capybara mixture, off by default (--set data.mixture=ultrachat_capybara): every UltraChat
# train_sft row once (weight 1) and every trl-lib/Capybara train row twice (weight 2: its multi-turn
# conversations, about 13% of the mixed rows), interleaved by data.seed; held out: each one's own test split.
MIXTURES = {"ultrachat_capybara": [
    {"name": "ultrachat", "source": DATASET, "revision": DATASET_REVISION, "split": "train_sft",
     "validation_split": EVAL_SPLIT, "weight": 1.0},
    {"name": "capybara", "source": "hf://trl-lib/Capybara", "split": "train", "validation_split": "test",
     "weight": 2.0},
]}
# The Qwen3.8 template's own defaults, as the notebook renders UltraChat: a system text on reasoning
# effort in every row (not supervised) and an empty think block before each answer (supervised).
# README "Chat template settings" shows a rendered row and how to change it.
TEMPLATE_KWARGS = {"enable_thinking": True, "reasoning_effort": "xhigh"}


def recipe() -> Recipe:
    """Qwen3.8-27B full SFT on UltraChat 200k, FSDP2 over 8 GPUs."""
    return Recipe(
        job="qwen27b_b300",
        model=ModelConfig(name=MODEL, revision=MODEL_REVISION, family="qwen3_5", dtype="bfloat16",
                          max_position_embeddings=262_144),
        data=DataConfig(source=DATASET, revision=DATASET_REVISION, split="train_sft", seq_len=SEQ_LEN,
                        template_kwargs=TEMPLATE_KWARGS, validation_split=EVAL_SPLIT,
                        validation_max_rows=EVAL_ROWS, mixtures=MIXTURES),
        train=TrainConfig(loop="fsdp2", lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, warmup_steps=0,
                          schedule="constant", epochs=1, micro_batch_size=1, grad_accum=1,
                          activation_checkpointing="auto", master_weights="fp32", log_every=100,
                          checkpoint_every=CHECKPOINT_EVERY, eval_every=CHECKPOINT_EVERY,
                          sample_prompts=SAMPLE_PROMPTS, sample_max_new_tokens=SAMPLE_MAX_NEW_TOKENS, compile=True),
        scaling=ScalingConfig(num_workers=NUM_GPUS, use_gpu=True, gpus_per_node=8, cpus_per_worker=8,
                              accelerator_type=None),
        tracking=TrackingConfig(run_name="qwen27b-ultrachat", experiment="raytune_ft"),
        registry=RegistryConfig(name="main.default.qwen27b_ultrachat"),
    )


def local(r: Recipe) -> Recipe:
    """The same recipe on local Ray on CPU: tiny qwen3_5 model, generated chat data, 2 gloo workers."""
    on_local_cpu(r, workers=2, rows=600, seq_len=512, run_name="qwen27b-local",
                 registry_name="main.default.qwen27b_local")
    r.train.lr = 3e-3
    r.train.warmup_steps = 2
    r.train.schedule = "cosine"
    r.train.max_steps = 20
    r.train.log_every = 5
    r.train.checkpoint_every = 10
    r.train.eval_every = 10
    r.data.validation_max_rows = 64    # of the generated chat's own held-out rows
    r.data.mixtures = {}               # the hub's: a local file mixture is data.sources (README)
    r.train.sample_prompts = 2         # a newcomer sees two answers grow in MLflow's samples.json table
    r.train.sample_max_new_tokens = 24
    return r


def main(argv=None) -> int:
    return job_main(recipe, local, argv, prog="jobs/qwen27b_b300.py")


if __name__ == "__main__":
    sys.exit(main())
