"""train.precision=fp8 (raytune_ft.train.fp8): which linears go to float8, where float8 is refused, and
that the FSDP2 step, DCP checkpoints and the Hugging Face export keep the bf16 model's state.

torchao's float8 training linears run on CPU (torch's CPU float8 matmul), so conversion, the training
step with FSDP2's float8 all-gather, checkpoints and export run here for real at a small shape; only
speed and the GPU kernels are left to the GPU bench (bench/gpu_compare.py --precision fp8,
bench/fp8_parity.py).
"""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from raytune_ft.models.build import decoder_layers
from raytune_ft.train import fp8

pytest.importorskip("torchao", reason="torchao is in the dev extra: pip install -e '.[dev]'")


def _meta_lm(cfg):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def test_only_the_big_decoder_linears_of_the_27b_shape_are_converted():
    from raytune_ft.models.tiny import real_config

    lm = _meta_lm(real_config("qwen3.8-27b", num_hidden_layers=4))   # 3 gated-delta-net layers + 1 attention
    converted = fp8.convert_to_fp8(decoder_layers(lm), "tensorwise")
    gdn = ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"]
    mlp = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]
    attn = ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    expected = [f"{i}.{n}" for i in range(3) for n in sorted(gdn + mlp)] + [f"3.{n}" for n in sorted(attn + mlp)]
    assert converted == expected
    names = fp8.fp8_module_names(lm)
    assert names == [n for n, m in lm.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(names) == len(expected) and all(n.startswith("model.layers.") for n in names)
    # the gated-delta-net gates (5120 -> 48), lm_head, embeddings, conv and norms stay as they were
    layer0 = lm.model.layers[0]
    assert type(layer0.linear_attn.in_proj_a) is nn.Linear and type(layer0.linear_attn.in_proj_b) is nn.Linear
    assert type(lm.lm_head) is nn.Linear and type(lm.model.embed_tokens) is nn.Embedding
    assert type(layer0.linear_attn.conv1d) is nn.Conv1d
    assert "Float8" not in type(layer0.input_layernorm).__name__


def test_every_decoder_linear_of_the_4b_shape_is_converted():
    """The Qwen3-4B shape through the FSDP2 loop: hidden 2560, MLP 9728, 32 query heads and 8 KV heads of
    128 (k/v 2560 -> 1024): every projection of every layer qualifies; lm_head, embeddings, norms do not."""
    from raytune_ft.models.tiny import real_config

    lm = _meta_lm(real_config("qwen3-4b", num_hidden_layers=2))
    converted = fp8.convert_to_fp8(decoder_layers(lm), "rowwise")
    per_layer = sorted(["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                        "self_attn.q_proj", "self_attn.v_proj"])
    assert converted == [f"{i}.{n}" for i in range(2) for n in per_layer]
    assert type(lm.lm_head) is nn.Linear and type(lm.model.embed_tokens) is nn.Embedding


def test_filter_needs_multiples_of_16_or_32_and_size():
    keep, keep_mx = fp8.fp8_linear_filter("tensorwise"), fp8.fp8_linear_filter("mxfp8")
    with torch.device("meta"):
        cases = {(1024, 1024): (True, True), (1000, 1024): (False, False), (1040, 1024): (True, False),
                 (4096, 48): (False, False), (4096, 496): (False, False), (512, 4096): (True, True)}
        for (i, o), (want, want_mx) in cases.items():
            lin = nn.Linear(i, o, bias=False)
            assert keep(lin, "x") is want, (i, o)
            assert keep_mx(lin, "x") is want_mx, (i, o)
        assert not keep(nn.Embedding(1024, 1024), "x")


def test_a_model_too_small_for_float8_is_refused():
    from raytune_ft.models.tiny import tiny_config

    lm = _meta_lm(tiny_config("qwen3_5", 512))    # hidden 64: no linear reaches FP8_MIN_DIM
    with pytest.raises(RuntimeError, match="too small for float8"):
        fp8.convert_to_fp8(decoder_layers(lm), "tensorwise")


def test_refused_on_cpu_with_the_reason():
    msg = fp8.fp8_support_error(torch.device("cpu"), "tensorwise")
    assert "compute capability 8.9" in msg and "runs on cpu" in msg and "train.precision=bf16" in msg
    with pytest.raises(RuntimeError, match="runs on cpu"):
        fp8.check_fp8_supported(torch.device("cpu"), "rowwise")
    assert "not one of" in fp8.fp8_support_error(torch.device("cpu"), "fp4")


@pytest.mark.parametrize("cap, recipe, refused_with", [
    ((8, 0), "tensorwise", "has 8.0"),         # A100: no float8 matmul
    ((8, 6), "rowwise", "has 8.6"),
    ((8, 9), "tensorwise", None),              # Ada
    ((9, 0), "rowwise", None),                 # Hopper
    ((9, 0), "mxfp8", "10.x"),                 # MXFP8 is Blackwell's
    ((10, 0), "mxfp8", None),
])
def test_gpu_capability_decides(monkeypatch, cap, recipe, refused_with):
    # No GPU on this machine: the two CUDA queries are replaced by the values a GPU of that capability
    # returns; the decision itself is the real code.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU sm{cap[0]}{cap[1]}")
    msg = fp8.fp8_support_error(torch.device("cuda", 0), recipe)
    if refused_with is None:
        assert msg is None
    else:
        assert refused_with in msg and "GPU sm" in msg


def test_compile_covers_the_float8_linears_outside_the_mlp():
    from raytune_ft.models.tiny import real_config
    from raytune_ft.train.fsdp_loop import compile_pointwise

    lm = _meta_lm(real_config("qwen3.8-27b", num_hidden_layers=4))
    layers = decoder_layers(lm)
    fp8.convert_to_fp8(layers, "tensorwise")
    n = fp8.compile_fp8_linears(layers)
    compiled = {name for name, m in lm.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert n == 3 * 3 + 4 == len(compiled)         # the MLP is compiled whole by train.compile
    assert all(".mlp." not in name for name in compiled)
    assert "model.layers.3.self_attn.q_proj" in compiled and "model.layers.0.linear_attn.out_proj" in compiled
    # the loop's train.compile path does the same after compiling the MLPs and norms
    lm2 = _meta_lm(real_config("qwen3.8-27b", num_hidden_layers=4))
    fp8.convert_to_fp8(decoder_layers(lm2), "tensorwise")
    compile_pointwise(lm2)
    compiled2 = {name for name, m in lm2.named_modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled <= compiled2 and "model.layers.0.mlp" in compiled2


def test_recipe_precision_fields():
    from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, on_local_cpu, validate

    assert (Recipe().train.precision, Recipe().train.fp8_recipe) == ("bf16", "tensorwise")
    r = validate(apply_overrides(Recipe(), ["train.precision=fp8", "train.fp8_recipe=rowwise"]))
    assert (r.train.precision, r.train.fp8_recipe) == ("fp8", "rowwise")
    for overrides, message in [
        (["train.precision=fp8", "train.loop=trl"], "FSDP2 loop only"),
        (["train.precision=fp8", "scaling.use_gpu=false", "scaling.backend=gloo"], "use train.precision=bf16 on CPU"),
        (["train.precision=fp16"], "'fp16' is not one of"),
        (["train.fp8_recipe=nvfp4"], "'nvfp4' is not one of"),
    ]:
        with pytest.raises(RecipeError, match=message):
            validate(apply_overrides(Recipe(), overrides))
    local = on_local_cpu(apply_overrides(Recipe(), ["train.precision=fp8"]), workers=1, rows=10, seq_len=128,
                         run_name="x", registry_name="a.b.c")
    assert local.train.precision == "bf16"


def test_the_loop_refuses_fp8_on_a_cpu_worker_before_loading_anything(monkeypatch):
    """A recipe for GPUs whose worker lands on a CPU (or an old GPU): refused at the worker's start."""
    from raytune_ft.recipe.recipe import Recipe, apply_overrides
    from raytune_ft.train import fsdp_loop
    from raytune_ft.train.common import WorkerLog

    recipe = apply_overrides(Recipe(), ["train.precision=fp8", "tracking.storage_path=/nonexistent"])
    monkeypatch.setattr("raytune_ft.models.build.tokenizer_for",
                        lambda *a, **k: pytest.fail("the model was being loaded before the refusal"))
    with pytest.raises(RuntimeError, match="train.precision=fp8 needs an NVIDIA GPU"):
        fsdp_loop.build_fsdp_model(recipe, torch.device("cpu"), WorkerLog(0, recipe, None))


# ------------------------------------------------------------------ training, checkpoints, export on CPU

def _small_config():
    """qwen3_5, one gated-delta-net and one attention layer, wide enough for every projection to pass
    the filter."""
    from raytune_ft.models.tiny import tiny_config

    return tiny_config("qwen3_5", 512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                       layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                       num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=4,
                       linear_key_head_dim=128, linear_value_head_dim=128)


@pytest.fixture(scope="module")
def process_group():
    """World size 1 on gloo: what one CPU worker sees (FSDP2 needs a process group)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _blocks(n: int, seq: int = 256, vocab: int = 512) -> list[dict]:
    from raytune_ft.data.packing import block_from_segments

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        lens = [100, 80, seq - 180]
        segs = [(rng.integers(10, vocab - 10, size=k), np.ones(k, dtype=bool)) for k in lens]
        out.append(block_from_segments(segs, seq))
    return out


def _train(init: dict, recipe: str | None, blocks: list[dict], ac: str):
    """fp32 master weights, bf16 compute, FSDP2 (world size 1), AdamW: the loop's step."""
    from transformers import AutoModelForCausalLM

    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.fsdp_loop import forward_backward, shard_packed_model

    lm = AutoModelForCausalLM.from_config(_small_config(), dtype=torch.float32, attn_implementation="sdpa")
    lm.load_state_dict(init)
    if recipe:
        fp8.convert_to_fp8(decoder_layers(lm), recipe)
    model = shard_packed_model(lm, torch.device("cpu"), compute_dtype=torch.bfloat16,
                               activation_checkpointing=ac, loss_chunk=128)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    losses = []
    for b in blocks:
        mb = StepBatch.from_blocks([b], torch.device("cpu"))
        loss_sum, denom = forward_backward(model, [mb], 1, torch.device("cpu"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if recipe:
            fp8.precompute_fp8_scales(model, recipe)
        losses.append(float(loss_sum / denom))
    return lm, model, opt, losses


def _plain_state(model) -> dict:
    return {k: (type(getattr(v, "_local_tensor", v)), v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(900)   # float8 emulated on CPU: minutes on a loaded 2-core machine
@pytest.mark.parametrize("recipe, ac", [("tensorwise", "selective"), ("rowwise", "full")])
def test_fp8_step_checkpoint_and_export_keep_the_bf16_state(tmp_path, process_group, recipe, ac):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from raytune_ft.train import checkpoint as ckpt_io
    from raytune_ft.train.fsdp_loop import shard_packed_model
    from raytune_ft.train.state import TrainState

    def state_at(model, opt, step=0):
        state = TrainState(model, opt)
        state.schedule.step = step
        return state

    torch.manual_seed(0)
    init = AutoModelForCausalLM.from_config(_small_config(), dtype=torch.float32).state_dict()
    blocks = _blocks(3)
    lm_ref, ref, _, ref_losses = _train(init, None, blocks, ac)
    lm8, model8, opt8, losses8 = _train(init, recipe, blocks, ac)

    # gated-delta-net 3, attention q and o (k/v: 512 -> 256, under FP8_MIN_DIM), 2 MLPs x 3
    assert len(fp8.fp8_module_names(model8)) == 3 + 2 + 2 * 3
    # same keys, dtypes (fp32 master) and shapes, and only plain tensors in the state dict
    assert _plain_state(model8) == _plain_state(ref)
    assert {t for t, _, _ in _plain_state(model8).values()} == {torch.Tensor}
    # float8 changes the numbers a little, not the training
    assert losses8 != ref_losses
    assert np.allclose(losses8, ref_losses, rtol=5e-3), (losses8, ref_losses)

    # DCP checkpoint of the float8 run: no torchao class pickled into it, and a bf16 model resumes from it
    ckpt = tmp_path / "ckpt"
    ckpt_io.save_train_checkpoint(str(ckpt), state_at(model8, opt8, 3), 0)
    blobs = b"".join(p.read_bytes() for p in (ckpt / "dcp").iterdir())
    assert b"torchao" not in blobs and b"Float8" not in blobs
    fresh_lm = AutoModelForCausalLM.from_config(_small_config(), dtype=torch.float32, attn_implementation="sdpa")
    fresh_lm.load_state_dict(init)
    fresh = shard_packed_model(fresh_lm, torch.device("cpu"), compute_dtype=torch.bfloat16)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-4)
    trained = {k: v.full_tensor() for k, v in model8.state_dict().items()}
    assert any(not torch.equal(trained[k], v.full_tensor()) for k, v in fresh.state_dict().items())
    ckpt_io.load_train_checkpoint(str(ckpt), state_at(fresh, fresh_opt), 0)
    assert all(torch.equal(trained[k], v.full_tensor()) for k, v in fresh.state_dict().items())
    # ... and the float8 model resumes from a bf16 run's checkpoint the same way
    ref_ckpt = tmp_path / "ref_ckpt"
    ckpt_io.save_train_checkpoint(str(ref_ckpt), state_at(ref, torch.optim.AdamW(ref.parameters()), 3), 0)
    lm_b, model_b, opt_b, _ = _train(init, recipe, [], ac)
    ckpt_io.load_train_checkpoint(str(ref_ckpt), state_at(model_b, opt_b), 0)
    ref_state = {k: v.full_tensor() for k, v in ref.state_dict().items()}
    assert all(torch.equal(ref_state[k], v.full_tensor()) for k, v in model_b.state_dict().items())

    # HF export: bf16, the bf16 run's keys, the trained weights themselves
    out8, out_ref = tmp_path / "hf8", tmp_path / "hf_ref"
    for out, loop_model, hf_lm in ((out8, model8, lm8), (out_ref, ref, lm_ref)):
        export = ckpt_io.HfExport(hf_lm.config, prefix_strip="lm.", arch=type(hf_lm).__name__)
        ckpt_io.export_hf_folder(str(out), loop_model, export, 0)
    w8, wref = load_file(os.path.join(out8, "model.safetensors")), load_file(os.path.join(out_ref, "model.safetensors"))
    assert w8.keys() == wref.keys() and {v.dtype for v in w8.values()} == {torch.bfloat16}
    assert all(torch.equal(w8[k], trained["lm." + k].to(torch.bfloat16)) for k in w8)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out8))
    assert all(type(m) in (nn.Linear,) for m in reloaded.modules() if isinstance(m, nn.Linear))


@pytest.mark.timeout(120)
def test_mxfp8_conversion_keeps_a_plain_state_dict(process_group):
    """MXFP8 needs Blackwell; torchao's emulated MXFP8 recipe runs the same conversion and state-dict
    path on CPU."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(_small_config(), dtype=torch.float32, attn_implementation="sdpa")
    before = {k: (v.dtype, tuple(v.shape)) for k, v in lm.state_dict().items()}
    cfg = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    converted = fp8.convert_to_fp8(decoder_layers(lm), "mxfp8", config=cfg)
    assert len(converted) == len(fp8.fp8_module_names(lm)) == 11
    wrapped = lm.model.layers[0].mlp.up_proj.weight
    assert type(wrapped.data).__name__ == "MXFP8TrainingWeightWrapperTensor"
    state = lm.state_dict()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in state.items()} == before
    assert all(type(v) is torch.Tensor for v in state.values())
    assert state["model.layers.0.mlp.up_proj.weight"].data_ptr() == fp8.plain_tensor(wrapped).data_ptr()


def test_the_memory_plan_counts_float8_casts():
    from raytune_ft.planning.plan import memory_plan
    from raytune_ft.recipe.recipe import Recipe, apply_overrides

    # one checkpointing for both: auto may keep a different number of layers whole beside the casts
    base = apply_overrides(Recipe(), ["model.name=qwen3.8-27b", "model.init=random", "data.seq_len=32768",
                                      "train.activation_checkpointing=full"])
    bf16 = memory_plan(base, gpu="H200")
    f8 = memory_plan(apply_overrides(base, ["train.precision=fp8"]), gpu="H200")
    assert "float8 casts" not in [line.name for line in bf16.lines]
    extra = f8.component("float8 casts")
    # the 27B's largest converted matmuls: down_proj's input and gate/up's output gradients are 17,408 wide; less
    # the 2 unsharded layers' converted weights in 1 byte instead of 2 (tensorwise: FSDP2's float8 all-gather)
    converted = max(sum(i * o for i, o in f8.shape.linears(k).values() if min(i, o) >= 1024)
                    for k in set(f8.shape.layer_types))
    assert extra == 2 * (32768 * (17408 + 17408) + 17408 * 5120) - 2 * converted
    assert f8.total_bytes == bf16.total_bytes + extra
    rowwise = memory_plan(apply_overrides(base, ["train.precision=fp8", "train.fp8_recipe=rowwise"]), gpu="H200")
    assert rowwise.component("float8 casts") == 2 * (32768 * (17408 + 17408) + 17408 * 5120)   # gathered in bf16


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_loops_build_converts_a_meta_model_and_trains(tmp_path, monkeypatch, process_group):
    """build_fsdp_model as a worker runs it: meta model, float8 conversion, FSDP2, then transformers'
    random init filling the (wrapped) shards; then the loop's step with the scales after it. The GPU
    check is the one part replaced (no float8 GPU here; the check has its own tests above)."""
    from raytune_ft.models.tiny import ASSETS
    from raytune_ft.recipe.recipe import Recipe, apply_overrides
    from raytune_ft.train import fsdp_loop
    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.common import WorkerLog

    cfg = _small_config()
    cfg.vocab_size = 2176
    cfg.save_pretrained(tmp_path / "model")
    recipe = apply_overrides(Recipe(), [f"model.name={tmp_path / 'model'}", "model.init=random",
                                        f"model.tokenizer={ASSETS}", "train.precision=fp8",
                                        "train.activation_checkpointing=selective"])
    monkeypatch.setattr(fp8, "check_fp8_supported", lambda device, recipe: None)
    logged = []
    log = WorkerLog(0, recipe, None)
    monkeypatch.setattr(log, "info", logged.append)
    model, lm, _ = fsdp_loop.build_fsdp_model(recipe, torch.device("cpu"), log)
    assert any("precision: fp8 (tensorwise): 11 decoder linears compute in float8" in line for line in logged)
    w = lm.model.layers[0].mlp.up_proj.weight
    assert type(w._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
    assert 0.01 < float(w.full_tensor().detach().std()) < 0.03          # transformers' init (std 0.02) filled it
    before = w.full_tensor().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for b in _blocks(2, vocab=2176):
        mb = StepBatch.from_blocks([b], torch.device("cpu"))
        loss_sum, denom = fsdp_loop.forward_backward(model, [mb], 1, torch.device("cpu"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        fp8.precompute_fp8_scales(model, "tensorwise")
        assert torch.isfinite(loss_sum / denom)
    assert not torch.equal(before, w.full_tensor())
    assert w._local_tensor._precomputed_scale is not None


# ------------------------------------------------------------- the loss-parity bench's own arithmetic
# bench/fp8_parity.py decides the "within 2% at every logged step": its comparison and its real
# text rows are checked here, where a mistake would pass a bad curve or train on broken rows.

def test_parity_compare_reads_the_logged_steps_and_window_means():
    from bench.fp8_parity import compare, window_means

    ref = [10.0] * 20 + [2.0] * 10
    fp8 = list(ref)
    fp8[22] = 2.1                                     # step 23: 5% off, between two logged steps
    fp8[29] = 2.03                                    # step 30 (logged): 1.5% off
    seed = [r * 0.97 for r in ref]                    # 3% below everywhere
    out = compare({"bf16": ref, "fp8:tensorwise": fp8, "bf16:seed1": seed}, warmup=10, log_every=5, tol=0.02)
    assert out["logged_steps"] == [15, 20, 25, 30]
    t = out["fp8:tensorwise"]
    assert t["within_tol"] and t["within_tol_logged"] == 4
    assert t["max_rel_diff_logged"] == pytest.approx(0.015, abs=1e-6)
    assert t["max_rel_diff_any_step"] == pytest.approx(0.05, abs=1e-6)          # step 23 is seen here
    assert t["max_rel_diff_window_mean"] == pytest.approx(0.1 / 5 / 2.0, abs=1e-6)   # steps 21-25
    s = out["bf16:seed1"]
    assert not s["within_tol"] and s["within_tol_logged"] == 0
    assert s["signed_mean_rel_diff_logged"] == pytest.approx(-0.03, abs=1e-6)
    assert window_means([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_parity_skips_steps_without_labels():
    from bench.fp8_parity import compare

    ref = [3.0, 0.0, 2.0, 0.0]                        # steps 2 and 4: blocks with no supervised token
    out = compare({"bf16": ref, "fp8:rowwise": [3.0, 0.0, 2.02, 0.0]}, warmup=0, log_every=1, tol=0.02)
    assert out["logged_steps"] == [1, 3]
    assert out["fp8:rowwise"]["max_rel_diff_logged"] == pytest.approx(0.01, abs=1e-6)


def test_parity_text_rows_render_with_the_real_tokenizer(fixtures):
    from bench.fp8_parity import load_tokenizer, stdlib_rows
    from raytune_ft.data.pipeline import tokenize_rows

    rows = stdlib_rows(40)
    assert len(rows) == 40 and rows == stdlib_rows(40)                     # deterministic
    user, assistant = rows[3]["messages"]
    assert user["role"] == "user" and user["content"].startswith("Continue `python3.")
    assert assistant["role"] == "assistant" and assistant["content"].startswith("```python\n")
    cols = tokenize_rows(rows, load_tokenizer(str(fixtures / "tokenizers" / "qwen3")))
    assert all(cols["input_ids"]) and not any(cols["skip_reason"])
    for ids, mask in zip(cols["input_ids"], cols["mask"]):
        assert 0 < sum(mask) < len(ids)                                     # loss on the continuation only


WORKER_BUILD = """
import importlib.util, json, socket, sys
import torch, torch.distributed as dist
from raytune_ft.recipe.recipe import Recipe, on_local_cpu, apply_overrides
from raytune_ft.train import fsdp_loop
from raytune_ft.train.common import WorkerLog
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
recipe = on_local_cpu(Recipe(), workers=1, rows=10, seq_len=128, run_name="x", registry_name="a.b.c")
model, lm, tok = fsdp_loop.build_fsdp_model(recipe, torch.device("cpu"), WorkerLog(0, recipe, None))
from transformers.utils import is_torchao_available
print(json.dumps({"torchao": "torchao" in sys.modules, "check_restored": is_torchao_available() == (importlib.util.find_spec("torchao") is not None),
                  "built": sum(p.numel() for p in model.parameters()) > 0}))
"""


@pytest.mark.timeout(300)
def test_a_bf16_workers_model_build_does_not_import_torchao():
    """The FSDP2 worker's model build, as the worker runs it in a fresh process: in bf16, transformers'
    quantizers come in without torchao (compat.transformers_without_torchao), and transformers' torchao
    check answers as before once the modelling code is in."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, env_with_path

    out = subprocess.run([sys.executable, "-c", WORKER_BUILD], env=env_with_path(REPO), capture_output=True,
                         text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"torchao": False, "check_restored": True, "built": True}
    assert "Failed to load" not in out.stderr      # torchao's .so warnings on a CPU machine


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_probes_run_the_float8_linears_as_plain_matmuls(process_group, monkeypatch):
    """The held-out loss and the samples run eagerly; eager float8 linears cast through torchao's tensor
    subclass op by op, which made fp8's time outside the steps twice bf16's. Inside the probes no float8
    forward runs, the loss is the one of the same (float8-all-gathered, dequantised) weights in bf16 within
    float8's rounding, and training runs its float8 linears again afterwards."""
    from transformers import AutoModelForCausalLM

    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.evaluate import held_out_loss

    torch.manual_seed(0)
    init = AutoModelForCausalLM.from_config(_small_config(), dtype=torch.float32).state_dict()
    blocks = _blocks(2)
    _, model8, _, _ = _train(init, "tensorwise", blocks[:1], "none")
    _, ref, _, _ = _train(init, None, [], "none")
    ref.load_state_dict({k: v for k, v in model8.state_dict().items()})
    from torchao.float8.float8_linear import Float8Linear

    calls = []
    original = Float8Linear.forward
    monkeypatch.setattr(Float8Linear, "forward", lambda self, x: calls.append(1) or original(self, x))
    loss8, n8 = held_out_loss(model8, blocks, micro_batch_size=1, device=torch.device("cpu"))
    assert calls == []
    loss_ref, n_ref = held_out_loss(ref, blocks, micro_batch_size=1, device=torch.device("cpu"))
    assert n8 == n_ref and loss8 == pytest.approx(loss_ref, rel=2e-2)
    mb = StepBatch.from_blocks([blocks[0]], torch.device("cpu"))
    model8(mb.labels, **mb.kwargs)[0].backward()
    assert len(calls) == len(fp8.fp8_module_names(model8))
