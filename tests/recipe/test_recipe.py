"""Recipe validation: every bad recipe fails before Ray starts, with a message that names the field."""
from __future__ import annotations

import subprocess
import sys

import pytest

from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, recipe_from_dict, validate
from tests.conftest import REPO

BAD = [
    # (override, expected words in the message)
    ("train.lr=-1", "train.lr"),
    ("train.lr=0", "train.lr"),
    ("train.lr=abc", "train.lr: 'abc' is not a number"),
    ("train.lr=2", "train.lr"),
    ("train.betas=0.9,1.5", "train.betas[1]"),
    ("train.betas=0.9", "train.betas: expected a list"),
    ("train.betas=0.9,0.95,0.99", "train.betas: expected 2 values"),
    ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.warmup_steps=-5", "train.warmup_steps"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("train.grad_accum=0", "train.grad_accum"),
    ("train.loop=deepspeed", "train.loop: 'deepspeed' is not one of"),
    ("train.activation_checkpointing=some", "train.activation_checkpointing"),
    ("train.master_weights=fp8", "train.master_weights"),
    ("train.load_best_at_end=true", "train.load_best_at_end"),
    ("data.sources=[{\"source\": \"builtin:chat\", \"weight\": 0}]", "data.sources[0].weight"),
    ("data.sources=[{\"source\": \"builtin:chat\", \"wieght\": 2}]", "data.sources[0].wieght: unknown key"),
    ("data.roles.speaker=[bot]", "data.roles.speaker: not a chat role"),
    ("data.fields.dialog=messages", "data.fields.dialog: not a field"),
    ("data.mixture=nope", "data.mixture: 'nope' is not one of this job's mixtures"),
    ("train.nonsense=1", "train.nonsense: unknown field 'nonsense' of train"),
    ("trainer.lr=1", "trainer.lr: unknown section 'trainer'"),
    ("lr=1", "expected section.field"),
    ("train.lr", "expected section.field=value"),
    ("data.seq_len=8", "data.seq_len"),
    ("data.seq_len=300000", "data.seq_len: 300000 exceeds the model context"),
    ("data.validation_fraction=0.9", "data.validation_fraction"),
    ("data.source=/no/such/file.jsonl", "data.source: '/no/such/file.jsonl' does not exist"),
    ("data.source=", "data.source: must not be empty"),
    ("data.max_rows=0", "data.max_rows"),
    ("data.schema=openai", "data.schema: 'openai' is not one of"),
    ("data.overlong=truncate", "data.overlong"),
    ("data.num_cpus_per_op=0", "data.num_cpus_per_op"),
    ("data.tokenize_workers=0", "data.tokenize_workers: 0 is out of range"),
    ("model.family=llama", "model.family: 'llama' is not one of"),
    ("model.name=", "model.name: must not be empty"),
    ("model.dtype=float16", "model.dtype"),
    ("model.chat_template=/no/template.jinja", "model.chat_template"),
    ("model.trust_remote_code=maybe", "model.trust_remote_code: 'maybe' is not a boolean"),
    ("scaling.num_workers=0", "scaling.num_workers"),
    ("scaling.num_workers=12", "scaling.num_workers: 12 workers do not fill whole nodes"),
    ("scaling.num_workers=two", "scaling.num_workers: 'two' is not an integer"),
    ("scaling.placement_strategy=RANDOM", "scaling.placement_strategy"),
    ("scaling.cpus_per_worker=0", "scaling.cpus_per_worker"),
    ("scaling.max_failures=-2", "scaling.max_failures"),
    ("scaling.resources_per_worker={\"memory\": -1}", "scaling.resources_per_worker.memory"),
    ("tracking.run_name=my run", "tracking.run_name"),
    ("tracking.storage_path=", "tracking.storage_path: must not be empty"),
    ("tracking.tracking_uri=ftp://x", "tracking.tracking_uri"),
    ("registry.name=model", "registry.name: 'model' is not a three-level"),
    ("registry.name=main.default", "registry.name"),
    ("registry.name=main.default.my model", "registry.name"),
    ("registry.name=a.b.c.d", "registry.name"),
    ("registry.registry_uri=s3://bucket", "registry.registry_uri"),
    ("registry.timeout_s=0", "registry.timeout_s"),
]


def base() -> Recipe:
    r = Recipe()
    r.model.max_position_embeddings = 262_144
    return r


@pytest.mark.parametrize("override,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_recipe_names_the_field(override, expected):
    with pytest.raises(RecipeError) as err:
        validate(apply_overrides(base(), [override]))
    assert expected in str(err.value)


@pytest.mark.parametrize("override,expected", [
    ("train.lora_target_modules=q_proj,qkv", "train.lora_target_modules: ['qkv'] (allowed: q_proj"),
    ("train.lora_alpha=0", "train.lora_alpha: 0 is out of range"),
    ("train.lora_lr_multiplier=10", "train.lora_lr_multiplier: the TRL loop's")])
def test_fsdp2_lora_settings_are_checked(override, expected):
    """LoRA in the FSDP2 loop takes the TRL recipe's fields; a target that no Qwen3.5 linear has fails early."""
    ok = validate(apply_overrides(base(), ["train.lora_r=16"]))
    assert ok.train.loop == "fsdp2" and ok.train.lora_r == 16
    with pytest.raises(RecipeError) as err:
        validate(apply_overrides(base(), ["train.lora_r=16", override]))
    assert expected in str(err.value)


def test_nccl_on_cpu_rejected():
    with pytest.raises(RecipeError, match="scaling.backend"):
        validate(apply_overrides(base(), ["scaling.use_gpu=false", "scaling.backend=nccl"]))


def test_good_overrides_apply_and_round_trip():
    r = validate(apply_overrides(base(), ["train.lr=2e-5", "scaling.num_workers=16", "train.betas=0.9,0.99",
                                          "data.max_rows=none", "train.lora_target_modules=q_proj,v_proj"]))
    assert r.train.lr == 2e-5 and r.scaling.num_workers == 16 and r.train.betas == (0.9, 0.99)
    assert r.train.lora_target_modules == ["q_proj", "v_proj"]
    again = recipe_from_dict(r.to_dict())
    assert again == r


def test_dry_run_prints_resolved_recipe_and_bad_recipe_exits_before_ray():
    job = str(REPO / "jobs" / "qwen27b_b300.py")
    out = subprocess.run([sys.executable, job, "--dry-run", "--set", "scaling.num_workers=16"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"num_workers": 16' in out.stdout and "Qwen/Qwen3.8-27B" in out.stdout
    bad = subprocess.run([sys.executable, job, "--local", "--set", "registry.name=nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "registry.name" in bad.stderr and "ray" not in bad.stdout.lower()


def test_evaluation_without_a_named_split_holds_out_five_percent():
    """With no held-out split, evaluation holds out 5% by content hash (data.validation_fraction=None); set to
    0, evaluation has no data and the recipe says so."""
    r = validate(apply_overrides(base(), ["train.eval_every=10"]))
    assert r.data.validation_fraction == 0.05
    assert validate(apply_overrides(base(), [])).data.validation_fraction == 0.0
    with pytest.raises(RecipeError, match="train.eval_every: no validation data"):
        validate(apply_overrides(base(), ["train.eval_every=10", "data.validation_fraction=0"]))
