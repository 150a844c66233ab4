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

import torch
import torch.distributed as dist
from torch import nn

from raytune_ft.data.packing import DataCounters
from raytune_ft.recipe import Recipe
from raytune_ft.train import checkpoint as ckpt_io
from raytune_ft.train.batch import StepBatch, StepFeed, feed_owned_counts, worker_blocks
from raytune_ft.train.common import WorkerLog, lr_at, recipe_from_config, report
from raytune_ft.train.fp8 import precompute_fp8_scales


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


def _device() -> torch.device:
    import ray.train.torch

    return ray.train.torch.get_device()


def build_fsdp_model(recipe: Recipe, device: torch.device, log: WorkerLog):
    """Build (or load) the model, install the packed-sequence paths, and shard it with FSDP2."""
    from raytune_ft.models.attention import select_attention_backend
    from raytune_ft.models.build import load_causal_lm, materialize_model, tokenizer_for
    from raytune_ft.models.kernel_check import check_on_worker

    fp8_recipe = recipe.train.fp8_recipe if recipe.train.precision == "fp8" else None
    if fp8_recipe:   # this worker's own device decides; refused before anything is loaded
        from raytune_ft.train.fp8 import check_fp8_supported

        check_fp8_supported(device, fp8_recipe)
    tok = tokenizer_for(recipe.model)
    on_gpu = device.type == "cuda"
    compute_dtype = torch.bfloat16 if (on_gpu and recipe.model.dtype == "bfloat16") else torch.float32
    param_dtype = torch.float32 if recipe.train.master_weights == "fp32" else compute_dtype
    # Built on the meta device, sharded, then filled: each rank allocates and reads only its own
    # shard of the weights, so no rank ever holds the whole model in host or GPU memory.
    lm = load_causal_lm(recipe.model, tokenizer_vocab_size=len(tok), device="meta", dtype=param_dtype)
    # every fast kernel proves itself on this GPU before the first step; a failing one is switched off
    check_on_worker(lm.config, device, mode=recipe.train.kernels, dtype=compute_dtype, log=log)
    backend = select_attention_backend(device)
    log.info(f"attention backend: {backend}; params {param_dtype}, compute {compute_dtype}, "
             f"reduce fp32; activation checkpointing {recipe.train.activation_checkpointing}")
    ran = "bf16"
    if fp8_recipe:   # before compile and fully_shard: FSDP2 must see the float8 weights to all-gather them
        from raytune_ft.models.build import decoder_layers
        from raytune_ft.train.fp8 import convert_to_fp8

        n = len(convert_to_fp8(decoder_layers(lm), fp8_recipe))
        ran = f"fp8 {fp8_recipe} ({n} decoder linears)"
        log.info(f"precision: fp8 ({fp8_recipe}): {n} decoder linears compute in float8; embeddings, lm_head, "
                 f"norms and the gated-delta-net recurrence and conv in {compute_dtype}")
    else:
        log.info(f"precision: bf16 matmuls (compute {compute_dtype})")
    log.log_param("precision_ran", ran)
    if recipe.train.compile:
        compile_pointwise(lm)
        log.info("torch.compile: each decoder layer's MLP and RMSNorms")
    model = shard_packed_model(lm, device, compute_dtype=compute_dtype,
                               activation_checkpointing=recipe.train.activation_checkpointing)
    materialize_model(lm, recipe.model, device, seed=recipe.train.seed)
    return model, lm, tok


def compile_pointwise(lm: nn.Module) -> None:
    """torch.compile the memory-bound pieces of each decoder layer: SwiGLU MLP and the fp32 RMSNorms
    (and the gated norm of gated-delta-net layers): unfused, these element-wise kernels take a large
    share of the step (bench/NOTES.md has the profile). Blocks have a fixed length, so each module kind
    compiles one graph."""
    from raytune_ft.models.build import decoder_layers
    from raytune_ft.train.fp8 import compile_fp8_linears

    for layer in decoder_layers(lm):
        layer.mlp.compile()
        layer.input_layernorm.compile()
        layer.post_attention_layernorm.compile()
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.norm.compile()
    compile_fp8_linears(decoder_layers(lm))   # float8's casts fuse only compiled (none when bf16)


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

    recipe = recipe_from_config(config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = _device()
    log = WorkerLog(rank, recipe, config.get("mlflow_run_id"))
    t_cfg = recipe.train
    fp8_recipe = t_cfg.fp8_recipe if t_cfg.precision == "fp8" else None

    model, lm, tok = build_fsdp_model(recipe, device, log)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t_cfg.lr, betas=tuple(t_cfg.betas), weight_decay=t_cfg.weight_decay,
                            fused=device.type == "cuda")
    state = _resume_state(model, opt, rank, log)
    total_steps = int(config.get("total_steps") or t_cfg.max_steps or 0)
    feed = _open_feed(recipe, config, state, rank=rank, world=world, device=device)
    window = _Window(device, lm.config, world)
    log.info(f"MFU basis: {window.mfu_basis}")

    step = state["step"]
    run_t0 = time.perf_counter()
    last_metrics: dict = {}
    while total_steps == 0 or step < total_steps:
        blocks = feed.next_blocks()
        if blocks is None:  # every rank's data is spent
            break
        mbs = t_cfg.micro_batch_size
        micro_batches = [StepBatch.from_blocks(blocks[i:i + mbs], device) for i in range(0, len(blocks), mbs)]
        loss_sum, denom = forward_backward(model, micro_batches, world, device)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t_cfg.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = t_cfg.lr * lr_at(step, t_cfg, total_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fp8_recipe:
            precompute_fp8_scales(model, fp8_recipe)
        step += 1
        window.add(step, loss_sum, denom, grad_norm.detach(), lr, micro_batches)

        at_log = step % t_cfg.log_every == 0 or step == total_steps
        at_ckpt = step % t_cfg.checkpoint_every == 0 and step != total_steps
        if not (at_log or at_ckpt):
            continue
        last_metrics = window.close(state, rank)
        last_metrics["epoch_progress"] = step / total_steps if total_steps else 0.0
        _record_position(state, step, feed)
        log.progress(last_metrics, total_steps, time.perf_counter() - run_t0)
        if at_ckpt:
            _save_and_report(recipe, model, opt, rank, state, last_metrics, log, final=False)
        else:
            report(last_metrics | feed.counters.as_metrics())
        # the next window starts after the report/checkpoint, so saving is not counted as training
        window.restart()

    _finish(recipe, model, opt, lm, tok, rank, state, step, feed, window, last_metrics, log,
            time.perf_counter() - run_t0)


def _resume_state(model, opt, rank: int, log: WorkerLog) -> dict:
    """The train state of the checkpoint Ray hands this attempt (model and optimizer loaded), or a fresh one."""
    import ray.train

    state = {"step": 0, "blocks_consumed": 0, "history": [], "counters": {}}
    resume = ray.train.get_checkpoint()
    if resume is None:
        return state
    with resume.as_directory() as d:
        state = ckpt_io.load_train_checkpoint(d, model, opt, rank)
    # where each restart (Ray's, after a worker died, or a re-submit) picked the run up
    state.setdefault("resumed_from", []).append(state["step"])
    log.info(f"resumed from checkpoint at step {state['step']} ({state['blocks_consumed']} blocks consumed "
             f"on rank {rank})")
    return state


def _open_feed(recipe: Recipe, config: dict, state: dict, *, rank: int, world: int,
               device: torch.device) -> StepFeed:
    """This rank's feed of blocks, past the blocks the checkpoint had consumed."""
    # `blocks_by_rank` (tests, benchmarks): fixed blocks per rank instead of the Ray Data shard
    fixed = (config.get("blocks_by_rank") or {}).get(rank)
    saved = DataCounters.from_dict(state["counters"]) if state.get("counters") else DataCounters()
    counters = feed_owned_counts(saved, recipe.data.seq_len) if state["blocks_consumed"] else saved
    blocks = fixed if fixed is not None else worker_blocks(recipe, counters=counters)
    # the step flag travels on a CPU (gloo) group, so the GPU never waits for it
    group = dist.new_group(backend="gloo") if dist.is_initialized() and device.type == "cuda" else None
    return StepFeed(blocks, per_step=recipe.train.grad_accum * recipe.train.micro_batch_size,
                    seq_len=recipe.data.seq_len, counters=counters, rank=rank,
                    skip_blocks=state["blocks_consumed"], fingerprint=state.get("data_fingerprint"),
                    group=group)


def _record_position(state: dict, step: int, feed: StepFeed) -> None:
    """Where the run stands, for the next checkpoint: step, blocks consumed, counters, data fingerprint."""
    state["step"] = step
    state["blocks_consumed"] = feed.blocks_consumed
    state["counters"] = feed.counters.to_dict()
    state["data_fingerprint"] = feed.fingerprint


class _Window:
    """The steps since the last log: their losses (kept on the device until the host syncs anyway),
    tokens and model FLOPs, and a non-finite flag checked at each sync."""

    def __init__(self, device: torch.device, model_config, world: int):
        from raytune_ft.hardware import mfu_basis

        self.device, self.model_config, self.world = device, model_config, world
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.mfu_basis = mfu_basis(self.device_name)
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.restart()

    def restart(self) -> None:
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []
        self.tokens, self.flops, self.t0 = 0, 0.0, time.perf_counter()

    def add(self, step: int, loss_sum, denom, grad_norm, lr: float, micro_batches: list[StepBatch]) -> None:
        from raytune_ft.hardware import flops_per_block

        self.bad |= ~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)
        self.pending.append((step, loss_sum, denom, grad_norm, lr))
        for mb in micro_batches:
            self.tokens += mb.n_real
            self.flops += flops_per_block(self.model_config, mb.seq_lens)

    def close(self, state: dict, rank: int) -> dict:
        """Host sync: all-reduce the window's losses and tokens (a collective), stop on a non-finite
        value, append the steps to `state["history"]`, and return the window's metrics."""
        from raytune_ft.hardware import mfu_metrics

        dt = max(time.perf_counter() - self.t0, 1e-9)
        if self.pending:
            losses = torch.stack([p[1] for p in self.pending])
            dist.all_reduce(losses)
            if bool(self.bad.item()):
                raise FloatingPointError(
                    f"non-finite loss or gradient norm within steps {self.pending[0][0]}..{self.pending[-1][0]} "
                    f"(rank {rank}); stopping without saving: the last good checkpoint is kept. "
                    "Lower train.lr, check the data, or use train.master_weights=fp32.")
            for (s, _, d, gn, lr_s), loss in zip(self.pending, losses.tolist()):
                state["history"].append({"step": s, "loss": loss / float(d), "lr": lr_s, "grad_norm": float(gn)})
        tokens_all = torch.tensor(float(self.tokens), device=self.device)
        dist.all_reduce(tokens_all)
        state["tokens_total"] = state.get("tokens_total", 0) + int(tokens_all.item())
        if not self.pending:
            return {}
        tps = float(tokens_all) / dt
        last = state["history"][-1]
        m = {"step": last["step"], "loss": last["loss"], "lr": last["lr"], "grad_norm": last["grad_norm"],
             "tokens_per_s": tps, "tokens_per_s_per_worker": tps / self.world, "tokens": state["tokens_total"],
             **mfu_metrics(self.flops / dt, self.device_name)}
        if self.device.type == "cuda":
            m["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.pending = []
        return m


def _finish(recipe: Recipe, model, opt, lm, tok, rank: int, state: dict, step: int, feed: StepFeed,
            window: _Window, last_metrics: dict, log: WorkerLog, seconds: float) -> None:
    """End of the run: the steps since the last log go into the history, then the final checkpoint
    (with the hf/ export) or, with train.save_final=false, only the final metrics."""
    window.close(state, rank)
    _record_position(state, step, feed)
    final = dict(last_metrics)
    final.update({"step": step, "loss": state["history"][-1]["loss"] if state["history"] else float("nan"),
                  "train_seconds": seconds, "tokens": state["tokens_total"], "done": True})
    final |= feed.counters.as_metrics()
    if recipe.train.save_final:
        _save_and_report(recipe, model, opt, rank, state, final, log, final=True, lm=lm, tokenizer=tok)
    else:
        log.info("train.save_final=false: no final checkpoint or hf/ export")
        log.log_metrics(final, step)   # the summary reads the end of the run from MLflow
        report(final)
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
