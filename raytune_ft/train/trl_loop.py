"""The TRL loop: a `trl.SFTTrainer` inside each Ray Train worker, fed from the project's Ray Data pipeline.

The trainer never tokenizes or packs: each worker reads its share of the packed blocks the FSDP2
recipe trains on (same masks, same best-fit-decreasing packing), and a collator lays a micro-batch's
blocks end to end as one row with the varlen signals (`cu_seq_lens_q/k`, `max_length_q/k`,
`seq_idx`, restarting `position_ids`), TRL's padding-free format. The model's full attention and
gated-delta-net layers read those signals (`raytune_ft.models.gated_delta.enable_packing`), so no
token attends across a conversation boundary on CPU or GPU.

Steps are equal on every rank: a rank whose share runs dry feeds all-padding blocks (no supervised
token, so no gradient) until every rank is dry, and the stream is padded to whole optimizer steps, so
Hugging Face's accumulation never leaves a partial step behind. Without `train.max_steps` the number of
steps is counted first (one extra pass over the data) so the LR schedule knows its length.

Evaluation: every rank evaluates the whole validation set (the validation dataset reaches each worker
unsplit). Ranks then agree on the eval loss without equalisation padding biasing it; the cost is
duplicated evaluation work on multi-worker runs, small next to training for the recipes here.

Ray checkpoint layout (one per Hugging Face save, and a final one):
    hf/                  full fine-tune: model + tokenizer (for LoRA runs: the merged model, final only)
    adapter/             LoRA: adapter + tokenizer
    base/                LoRA on a `--local` tiny model: the random base it was trained on (nothing else
                         can rebuild it)
    trainer/             Hugging Face trainer state: optimizer, scheduler, RNG, trainer_state.json
    train_state/rank{R}.json   step, blocks this rank consumed, data counters
    raytune_meta.json    job, model_name, family, step, final_loss, best_eval_loss, run_name, loop="trl"
The final checkpoint is reported last; with `train.load_best_at_end` it holds the best weights.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import tempfile
import time
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from raytune_ft.recipe import Recipe
from raytune_ft.train.common import WorkerLog, recipe_from_config

# Files of a Hugging Face checkpoint folder that are trainer state rather than model or tokenizer.
_TRAINER_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", "training_args.bin",
                  "rng_state.pth")
_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


# ---------------------------------------------------------------- data: blocks -> batches

def _real_seq_lens(block: dict) -> np.ndarray:
    """Lengths of a block's conversations (the trailing pad segment, if any, dropped)."""
    cu = np.asarray(block["cu_seqlens"])
    last = int(cu[-2]) if len(cu) > 1 else 0
    if not (block["labels"][last:] != -100).any() and not block["input_ids"][last:].any():
        cu = cu[:-1]
    return np.diff(cu)


def collate_blocks(blocks: list[dict]) -> dict[str, Any]:
    """A micro-batch of packed blocks -> one row in TRL's padding-free format.

    input_ids / labels / position_ids (1, B*T); cu_seq_lens_q/k (int32 global boundaries),
    max_length_q/k, seq_idx (1, B*T): what varlen attention and the gated-delta-net layers need.
    Labels stay unshifted (the model shifts); each conversation's first label is already -100.
    """
    from raytune_ft.models.gated_delta import packed_forward_kwargs

    stack = {k: np.stack([b[k] for b in blocks]) for k in ("input_ids", "labels", "position_ids", "seq_idx")}
    stack["cu_seqlens"] = [b["cu_seqlens"] for b in blocks]
    batch = packed_forward_kwargs(stack)
    batch.pop("use_cache", None)               # TRL sets it per call
    batch["labels"] = torch.from_numpy(stack["labels"].astype(np.int64).reshape(1, -1))
    return batch


class RankBlocks(torch.utils.data.IterableDataset):
    """This rank's packed training blocks, one pass per iteration, the same count on every rank.

    Each pass is equalised across ranks (all-padding blocks once a rank runs dry, one tiny all-reduce
    per block) and padded to a whole number of optimizer steps. `peek()` starts the first pass and
    keeps its first block; the next iteration replays it, so TRL's look at a sample costs no data.
    """

    def __init__(self, recipe: Recipe, *, rank: int, world: int, counters, flag_device: torch.device,
                 skip_blocks: int = 0, blocks_fn=None):
        self.recipe, self.rank, self.world = recipe, rank, world
        self.counters, self.flag_device = counters, flag_device
        self.per_step = recipe.train.micro_batch_size * recipe.train.grad_accum
        self.skip_blocks = skip_blocks              # for the first pass only (resume)
        self.blocks_consumed = skip_blocks          # real blocks of this rank trained in the current pass
        self.real_tokens = 0
        self.flops = 0.0                            # model FLOPs of the real blocks fed (set flops_config)
        self.flops_config = None
        self._blocks_fn = blocks_fn or self._worker_blocks
        self._pending: tuple[dict, Iterator[dict]] | None = None
        self._passes = 0

    def _worker_blocks(self, skip: int) -> Iterator[dict]:
        from raytune_ft.train.feed import worker_blocks

        return worker_blocks(self.recipe, rank=self.rank, world=self.world, counters=self.counters,
                             skip_blocks=skip, split="train")

    def count_steps_per_pass(self) -> int:
        """Optimizer steps of one pass over the data (a full extra pass: tokenize + pack, no training)."""
        from raytune_ft.data.packing import DataCounters
        from raytune_ft.train.feed import worker_blocks

        n = sum(1 for _ in worker_blocks(self.recipe, rank=self.rank, world=self.world,
                                         counters=DataCounters(), split="train"))
        n_max = torch.tensor([n], dtype=torch.int64, device=self.flag_device)
        if dist.is_initialized():
            dist.all_reduce(n_max, op=dist.ReduceOp.MAX)
        return max(1, math.ceil(int(n_max.item()) / self.per_step))

    def _pass(self) -> Iterator[dict]:
        from raytune_ft.data.packing import padding_block
        from raytune_ft.data.pipeline import equalize_steps
        from raytune_ft.hardware import flops_per_block

        skip = self.skip_blocks if self._passes == 0 else 0
        self._passes += 1
        self.blocks_consumed = skip
        seq_len = self.recipe.data.seq_len
        n = 0
        for block, is_pad in equalize_steps(self._blocks_fn(skip), seq_len=seq_len, device=self.flag_device,
                                            counters=self.counters):
            if not is_pad:
                self.blocks_consumed += 1
                lens = _real_seq_lens(block)
                self.real_tokens += int(lens.sum())
                if self.flops_config is not None:
                    self.flops += flops_per_block(self.flops_config, lens)
            n += 1
            yield block
        # the same n on every rank after equalisation: pad to whole optimizer steps
        while n % self.per_step:
            self.counters.equalisation_padding_blocks += 1
            self.counters.blocks += 1
            self.counters.padding_tokens += seq_len
            n += 1
            yield padding_block(seq_len)

    def peek(self) -> dict:
        if self._pending is None:
            it = self._pass()
            first = next(it)
            self._pending = (first, it)
        return self._pending[0]

    def __iter__(self) -> Iterator[dict]:
        if self._pending is not None:
            first, it = self._pending
            self._pending = None
            return itertools.chain([first], it)
        return self._pass()


_LIVE: dict[int, Any] = {}


def _peek_rows(key: int):
    """Generator behind the `datasets` facade TRL inspects: the peeked first block of a live stream."""
    src = _LIVE[key]
    block = src.peek() if isinstance(src, RankBlocks) else src[0]
    yield {k: block[k].tolist() for k in ("input_ids", "labels", "position_ids")}


def _facade(src) -> Any:
    """A one-row `datasets.IterableDataset` for SFTTrainer's type and format checks.

    SFTTrainer accepts only `datasets` objects and looks at one row; training and evaluation read the
    real streams through the trainer's overridden dataloaders, never through this facade.
    """
    import datasets

    key = id(src)
    _LIVE[key] = src
    return datasets.IterableDataset.from_generator(_peek_rows, gen_kwargs={"key": key})


# ---------------------------------------------------------------- the trainer

@contextlib.contextmanager
def not_training(pause: dict):
    """Add the time spent inside to pause["s"]: evaluation and checkpointing, left out of tokens/s."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        pause["s"] += time.perf_counter() - t0


def _trainer_class():
    from torch.utils.data import DataLoader
    from trl import SFTTrainer

    class RayBlocksSFTTrainer(SFTTrainer):
        """SFTTrainer reading pre-packed blocks: plain DataLoaders (no accelerate re-sharding: each rank's
        stream is already its own share) and AdamW with a separate LR for LoRA parameters."""

        raytune_train_blocks: RankBlocks
        raytune_eval_blocks: list
        raytune_recipe: Recipe

        raytune_pause: dict           # seconds spent evaluating and saving (not training)

        def evaluate(self, *args, **kwargs):
            with not_training(self.raytune_pause):
                return super().evaluate(*args, **kwargs)

        def _save_checkpoint(self, *args, **kwargs):
            with not_training(self.raytune_pause):
                return super()._save_checkpoint(*args, **kwargs)

        def get_train_dataloader(self) -> DataLoader:
            return DataLoader(self.raytune_train_blocks, batch_size=self.args.per_device_train_batch_size,
                              collate_fn=collate_blocks, num_workers=0)

        def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
            return DataLoader(self.raytune_eval_blocks, batch_size=self.args.per_device_eval_batch_size,
                              collate_fn=collate_blocks, shuffle=False, num_workers=0)

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                t = self.raytune_recipe.train
                decay = set(self.get_decay_parameter_names(self.model))
                groups: dict[tuple[float, float], list] = {}
                for name, p in self.model.named_parameters():
                    if not p.requires_grad:
                        continue
                    lr = t.lr * (t.lora_lr_multiplier if "lora_" in name else 1.0)
                    wd = t.weight_decay if name in decay else 0.0
                    groups.setdefault((lr, wd), []).append(p)
                params = [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]
                self.optimizer = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas),
                                                   fused=self.args.device.type == "cuda")
            return self.optimizer

    return RayBlocksSFTTrainer


# Fault injection for tests/test_trl_resume.py: "STEP:RANK" SIGKILLs that rank's worker at the end of
# optimizer step STEP, in an attempt that did not resume (so the restarted worker runs on), once Ray has
# registered a checkpoint of the run (its controller takes reports in asynchronously: a worker dying
# right after reporting can lose that report, as a real crash would).
FAULT_AT_STEP_ENV = "RAYTUNE_FAULT_AT_STEP"


def _die_for_test(recipe: Recipe, rank: int, step: int) -> None:
    snapshot = os.path.join(recipe.run_dir, "checkpoint_manager_snapshot.json")
    deadline = time.time() + 120
    while not os.path.exists(snapshot) and time.time() < deadline:
        time.sleep(0.1)
    print(f"[raytune_ft] {FAULT_AT_STEP_ENV}: killing rank {rank} at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _report_callback(recipe: Recipe, rank: int, log: WorkerLog, train_blocks: RankBlocks, lora: bool,
                     pause: dict, world: int, resumed: bool = False):
    from transformers import TrainerCallback

    from raytune_ft.hardware import gpu_peak_tflops

    on_cuda = torch.cuda.is_available() and recipe.scaling.use_gpu
    peak = gpu_peak_tflops(torch.cuda.get_device_name() if on_cuda else "cpu") * 1e12

    class RayReportCallback(TrainerCallback):
        """Logs to MLflow on rank 0 and reports every Hugging Face save to Ray Train as a checkpoint in
        the project's layout (all ranks report: Ray merges their files into one checkpoint)."""

        def __init__(self):
            self.t0 = time.perf_counter()
            self.last: dict[str, float] = {}
            self.history: list[dict] = []
            self.window = None             # (time, paused seconds, tokens, flops) at the last train log

        def on_train_begin(self, args, state, control, **kwargs):
            self.window = (time.perf_counter(), pause["s"], train_blocks.real_tokens, train_blocks.flops)

        def throughput(self) -> dict[str, float]:
            """tokens/s (all ranks), per worker, MFU and peak memory since the last train log; evaluation
            and checkpoint time excluded. A collective: every rank calls it at the same log."""
            t, paused, tokens, flops = self.window
            now = time.perf_counter()
            dt = max(now - t - (pause["s"] - paused), 1e-9)
            both = torch.tensor([float(train_blocks.real_tokens - tokens), train_blocks.flops - flops],
                                dtype=torch.float64, device=train_blocks.flag_device)
            if dist.is_initialized():
                dist.all_reduce(both)
            self.window = (now, pause["s"], train_blocks.real_tokens, train_blocks.flops)
            out = {"tokens_per_s": float(both[0]) / dt, "tokens_per_s_per_worker": float(both[0]) / dt / world}
            if peak and train_blocks.flops_config is not None:
                out["mfu"] = float(both[1]) / dt / (peak * world)
            if on_cuda:
                out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
            return out

        def on_step_end(self, args, state, control, **kwargs):
            if not resumed and os.environ.get(FAULT_AT_STEP_ENV, "").strip() == f"{state.global_step}:{rank}":
                _die_for_test(recipe, rank, state.global_step)
            # Hugging Face saves at the end of training whatever save_steps says; with train.save_final
            # false only the checkpoint_every saves are wanted
            if (not recipe.train.save_final and state.global_step >= state.max_steps
                    and state.global_step % recipe.train.checkpoint_every):
                control.should_save = False
            return control

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = {k: float(v) for k, v in (logs or {}).items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if "loss" in logs and self.window is not None:
                logs.update(self.throughput())
            self.last.update(logs)
            self.history.append({"step": state.global_step, **logs})
            if rank == 0 and logs:
                log.log_metrics(logs, state.global_step)
                shown = " | ".join(f"{k} {v:.4g}" for k, v in logs.items()
                                   if k in ("loss", "eval_loss", "learning_rate", "grad_norm",
                                            "mean_token_accuracy", "eval_mean_token_accuracy"))
                if "tokens_per_s" in logs:
                    shown += f" | {logs['tokens_per_s']:,.0f} tok/s"
                    if "mfu" in logs:
                        shown += f" | MFU {logs['mfu']:.1%}"
                    if "peak_mem_gib" in logs:
                        shown += f" | mem {logs['peak_mem_gib']:.1f} GiB"
                if shown:
                    log.info(f"step {state.global_step}/{state.max_steps} | {shown}")

        def on_save(self, args, state, control, **kwargs):
            with not_training(pause):                     # staging + upload: not training time
                self._report_save(args, state)

        def _report_save(self, args, state):
            src = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            with tempfile.TemporaryDirectory(prefix="raytune_trl_ckpt_") as d:
                _stage_checkpoint(src, d, rank=rank, lora=lora)
                _write_train_state(d, rank, state.global_step, train_blocks)
                if rank == 0:
                    _write_meta(d, recipe, state, self.last, final=False)
                log.info(f"checkpoint at step {state.global_step}")
                _ray_report(self.metrics(state, train_blocks), d)

        def metrics(self, state, blocks: RankBlocks) -> dict:
            m = {k: v for k, v in self.last.items()}
            m.update({"step": state.global_step, "train_seconds": time.perf_counter() - self.t0,
                      "tokens": _sum_over_ranks(blocks.real_tokens)})
            if state.best_metric is not None:
                m["best_eval_loss"] = float(state.best_metric)
            return m

    return RayReportCallback()


def _sum_over_ranks(x: int) -> int:
    t = torch.tensor([float(x)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        t = t.cuda()
    if dist.is_initialized():
        dist.all_reduce(t)
    return int(t.item())


def _link_or_copy(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.isdir(src):
        shutil.copytree(src, dst, copy_function=_link_file)
    else:
        _link_file(src, dst)


def _link_file(src: str, dst: str) -> None:
    try:
        os.link(src, dst)                  # same filesystem: no copy of multi-GB weights
    except OSError:
        shutil.copy2(src, dst)


def _stage_checkpoint(src: str, dst: str, *, rank: int, lora: bool) -> None:
    """Lay a Hugging Face checkpoint folder out as the project's checkpoint: model files under hf/ (or
    adapter/), trainer state under trainer/. Rank > 0 holds only its RNG state."""
    if not os.path.isdir(src):
        return
    model_dir = os.path.join(dst, "adapter" if lora else "hf")
    for name in os.listdir(src):
        path = os.path.join(src, name)
        is_state = name in _TRAINER_FILES or name.startswith("rng_state")
        if rank != 0 and not is_state:
            continue
        _link_or_copy(path, os.path.join(dst, "trainer", name) if is_state else os.path.join(model_dir, name))


def _write_train_state(d: str, rank: int, step: int, blocks: RankBlocks) -> None:
    os.makedirs(os.path.join(d, "train_state"), exist_ok=True)
    with open(os.path.join(d, "train_state", f"rank{rank}.json"), "w") as f:
        json.dump({"step": step, "blocks_consumed": blocks.blocks_consumed,
                   "counters": blocks.counters.to_dict()}, f)


def _write_meta(d: str, recipe: Recipe, state, last: dict, *, final: bool, extra: dict | None = None) -> None:
    from raytune_ft.train.checkpoint import write_meta

    losses = [h["loss"] for h in state.log_history if "loss" in h]
    write_meta(d, {
        "job": recipe.job, "model_name": recipe.model.name, "revision": recipe.model.revision,
        "family": recipe.model.family, "step": state.global_step, "final": final,
        "final_loss": losses[-1] if losses else last.get("loss"),
        "best_eval_loss": None if state.best_metric is None else float(state.best_metric),
        "best_step": state.best_global_step or None,
        "run_name": recipe.tracking.run_name, "loop": "trl",
        "lora": bool(recipe.train.lora_r), **(extra or {}),
    })


def _ray_report(metrics: dict, checkpoint_dir: str | None) -> None:
    import ray.train

    ckpt = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
    ray.train.report({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))},
                     checkpoint=ckpt)


# ---------------------------------------------------------------- model + tokenizer

def _tokenizer(recipe: Recipe, log: WorkerLog):
    from raytune_ft.models.build import tokenizer_for

    tok = tokenizer_for(recipe.model)
    if not tok.chat_template:
        from raytune_ft.models.tiny import CHATML_TEMPLATE

        tok.chat_template = CHATML_TEMPLATE
        log.info("the tokenizer has no chat template: using ChatML")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else "<|endoftext|>"
        log.info(f"the tokenizer has no pad token: using {tok.pad_token!r}")
    return tok


def _use_liger(recipe: Recipe, on_gpu: bool, log: WorkerLog) -> bool:
    if not recipe.train.use_liger:
        return False
    if not on_gpu:
        log.info("Liger kernels: off (no GPU here; they are Triton kernels). The same job runs without them.")
        return False
    if importlib.util.find_spec("liger_kernel") is None:
        log.info("Liger kernels: off (liger-kernel is not installed; pip install 'raytune-ft[gpu]')")
        return False
    log.info("Liger kernels: on (GPU present)")
    return True


def _finished_step() -> int | None:
    """The step of the run's final checkpoint when that is the latest one, else None."""
    import ray.train

    from raytune_ft.train.checkpoint import META_FILE

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return None
    try:   # read the one small file where the checkpoint lies (no download of the model)
        with ckpt.filesystem.open_input_stream(f"{ckpt.path.rstrip('/')}/{META_FILE}") as f:
            meta = json.loads(f.read())
    except (FileNotFoundError, OSError):
        return None
    return int(meta.get("step") or 0) if meta.get("final") else None


def _restore_hf_checkpoint(recipe: Recipe, out_dir: str, rank: int, log: WorkerLog) -> tuple[str | None, int]:
    """Rebuild a Hugging Face checkpoint folder from the Ray checkpoint to resume from (if any)."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return None, 0
    with ckpt.as_directory() as d:
        state_file = os.path.join(d, "train_state", f"rank{rank}.json")
        if not os.path.isdir(os.path.join(d, "trainer")) or not os.path.isfile(state_file):
            log.info("the latest checkpoint has no trainer state: starting over")
            return None, 0
        with open(state_file) as f:
            st = json.load(f)
        dst = os.path.join(out_dir, f"checkpoint-{st['step']}")
        os.makedirs(dst, exist_ok=True)
        for sub in ("hf", "adapter", "trainer"):
            for path in glob.glob(os.path.join(d, sub, "*")):
                target = os.path.join(dst, os.path.basename(path))
                (shutil.copytree if os.path.isdir(path) else shutil.copy2)(path, target)
    log.info(f"resuming from step {st['step']} ({st['blocks_consumed']} blocks consumed on rank {rank})")
    return dst, int(st["blocks_consumed"])


# ---------------------------------------------------------------- worker entry point

def train_trl(config: dict) -> None:
    """Ray Train worker entry point for the TRL recipes (full fine-tune or LoRA)."""
    import ray.train
    import ray.train.torch
    from trl import SFTConfig

    from raytune_ft.data.packing import DataCounters
    from raytune_ft.models.build import load_causal_lm
    from raytune_ft.models.gated_delta import enable_packing

    recipe = recipe_from_config(config)
    t = recipe.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log = WorkerLog(rank, recipe, config.get("mlflow_run_id"))
    finished = _finished_step()
    if finished is not None:
        # a worker lost after the final checkpoint was registered, or the finished run submitted again
        # under its name: the run is complete, and that final checkpoint stays its result
        log.info(f"the run already ended at step {finished} (its final checkpoint is the latest): nothing "
                 "to train; use a new tracking.run_name to train again")
        _ray_report({"step": finished, "done": True}, None)
        return
    on_gpu = recipe.scaling.use_gpu and torch.cuda.is_available()
    lora = t.lora_r > 0
    flag_device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")

    tok = _tokenizer(recipe, log)
    # weights in bf16 only when the recipe asks for bf16 master weights; fp32 weights train under
    # bf16 autocast (TrainingArguments(bf16=True)), so AdamW updates are not lost to bf16 rounding
    compute_bf16 = on_gpu and recipe.model.dtype == "bfloat16"
    dtype = torch.bfloat16 if (compute_bf16 and t.master_weights == "bf16") else torch.float32
    torch.manual_seed(t.seed)
    # built straight on the worker's GPU: a random init or a checkpoint read of a 4B model on the host
    # takes minutes; the Trainer finds it already in place
    build_device = ray.train.torch.get_device() if on_gpu else torch.device("cpu")
    lm = load_causal_lm(recipe.model, tokenizer_vocab_size=len(tok), device=build_device, dtype=dtype,
                        seed=t.seed)
    enable_packing(lm)                             # idempotent: varlen attention + packed gated-delta-net
    if not recipe.model.local_tiny:
        lm.config._name_or_path = recipe.model.name  # what a LoRA adapter names as its base
    lm.config.use_cache = False
    liger = _use_liger(recipe, on_gpu, log)

    out_dir = tempfile.mkdtemp(prefix=f"raytune_trl_rank{rank}_")
    base_dir = None
    if lora and (recipe.model.local_tiny or recipe.model.init == "random") and rank == 0:
        # a random base (tiny, or init="random"): keep it, so the adapter can be loaded and merged later
        base_dir = os.path.join(out_dir, "base")
        lm.save_pretrained(base_dir)
        tok.save_pretrained(base_dir)

    resume_dir, skip_blocks = _restore_hf_checkpoint(recipe, out_dir, rank, log)
    counters = DataCounters()
    train_blocks = RankBlocks(recipe, rank=rank, world=world, counters=counters, flag_device=flag_device,
                              skip_blocks=skip_blocks)
    from raytune_ft.train.feed import worker_blocks

    eval_blocks: list = []
    if t.eval_every:
        eval_blocks = list(worker_blocks(recipe, rank=rank, world=world, counters=DataCounters(),
                                         split="validation"))
        if not eval_blocks:
            raise RuntimeError("the validation split produced no blocks: nothing to evaluate on")
        log.info(f"validation: {len(eval_blocks)} blocks of {recipe.data.seq_len} tokens (every rank "
                 "evaluates all of them)")

    max_steps = int(config.get("total_steps") or t.max_steps or 0)
    if not max_steps:
        max_steps = train_blocks.count_steps_per_pass() * t.epochs
        log.info(f"counted {max_steps} optimizer steps for {t.epochs} epoch(s) (one extra pass over the "
                 "data; set train.max_steps to skip it)")

    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=t.lora_r, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                                 target_modules=list(t.lora_target_modules) or "all-linear",
                                 task_type="CAUSAL_LM")
    eval_steps = t.eval_every or None
    args = SFTConfig(
        output_dir=out_dir, max_steps=max_steps, num_train_epochs=t.epochs,
        per_device_train_batch_size=t.micro_batch_size, per_device_eval_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum, learning_rate=t.lr, weight_decay=t.weight_decay,
        adam_beta1=t.betas[0], adam_beta2=t.betas[1], max_grad_norm=t.max_grad_norm,
        warmup_steps=t.warmup_steps, lr_scheduler_type=_SCHEDULES[t.schedule]
        if not (t.schedule == "cosine" and t.min_lr_ratio) else "cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio} if (t.schedule == "cosine" and t.min_lr_ratio) else None,
        logging_steps=t.log_every, eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps,
        save_strategy="steps", save_steps=t.checkpoint_every, save_total_limit=t.keep_checkpoints,
        load_best_model_at_end=t.load_best_at_end, metric_for_best_model="eval_loss" if eval_steps else None,
        greater_is_better=False if eval_steps else None,
        bf16=compute_bf16, use_cpu=not on_gpu,
        gradient_checkpointing=t.gradient_checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
        use_liger_kernel=liger, seed=t.seed, report_to="none", disable_tqdm=True,
        remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True}, packing=False,
        padding_free=False, max_length=None, dataloader_num_workers=0, ignore_data_skip=True,
        ddp_find_unused_parameters=False, save_only_model=False,
    )

    train_blocks.flops_config = lm.config
    pause = {"s": 0.0}
    trainer_cls = _trainer_class()
    callback = _report_callback(recipe, rank, log, train_blocks, lora, pause, world,
                                resumed=resume_dir is not None)
    trainer = trainer_cls(
        model=lm, args=args, train_dataset=_facade(train_blocks),
        eval_dataset=_facade(eval_blocks) if eval_blocks else None, processing_class=tok,
        data_collator=collate_blocks, peft_config=peft_config, callbacks=[callback])
    trainer.raytune_train_blocks = train_blocks
    trainer.raytune_eval_blocks = eval_blocks
    trainer.raytune_recipe = recipe
    trainer.raytune_pause = pause
    if lora:
        n_train = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        log.info(f"LoRA r={t.lora_r} alpha={t.lora_alpha} on {t.lora_target_modules or 'all-linear'}: "
                 f"{n_train:,} trainable parameters, LR {t.lr:g} x {t.lora_lr_multiplier:g}")
    log.info(f"TRL SFTTrainer: {max_steps} steps, {world} worker(s) x {t.micro_batch_size} blocks x "
             f"{t.grad_accum} accumulation, {dtype}, gradient checkpointing {t.gradient_checkpointing}")

    trainer.train(resume_from_checkpoint=resume_dir)
    state = trainer.state
    if t.load_best_at_end and state.best_global_step:
        log.info(f"loaded the best checkpoint: step {state.best_global_step}, eval loss {state.best_metric:.4f}")

    # the final checkpoint: the weights the trainer holds now (the best ones with load_best_at_end)
    metrics = callback.metrics(state, train_blocks)
    metrics["done"] = True
    losses = [h["loss"] for h in state.log_history if "loss" in h]
    if losses:
        metrics["loss"] = losses[-1]
    if not t.save_final:
        log.info("train.save_final=false: no final checkpoint")
        log.log_metrics(metrics, state.global_step)   # the summary reads the end of the run from MLflow
        _ray_report(metrics, None)
    else:
        with tempfile.TemporaryDirectory(prefix="raytune_trl_final_") as d:
            if rank == 0:
                _save_final(trainer, tok, d, recipe, lora, base_dir, log)
                _write_meta(d, recipe, state, callback.last, final=True)
            _write_train_state(d, rank, state.global_step, train_blocks)
            _ray_report(metrics, d)
    shutil.rmtree(out_dir, ignore_errors=True)
    _LIVE.clear()


def _save_final(trainer, tok, d: str, recipe: Recipe, lora: bool, base_dir: str | None, log: WorkerLog) -> None:
    """Write the deliverable: hf/ (full), or adapter/ (+ merged hf/ when train.merge_adapter) for LoRA."""
    model = trainer.model
    model = getattr(model, "module", model)      # DDP
    if not lora:
        model.config.use_cache = True
        model.save_pretrained(os.path.join(d, "hf"), safe_serialization=True)
        tok.save_pretrained(os.path.join(d, "hf"))
        return
    model.save_pretrained(os.path.join(d, "adapter"))
    tok.save_pretrained(os.path.join(d, "adapter"))
    if base_dir:
        _link_or_copy(base_dir, os.path.join(d, "base"))
    if recipe.train.merge_adapter:
        merged = model.merge_and_unload()
        merged.config.use_cache = True
        merged.save_pretrained(os.path.join(d, "hf"), safe_serialization=True)
        tok.save_pretrained(os.path.join(d, "hf"))
        log.info("merged the LoRA adapter into the base model (hf/)")
