"""Throughput of the project's FSDP2 training step on one GPU (world size 1), real shapes, random weights.

Runs exactly the step train_fsdp runs (raytune_ft.train.fsdp_loop): shard_packed_model (packing paths,
activation checkpointing, chunked loss, FSDP2 with bf16 compute and fp32 reduction), StepBatch from
blocks in the pipeline's format, forward_backward, clip_grad_norm_, fused AdamW. Blocks have the seed
loop's conversation lengths (same generator, same seed), so tokens/s and MFU compare run for run with
../shared/peers/seed000_loop.py.

    python bench/gpu_compare.py --model qwen3.8-27b --layers 16 --seq 16384 --ac full --master bf16
    python bench/gpu_compare.py --model qwen3.8-27b --layers 16 --seq 32768 --compile-mlp --precision fp8 --fp8-recipe rowwise
    SHAPE=tiny DEVICE=cpu python bench/gpu_compare.py --model qwen3.8-27b --seq 512 --steps 3 --warm 1

Prints one `RESULT {json}` line: tok_per_s, mfu (6 x matmul params x tokens + attention term, over
the datasheet dense bf16 peak: 989 TFLOP/s on an H200, raytune_ft.planning.hardware), peak_gib, s_per_step, backends; or {"oom": true}.
`--precision fp8` trains the decoder linears in float8 as train.precision=fp8 does (raytune_ft.train.fp8:
conversion before compile and FSDP2, scales after each optimizer step); its MFU counts the same model
FLOPs over the same bf16 peak, so MFU and tokens/s compare one to one with the bf16 run. Refused (exit 2,
the reason on stderr) where float8 cannot run, e.g. on CPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import gpu_common as gc  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.8-27b")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many decoder layers")
    p.add_argument("--seq", type=int, default=16384, help="tokens per packed block (one block per step)")
    p.add_argument("--ac", default="full", choices=["none", "full", "selective"])
    p.add_argument("--master", default="bf16", choices=["bf16", "fp32"], help="parameter (master weight) dtype")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--compile-mlp", action="store_true", help="torch.compile each decoder layer's MLP and RMSNorms")
    p.add_argument("--conv", default="shifted", choices=["shifted", "padded"],
                   help="torch path of the packed gated-delta-net conv (gated_delta.CONV_IMPL)")
    p.add_argument("--gqa", default="auto", choices=["auto", "repeat"],
                   help="varlen attention: pass 4 KV heads when the kernel takes them (auto) or repeat k/v")
    p.add_argument("--profile", action="store_true", help="profile the last step; print the top GPU kernels")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8"], help="train.precision")
    p.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "mxfp8"],
                   help="train.fp8_recipe (with --precision fp8)")
    a = p.parse_args(argv)

    from raytune_ft.models.attention import select_attention_backend
    from raytune_ft.planning.hardware import flops_per_block, gpu_peak_tflops, matmul_params
    from raytune_ft.models.gated_delta import gated_delta_backends
    from raytune_ft.train.fsdp_loop import StepBatch, compile_pointwise, forward_backward, shard_packed_model

    import raytune_ft.models.attention as attention
    import raytune_ft.models.gated_delta as gated_delta

    gated_delta.CONV_IMPL = a.conv
    if a.gqa == "repeat":
        attention._native_gqa_ok = lambda *args, **kw: False

    dev = gc.device()
    fp8_recipe = a.fp8_recipe if a.precision == "fp8" else None
    if fp8_recipe:
        from raytune_ft.train.fp8 import fp8_support_error

        reason = fp8_support_error(dev, fp8_recipe)
        if reason:
            print(reason, file=sys.stderr)
            sys.exit(2)
    gc.init_single_process_group(dev)
    compute = torch.bfloat16 if dev.type == "cuda" else torch.float32
    master = torch.float32 if a.master == "fp32" else compute
    cfg = gc.model_config(a.model, a.layers)
    rec = {"bench": "fsdp_step", "model": a.model, "layers": cfg.num_hidden_layers, "seq": a.seq, "ac": a.ac,
           "master": a.master, "loss_chunk": a.loss_chunk, "compile_mlp": a.compile_mlp, "shape": gc.SHAPE,
           "conv": a.conv, "gqa": a.gqa, "precision": a.precision, "fp8_recipe": fp8_recipe}
    t_build = time.perf_counter()
    lm = gc.build_random_lm(cfg, dev, master)
    if fp8_recipe:   # before compile and FSDP2, as the loop does
        from raytune_ft.models.build import decoder_layers
        from raytune_ft.train.fp8 import convert_to_fp8

        rec["fp8_linears"] = len(convert_to_fp8(decoder_layers(lm), fp8_recipe))
    if a.compile_mlp:
        compile_pointwise(lm)   # the loop's own train.compile=true path
    if fp8_recipe:
        rec["fp8_linears_compiled"] = sum(1 for m in lm.modules() if type(m).__name__ == "Float8Linear"
                                          and getattr(m, "_compiled_call_impl", None) is not None)
    model = shard_packed_model(lm, dev, compute_dtype=compute, activation_checkpointing=a.ac,
                               loss_chunk=a.loss_chunk)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, fused=dev.type == "cuda")
    rec["build_s"] = round(time.perf_counter() - t_build, 1)
    rec["matmul_params_b"] = round(matmul_params(lm) / 1e9, 3)
    rec["backends"] = {"attention": select_attention_backend(dev), **gated_delta_backends(dev)}

    from raytune_ft.train.fp8 import precompute_fp8_scales

    rng = np.random.default_rng(0)
    model.train()
    flops, tokens, t0 = 0.0, 0, None
    losses = []
    try:
        for step in range(a.steps):
            if step == a.warm:
                gc.sync(dev)
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                t0 = time.perf_counter()
                flops, tokens = 0.0, 0
            prof = None
            if a.profile and step == a.steps - 1:
                from torch.profiler import ProfilerActivity, profile
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                prof.__enter__()
            lens = gc.seed_lengths(a.seq, rng)
            mb = StepBatch.from_blocks([gc.packed_block(lens, cfg.vocab_size, rng)], dev)
            loss_sum, denom = forward_backward(model, [mb], 1, dev)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if fp8_recipe:
                precompute_fp8_scales(model, fp8_recipe)
            tokens += mb.n_real
            flops += flops_per_block(cfg, mb.seq_lens)
            if prof is not None:
                gc.sync(dev)
                prof.__exit__(None, None, None)
                print(prof.key_averages().table(sort_by="self_device_time_total" if dev.type == "cuda"
                                                else "self_cpu_time_total", row_limit=30, max_name_column_width=70))
            if step < a.warm or step == a.steps - 1:   # a host sync only outside the timed window's inside
                losses.append(round(float(loss_sum / denom), 4))
        gc.sync(dev)
    except torch.OutOfMemoryError as e:
        rec.update(oom=True, error=str(e).split("\n")[0][:300], peak_gib=round(gc.peak_gib(dev), 1))
        gc.emit(rec)
        return rec
    dt = time.perf_counter() - t0
    n_steps = a.steps - a.warm
    peak = gpu_peak_tflops(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else 0.0
    rec.update(tok_per_s=round(tokens / dt), s_per_step=round(dt / n_steps, 3),
               mfu=round(flops / dt / (peak * 1e12), 4) if peak else None,
               peak_gib=round(gc.peak_gib(dev), 1), losses=losses, timed_steps=n_steps)
    rec["native_gqa"] = {f"{k[0]}/{k[1]}": v for k, v in attention._NATIVE_GQA.items()}
    gc.emit(rec)
    return rec


if __name__ == "__main__":
    main()
