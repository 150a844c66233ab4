"""Will the recipe fit, and how long will one pass take? A per-GPU memory and time plan, before Ray starts.

`memory_plan(recipe)` reads the model's shape (shapes.py: the real config for the recipe models, the tiny
config with `model.local_tiny`), the GPU (hardware.py), the loop (FSDP2 or TRL), the scaling and the activation checkpointing, and
returns a `Plan` whose `render()` is what `raytune-ft plan JOB` and `--dry-run` print.

The memory model (bytes per GPU; every line is a stated estimate, not a measurement):
  params / grads      FSDP2 shards them over `scaling.num_workers`; the TRL loop (DDP) keeps a full copy.
                      Grads have the dtype of the parameters they belong to.
  optimizer           AdamW, two states per trainable parameter. `torch.optim.AdamW` allocates them with
                      `zeros_like(param)`: fp32 with `train.master_weights=fp32`, bf16 with `bf16`.
  FSDP2 gathered      the root unit (embeddings, final norm, lm_head) stays unsharded during the step
                      (the root is not resharded after forward); two decoder layers are gathered at a
                      time (current + prefetch) in the compute dtype; one layer's unsharded fp32
                      gradients wait for their reduce-scatter (reduce dtype fp32).
  activations         per token, the tensors a decoder layer saves for backward (listed in
                      `_layer_activation_elems`); `full` checkpointing keeps each layer's input and
                      recomputes one layer at a time, `selective` (as the FSDP2 loop does it) checkpoints
                      every other layer, `none` keeps every layer's tensors. Attention is a varlen /
                      SDPA kernel: no (T x T) score matrix is stored.
  loss                the FSDP2 loop's chunked cross-entropy (models/loss.py): one chunk of fp32 logits
                      plus its compute-dtype gradient, an fp32 (V x D) lm_head-gradient accumulator and
                      the hidden-state gradient; never the full fp32 logits. The TRL loop without Liger
                      materialises full logits (bf16) and their fp32 upcast and gradient.
  LoRA (FSDP2)        the adapters' extra input gradients in the backward and a calibrated allowance
                      (plan_lora.py says which is which).
The components are summed (the loss's logits chunk, freed before the first recompute, shares its memory with the
recomputed layer); other phases that do not overlap are counted together, so the total is an upper estimate; tests/test_plan.py holds it against
peaks measured on an H200 (TRL on the Qwen3-4B shape, the seed loop on the 4B shape and on the 27B shape
cut to 16 layers). A plan "fits" when the total is within the GPU's memory
less a margin (default 10%) for the CUDA context, NCCL buffers and allocator fragmentation.

The time model: tokens of one pass / (tokens/s per GPU x GPUs), tokens/s per GPU = MFU x bf16 peak /
training FLOPs per token, peaks and FLOPs from `raytune_ft.planning.hardware` (the datasheet dense bf16 peak and the
FLOPs the loops count for MFU). Evaluation and samples (FSDP2 loop) are forward passes only, a third of
the training FLOPs per token at the same MFU: the held-out tokens spread over the GPUs; the samples'
forwards (no KV cache: each new token a forward over the prompt and the tokens so far) the same on every
GPU. Their FSDP2 all-gather of the weights per forward is not counted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from raytune_ft.planning.hardware import GPUS, GiB, GpuSpec, gpu_spec
from raytune_ft.planning.lora import lora_fsdp2_lines, lora_layer_params, lora_state_lines
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.planning.shapes import ModelShape, model_shape


# ------------------------------------------------------------------ GPUs

# The GPU each shipped job is written for, when scaling.accelerator_type leaves it open.
DEFAULT_GPU_BY_JOB = {"qwen27b_b300": "B300", "qwen3_4b_full": "H100", "qwen2_05b_lora": "H100",
                      "qwen27b_lora": "H200"}


def gpu_for(recipe: Recipe, gpu: str | None = None) -> GpuSpec | None:
    """The GPU the plan is for: `gpu`, else scaling.accelerator_type, else the job's default; None on CPU."""
    if gpu is None and not recipe.scaling.use_gpu:
        return None
    name = gpu or recipe.scaling.accelerator_type or DEFAULT_GPU_BY_JOB.get(recipe.job, "H100")
    spec = gpu_spec(name)
    if spec is not None:
        return spec
    raise ValueError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")


# ------------------------------------------------------------------ data sizes

@dataclass(frozen=True)
class DatasetSize:
    rows: int
    mean_tokens: float
    source: str


# UltraChat 200k train_sft: 207,865 rows (the dataset card's split size); mean 1,322 tokens per
# conversation (median 1,238) rendered with the Qwen3.8 chat template and the real Qwen tokenizer, as
# measured by ../shared/peers/data_peer.py (peers/README.md; issue 4). The 16 rows in
# tests/fixtures/data give a mean of 1,365 with the Qwen3 vocabulary, consistent with it.
KNOWN_DATASETS: dict[tuple[str, str], DatasetSize] = {
    ("hf://HuggingFaceH4/ultrachat_200k", "train_sft"): DatasetSize(
        207_865, 1_322,
        "UltraChat 200k train_sft: 207,865 rows x mean 1,322 tokens (Qwen3.8 template, counted over the whole split)"),
    ("hf://HuggingFaceH4/ultrachat_200k", "test_sft"): DatasetSize(
        23_110, 1_322, "UltraChat 200k test_sft: 23,110 rows (the dataset card) x mean 1,322 tokens (train_sft's "
                       "mean, assumed)"),
}
# a prompt file's prompts are not tokenized to plan: each counts as this many tokens
PROMPT_FILE_TOKENS = 256


# ------------------------------------------------------------------ the plan

@dataclass
class MemoryLine:
    name: str
    bytes: float
    how: str                         # the arithmetic, in words


@dataclass
class Plan:
    """A per-GPU memory estimate and a time estimate for one recipe."""

    job: str
    model_name: str
    shape: ModelShape
    shape_source: str
    loop: str
    gpu: GpuSpec | None
    n_workers: int
    shard: int                       # how many ways params/grads/optimizer are split
    lines: list[MemoryLine]
    margin: float
    trainable_params: int
    tokens: float | None = None      # tokens of the run (one pass, or max_steps x tokens per step)
    tokens_source: str = ""
    steps: int | None = None
    flops_per_token: float = 0.0
    tokens_per_s_per_gpu: float | None = None
    tokens_per_s_source: str = ""
    notes: list[str] = field(default_factory=list)
    eval_each_s: float | None = None     # one held-out evaluation
    eval_count: int | None = None        # evaluations in the run (None: the step count is unknown)
    eval_how: str = ""
    sample_each_s: float | None = None   # one round of sample generations
    sample_rounds: int | None = None
    sample_how: str = ""

    @property
    def eval_seconds(self) -> float | None:
        """Seconds of the run's evaluations (of one, when the step count is unknown); None: off or unknown."""
        return None if self.eval_each_s is None else self.eval_each_s * (self.eval_count or 1)

    @property
    def sample_seconds(self) -> float | None:
        return None if self.sample_each_s is None else self.sample_each_s * (self.sample_rounds or 1)

    @property
    def total_bytes(self) -> float:
        return sum(line.bytes for line in self.lines)

    @property
    def budget_bytes(self) -> float | None:
        return None if self.gpu is None else self.gpu.memory_bytes * (1.0 - self.margin)

    @property
    def fits(self) -> bool:
        """True when the estimate is within the GPU's memory less the margin (always True on CPU)."""
        return self.budget_bytes is None or self.total_bytes <= self.budget_bytes

    @property
    def seconds(self) -> float | None:
        if not self.tokens or not self.tokens_per_s_per_gpu:
            return None
        return self.tokens / (self.tokens_per_s_per_gpu * self.n_workers)

    def component(self, name: str) -> float:
        return sum(line.bytes for line in self.lines if line.name == name)

    def render(self) -> str:
        s = self.shape
        out = [f"memory plan: {self.job} - {self.model_name}",
               f"  model        {s.describe()}  [{self.shape_source}]",
               f"  parameters   {_fmt_count(s.total_params)}, trainable {_fmt_count(self.trainable_params)}; "
               f"loop {self.loop}, {self.n_workers} worker{'s' if self.n_workers != 1 else ''}, "
               + (f"params/grads/optimizer sharded {self.shard} ways (FSDP2)" if self.shard > 1
                  else "params/grads/optimizer replicated on each worker")]
        where = (f"{self.gpu.name}, {self.gpu.memory_bytes / GiB:.1f} GiB ({self.gpu.memory_source})"
                 if self.gpu else "CPU worker (host memory)")
        out.append(f"  {'per GPU' if self.gpu else 'per worker':<12} {where}")
        width = max(len(line.name) for line in self.lines)
        for line in self.lines:
            out.append(f"    {line.name:<{width}}  {_fmt_bytes(line.bytes)}   {line.how}")
        out.append(f"    {'total':<{width}}  {_fmt_bytes(self.total_bytes)}   (sum of the lines above; "
                   "an upper estimate)")
        if self.gpu:
            verdict = "FITS" if self.fits else "DOES NOT FIT"
            out.append(f"  verdict      {verdict}: {self.total_bytes / GiB:.1f} GiB of a "
                       f"{self.budget_bytes / GiB:.1f} GiB budget ({self.gpu.name} less a "
                       f"{self.margin:.0%} margin for CUDA context, NCCL buffers, fragmentation)")
        for n in self.notes:
            out.append(f"  note         {n}")
        out.append("time plan:")
        flops = _fmt_count(self.flops_per_token).replace(" B", " G")
        out.append(f"  FLOPs/token  {flops}FLOP (6 x matmul params + causal attention term, forward + backward)")
        if self.tokens:
            steps = f", {self.steps:,} optimizer steps" if self.steps else ""
            out.append(f"  tokens       {_fmt_count(self.tokens)}{steps} ({self.tokens_source})")
        else:
            out.append("  tokens       unknown: no token count known for this data source and no train.max_steps")
        if self.tokens_per_s_per_gpu:
            out.append(f"  throughput   {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
                       f"({self.tokens_per_s_source})")
        elif self.gpu is None:
            out.append("  throughput   not estimated on CPU (pass --tokens-per-s-per-gpu, or --gpu H100 to plan "
                       "for a GPU)")
        else:
            out.append(f"  throughput   unknown: no bf16 peak known for {self.gpu.name} (pass --tokens-per-s-per-gpu)")
        gpus = f"{self.n_workers} GPU{'s' if self.n_workers != 1 else ''}"
        for name, each, count, how in (("evaluation", self.eval_each_s, self.eval_count, self.eval_how),
                                       ("samples", self.sample_each_s, self.sample_rounds, self.sample_how)):
            if each is not None:
                times = f"{count} x {_fmt_duration(each)} = {_fmt_duration(each * count)}" if count else \
                    f"{_fmt_duration(each)} each"
                out.append(f"  {name:<12} {times} ({how})")
        if self.seconds is not None:
            out.append(f"  time         {_fmt_duration(self.seconds)} on {gpus}, excluding start-up, "
                       "checkpoints, evaluation and samples")
            extra = (self.eval_seconds or 0.0) + (self.sample_seconds or 0.0)
            if extra:
                out.append(f"  with both    {_fmt_duration(self.seconds + extra)} (training + evaluation + samples)")
        elif self.tokens_per_s_per_gpu:
            per_m = 1e6 / (self.tokens_per_s_per_gpu * self.n_workers)
            out.append(f"  time         {_fmt_duration(per_m)} per million tokens on {gpus}")
        return "\n".join(out)


def _fmt_bytes(n: float) -> str:
    return f"{n / GiB:8.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / 1024**2:8.2f} MiB"


def _fmt_count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f}"


def _fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    h, rem = divmod(int(round(seconds)), 3600)
    m, s = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s"


def _layer_activation_elems(s: ModelShape, kind: str) -> float:
    """Elements (compute dtype) one decoder layer saves for backward, per token.

    Shared by both kinds: the RMSNorm inputs and outputs around the mixer and the MLP (4 x hidden), and
    the SwiGLU MLP's gate, up, silu(gate) and product (4 x intermediate).
    Full attention: q (and Qwen3.5's output gate), k, v, their normed/rotated copies, the attention
    output, and for Qwen3.5 the sigmoid gate and gated output.
    Gated-delta-net: the qkv projection, its conv and silu outputs, z, the l2-normed q/k, the recurrence
    output, the gated norm's output, and the chunked recurrence's per-chunk states (fp32, one
    dk x dv state per value head every 64 tokens, counted as two compute-dtype elements each).
    """
    h, inter = s.hidden, s.intermediate
    n = 4 * h + 4 * inter
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    if kind == "full_attention":
        n += 6 * q + 3 * kv if s.family == "qwen3_5" else 3 * q + 3 * kv
    else:
        kd, vd = s.lin_k_heads * s.lin_k_dim, s.lin_v_heads * s.lin_v_dim
        conv = 2 * kd + vd
        n += 3 * conv + vd + 2 * kd + 2 * vd + 4 * s.lin_v_heads
        n += 2 * s.lin_v_heads * s.lin_k_dim * s.lin_v_dim / 64
    return n


def memory_plan(recipe: Recipe, *, gpu: str | None = None, tokens_per_s_per_gpu: float | None = None,
                mfu: float = 0.40, margin: float = 0.10, shape: ModelShape | None = None) -> Plan:
    """The per-GPU memory plan and time estimate of `recipe` (see the module docstring for the model).

    gpu: plan for this GPU (B300, H200, H100, ...) instead of scaling.accelerator_type / the job's default.
    tokens_per_s_per_gpu: throughput to assume; default `mfu` x the GPU's bf16 peak / FLOPs per token.
    margin: the fraction of GPU memory kept free. shape: a model shape to use instead of the recipe's.
    """
    if shape is not None:
        shape_src = "given"
    else:
        shape, shape_src = model_shape(recipe)
    t, s_cfg, d = recipe.train, recipe.scaling, recipe.data
    g = gpu_for(recipe, gpu)
    on_gpu = g is not None
    compute_b = 2 if (on_gpu and recipe.model.dtype == "bfloat16") else 4
    workers = s_cfg.num_workers
    lora = t.lora_r > 0
    shard = workers if t.loop == "fsdp2" else 1
    lines: list[MemoryLine] = []
    notes: list[str] = []
    P = shape.total_params

    def add(name: str, n_bytes: float, how: str) -> None:
        lines.append(MemoryLine(name, float(n_bytes), how))

    # ---- states
    if lora:   # the frozen base, fp32 adapters with their grads and AdamW states (plan_lora.py)
        trainable, state_lines = lora_state_lines(shape, t, compute_b, shard, _fmt_count)
        for line in state_lines:
            add(*line)
    else:
        trainable = P
        param_b = 4 if (t.master_weights == "fp32" or compute_b == 4) else 2
        pname = "fp32" if param_b == 4 else "bf16"
        div = f" / {shard}" if shard > 1 else ""
        add("params", P * param_b / shard, f"{_fmt_count(P)} x {param_b} B ({pname}){div}")
        add("grads", P * param_b / shard, f"{pname}, as the params{div}")
        add("optimizer", 2 * P * param_b / shard, f"AdamW 2 states x {param_b} B ({pname}, zeros_like param){div}")
        if param_b == 2:
            notes.append("master_weights=bf16: weights, grads and AdamW states are bf16; updates smaller than "
                         "bf16's resolution (~1e-3 relative) are lost")
        if t.loop == "trl" and param_b == 4 and compute_b == 2:
            # autocast caches the bf16 copy of every weight for the duration of the forward
            add("autocast copies", P * 2, "bf16 casts of the fp32 weights, cached by autocast during forward")

    if t.loop == "fsdp2":
        grads = lora_layer_params(shape, t) if lora else shape.max_layer_params    # LoRA: the adapters' only
        gathered = (shape.root_params + 2 * shape.max_layer_params) * compute_b + grads * 4
        add("fsdp gathered", gathered,
            f"root unit {_fmt_count(shape.root_params)} + 2 layers x {_fmt_count(shape.max_layer_params)} "
            f"unsharded in {compute_b} B, + 1 layer of fp32 grads before reduce-scatter")
    elif workers > 1:
        add("ddp buckets", trainable * (4 if lora else (4 if t.master_weights == "fp32" else 2)),
            "DDP's gradient buckets (a second copy of the trainable grads)")

    # ---- activations
    if t.loop == "fsdp2":
        tokens_mb = d.seq_len * t.micro_batch_size
        mode = t.activation_checkpointing
    else:
        per_example = d.seq_len if t.packing else (t.max_length or d.seq_len)
        tokens_mb = per_example * t.micro_batch_size
        mode = "full" if t.gradient_checkpointing else "none"
    per_layer = {k: _layer_activation_elems(shape, k) for k in set(shape.layer_types)}
    layer_in = shape.hidden  # a checkpointed layer keeps only its input
    if mode == "none":
        kept = sum(per_layer[k] for k in shape.layer_types)
        recompute = 0.0
        how = "every layer's saved tensors"
    elif mode == "full":
        kept = layer_in * shape.n_layers
        recompute = max(per_layer.values())
        how = "full checkpointing: each layer's input + one layer recomputed"
    else:  # selective: the FSDP2 loop checkpoints every other layer
        kept = sum(per_layer[k] if i % 2 == 1 else layer_in for i, k in enumerate(shape.layer_types))
        recompute = max(per_layer.values())
        how = "selective: every other layer checkpointed"
    add("activations", (kept + recompute) * tokens_mb * compute_b,
        f"{tokens_mb:,} tokens x {_fmt_count(kept + recompute)} elements x {compute_b} B ({how})")

    if t.loop == "fsdp2" and t.precision == "fp8":
        from raytune_ft.planning.shapes import fp8_linear_filter_dims

        conv = [(i, o) for k in set(shape.layer_types) for i, o in shape.linears(k).values()
                if fp8_linear_filter_dims(i, o, t.fp8_recipe)]
        if conv:
            x, go, w = max(i for i, _ in conv), max(o for _, o in conv), max(i * o for i, o in conv)
            add("float8 casts", 2 * (tokens_mb * (x + go) + w),
                f"1-byte casts of the largest float8 matmul's input ({tokens_mb:,} x {x:,}), output gradient "
                f"({tokens_mb:,} x {go:,}) and weight, each with its transpose for backward ({t.fp8_recipe}; "
                "the float8 all-gather's smaller weights are not subtracted above)")

    # ---- loss
    V, D = shape.vocab, shape.hidden
    if t.loop == "fsdp2":
        chunk = min(4096, tokens_mb)
        head_grad = 0 if lora else V * D * 4       # a frozen lm_head gets no gradient accumulator
        logits = chunk * V * (4 + compute_b)
        # the loss's logits are freed before the backward recomputes its first layer: the two never coexist
        shared = min(logits, recompute * tokens_mb * compute_b)
        add("loss", logits - shared + head_grad + 2 * tokens_mb * D * compute_b,
            f"chunked CE: {chunk:,} x {V:,} fp32 logits + grad (less {_fmt_bytes(shared).strip()} freed before the "
            f"first recompute), {'no' if lora else 'fp32'} lm_head grad accumulator, final hidden + its grad")
        for line in lora_fsdp2_lines(shape, t, tokens_mb, compute_b, P * compute_b / shard) if lora else ():
            add(*line)
    elif t.use_liger and on_gpu:
        chunk = min(tokens_mb, 2048)
        add("loss", chunk * V * (4 + compute_b) + 2 * tokens_mb * D * compute_b,
            f"Liger fused linear CE: ~{chunk:,}-token chunks of logits")
    else:
        add("loss", tokens_mb * V * (compute_b + 8),
            f"full logits: {tokens_mb:,} x {V:,} x ({compute_b} B + fp32 upcast + fp32 grad)")

    # ---- time
    size = KNOWN_DATASETS.get((d.source.rstrip("/"), d.split))
    mean_conv = size.mean_tokens if size else float(min(d.seq_len, 1024))
    fpt = shape.flops_per_token(mean_conv)
    tokens_per_step = tokens_mb * t.grad_accum * workers
    tokens: float | None = None
    tokens_src = ""
    if size is not None:
        rows = min(size.rows, d.max_rows) if d.max_rows else size.rows
        tokens = rows * size.mean_tokens * (1 - (d.validation_fraction or 0.0)) * t.epochs
        tokens_src = size.source + (f", first {rows:,} rows" if d.max_rows else "") + \
            (f", x {t.epochs} epochs" if t.epochs > 1 else "")
    if t.max_steps:
        cap = t.max_steps * tokens_per_step
        if tokens is None or cap < tokens:
            tokens = float(cap)
            tokens_src = (f"train.max_steps {t.max_steps} x {tokens_per_step:,} tokens per step "
                          "(full blocks; an upper bound)")
    steps = t.max_steps or (math.ceil(tokens / tokens_per_step) if tokens else None)
    if tokens_per_s_per_gpu:
        tps_src = "given"
    elif g is not None and g.peak_bf16_tflops > 0:
        tokens_per_s_per_gpu = mfu * g.peak_bf16_tflops * 1e12 / fpt
        tps_src = (f"{mfu:.0%} MFU x {g.peak_bf16_tflops:,.0f} TFLOP/s datasheet dense bf16 peak / "
                   f"{fpt / 1e9:.1f} GFLOP per token")
    else:
        tps_src = ""
    if lora:
        notes.append("LoRA: the frozen base still does its forward and input-gradient matmuls; the time "
                     "estimate counts full training FLOPs (an upper bound)")
    plan = Plan(job=recipe.job, model_name=recipe.model.name + (" (tiny)" if recipe.model.local_tiny else ""),
                shape=shape, shape_source=shape_src, loop=t.loop, gpu=g, n_workers=workers, shard=shard,
                lines=lines, margin=margin, trainable_params=trainable, tokens=tokens, tokens_source=tokens_src,
                steps=steps, flops_per_token=fpt, tokens_per_s_per_gpu=tokens_per_s_per_gpu,
                tokens_per_s_source=tps_src, notes=notes)
    if tokens_per_s_per_gpu and t.loop == "fsdp2":
        _plan_eval_and_samples(plan, recipe, size, mean_conv)
    return plan


def _plan_eval_and_samples(plan: Plan, recipe: Recipe, train_size: DatasetSize | None, mean_conv: float) -> None:
    """The cost of the FSDP2 loop's held-out evaluations and sample rounds (module docstring: the model)."""
    t, d = recipe.train, recipe.data
    forward_tps = 3 * plan.tokens_per_s_per_gpu        # forward only: 2 of the 6 FLOPs per parameter and token
    steps = plan.steps
    if t.eval_every:
        held = KNOWN_DATASETS.get((d.source.rstrip("/"), d.validation_split)) if d.validation_split else None
        rows = held.rows if held else None
        if rows is None and d.validation_fraction and train_size:
            rows = int(train_size.rows * d.validation_fraction)
        if d.validation_max_rows:
            rows = min(rows, d.validation_max_rows) if rows else d.validation_max_rows
        mean = held.mean_tokens if held else mean_conv
        if rows:
            held_tokens = rows * mean
            plan.eval_each_s = held_tokens / (forward_tps * plan.n_workers)
            plan.eval_count = (steps - 1) // t.eval_every + 1 if steps else None
            plan.eval_how = (f"every {t.eval_every} steps and at the end: {rows:,} held-out rows x {mean:,.0f} "
                             f"tokens, forward only at 3x the training tokens/s, over {plan.n_workers} GPUs")
    n = t.sample_count()
    if n != 0:
        if n is None:
            from raytune_ft.data.prompts import read_prompt_file

            n, prompt_len, what = len(read_prompt_file(str(t.sample_prompts))), PROMPT_FILE_TOKENS, "file prompts"
        else:
            prompt_len, what = mean_conv, "held-out prompts"
        m = t.sample_max_new_tokens
        forward_tokens = n * (m * prompt_len + m * (m - 1) / 2)
        plan.sample_each_s = forward_tokens / forward_tps
        plan.sample_rounds = (steps - 1) // t.checkpoint_every + 2 if steps else None
        plan.sample_how = (f"at the start, each checkpoint and the end: {n} {what} of ~{prompt_len:,.0f} tokens x up "
                           f"to {m} new tokens, a forward over the whole sequence per token, the same on every GPU")
