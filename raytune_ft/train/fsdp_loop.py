"""The FSDP2 training loop of the 27B recipe, run inside each Ray Train worker.

One optimizer step = `grad_accum` micro-batches of `micro_batch_size` packed blocks per rank.
The loss is the sum of per-token losses over the step's supervised tokens on all ranks, divided
by their global count (all-reduced before the first backward of the step), so a token weighs the
same whatever rank or micro-batch it lands on. FSDP2 averages gradients over ranks; each
micro-batch loss is multiplied by the world size to undo that average.

Non-finite losses and gradient norms are accumulated into a device flag and checked where the
host syncs anyway (log and checkpoint steps), so the step itself never waits on the GPU.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from raytune_ft.recipe import Recipe
from raytune_ft.train import checkpoint as ckpt_io
from raytune_ft.train.common import (
    WorkerLog,
    lr_at,
    recipe_from_config,
    report,
)


class PackedCausalLM(nn.Module):
    """A causal LM whose forward returns (sum of shifted token losses, supervised token count).

    Wrapping the HF model lets FSDP2's root hooks cover the embedding, final norm and lm_head
    while the loss is computed in chunks, never holding fp32 logits for a whole block.
    """

    def __init__(self, lm: nn.Module, loss_chunk: int = 4096):
        super().__init__()
        self.lm = lm
        self.loss_chunk = loss_chunk

    def forward(self, labels: torch.Tensor, **packed_kwargs):
        from raytune_ft.models.loss import chunked_cross_entropy

        hidden = self.lm.model(**packed_kwargs).last_hidden_state
        return chunked_cross_entropy(hidden, self.lm.lm_head.weight, labels, chunk_size=self.loss_chunk)


@dataclass
class StepBatch:
    """A micro-batch: its blocks laid end to end as one row, with merged boundaries (on the device)."""
    kwargs: dict
    labels: torch.Tensor
    n_supervised: int
    n_real: int
    seq_lens: list[int] = field(default_factory=list)

    @classmethod
    def from_blocks(cls, blocks: list[dict], device: torch.device) -> "StepBatch":
        import numpy as np

        from raytune_ft.models.gated_delta import packed_forward_kwargs

        stack = {k: np.stack([b[k] for b in blocks]) for k in ("input_ids", "labels", "position_ids", "seq_idx")}
        stack["cu_seqlens"] = [b["cu_seqlens"] for b in blocks]
        kwargs = packed_forward_kwargs(stack, device=device)
        seq_lens, n_real = [], 0
        for b in blocks:
            lens = np.diff(b["cu_seqlens"].astype(np.int64)).tolist()
            last = int(b["cu_seqlens"][-2])
            # the block's padding: a trailing segment of pad ids (0) with no supervised token
            if not (b["labels"][last:] != -100).any() and not b["input_ids"][last:].any():
                lens = lens[:-1]
            seq_lens.extend(lens)
            n_real += int(sum(lens))
        labels = torch.from_numpy(stack["labels"].reshape(1, -1)).to(device, non_blocking=True)
        n_sup = int((stack["labels"][:, 1:] != -100).sum())
        return cls(kwargs, labels, n_sup, n_real, seq_lens)


def _device() -> torch.device:
    import ray.train.torch

    return ray.train.torch.get_device()


def build_fsdp_model(recipe: Recipe, device: torch.device, log: WorkerLog):
    """Build (or load) the model, install the packed-sequence paths, and shard it with FSDP2."""
    from raytune_ft.models.attention import select_attention_backend
    from raytune_ft.models.build import load_causal_lm, materialize_model, tokenizer_for

    tok = tokenizer_for(recipe.model)
    on_gpu = device.type == "cuda"
    compute_dtype = torch.bfloat16 if (on_gpu and recipe.model.dtype == "bfloat16") else torch.float32
    param_dtype = torch.float32 if recipe.train.master_weights == "fp32" else compute_dtype
    # Built on the meta device, sharded, then filled: each rank allocates and reads only its own
    # shard of the weights, so no rank ever holds the whole model in host or GPU memory.
    lm = load_causal_lm(recipe.model, tokenizer_vocab_size=len(tok), device="meta", dtype=param_dtype)
    backend = select_attention_backend(device)
    log.info(f"attention backend: {backend}; params {param_dtype}, compute {compute_dtype}, "
             f"reduce fp32; activation checkpointing {recipe.train.activation_checkpointing}")
    if recipe.train.compile:
        compile_pointwise(lm)
        log.info("torch.compile: each decoder layer's MLP and RMSNorms")
    model = shard_packed_model(lm, device, compute_dtype=compute_dtype,
                               activation_checkpointing=recipe.train.activation_checkpointing)
    materialize_model(lm, recipe.model, device, seed=recipe.train.seed)
    return model, lm, tok


def compile_pointwise(lm: nn.Module) -> None:
    """torch.compile the memory-bound pieces of each decoder layer: SwiGLU MLP and the fp32 RMSNorms
    (and the gated norm of gated-delta-net layers). A profile on the H200 put ~half the step in such
    element-wise kernels; fused, the 27B cut gained 8% (bench/NOTES.md). Blocks have a fixed length,
    so each module kind compiles one graph."""
    from raytune_ft.models.build import decoder_layers

    for layer in decoder_layers(lm):
        layer.mlp.compile()
        layer.input_layernorm.compile()
        layer.post_attention_layernorm.compile()
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.norm.compile()


def shard_packed_model(lm: nn.Module, device: torch.device, *, compute_dtype: torch.dtype,
                       activation_checkpointing: str = "full", loss_chunk: int = 4096) -> PackedCausalLM:
    """Turn a built causal LM into the loop's training module: packing paths on, activation
    checkpointing per `activation_checkpointing` ("none" | "full" | "selective"), the chunked-loss
    wrapper, then FSDP2 (each decoder layer, then the root; compute in `compute_dtype`, gradients
    reduced in fp32). The parameters keep the dtype they were built in (the master weights).

    Split from build_fsdp_model so benchmarks can hand in a model built directly on the GPU at a real
    shape with random weights and still train exactly what the loop trains."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from raytune_ft.models.build import decoder_layers
    from raytune_ft.models.gated_delta import enable_packing

    enable_packing(lm)
    layers = decoder_layers(lm)
    _set_activation_checkpointing(lm, layers, activation_checkpointing)
    model = PackedCausalLM(lm, loss_chunk)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if not any(p.is_meta for p in model.parameters()):  # a meta model is filled by materialize_model
        model.to(device)
    return model


def forward_backward(model: nn.Module, micro_batches: list[StepBatch], world: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step's forward and backward passes over this rank's micro-batches.

    Returns (sum of this rank's token losses, fp32; global supervised-token count, clamped to >= 1).
    Each micro-batch's loss is divided by the global count before its backward, and multiplied by the
    world size to undo FSDP2's average over ranks, so a token weighs the same wherever it lands.
    Gradients are reduced across ranks only in the last micro-batch's backward."""
    n_sup = torch.tensor(float(sum(mb.n_supervised for mb in micro_batches)), device=device)
    dist.all_reduce(n_sup)
    denom = n_sup.clamp(min=1.0)
    loss_sum = torch.zeros((), device=device)
    for i, mb in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        ls, _ = model(mb.labels, **mb.kwargs)
        (ls * world / denom).backward()
        loss_sum += ls.detach().float()
    return loss_sum, denom


def _set_activation_checkpointing(lm, layers, mode: str) -> None:
    if mode == "none":
        return
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "selective":
        # layer-selective: recompute every other decoder layer, keep the rest's activations
        for i, layer in enumerate(layers):
            if i % 2 == 1 and hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = False


def train_fsdp(config: dict) -> None:
    """Ray Train worker entry point for the FSDP2 loop."""
    import ray.train

    from raytune_ft.train.feed import StepFeed

    recipe = recipe_from_config(config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = _device()
    log = WorkerLog(rank, recipe, config.get("mlflow_run_id"))
    t_cfg = recipe.train

    model, lm, tok = build_fsdp_model(recipe, device, log)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t_cfg.lr, betas=tuple(t_cfg.betas), weight_decay=t_cfg.weight_decay,
                            fused=device.type == "cuda")

    state = {"step": 0, "blocks_consumed": 0, "history": [], "counters": {}}
    resume = ray.train.get_checkpoint()
    if resume is not None:
        with resume.as_directory() as d:
            state = ckpt_io.load_train_checkpoint(d, model, opt, rank)
        # where each restart (Ray's, after a worker died, or a re-submit) picked the run up
        state.setdefault("resumed_from", []).append(state["step"])
        log.info(f"resumed from checkpoint at step {state['step']} ({state['blocks_consumed']} blocks consumed "
                 f"on rank {rank})")

    total_steps = int(config.get("total_steps") or t_cfg.max_steps or 0)
    # `blocks_by_rank` (tests, benchmarks): fixed blocks per rank instead of the Ray Data shard
    fixed = (config.get("blocks_by_rank") or {}).get(rank)
    if fixed is not None:
        fixed = fixed[state["blocks_consumed"]:]
    feed = StepFeed(recipe, rank=rank, world=world, device=device, skip_blocks=state["blocks_consumed"],
                    counters_state=state.get("counters"), blocks=fixed,
                    fingerprint=state.get("data_fingerprint"))
    from raytune_ft.hardware import flops_per_block, gpu_peak_tflops

    peak_flops = gpu_peak_tflops(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu") * 1e12
    n_layers_cfg = lm.config

    step = state["step"]
    bad = torch.zeros((), dtype=torch.bool, device=device)
    pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []
    window_tokens, window_flops, window_t0 = 0, 0.0, time.perf_counter()
    run_t0 = time.perf_counter()
    last_metrics: dict = {}

    while total_steps == 0 or step < total_steps:
        micro_batches = feed.next_step()
        if micro_batches is None:  # every rank's data is spent
            break
        loss_sum, denom = forward_backward(model, micro_batches, world, device)
        for mb in micro_batches:
            window_tokens += mb.n_real
            window_flops += flops_per_block(n_layers_cfg, mb.seq_lens)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t_cfg.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        bad |= ~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)
        lr = t_cfg.lr * lr_at(step, t_cfg, total_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        pending.append((step, loss_sum, denom, grad_norm.detach(), lr))

        at_log = step % t_cfg.log_every == 0 or step == total_steps
        at_ckpt = step % t_cfg.checkpoint_every == 0 and step != total_steps
        if not (at_log or at_ckpt):
            continue
        # host sync point: losses of the window, the non-finite flag, throughput
        losses = torch.stack([p[1] for p in pending])
        dist.all_reduce(losses)
        if bool(bad.item()):
            raise FloatingPointError(
                f"non-finite loss or gradient norm within steps {pending[0][0]}..{step} "
                f"(rank {rank}); stopping without saving: the last good checkpoint is kept. "
                "Lower train.lr, check the data, or use train.master_weights=fp32.")
        dt = time.perf_counter() - window_t0
        tokens_all = torch.tensor(float(window_tokens), device=device)
        dist.all_reduce(tokens_all)
        state["tokens_total"] = state.get("tokens_total", 0) + int(tokens_all.item())
        for (s, _, d, gn, lr_s), l in zip(pending, losses.tolist()):
            state["history"].append({"step": s, "loss": l / float(d), "lr": lr_s, "grad_norm": float(gn)})
        tps = float(tokens_all) / max(dt, 1e-9)
        mfu = (window_flops / max(dt, 1e-9)) / peak_flops if peak_flops else 0.0
        last_metrics = {
            "step": step, "loss": state["history"][-1]["loss"], "lr": pending[-1][4],
            "grad_norm": state["history"][-1]["grad_norm"], "tokens_per_s": tps,
            "tokens_per_s_per_worker": tps / world, "mfu": mfu, "tokens": state["tokens_total"],
            "epoch_progress": step / total_steps if total_steps else 0.0,
        }
        if device.type == "cuda":
            last_metrics["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        log.progress(last_metrics, total_steps, time.perf_counter() - run_t0)
        pending.clear()
        state["step"] = step
        state["blocks_consumed"] = feed.blocks_consumed
        state["counters"] = feed.counters_state()
        state["data_fingerprint"] = feed.fingerprint
        if at_ckpt:
            _save_and_report(recipe, model, opt, rank, state, last_metrics, log, final=False)
        else:
            report(last_metrics | feed.data_metrics())
        # the next throughput window starts after the report/checkpoint, so saving is not counted as training
        window_tokens, window_flops, window_t0 = 0, 0.0, time.perf_counter()

    # end of the run: the step count, counters and history go into the final checkpoint
    rest = torch.tensor(float(window_tokens), device=device)
    dist.all_reduce(rest)
    state["tokens_total"] = state.get("tokens_total", 0) + int(rest.item())
    if pending:  # steps after the last log (the data ran out before total_steps)
        losses = torch.stack([p[1] for p in pending])
        dist.all_reduce(losses)
        if bool(bad.item()):
            raise FloatingPointError(f"non-finite loss or gradient norm within the last steps (rank {rank})")
        for (s, _, d, gn, lr_s), l in zip(pending, losses.tolist()):
            state["history"].append({"step": s, "loss": l / float(d), "lr": lr_s, "grad_norm": float(gn)})
    state["step"] = step
    state["blocks_consumed"] = feed.blocks_consumed
    state["counters"] = feed.counters_state()
    state["data_fingerprint"] = feed.fingerprint
    final = dict(last_metrics)
    final.update({"step": step, "loss": state["history"][-1]["loss"] if state["history"] else float("nan"),
                  "train_seconds": time.perf_counter() - run_t0, "tokens": state["tokens_total"], "done": True})
    if t_cfg.save_final:
        _save_and_report(recipe, model, opt, rank, state, final | feed.data_metrics(), log, final=True,
                         lm=lm, tokenizer=tok)
    else:
        import ray.train

        log.info("train.save_final=false: no final checkpoint or hf/ export")
        final_metrics = final | feed.data_metrics()
        log.log_metrics(final_metrics, step)   # the summary reads the end of the run from MLflow
        ray.train.report({k: v for k, v in final_metrics.items() if isinstance(v, (int, float, str, bool))})
    log.close()


def _save_and_report(recipe, model, opt, rank, state, metrics, log, *, final: bool, lm=None, tokenizer=None):
    import ray.train

    with tempfile.TemporaryDirectory(prefix="raytune_ckpt_") as d:
        ckpt_io.save_train_checkpoint(d, model, opt, rank, state)
        if final:
            ckpt_io.export_hf_folder(os.path.join(d, "hf"), model, lm.config, tokenizer, rank,
                                     dtype=torch.bfloat16 if recipe.model.dtype == "bfloat16" else torch.float32,
                                     prefix_strip="lm.", arch=type(lm).__name__)
        if rank == 0:
            ckpt_io.write_meta(d, {
                "job": recipe.job, "model_name": recipe.model.name, "revision": recipe.model.revision,
                "family": recipe.model.family, "step": state["step"], "final": final,
                "final_loss": state["history"][-1]["loss"] if state["history"] else None,
                "run_name": recipe.tracking.run_name, "loop": "fsdp2",
            })
        log.info(f"checkpoint at step {state['step']}{' (final, with hf/ export)' if final else ''}")
        extra = {}
        if _dies_after_upload(state["step"], rank):
            extra["checkpoint_upload_fn"] = _upload_then_die
        ray.train.report({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))},
                         checkpoint=ray.train.Checkpoint.from_directory(d), **extra)


# Fault injection for the fault-tolerance tests: "STEP:RANK" makes that rank's process exit right
# after its part of the step-STEP checkpoint is on storage, before its report reaches Ray, i.e. a
# worker dying in the checkpoint window. Ray must keep the previous checkpoint as the latest.
FAULT_AFTER_UPLOAD_ENV = "RAYTUNE_FAULT_AFTER_UPLOAD"


def _dies_after_upload(step: int, rank: int) -> bool:
    spec = os.environ.get(FAULT_AFTER_UPLOAD_ENV, "")
    return bool(spec) and spec.strip() == f"{step}:{rank}"


def _upload_then_die(checkpoint, checkpoint_dir_name: str):
    import ray.train

    ray.train.get_context().get_storage().persist_current_checkpoint(checkpoint, checkpoint_dir_name)
    print(f"[raytune_ft] {FAULT_AFTER_UPLOAD_ENV}: exiting after uploading {checkpoint_dir_name}", flush=True)
    os._exit(1)
