"""One pass of the 27B recipe on 8xB300, projected from parts measured at the model's real depth.

`raytune-ft plan qwen27b_b300` prints it after the memory plan. Every input is labelled: "measured" (a
figure from `python -m bench gpu shape`, the 64-layer model as rank 0 of 8 on one lent GPU, or another bench
named beside it) or "stated" (a datasheet or the recipe). The arithmetic:

  compute per step   the measured per-rank step time x (the measured GPU's dense bf16 peak / B300's): the
                     same MFU on the faster chip; scaled by tokens when the recipe's block differs, and by the
                     recompute the run makes on B300 against the measured step's (below).
  recompute          the activation checkpointing the run takes on B300 (`auto`: the least recompute that fits
                     its memory) against the measured step's (full, on a smaller GPU): a step is the forward F,
                     the backward 2F and the recomputed share s of the decoder layers' forward F_L, so compute
                     scales by (3 + s_B300 r) / (3 + s_measured r), r = F_L / F, the layers' share of the
                     forward's matmul FLOPs (lm_head the rest), at the same MFU.
  communication      FSDP2 per step and rank: the decoder layers' all-gather twice (forward, and again for the
                     backward, which recomputes under activation checkpointing) in the compute dtype, the
                     root unit's once (it stays gathered), for every micro-batch of the step (grad_accum, and
                     under context parallelism the C blocks a group trains), and the reduce-scatter of every
                     gradient in fp32, also once per micro-batch (the loop reduces each micro-batch's gradients
                     into the shards rather than hold them unsharded); a ring moves (N-1)/N of each, over the
                     GPU's stated NVLink bandwidth. FSDP2 prefetches the next layer's all-gather and overlaps the
                     reduce-scatters with the backward, so a step costs max(compute, communication) while
                     communication is the smaller.
  context parallel   the exchange of cp_comms.py, on the critical path: added to the step.
  data path          tokens/s the 8 ranks consume against the measured render + mask + pack rate of one core.
  checkpoints        each rank's DCP shard (weights and AdamW's two moments in the master dtype); the loop is
                     held for the staging copy into pinned host memory, the write runs in the background;
                     both at the rates measured by the shape bench's save of a 64-layer shard.
  evaluation,        the memory plan's own estimate (plan.py), at the projected tokens/s.
  samples
"""
from __future__ import annotations

from dataclasses import dataclass

from raytune_ft.planning.checkpointing import recompute_share
from raytune_ft.planning.cp_comms import COLLECTIVE_LATENCY_S
from raytune_ft.planning.hardware import GiB, gpu_spec
from raytune_ft.planning.measured import figure, measured_64, measured_64_cp
from raytune_ft.planning.plan import mean_conversation, resolve_checkpointing
from raytune_ft.recipe.checkpointing import parse_checkpointing

# the measured inputs, each with its bench record (planning/data/measured.json; tests/planning/test_measured.py):
# without context parallelism, and as a rank of a CP group (the long-context step, slower per token)
MEASURED_64: dict | None = measured_64()
MEASURED_64_CP: dict = measured_64_cp()
DATA_TOK_S_PER_CORE = float(figure("data_tok_s_per_core")["values"]["tok_s"])
# the seed's own figure for one pass of the recipe on 8xB300
SEED_PASS_HOURS = 2.5


@dataclass(frozen=True)
class Item:
    """One line of the projection: a value, its unit, and where it comes from."""
    name: str
    value: float
    unit: str
    source: str             # "measured" or "stated" (or "derived": arithmetic on the two)
    how: str


@dataclass
class Projection:
    items: list[Item]
    pass_seconds: float
    verdict: str

    def item(self, name: str) -> Item:
        return next(i for i in self.items if i.name == name)

    def lines(self) -> list[str]:
        out = ["full-pass projection (8 x B300, from the 64-layer measurement):"]
        for i in self.items:
            value = f"{i.value:,.3g}" if abs(i.value) < 100 else f"{i.value:,.0f}"
            out.append(f"  {i.name:<22} {value} {i.unit}  [{i.source}] {i.how}")
        out.append(f"  {'verdict':<22} {self.verdict}")
        return out


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def project(recipe, plan, measured: dict | None = None, gpu: str = "B300") -> Projection | None:
    """The projection of `recipe` (its memory `plan` gives the pass's steps, evaluation and samples) on 8 x
    `gpu`; None where no 64-layer measurement of this model exists, the loop is not FSDP2, or the run is a
    LoRA run (the measurement is full SFT's: its step, its fp32 reduce-scatter and its checkpoints are not a
    LoRA run's)."""
    cp = recipe.scaling.context_parallel
    m = measured if measured is not None else MEASURED_64_CP if cp > 1 else MEASURED_64
    shape = plan.shape
    if (m is None or recipe.train.loop != "fsdp2" or recipe.train.lora_r > 0 or shape.n_layers != m["layers"]
            or shape.hidden != m["hidden"]):
        return None
    target, source_gpu = gpu_spec(gpu), gpu_spec(m["gpu"])
    n = recipe.scaling.num_workers
    seq = recipe.data.seq_len * recipe.train.micro_batch_size * recipe.train.grad_accum
    items: list[Item] = []

    def add(name, value, unit, source, how) -> float:
        items.append(Item(name, float(value), unit, source, how))
        return float(value)

    in_cp = f" as one of a CP group of {m['cp']}" if m.get("cp", 1) > 1 else ""
    measured_s = add("measured step", m["s_per_step"], "s", "measured",
                     f"{m['gpu']}, rank 0 of {m['ranks']}{in_cp}, {m['seq']:,} tokens, {m['master']} master weights, "
                     f"{m['tok_s_per_rank']:,} tok/s per rank, MFU {m['mfu']:.1%} ({m['mfu_with_gdn']:.1%} with the "
                     f"gated-delta-net FLOPs), peak {m['peak_gib']} GiB; {m['date']}, {m['command']}")
    ratio = add("peak ratio", target.peak_bf16_tflops / source_gpu.peak_bf16_tflops, "x", "stated",
                f"{target.name} {target.peak_bf16_tflops:,.0f} / {source_gpu.name} {source_gpu.peak_bf16_tflops:,.0f} "
                "TFLOP/s dense bf16 (datasheets)")
    # under context parallelism a group trains its C members' blocks each step, a rank 1/C of each: the same
    # tokens per rank and step as without it; the CP measurement's block length is scaled linearly, so a longer
    # block (attention's quadratic part grows with it) is slower than this says
    split = (f"; {cp} blocks a step over the {cp} CP ranks, 1/{cp} of each a rank, attention's quadratic part "
             "scaled as the rest" if cp > 1 else "")
    recompute = _recompute(recipe, plan, m, target, add)
    compute = add("compute per step", measured_s / ratio * seq / m["seq"] * recompute, "s", "derived",
                  f"measured step / peak ratio x {seq:,} / {m['seq']:,} tokens x recompute (the same MFU on "
                  f"{target.name}; {recipe.train.master_weights} master weights change only the optimizer step's "
                  f"memory traffic{split})")
    step = _step(recipe, plan, target, compute, add)
    tok_s = seq * n / step
    need_cores = add("data path", tok_s / DATA_TOK_S_PER_CORE, "cores", "measured",
                     f"{tok_s:,.0f} tok/s for {n} ranks / {DATA_TOK_S_PER_CORE:,.0f} tok/s render + mask + pack per "
                     f"core (bench/data_pipeline.py); {recipe.scaling.cpus_per_worker * n} CPUs asked")
    steps = plan.steps or 0
    train_s = add("training", steps * step, "s", "derived", f"{steps:,} steps x step ({_hours(steps * step)})")
    param_b = 4 if recipe.train.master_weights == "fp32" else 2
    shard = 3 * shape.total_params * param_b / n
    add("checkpoint per rank", shard / 1e9, "GB", "derived",
        f"3 x {shape.total_params / 1e9:.1f} B params x {param_b} B / {n} (weights, AdamW's two moments)")
    ck = m.get("checkpoint") or {}
    every = recipe.train.checkpoint_every or 0
    n_ckpt = steps // every if every else 0
    held = 0.0
    if ck.get("held_s") and ck.get("bytes"):
        held = add("held per save", shard / ck["bytes"] * ck["held_s"], "s", "measured",
                   f"staging at the measured {ck['bytes'] / ck['held_s'] / 1e9:.1f} GB/s ({ck['gib']} GiB shard held "
                   f"{ck['held_s']} s)")
        add("background write", shard / ck["bytes"] * ck["write_s"], "s", "measured",
                    f"at the measured {ck['bytes'] / ck['write_s'] / 1e9:.1f} GB/s of the lent machine's disk; "
                    f"{'hidden' if ck['write_s'] * shard / ck['bytes'] < every * step else 'NOT hidden'} under the "
                    f"{every} steps to the next save")
    ckpt_s = add("checkpoints", n_ckpt * held, "s", "derived", f"{n_ckpt} saves x held per save")
    probes = (plan.eval_seconds or 0.0) + (plan.sample_seconds or 0.0)
    if plan.tokens_per_s_per_gpu:
        probes *= plan.tokens_per_s_per_gpu / (tok_s / n)
    probes = add("evaluation + samples", probes, "s", "derived", "the memory plan's estimate at the projected tok/s")
    startup = add("start-up", m["build_s"] + m["compile_s"], "s", "measured",
                  f"the 64-layer model's cold build ({m['build_s']} s, the kernel check's JIT in it) and compile "
                  f"({m['compile_s']} s) on the {m['gpu']}; Ray's and the data's start not in it")
    total = train_s + ckpt_s + probes + startup
    verdict = (f"one pass {_hours(total)} against the seed's {SEED_PASS_HOURS} h (stated): "
               f"{'faster' if total < SEED_PASS_HOURS * 3600 else 'slower'} by "
               f"{abs(SEED_PASS_HOURS * 3600 - total) / 3600:.2f} h; the data path needs {need_cores:.2f} cores")
    return Projection(items, total, verdict)


def _recompute(recipe, plan, m: dict, target, add) -> float:
    """The compute factor of the checkpointing the run takes on `target` against the measured step's (the
    module docstring's `recompute`), added as a line through `add`."""
    shape = plan.shape
    _, mean_len = mean_conversation(recipe)
    measured = parse_checkpointing(m["checkpointing"])     # a measured step names its own (measured.json)
    chosen, _ = resolve_checkpointing(recipe, shape, target)
    s_m, s_t = (recompute_share(shape, c, mean_len) for c in (measured, chosen))
    layers = shape.total_params - shape.root_params
    r = layers / (layers + shape.embedding_params)           # lm_head: vocab x hidden, as the embedding
    return add("recompute", (3 + s_t * r) / (3 + s_m * r), "x", "derived",
               f"on {target.name} {chosen.label} recomputes {s_t:.0%} of the layers' forward, the measured step "
               f"({measured.label}) {s_m:.0%}: (3 + {s_t:.2f} r) / (3 + {s_m:.2f} r), r = {r:.3f} the layers' "
               "share of the forward's matmul FLOPs")


def _step(recipe, plan, target, compute: float, add) -> float:
    """The step's seconds: compute, or FSDP2's traffic where that is the larger (overlapped), plus context
    parallelism's exchange (not overlapped); each term added as a line through `add`."""
    shape, n, cp = plan.shape, recipe.scaling.num_workers, recipe.scaling.context_parallel
    compute_b = 2 if recipe.model.dtype == "bfloat16" else 4
    layers_p = shape.total_params - shape.root_params
    ag = 2 * layers_p * compute_b + shape.root_params * compute_b
    rs = shape.total_params * 4
    ring = (n - 1) / n
    nvlink = add("NVLink", target.nvlink_gb_s, "GB/s", "stated", f"{target.name} per GPU and direction (datasheet)")
    mb = cp * recipe.train.grad_accum   # micro-batches a step: each gathers the layers again
    per_mb = f" x {mb} micro-batches" if mb > 1 else ""
    comm = add("communication", (ag + rs) * mb * ring / (nvlink * 1e9), "s", "derived",
               f"all-gather {ag / 1e9:,.0f} GB ({compute_b} B: layers twice, root once){per_mb} + reduce-scatter "
               f"{rs / 1e9:,.0f} GB (fp32){per_mb} per step, x (N-1)/N = {ring:.3f}, over NVLink")
    step = max(compute, comm)
    add("step", step, "s", "derived", "hidden under compute" if comm < compute else
        "communication-bound: communication exceeds compute")
    if cp > 1 and plan.cp_exchange is not None:     # on the critical path: added, not hidden (cp_comms.py)
        x = plan.cp_exchange
        cp_s = x.seconds_at(nvlink)
        step = add("step with CP", step + cp_s, "s", "derived",
                   f"+ the CP exchange: {x.bytes / 1e9:,.1f} GB per rank over NVLink and {x.collectives:,} "
                   f"collectives at {COLLECTIVE_LATENCY_S * 1e6:.0f} us (assumed), {cp_s:,.2f} s, not overlapped")
    return step


def memory_margin_line(plan) -> str | None:
    """The margin the plan's GPU leaves the shipped recipe: its memory less the plan's total, in GiB and %."""
    if plan.gpu is None:
        return None
    free = plan.gpu.memory_bytes - plan.total_bytes
    return (f"  margin       {free / GiB:.1f} GiB ({free / plan.gpu.memory_bytes:.0%} of {plan.gpu.name}'s "
            f"{plan.gpu.memory_bytes / GiB:.1f} GiB) left by the plan's {plan.total_bytes / GiB:.1f} GiB")


def plan_extras(recipe, plan) -> list[str]:
    """What `raytune-ft plan` prints after the memory and storage plans: the margin the GPU leaves, and the
    full-pass projection where a measurement at this model's depth exists."""
    out = [line] if (line := memory_margin_line(plan)) else []
    proj = project(recipe, plan)
    if proj is None and recipe.train.lora_r > 0 and MEASURED_64 and plan.shape.n_layers == MEASURED_64["layers"]:
        out.append("  projection   none: the 64-layer measurement is full SFT's, and no LoRA run of this depth and "
                   "block length has been measured beside it")
    return out + (proj.lines() if proj else [])
