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
  activations         per token, what each decoder layer keeps for backward under the activation
                      checkpointing choice, part by part, and the largest unit the backward recomputes
                      (planning/checkpointing.py); `auto` is resolved here to the least recompute that fits.
  loss                the FSDP2 loop's chunked cross-entropy (models/loss.py): one chunk of fp32 logits
                      plus its compute-dtype gradient, an fp32 (V x D) lm_head-gradient accumulator and
                      the hidden-state gradient; never the full fp32 logits. The TRL loop without Liger
                      materialises full logits (bf16) and their fp32 upcast and gradient.
  LoRA (FSDP2)        the adapters' extra input gradients in the backward and a calibrated allowance
                      (plan_lora.py says which is which).
The components are summed (the loss's logits chunk, freed before the first recompute, shares its memory with the
recomputed layer); other phases that do not overlap are counted together, so the total is an upper estimate;
tests/planning/test_plan.py holds it against measured peaks. A plan "fits" when the total is within the GPU's memory
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
from raytune_ft.planning.checkpointing import choose
from raytune_ft.planning.cp_comms import CpExchange, CpStep, cp_exchange
from raytune_ft.planning.memory import (MemoryLine, compute_bytes, fmt_bytes, fmt_count, memory_lines,
                                        tokens_per_micro_batch)
from raytune_ft.planning.shapes import ModelShape, model_shape
from raytune_ft.recipe.checkpointing import FULL, NONE, Checkpointing, parse_checkpointing
from raytune_ft.recipe.recipe import Recipe


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
    checkpointing: str = ""              # the activation checkpointing planned (`auto` resolved)
    checkpointing_why: str = ""
    cp_exchange: CpExchange | None = None   # context parallelism's traffic per step and rank (cp_comms.py)

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
               f"  parameters   {fmt_count(s.total_params)}, trainable {fmt_count(self.trainable_params)}; "
               f"loop {self.loop}, {self.n_workers} worker{'s' if self.n_workers != 1 else ''}, "
               + (f"params/grads/optimizer sharded {self.shard} ways (FSDP2)" if self.shard > 1
                  else "params/grads/optimizer replicated on each worker")]
        where = (f"{self.gpu.name}, {self.gpu.memory_bytes / GiB:.1f} GiB ({self.gpu.memory_source})"
                 if self.gpu else "CPU worker (host memory)")
        out.append(f"  {'per GPU' if self.gpu else 'per worker':<12} {where}")
        out.append(f"  recompute    activation checkpointing {self.checkpointing_why}")
        width = max(len(line.name) for line in self.lines)
        for line in self.lines:
            out.append(f"    {line.name:<{width}}  {fmt_bytes(line.bytes)}   {line.how}")
        out.append(f"    {'total':<{width}}  {fmt_bytes(self.total_bytes)}   (sum of the lines above; "
                   "an upper estimate)")
        if self.gpu:
            verdict = "FITS" if self.fits else "DOES NOT FIT"
            out.append(f"  verdict      {verdict}: {self.total_bytes / GiB:.1f} GiB of a "
                       f"{self.budget_bytes / GiB:.1f} GiB budget ({self.gpu.name} less a "
                       f"{self.margin:.0%} margin for CUDA context, NCCL buffers, fragmentation)")
        for n in self.notes:
            out.append(f"  note         {n}")
        out.append("time plan:")
        flops = fmt_count(self.flops_per_token).replace(" B", " G")
        out.append(f"  FLOPs/token  {flops}FLOP (6 x matmul params + causal attention term, forward + backward)")
        if self.tokens:
            steps = f", {self.steps:,} optimizer steps" if self.steps else ""
            out.append(f"  tokens       {fmt_count(self.tokens)}{steps} ({self.tokens_source})")
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
        if self.cp_exchange is not None:
            out += self.cp_exchange.lines()
        return "\n".join(out)


def _fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    h, rem = divmod(int(round(seconds)), 3600)
    m, s = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s"


def mean_conversation(recipe: Recipe) -> tuple[DatasetSize | None, float]:
    """The training data's known size (None when unknown) and the mean conversation length the FLOPs use."""
    size = KNOWN_DATASETS.get((recipe.data.source.rstrip("/"), recipe.data.split))
    return size, (size.mean_tokens if size else float(min(recipe.data.seq_len, 1024)))


def resolve_checkpointing(recipe: Recipe, shape: ModelShape, g: GpuSpec | None,
                          margin: float = 0.10) -> tuple[Checkpointing, str]:
    """The FSDP2 loop's checkpointing choice and why, in one line: the recipe's own, or for `auto` the least
    recompute whose memory plan fits `g` less `margin` (planning/checkpointing.py)."""
    t = recipe.train
    if t.loop != "fsdp2":
        choice = FULL if t.gradient_checkpointing else NONE
        return choice, f"{choice.label} (the TRL loop's train.gradient_checkpointing)"
    choice = parse_checkpointing(t.activation_checkpointing)
    if choice is not None:
        return choice, f"{choice.label} (as the recipe sets it)"
    _, mean_conv = mean_conversation(recipe)
    return choose(shape, lambda c: sum(line.bytes for line in memory_lines(recipe, shape, g, c)[0]), g, margin,
                  mean_conv)


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
    t, workers = recipe.train, recipe.scaling.num_workers
    g = gpu_for(recipe, gpu)
    choice, why = resolve_checkpointing(recipe, shape, g, margin)
    lines, notes, trainable = memory_lines(recipe, shape, g, choice)
    if t.lora_r > 0:
        notes.append("LoRA: the frozen base still does its forward and input-gradient matmuls; the time "
                     "estimate counts full training FLOPs (an upper bound)")
    plan = Plan(job=recipe.job, model_name=recipe.model.name + (" (tiny)" if recipe.model.local_tiny else ""),
                shape=shape, shape_source=shape_src, loop=t.loop, gpu=g, n_workers=workers,
                shard=workers if t.loop == "fsdp2" else 1, lines=lines, margin=margin, trainable_params=trainable,
                notes=notes, checkpointing=choice.label, checkpointing_why=why)
    _plan_time(plan, recipe, tokens_per_s_per_gpu, mfu)
    if recipe.scaling.context_parallel > 1:
        step = CpStep(recipe.scaling.context_parallel, tokens_per_micro_batch(recipe), t.grad_accum,
                      compute_bytes(recipe, g))
        plan.cp_exchange = cp_exchange(shape, step, choice, g, plan.tokens_per_s_per_gpu)
    return plan


def _plan_time(plan: Plan, recipe: Recipe, tokens_per_s_per_gpu: float | None, mfu: float) -> None:
    """The time plan (module docstring): tokens, steps, throughput, evaluation and samples."""
    t, d, g = recipe.train, recipe.data, plan.gpu
    size, mean_conv = mean_conversation(recipe)
    plan.flops_per_token = fpt = plan.shape.flops_per_token(mean_conv)
    tokens_per_step = tokens_per_micro_batch(recipe) * t.grad_accum * plan.n_workers
    if size is not None:
        rows = min(size.rows, d.max_rows) if d.max_rows else size.rows
        plan.tokens = rows * size.mean_tokens * (1 - (d.validation_fraction or 0.0)) * t.epochs
        plan.tokens_source = size.source + (f", first {rows:,} rows" if d.max_rows else "") + \
            (f", x {t.epochs} epochs" if t.epochs > 1 else "")
    if t.max_steps:
        cap = t.max_steps * tokens_per_step
        if plan.tokens is None or cap < plan.tokens:
            plan.tokens = float(cap)
            plan.tokens_source = (f"train.max_steps {t.max_steps} x {tokens_per_step:,} tokens per step "
                                  "(full blocks; an upper bound)")
    plan.steps = t.max_steps or (math.ceil(plan.tokens / tokens_per_step) if plan.tokens else None)
    if tokens_per_s_per_gpu:
        plan.tokens_per_s_per_gpu, plan.tokens_per_s_source = tokens_per_s_per_gpu, "given"
    elif g is not None and g.peak_bf16_tflops > 0:
        plan.tokens_per_s_per_gpu = mfu * g.peak_bf16_tflops * 1e12 / fpt
        plan.tokens_per_s_source = (f"{mfu:.0%} MFU x {g.peak_bf16_tflops:,.0f} TFLOP/s datasheet dense bf16 peak / "
                                    f"{fpt / 1e9:.1f} GFLOP per token")
    if plan.tokens_per_s_per_gpu and t.loop == "fsdp2":
        _plan_eval_and_samples(plan, recipe, size, mean_conv)


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
