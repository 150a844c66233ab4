"""The FSDP2 loop's model: built on the meta device, packing paths on, activation checkpointing, the
chunked-loss wrapper, then sharded with FSDP2 (each decoder layer, then the root) and filled.

Split from the loop (train/fsdp_loop.py) so benchmarks and tests build exactly the model it trains.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from raytune_ft.recipe.checkpointing import Checkpointing, parse_checkpointing
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.common import WorkerLog


class PackedCausalLM(nn.Module):
    """A causal LM whose forward returns (sum of shifted token losses, supervised token count).

    Wrapping the HF model lets FSDP2's root hooks cover the embedding, final norm and lm_head
    while the loss is computed in chunks, never holding fp32 logits for a whole block.
    """

    def __init__(self, lm: nn.Module, loss_chunk: int = 4096):
        super().__init__()
        self.lm = lm
        self.loss_chunk = loss_chunk

    def forward(self, labels: torch.Tensor | None, logits_at: torch.Tensor | None = None, shift: bool = True,
                **packed_kwargs):
        """(loss sum, supervised count) of `labels`; with `logits_at` (token positions of the packed
        row) the fp32 logits at those positions instead (sampling), inside the root's forward too.
        shift=False: `labels` are already each token's target (a context-parallel share's)."""
        from raytune_ft.models.loss import chunked_cross_entropy

        hidden = self.lm.model(**packed_kwargs).last_hidden_state
        if logits_at is not None:
            return self.lm.lm_head(hidden[0, logits_at]).float()
        return chunked_cross_entropy(hidden, self.lm.lm_head.weight, labels, chunk_size=self.loss_chunk,
                                     shift=shift)


def build_fsdp_model(recipe: Recipe, device: torch.device, log: WorkerLog):
    """Build (or load) the model, install the packed-sequence paths, and shard it with FSDP2."""
    from raytune_ft.models.tokenizer import tokenizer_for

    fp8_recipe = recipe.train.fp8_recipe if recipe.train.precision == "fp8" else None
    if fp8_recipe:   # this worker's own device decides; refused before anything is loaded
        from raytune_ft.train.fp8 import check_fp8_supported

        check_fp8_supported(device, fp8_recipe)
    tok = tokenizer_for(recipe.model)
    log.startup.mark("model_build.tokenizer")
    # the model code's imports (transformers' modelling, the kernels) count as the model code's part
    from raytune_ft.compat import transformers_without_torchao

    with transformers_without_torchao(recipe.train.precision):
        from raytune_ft.models.attention import select_attention_backend
        from raytune_ft.models.build import load_causal_lm, materialize_model
        from raytune_ft.models.kernel_check import KernelUse, check_on_worker

    on_gpu = device.type == "cuda"
    compute_dtype = torch.bfloat16 if (on_gpu and recipe.model.dtype == "bfloat16") else torch.float32
    param_dtype = torch.float32 if recipe.train.master_weights == "fp32" else compute_dtype
    lora = recipe.train.lora_r > 0
    if lora:   # the frozen base in the compute dtype; the adapters are fp32 (train/lora.py)
        param_dtype = compute_dtype
    # Built on the meta device, sharded, then filled: each rank allocates and reads only its own
    # shard of the weights, so no rank ever holds the whole model in host or GPU memory.
    lm = load_causal_lm(recipe.model, tokenizer_vocab_size=len(tok), device="meta", dtype=param_dtype)
    log.startup.mark("model_build.skeleton")
    # every fast kernel proves itself on this GPU before the first step; a failing one is switched off
    checking = time.time()
    check_on_worker(KernelUse(lm.config, device, compute_dtype, context_parallel=recipe.scaling.context_parallel > 1),
                    mode=recipe.train.kernels, log=log)
    log.startup.mark("kernel_check", since=checking)
    backend = select_attention_backend(device)
    log.info(f"attention backend: {backend}; params {param_dtype}, compute {compute_dtype}, reduce fp32")
    recompute = resolve_on_worker(recipe, lm.config, device, log)
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
    if lora:   # after fp8: the adapters wrap the (converted) base linears and stay in high precision
        from raytune_ft.train.lora import add_adapters

        n = len(add_adapters(lm, recipe.train))
        log.info(f"LoRA r={recipe.train.lora_r} alpha={recipe.train.lora_alpha} on {n} linears; base frozen "
                 f"in {param_dtype}")
    if recipe.train.compile:
        compile_pointwise(lm)
        log.info("torch.compile: each decoder layer's MLP and RMSNorms")
    model = shard_packed_model(lm, device, compute_dtype=compute_dtype, activation_checkpointing=recompute)
    log.startup.mark("model_build.wrapping")
    materialize_model(lm, recipe.model, device, seed=recipe.train.seed)
    if lora:
        from raytune_ft.train.lora import init_adapters

        init_adapters(lm, recipe.train.seed)
    log.startup.mark("model_build.weights")
    return model, lm, tok


def resolve_on_worker(recipe: Recipe, config, device: torch.device, log: WorkerLog) -> Checkpointing:
    """The activation checkpointing this worker applies, said once with why (log line and MLflow param):
    `auto` is resolved by the memory plan for this worker's GPU and the model as built."""
    from raytune_ft.planning.hardware import device_spec
    from raytune_ft.planning.plan import resolve_checkpointing
    from raytune_ft.planning.shapes import ModelShape

    gpu = None
    if device.type == "cuda":
        gpu = device_spec(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    choice, why = resolve_checkpointing(recipe, ModelShape.from_config(config), gpu)
    log.info(f"activation checkpointing {why}")
    log.log_param("activation_checkpointing_ran", choice.label)
    return choice


def compile_pointwise(lm: nn.Module) -> None:
    """torch.compile the memory-bound pieces of each decoder layer: SwiGLU MLP and the fp32 RMSNorms
    (and the gated norm of gated-delta-net layers): unfused, these element-wise kernels are a visible
    share of the step (about half of it at the 27B's layer shapes). Blocks have a fixed length, so each module
    kind compiles one graph."""
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
                       activation_checkpointing: str | Checkpointing = "full",
                       loss_chunk: int = 4096) -> PackedCausalLM:
    """Turn a built causal LM into the loop's training module: packing paths on, activation
    checkpointing per `activation_checkpointing` (a resolved choice, or its text: "none", "full",
    "selective", "every:N", parts such as "gated_delta+mlp"; not "auto", which the plan resolves), the
    chunked-loss wrapper, then FSDP2 (each decoder layer, then the root; compute in `compute_dtype`,
    gradients reduced in fp32). The parameters keep the dtype they were built in (the master weights).

    Split from build_fsdp_model so benchmarks can hand in a model built directly on the GPU at a real
    shape with random weights and still train exactly what the loop trains."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from raytune_ft.models.build import decoder_layers
    from raytune_ft.models.gated_delta import enable_packing
    from raytune_ft.train.recompute import apply_checkpointing

    choice = activation_checkpointing
    if not isinstance(choice, Checkpointing):
        choice = parse_checkpointing(choice, "activation_checkpointing")
        if choice is None:
            raise ValueError("activation_checkpointing: 'auto' is resolved by the memory plan "
                             "(resolve_on_worker) before the model is sharded")
    enable_packing(lm)
    layers = decoder_layers(lm)
    apply_checkpointing(lm, layers, choice)
    model = PackedCausalLM(lm, loss_chunk)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if not any(p.is_meta for p in model.parameters()):  # a meta model is filled by materialize_model
        model.to(device)
    return model
