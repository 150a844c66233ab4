"""The memory and time plan: exact parameter counts, per-component arithmetic, verdicts, calibration."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from raytune_ft.planning.plan import GiB, memory_plan
from raytune_ft.recipe.recipe import DataConfig, ModelConfig, Recipe, ScalingConfig, TrainConfig, apply_overrides
from raytune_ft.planning.shapes import KNOWN_SHAPES, ModelShape

JOBS = Path(__file__).resolve().parents[2] / "jobs"


def job(name: str):
    spec = importlib.util.spec_from_file_location(f"_plan_job_{name}", JOBS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def meta_param_count(cfg) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- shapes

@pytest.mark.parametrize("name,layers", [("qwen3.8-27b", 8), ("qwen3-4b", 4), ("qwen2-0.5b", 4)])
def test_param_count_matches_transformers_model(name, layers):
    """The analytic count equals the parameters of the model transformers builds (meta device)."""
    from raytune_ft.models.tiny import real_config

    cfg = real_config(name, num_hidden_layers=layers)
    assert ModelShape.from_config(cfg).total_params == meta_param_count(cfg)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3", "qwen2"])
def test_param_count_matches_tiny_models(family):
    from raytune_ft.models.tiny import tiny_config

    cfg = tiny_config(family, vocab_size=300)
    assert ModelShape.from_config(cfg).total_params == meta_param_count(cfg)


@pytest.mark.parametrize("name", list(KNOWN_SHAPES))
def test_fallback_table_matches_real_configs(name):
    from raytune_ft.models.tiny import real_config

    assert KNOWN_SHAPES[name] == ModelShape.from_config(real_config(name))


def test_27b_shape_counts_gated_delta_and_attention_layers():
    s = KNOWN_SHAPES["qwen3.8-27b"]
    assert (s.n_linear_attention, s.n_full_attention) == (48, 16)
    assert s.total_params == 26_895_998_464
    # a gated-delta-net layer and an attention layer differ: both kinds are counted, not one kind x 64
    assert s.layer_params("linear_attention") != s.layer_params("full_attention")


# ---------------------------------------------------------------- the 27B recipe

def _rendered_gib(text: str) -> dict[str, float]:
    """name -> GiB from the rendered component lines (MiB lines converted)."""
    out = {}
    for m in re.finditer(r"^    (\S[\w ]*?)\s+([\d.]+) (GiB|MiB)   ", text, re.M):
        out[m.group(1)] = float(m.group(2)) / (1024 if m.group(3) == "MiB" else 1)
    return out


def test_27b_on_8_b300_fits_and_components_add_up():
    """The plan's shape on the recipe's target: its lines add up to the printed total and it fits. Its figures
    are held to measured peaks below (an 8xB300 node has not been measured: no test restates its arithmetic)."""
    plan = memory_plan(job("qwen27b_b300").recipe())
    assert plan.gpu.name == "B300" and plan.shard == 8 and plan.fits
    assert {l.name for l in plan.lines} >= {"params", "grads", "optimizer", "fsdp gathered", "activations", "loss"}
    assert plan.total_bytes == pytest.approx(sum(l.bytes for l in plan.lines))
    assert plan.total_bytes < plan.budget_bytes < 288e9
    text = plan.render()
    assert "FITS" in text and "DOES NOT FIT" not in text
    shown = _rendered_gib(text)
    total = shown.pop("total")
    assert len(shown) == len(plan.lines)
    assert sum(shown.values()) == pytest.approx(total, abs=0.01 * len(shown))   # rounding of the printed lines
    # the chunked loss: one 4,096-token chunk of fp32 logits, not 32,768 x 248,320 x 4 B = 30 GiB
    assert plan.component("loss") < 32768 * 248320 * 4


def test_27b_on_one_gpu_does_not_fit():
    plan = memory_plan(apply_overrides(job("qwen27b_b300").recipe(), ["scaling.num_workers=1"]))
    assert not plan.fits and "DOES NOT FIT" in plan.render()


def test_fsdp2_lora_plan_freezes_the_base_and_keeps_the_activations():
    """The LoRA job on one H200: the base frozen in bf16 (no grads, no optimizer states), fp32 adapters with
    their grads and AdamW states, the full fine-tune's activations, no lm_head gradient accumulator; it fits
    where the full fine-tune on one GPU does not. Two workers shard base and adapters alike."""
    # one checkpointing for both (auto would keep some layers whole where the LoRA run has the room)
    ac = "train.activation_checkpointing=full"
    full = memory_plan(apply_overrides(job("qwen27b_b300").recipe(), ["scaling.num_workers=1", ac]), gpu="H200")
    plan = memory_plan(apply_overrides(job("qwen27b_lora").recipe(), [ac]), gpu="H200")
    shape, P = plan.shape, plan.shape.total_params
    trainable = shape.lora_params(16, [])
    assert plan.trainable_params == trainable and 0 < trainable < P / 100
    assert plan.component("params") == P * 2
    assert plan.component("lora params") == plan.component("grads") == trainable * 4
    assert plan.component("optimizer") == trainable * 8
    assert plan.component("activations") == full.component("activations")
    assert full.component("loss") - plan.component("loss") == shape.vocab * shape.hidden * 4
    assert plan.fits and not full.fits
    two = memory_plan(apply_overrides(job("qwen27b_lora").recipe(), ["scaling.num_workers=2"]), gpu="H200")
    assert two.component("params") == P * 2 / 2 and two.component("optimizer") == trainable * 8 / 2
    # its checkpoints hold the adapters and their AdamW states, its final export the merged model
    from raytune_ft.planning.disk import storage_plan

    store = storage_plan(job("qwen27b_lora").recipe())
    assert [name for name, _, _ in store.parts] == ["adapter", "optimizer", "train state"]
    assert store.checkpoint_bytes < trainable * 12 + 2**20 and store.final_extra_bytes == P * 2


def test_lora_plan_counts_the_adapters_the_loop_adds():
    """The plan's adapter count is what train/lora.py wraps on the real 27B shape (cut to 4 layers, meta)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from raytune_ft.models.tiny import real_config
    from raytune_ft.train.lora import add_adapters, count_trainable

    cfg = real_config("qwen3.8-27b", num_hidden_layers=4)
    for targets in ([], ["q_proj", "in_proj_b", "in_proj_a", "down_proj"]):
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(cfg)
        add_adapters(lm, SimpleNamespace(lora_r=16, lora_alpha=32, lora_dropout=0.0, lora_target_modules=targets))
        assert count_trainable(lm) == ModelShape.from_config(cfg).lora_params(16, targets)


def test_activation_checkpointing_modes_order():
    r = job("qwen27b_b300").recipe()
    acts = {}
    for mode in ("none", "selective", "full"):
        r.train.activation_checkpointing = mode
        acts[mode] = memory_plan(r).component("activations")
    assert acts["full"] < acts["selective"] < acts["none"]


def test_27b_time_estimate_uses_ultrachat_and_the_mfu_flops():
    from raytune_ft.planning.hardware import flops_per_block
    from raytune_ft.models.tiny import real_config

    plan = memory_plan(job("qwen27b_b300").recipe())
    assert plan.tokens == pytest.approx(207_865 * 1_322)
    # FLOPs per token as hardware.py counts them for MFU, for conversations of the mean length
    per_token = flops_per_block(real_config("qwen3.8-27b"), [1322]) / 1322
    assert plan.flops_per_token == pytest.approx(per_token, rel=1e-9)
    assert plan.tokens_per_s_per_gpu == pytest.approx(0.40 * 2250e12 / per_token)
    assert plan.seconds == pytest.approx(207_865 * 1_322 / (8 * 0.40 * 2250e12 / per_token))
    assert plan.steps == -(-207_865 * 1_322 // (32_768 * 8))


# ---------------------------------------------------------------- the 4B recipe on one H100

def test_4b_on_one_h100_fp32_master_does_not_fit_bf16_does():
    """As the notebook runs it (no Liger): fp32 weights + grads + AdamW states are 16 B x 4.02 B = 60 GiB,
    plus autocast's bf16 copies, 4,096-token full logits and activations: over 80 GB less a 10% margin.
    bf16 halves the states: fits. With Liger's fused loss (the recipe's default on GPU) the logits shrink
    by 4 GiB and fp32 squeezes in under the margin (70.4 of 71.2 GiB); bf16 plans 32.9 GiB, and measured
    33.3 GiB on an H200 (bench/RESULTS.md, 2026-11-29 evening)."""
    mod = job("qwen3_4b_full")
    fp32 = memory_plan(apply_overrides(mod.recipe(), ["train.master_weights=fp32", "train.use_liger=false"]))
    bf16 = memory_plan(apply_overrides(mod.recipe(), ["train.master_weights=bf16", "train.use_liger=false"]))
    assert fp32.gpu.name == bf16.gpu.name == "H100" and fp32.n_workers == 1
    assert not fp32.fits
    assert bf16.fits
    assert fp32.component("optimizer") == 2 * bf16.component("optimizer") == 2 * 4 * 4_022_468_096
    assert fp32.total_bytes > 71 * GiB > bf16.total_bytes
    fp32_liger = memory_plan(apply_overrides(mod.recipe(), ["train.master_weights=fp32"]))
    bf16_liger = memory_plan(mod.recipe())
    assert fp32_liger.fits and fp32_liger.total_bytes > 70 * GiB          # by less than a GiB
    assert abs(bf16_liger.total_bytes / GiB - 33.3) < 0.1 * 33.3          # within 10% of the H200 peak


# ---------------------------------------------------------------- hand arithmetic

def test_formula_matches_hand_arithmetic():
    """A 2-layer qwen3-like model, FSDP2 over 2 GPUs, fp32 master weights, bf16 compute, full AC."""
    shape = ModelShape(family="qwen3", vocab=1000, hidden=64, intermediate=128,
                       layer_types=("full_attention",) * 2, heads=4, kv_heads=2, head_dim=16, tied=False)
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 + MLP 3x64x128 + 2 norms x 64 + q/k norms 2 x 16
    layer = 4096 + 2048 + 2048 + 4096 + 24576 + 128 + 32
    assert shape.layer_params("full_attention") == layer == 37_024
    P = 2 * layer + 2 * 64_000 + 64                      # + embeddings, lm_head, final norm
    assert shape.total_params == P == 202_112
    recipe = Recipe(job="hand", model=ModelConfig(name="hand"), data=DataConfig(source="builtin:chat", seq_len=64),
                    train=TrainConfig(loop="fsdp2", master_weights="fp32", activation_checkpointing="full"),
                    scaling=ScalingConfig(num_workers=2, gpus_per_node=2, accelerator_type="H100"))
    plan = memory_plan(recipe, shape=shape)
    assert plan.component("params") == P * 4 / 2
    assert plan.component("grads") == P * 4 / 2
    assert plan.component("optimizer") == P * 8 / 2
    # root unit (128,064) + 2 layers gathered in bf16, one layer's fp32 grads
    assert plan.component("fsdp gathered") == (128_064 + 2 * layer) * 2 + layer * 4
    # full AC: 2 layer inputs of 64 + one layer recomputed: 4h + 4I + 3q + 3kv = 256 + 512 + 192 + 96
    assert plan.component("activations") == (2 * 64 + 1056) * 64 * 2
    # chunk of 64 tokens x 1000 vocab x (fp32 + bf16) + fp32 lm_head grad + hidden and its grad in bf16
    # chunk of 64 tokens x 1000 vocab x (fp32 + bf16), less what it shares with the recomputed layer (freed
    # before the first recompute), + fp32 lm_head grad + hidden and its grad in bf16
    assert plan.component("loss") == 64 * 1000 * 6 - 1056 * 64 * 2 + 1000 * 64 * 4 + 2 * 64 * 64 * 2
    assert plan.total_bytes == 404_224 * 4 + 552_320 + 151_552 + 521_216
    # FLOPs/token: 6 x (P - input embedding) + 6 x layers x heads x head_dim x mean length (seq_len 64 here)
    assert plan.flops_per_token == 6 * (P - 64_000) + 6 * 2 * 4 * 16 * 64


# ---------------------------------------------------------------- calibration against measured peaks

@pytest.mark.parametrize("name,layers,seq,measured_gib", [
    ("qwen3-4b", None, 1024, 32.7),       # TRL SFTTrainer, batch 1, max_length 1024 (../shared/GPU.md)
    ("qwen3-4b", None, 16384, 59.1),      # the seed loop: bf16 params, grad ckpt, unfused loss
    ("qwen3.8-27b", 16, 16384, 109.6),    # the seed loop on the 27B shape cut to 16 layers
])
def test_plan_within_10_percent_of_measured_h200_peaks(name, layers, seq, measured_gib):
    """Peaks measured on an H200 (torch.cuda.max_memory_allocated), all bf16 weights, one GPU, an
    unfused loss: the TRL-loop model of the plan (full logits) describes these runs."""
    from raytune_ft.models.tiny import real_config

    cfg = real_config(name, num_hidden_layers=layers) if layers else real_config(name)
    recipe = Recipe(job="calib", model=ModelConfig(name=name), data=DataConfig(source="builtin:chat", seq_len=seq),
                    train=TrainConfig(loop="trl", master_weights="bf16", gradient_checkpointing=True),
                    scaling=ScalingConfig(num_workers=1, gpus_per_node=1))
    plan = memory_plan(recipe, gpu="H200", shape=ModelShape.from_config(cfg))
    assert plan.total_bytes / GiB == pytest.approx(measured_gib, rel=0.10)


def test_local_tiny_plan_on_cpu():
    mod = job("qwen27b_b300")
    plan = memory_plan(mod.local(mod.recipe()))
    assert plan.gpu is None and plan.shape.hidden == 64 and plan.shape.n_layers == 4
    text = plan.render()
    assert "CPU worker" in text and "not estimated on CPU" in text


# the 27B at its real depth: `python -m bench gpu shape --steps 10` (bench/shape.py), the FSDP2 loop's own path
# as rank 0 of 8 on torch's fake process group, one NVIDIA H100 80GB HBM3, 2026-12-06; torch 2.11.0+cu130,
# transformers 5.17.0, triton 3.6.0, fla 0.6.0, tilelang 0.1.15 (bench/RESULTS.md)
MEASURED_64_LAYERS_H100 = {"ranks": 8, "seq": 32768, "master": "bf16", "checkpointing": "full", "peak_gib": 64.16}


def test_plan_within_10_percent_of_the_64_layer_fsdp2_peak():
    """The shipped recipe does not fit one H100 as rank 0 of 8 with fp32 master weights (plan 93 GiB); the
    closest setting that does, bf16 master weights, peaked at 64.16 GiB (torch.cuda.max_memory_allocated)."""
    m = MEASURED_64_LAYERS_H100
    recipe = apply_overrides(job("qwen27b_b300").recipe(), [f"scaling.num_workers={m['ranks']}",
                                                          f"train.master_weights={m['master']}",
                                                          f"train.activation_checkpointing={m['checkpointing']}"])
    plan = memory_plan(recipe, gpu="H100")
    assert plan.shape.n_layers == 64 and recipe.data.seq_len == m["seq"]
    assert plan.total_bytes / GiB == pytest.approx(m["peak_gib"], rel=0.10)
    assert plan.total_bytes / GiB >= m["peak_gib"]           # still an upper estimate
    shipped = memory_plan(job("qwen27b_b300").recipe(), gpu="H100")
    assert not shipped.fits


def test_float8_plan_within_10_percent_over_the_64_layer_fsdp2_peak():
    """Issue 60: the same rank with float8 tensorwise matmuls (raytune_ft/planning/data/measured.json, one H100,
    2026-12-07) peaked at 63.82 GiB, under the bf16 run of its call (64.16). The plan it ran beside (70.55) was
    10.5% over it: its float8 line counted the casts but not that FSDP2 all-gathers the converted weights in
    float8, so the 2 unsharded layers hold them in 1 byte, not 2. With that subtracted the plan is within 10%."""
    from raytune_ft.planning.measured import figure

    fig = figure("shape_64_fp8")
    m, peak = fig["setting"], fig["values"]["peak_gib"]
    recipe = apply_overrides(job("qwen27b_b300").recipe(), [
        f"scaling.num_workers={m['ranks']}", f"train.master_weights={m['master']}", "train.precision=fp8",
        "train.activation_checkpointing=auto"])
    plan = memory_plan(recipe, gpu="H100")
    assert plan.checkpointing == "full" and recipe.data.seq_len == m["seq"]      # what auto chose in the run
    before = (plan.total_bytes + _float8_gather_saving(plan.shape)) / GiB
    assert before == pytest.approx(fig["values"]["plan_gib"], abs=0.01)      # the plan it ran beside
    assert before != pytest.approx(peak, rel=0.10)
    assert plan.total_bytes / GiB >= peak
    assert plan.total_bytes / GiB == pytest.approx(peak, rel=0.10)


def _float8_gather_saving(shape: ModelShape) -> int:
    """Bytes FSDP2's float8 all-gather saves in the 2 unsharded layers: one byte of each converted weight."""
    from raytune_ft.planning.shapes import fp8_linear_filter_dims

    return 2 * max(sum(i * o for i, o in shape.linears(k).values() if fp8_linear_filter_dims(i, o))
                   for k in set(shape.layer_types))


# the same rank under context parallelism, one conversation a block, full recompute, bf16 master weights: `python -m
# bench gpu shape --layers 64 --cp 8 --seq N --whole --steps 2 --warm 1 --ckpt off --master bf16 --set
# train.activation_checkpointing=full`, one H100, 2026-12-07 (bench/RESULTS.md, g17 and g18): 54.01 GiB at 65,536
# tokens, 59.48 at 131,072. Without the CP allowance the plan was 8-10% UNDER both; the allowance (80 MiB a layer) was
# fitted on the 65,536 peak and is checked here on the 131,072 one, which it was not chosen on.
def _cp_runs() -> list[tuple[str, dict]]:
    from raytune_ft.planning.measured import figure

    fig = figure("cp_allowance")
    return [("fitted", r) for r in fig["fitted_on"][-1:]] + [("checked", r) for r in fig["checked_on"]]


@pytest.mark.parametrize("role,run", _cp_runs(), ids=lambda x: x if isinstance(x, str) else str(x["seq"]))
def test_plan_within_10_percent_over_the_64_layer_peaks_under_context_parallelism(role, run):
    recipe = apply_overrides(job("qwen27b_b300").recipe(), [
        "scaling.num_workers=8", f"scaling.context_parallel={run['cp']}", f"data.seq_len={run['seq']}",
        "train.master_weights=bf16", f"train.activation_checkpointing={run['checkpointing']}"])
    plan = memory_plan(recipe, gpu="H100")
    peak, without = run["values"]["peak_gib"], plan.total_bytes - plan.component("context-parallel allowance")
    assert plan.shape.n_layers == run["layers"] and any(line.name == "context-parallel exchange" for line in plan.lines)
    assert without / GiB == pytest.approx(run["values"]["plan_gib"], abs=0.01)     # the plan it ran beside
    assert plan.total_bytes / GiB >= peak
    assert plan.total_bytes / GiB == pytest.approx(peak, rel=0.10)


def test_auto_at_131072_tokens_on_an_h100_does_not_pick_the_setting_that_ran_out_of_memory():
    """g17: `auto` chose keep:3 for 131,072 tokens at CP 8 (plan 70.3 GiB) and the second step ran out of memory
    (65.5 GiB allocated, 75.9 reserved). With the CP allowance the plan puts keep:3 over the budget."""
    recipe = apply_overrides(job("qwen27b_b300").recipe(), [
        "scaling.num_workers=8", "scaling.context_parallel=8", "data.seq_len=131072", "train.master_weights=bf16"])
    plan = memory_plan(recipe, gpu="H100")
    from raytune_ft.recipe.checkpointing import parse_checkpointing

    choice = parse_checkpointing(plan.checkpointing)
    assert plan.fits and choice.every == 1 and choice.keep < 3, plan.checkpointing


# jobs/qwen27b_lora.py on one H100 (`python -m bench gpu lora --gpus 0 --layers 10 --steps 4 --lora-seq 8192`,
# 2026-12-06, bench/RESULTS.md): FSDP2 at world size 1, frozen bf16 base, r=16 on every linear, full AC, compile
MEASURED_LORA_H100 = [(10, 32768, 34.5), (64, 8192, 74.8)]


@pytest.mark.parametrize("layers,seq,peak_gib", MEASURED_LORA_H100)
def test_lora_plan_within_10_percent_over_the_measured_h100_peaks(layers, seq, peak_gib):
    """The LoRA plan is an upper estimate of both measured peaks, and within 10% of them (before its LoRA
    lines it was 2.2 and 5.95 GiB under)."""
    from raytune_ft.models.tiny import real_config

    recipe = apply_overrides(job("qwen27b_lora").recipe(), [f"data.seq_len={seq}", "scaling.num_workers=1",
                                                          "scaling.gpus_per_node=1",
                                                          "train.activation_checkpointing=full"])   # as measured
    shape = ModelShape.from_config(real_config("qwen3.8-27b", num_hidden_layers=layers))
    plan = memory_plan(recipe, gpu="H100", shape=shape)
    assert plan.total_bytes / GiB >= peak_gib
    assert plan.total_bytes / GiB == pytest.approx(peak_gib, rel=0.10)
    # the adapters' input gradients: twice the tokens x the MLP's down_proj input, bf16
    assert plan.component("lora backward") == 2 * seq * shape.intermediate * 2
    assert plan.component("lora allowance") == pytest.approx(0.12 * shape.total_params * 2)
    assert "cause not identified" in plan.render()


def test_lora_plan_over_a_peak_it_was_not_fitted_on():
    """Issue 58 item 5: the LoRA allowance (12%) was chosen on the two peaks above; this measurement was not
    used: the same job with float8 matmuls over the frozen base (10 layers, 32,768 tokens, one H100, the
    record in raytune_ft/planning/data/measured.json). The plan is an upper estimate of it. The plan it ran beside
    was 10.5% over, past the 10% the fitted peaks hold: the peak equals the bf16 run's, so the plan's float8 casts
    line (2.29 GiB) was not resident at the peak; without it the plan is 3.9% over. Its float8 line now subtracts
    what the float8 all-gather saves in the 2 unsharded layers (0.71 GiB at the 27B's widths): 8.4% over."""
    from raytune_ft.models.tiny import real_config
    from raytune_ft.planning.measured import figure

    (held,) = figure("lora_allowance")["checked_on"]
    peak = held["values"]["figures.peak_gib"]
    recipe = apply_overrides(job("qwen27b_lora").recipe(), [f"data.seq_len={held['seq']}", "scaling.num_workers=1",
                                                          "scaling.gpus_per_node=1", f"train.precision={held['precision']}",
                                                          "train.activation_checkpointing=full"])   # as measured
    plan = memory_plan(recipe, gpu="H100", shape=ModelShape.from_config(
        real_config("qwen3.8-27b", num_hidden_layers=held["layers"])))
    total = plan.total_bytes / GiB
    before = total + _float8_gather_saving(plan.shape) / GiB
    assert before == pytest.approx(held["values"]["figures.plan_total_gib"], abs=0.001)   # the plan it ran beside
    assert total >= peak
    assert total == pytest.approx(peak, rel=0.10)
    assert (total - plan.component("float8 casts") / GiB) == pytest.approx(peak, rel=0.10)


def test_a_lora_linear_backward_holds_two_more_input_gradients_than_a_frozen_one():
    """What the "lora backward" line counts, measured (live tensor bytes, torch's MemTracker): the backward of a
    LoraLinear in bf16 (as under FSDP2's param_dtype) peaks 2 x tokens x in_features x 2 B over the same frozen
    linear's, which full SFT's one layer of fp32 weight gradients covered and a LoRA plan did not."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from raytune_ft.train.lora import LoraLinear

    T, n_in, n_out = 2048, 512, 1536
    peaks = {}
    for kind in ("frozen", "lora"):
        base = torch.nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        m = LoraLinear(base, 16, 32, 0.0).to(torch.bfloat16) if kind == "lora" else base
        x = torch.randn(T, n_in, dtype=torch.bfloat16, requires_grad=True)
        y = m(x)
        tracker = MemTracker()
        with tracker:
            y.backward(torch.ones_like(y))
        peaks[kind] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    extra = peaks["lora"] - peaks["frozen"]
    assert 2 * T * n_in * 2 <= extra < 2 * T * n_in * 2 + T * n_out * 2


def test_the_b300_plan_states_its_margin_and_the_projection_labels_its_inputs():
    from raytune_ft.planning.projection import plan_extras, project

    recipe = job("qwen27b_b300").recipe()
    plan = memory_plan(recipe)
    lines = plan_extras(recipe, plan)
    free = plan.gpu.memory_bytes - plan.total_bytes
    assert lines[0].startswith("  margin") and f"{free / GiB:.1f} GiB" in lines[0] and "B300" in lines[0]
    proj = project(recipe, plan)
    text = "\n".join(proj.lines())
    for name in ("measured step", "peak ratio", "communication", "data path", "checkpoint per rank",
                 "held per save", "background write", "start-up"):
        assert name in text, name
    assert "[measured]" in text and "[stated]" in text and "2.5 h" in proj.verdict
    # the measured step over the peak ratio; FSDP2's traffic: bf16 all-gathers (layers twice, root once) and an
    # fp32 reduce-scatter, 7/8 of each, over 900 GB/s: well under the compute
    P, root = plan.shape.total_params, plan.shape.root_params
    # ... times the recompute the run takes on the B300 (`auto` -> keep:K: 288 GB hold some layers' activations)
    # against the measured step's full recompute: (3 + s r) / (3 + r), r the layers' share of the forward FLOPs
    from raytune_ft.planning.checkpointing import recompute_share
    from raytune_ft.planning.plan import mean_conversation, resolve_checkpointing

    chosen, _ = resolve_checkpointing(recipe, plan.shape, plan.gpu)
    assert chosen.label == plan.checkpointing and chosen.keep > 0 and "keep:" in text
    s = recompute_share(plan.shape, chosen, mean_conversation(recipe)[1])
    r = (P - root) / (P - root + plan.shape.vocab * plan.shape.hidden)
    assert 0.5 < s < 1 and proj.item("recompute").value == pytest.approx((3 + s * r) / (3 + r))
    assert proj.item("compute per step").value == pytest.approx(13.291 / (2250 / 989) * (3 + s * r) / (3 + r))
    # a recipe that recomputes every layer itself is projected at the measured step's cost
    full = apply_overrides(recipe, ["train.activation_checkpointing=full"])
    assert project(full, memory_plan(full)).item("recompute").value == pytest.approx(1.0)
    assert proj.item("communication").value == pytest.approx((2 * (P - root) * 2 + root * 2 + P * 4) * 7 / 8 / 900e9)
    assert proj.item("communication").value < proj.item("compute per step").value
    # one rank's shard of the shipped fp32 recipe: weights and two moments, 4 B each, over 8 ranks
    assert proj.item("checkpoint per rank").value == pytest.approx(3 * P * 4 / 8 / 1e9)
    assert proj.pass_seconds == pytest.approx(sum(proj.item(n).value for n in (
        "training", "checkpoints", "evaluation + samples", "start-up")))
    # a LoRA run is not projected from full SFT's measurement (its step, reduce-scatter and checkpoints differ)
    lora = job("qwen27b_lora").recipe()
    lora_plan = memory_plan(lora)
    assert lora_plan.shape.n_layers == 64 and project(lora, lora_plan) is None
    assert any("projection   none" in x for x in plan_extras(lora, lora_plan))
    # a model of another depth has no measurement to project from
    cut = apply_overrides(job("qwen27b_b300").recipe(), ["scaling.num_workers=8"])
    from raytune_ft.models.tiny import real_config
    assert project(cut, memory_plan(cut, shape=ModelShape.from_config(real_config("qwen3.8-27b", num_hidden_layers=16)))) is None


def test_the_plan_under_context_parallelism_holds_a_share_of_each_block_and_the_exchange():
    """Issue 59 item 5: with scaling.context_parallel=C a rank's activations and loss are those of 1/C of each
    block's tokens, and a line of its own holds what the ranks exchange (the gathered K/V of the whole block in
    each attention layer that keeps its tensors, the gated-delta-net layers' fp32 state summaries). The 27B at
    131,072 tokens fits 8 H100s (bf16 master weights) with CP 8 (as measured, g18) and not with CP 1, 2 or 4 (CP 4
    did before the CP allowance: 3.7 GiB over the budget now); under full checkpointing the exchange is the one layer the
    backward works on."""
    long = ["data.seq_len=131072", "train.activation_checkpointing=full"]
    base = job("qwen27b_b300").recipe()
    plain = memory_plan(apply_overrides(base, long))
    cp = memory_plan(apply_overrides(base, [*long, "scaling.context_parallel=8"]))
    assert cp.component("activations") == pytest.approx(plain.component("activations") / 8)
    assert cp.component("loss") < plain.component("loss")
    assert "context-parallel exchange" not in {l.name for l in plain.lines}
    shape = cp.shape
    kv = 131072 * shape.kv_heads * 2 * shape.head_dim * 2
    summaries = 16 * shape.lin_v_heads * shape.lin_k_dim * (shape.lin_v_dim + shape.lin_k_dim) * 4
    assert cp.component("context-parallel exchange") == pytest.approx(3 * kv + 2 * summaries)
    assert "1/8 of 131,072" in cp.render()
    fits = {c: memory_plan(apply_overrides(base, [long[0], "train.master_weights=bf16",
                                                  f"scaling.context_parallel={c}"]), gpu="H100").fits
            for c in (1, 2, 4, 8)}
    assert fits == {1: False, 2: False, 4: False, 8: True}
    # keeping layers keeps their gathered K/V: the exchange grows with the attention layers that keep theirs
    none = memory_plan(apply_overrides(base, [long[0], "scaling.context_parallel=8",
                                              "train.activation_checkpointing=none"]))
    assert none.component("context-parallel exchange") == pytest.approx((2 * 16 + 3) * kv + (48 + 2) * summaries)
