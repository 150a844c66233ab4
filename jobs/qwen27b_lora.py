"""Qwen3.8-27B LoRA SFT on UltraChat 200k on one GPU: the FSDP2 loop with a frozen bf16 base.

Adapters (r 16, alpha 32, no dropout) on every linear of both layer kinds: the full-attention layers'
q/k/v/o, the gated-delta-net layers' in_proj_qkv/in_proj_z/in_proj_b/in_proj_a/out_proj and every MLP's
gate/up/down. 32,768-token packed blocks, loss on assistant tokens only, no attention across packed
conversations, full activation checkpointing, torch.compile; AdamW lr 2e-4 on the adapters only. At the
end the PEFT adapter is saved (adapter/, under the base checkpoint's own module names) and merged into the
base in the base's own layout (hf/, a Qwen3_5ForConditionalGeneration with its vision tower), and the
merged model is registered, the version naming the base and its revision.

    ray job submit --working-dir . -- python jobs/qwen27b_lora.py
    python jobs/qwen27b_lora.py --local        # tiny qwen3_5 model on local Ray, CPU
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
LORA_R, LORA_ALPHA = 16, 32
CHECKPOINT_EVERY = 200
# held-out loss at each checkpoint on UltraChat's own test split, and 2 answers beside the base model's
EVAL_SPLIT, EVAL_ROWS = "test_sft", 200
SAMPLE_PROMPTS, SAMPLE_MAX_NEW_TOKENS = 2, 128
TEMPLATE_KWARGS = {"enable_thinking": True, "reasoning_effort": "xhigh"}   # as jobs/qwen27b_b300.py


def recipe() -> Recipe:
    """Qwen3.8-27B LoRA on UltraChat 200k, FSDP2 loop, one GPU (an H200's 141 GB)."""
    return Recipe(
        job="qwen27b_lora",
        model=ModelConfig(name=MODEL, revision=MODEL_REVISION, family="qwen3_5", dtype="bfloat16",
                          max_position_embeddings=262_144),
        data=DataConfig(source=DATASET, revision=DATASET_REVISION, split="train_sft", seq_len=SEQ_LEN,
                        template_kwargs=TEMPLATE_KWARGS, validation_split=EVAL_SPLIT,
                        validation_max_rows=EVAL_ROWS),
        train=TrainConfig(loop="fsdp2", lr=2e-4, betas=(0.9, 0.95), weight_decay=0.0, warmup_steps=0,
                          schedule="constant", epochs=1, micro_batch_size=1, grad_accum=1,
                          activation_checkpointing="auto", log_every=100, checkpoint_every=CHECKPOINT_EVERY,
                          eval_every=CHECKPOINT_EVERY, sample_prompts=SAMPLE_PROMPTS,
                          sample_max_new_tokens=SAMPLE_MAX_NEW_TOKENS, compile=True, lora_r=LORA_R,
                          lora_alpha=LORA_ALPHA, lora_dropout=0.0, merge_adapter=True),
        scaling=ScalingConfig(num_workers=1, use_gpu=True, gpus_per_node=8, cpus_per_worker=8,
                              accelerator_type=None),
        tracking=TrackingConfig(run_name="qwen27b-ultrachat-lora", experiment="raytune_ft"),
        registry=RegistryConfig(name="main.default.qwen27b_ultrachat_lora"),
    )


def local(r: Recipe) -> Recipe:
    """The same recipe on local Ray on CPU: tiny qwen3_5 model, generated chat data, 2 gloo workers."""
    on_local_cpu(r, workers=2, rows=600, seq_len=512, run_name="qwen27b-lora-local",
                 registry_name="main.default.qwen27b_lora_local")
    r.train.lr = 3e-2
    r.train.warmup_steps = 2
    r.train.schedule = "cosine"
    r.train.max_steps = 20
    r.train.log_every = 5
    r.train.checkpoint_every = 10
    r.train.eval_every = 10
    r.data.validation_max_rows = 64
    r.train.sample_prompts = 2
    r.train.sample_max_new_tokens = 24
    return r


def main(argv=None) -> int:
    return job_main(recipe, local, argv, prog="jobs/qwen27b_lora.py")


if __name__ == "__main__":
    sys.exit(main())
