"""Held-out loss in the FSDP2 loop, and the schedule of what the loop measures besides training.

The held-out split (`data.validation_split`, e.g. UltraChat's test_sft, or the seeded
`data.validation_fraction` carved out of training; `data.validation_max_rows` caps it) reaches every
worker whole: rank 0 reads it once per attempt and sends it to the other ranks. It is packed exactly as
training packs, then each rank evaluates its share of the blocks (every `world`-th), filled up with
all-padding blocks so every rank runs the same number of forwards. The loss is normalised over the global token count (the sum of
token losses, all-reduced, over the all-reduced count of supervised tokens), as training's is, so it
does not depend on how the blocks fell on the ranks. Its forwards run eagerly (`probe_uncompiled`): a
no-grad pass through the compiled layers would compile graphs of its own beside the training step's.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from raytune_ft.data.packing import DataCounters, padding_block
from raytune_ft.env import redact_exception
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.batch import StepBatch
from raytune_ft.train.probe import probe_uncompiled
from raytune_ft.train.state import EvaluationState


def rank_share(blocks: Sequence[dict], rank: int, world: int, *, multiple: int, seq_len: int) -> list[dict]:
    """This rank's blocks (every `world`-th), padded with all-padding blocks to the same count on every
    rank, a multiple of `multiple` (the micro-batch size)."""
    per_rank = -(-len(blocks) // world)
    per_rank = -(-per_rank // multiple) * multiple
    mine = list(blocks[rank::world])
    return mine + [padding_block(seq_len)] * (per_rank - len(mine))


@torch.no_grad()
def held_out_loss(model, blocks: Sequence[dict], *, micro_batch_size: int, device: torch.device
                  ) -> tuple[float, int]:
    """(mean token loss over every rank's blocks, supervised tokens) of a `PackedCausalLM`; a collective
    when torch.distributed is up (every rank must pass the same number of blocks)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        with probe_uncompiled(model):
            for i in range(0, len(blocks), micro_batch_size):
                mb = StepBatch.from_blocks(list(blocks[i:i + micro_batch_size]), device)
                loss_sum, n = model(mb.labels, **mb.kwargs)
                sums += torch.stack([loss_sum.double(), n.double()])
    finally:
        model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(sums)
    loss, n = sums.tolist()
    return loss / max(n, 1.0), int(n)


def _read_in_background(out: dict) -> threading.Thread | None:
    """Start reading this worker's held-out shard into out["rows"] (out["error"] on failure); the shard is
    asked for in the caller's thread, where Ray Train's context is."""
    import ray.train

    from raytune_ft.data.pipeline import read_rows

    try:
        shard = ray.train.get_dataset_shard("validation")
    except Exception as e:  # noqa: BLE001 - raised where the rows are asked for, after the others are told
        out["error"] = e
        return None

    def read() -> None:
        try:
            out["rows"] = read_rows(shard)
        except BaseException as e:  # noqa: BLE001 - raised where the rows are asked for
            out["error"] = e

    thread = threading.Thread(target=read, name="raytune-held-out", daemon=True)
    thread.start()
    return thread


def start_reading_held_out(recipe: Recipe, *, rank: int, world: int) -> Callable[[], list[dict]]:
    """The held-out rows, read by a thread of rank 0 from now on (the loop starts it before building the
    model, so Ray Data's tasks run meanwhile); the function returned waits for them, and with several ranks
    is a collective: rank 0 sends the rows to the others (every rank calls it at the same point). One read
    per attempt, not one per rank: each rank's own read would run the split's whole pipeline again, with
    tokenizing processes of its own. Rank 0's read error is raised on every rank. [] at once when nothing
    needs the rows."""
    if not recipe.train.reads_held_out():
        return lambda: []
    out: dict = {}
    thread = _read_in_background(out) if rank == 0 else None

    def rows() -> list[dict]:
        if thread is not None:
            thread.join()
        if world > 1:
            box: list = [None]
            if rank == 0:
                box[0] = {"rows": out["rows"]} if "rows" in out else {"failed": redact_exception(out["error"])}
            dist.broadcast_object_list(box, src=0)
            if rank != 0:
                if "failed" in box[0]:
                    raise RuntimeError(f"reading the held-out split failed on rank 0: {box[0]['failed']}")
                out["rows"] = box[0]["rows"]
        if "error" in out:
            raise out["error"]
        return out["rows"]
    return rows


@dataclass(frozen=True)
class Place:
    """Where a worker trains: its rank among `world` workers, and its device."""
    rank: int
    world: int
    device: torch.device


class EvalAndSamples:
    """What the FSDP2 loop measures besides training: the held-out loss every `train.eval_every` steps
    and at the end; sample generations at the start (base model), at each checkpoint and at the end.
    Every method is a collective: every rank calls it at the same step."""

    def __init__(self, recipe: Recipe, blocks: list[dict] | None, sampler, *, device: torch.device, log):
        self.recipe, self.blocks, self.sampler, self.device, self.log = recipe, blocks, sampler, device, log

    @classmethod
    def open(cls, recipe: Recipe, tokenizer, place: Place, log,
             held_out: Callable[[], list[dict]] | None = None) -> "EvalAndSamples":
        """`held_out`: `start_reading_held_out`'s answer, when the loop started the read early."""
        from raytune_ft.data.pipeline import iter_blocks
        from raytune_ft.train import sampling

        t, (rank, world, device) = recipe.train, (place.rank, place.world, place.device)
        n_held_out = t.sample_count()
        rows = (held_out or start_reading_held_out(recipe, rank=rank, world=world))()
        blocks = None
        if t.eval_every:
            every = list(iter_blocks(rows, recipe.data, counters=DataCounters()))
            if not every:
                raise RuntimeError("the held-out split produced no blocks: nothing to evaluate on")
            blocks = rank_share(every, rank, world, multiple=t.micro_batch_size, seq_len=recipe.data.seq_len)
            log.info(f"held-out evaluation every {t.eval_every} steps and at the end: {len(every)} blocks of "
                     f"{recipe.data.seq_len} tokens, {len(blocks)} per rank")
        sampler = None
        if n_held_out != 0:
            kwargs = dict(recipe.data.template_kwargs)
            if n_held_out is None:
                prompts = sampling.render_prompts(tokenizer, sampling.read_prompt_file(str(t.sample_prompts)),
                                                  kwargs)
            else:
                prompts = sampling.held_out_prompts(rows, n_held_out, tokenizer)
            if not prompts:
                raise RuntimeError("train.sample_prompts: the held-out split has no conversation to prompt with")
            completion = sampling.Completion(t.sample_max_new_tokens, sampling.stop_token_ids(tokenizer, kwargs))
            sampler = sampling.Sampler(prompts, tokenizer, completion, device=device, rank=rank, log=log)
            log.info(f"samples: {len(prompts)} prompts, greedy, up to {t.sample_max_new_tokens} new tokens, at "
                     "the start, each checkpoint and the end (MLflow table samples.json)")
        return cls(recipe, blocks, sampler, device=device, log=log)

    def eval_due(self, step: int) -> bool:
        every = self.recipe.train.eval_every
        return bool(self.blocks is not None and every and step % every == 0)

    def at_start(self, model, state: EvaluationState, step: int) -> dict:
        """The base model's samples, on a run that starts from step 0 (`step`: the attempt's first)."""
        if self.sampler is None or step:
            return {}
        return self.sampler.run(model, 0, state)

    def at_end(self, model, step: int, state: EvaluationState) -> dict:
        """The held-out loss and the samples of the final weights, unless this step already had them."""
        return self.run(model, step, state, evaluate=not state.evaluated_at(step), sample=not state.sampled_at(step))

    def run(self, model, step: int, state: EvaluationState, *, evaluate: bool, sample: bool) -> dict:
        """The held-out loss (`evaluate`) and the samples (`sample`) at `step`, as metrics."""
        m: dict = {}
        if evaluate and self.blocks is not None:
            t0 = time.perf_counter()
            loss, n = held_out_loss(model, self.blocks, micro_batch_size=self.recipe.train.micro_batch_size,
                                    device=self.device)
            m = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)), "eval/tokens": n,
                 "eval/seconds": time.perf_counter() - t0}
            state.add_eval(step, loss)
            self.log.info(f"eval at step {step}: loss {loss:.4f}, perplexity {m['eval/perplexity']:.2f} over "
                          f"{n:,} held-out tokens in {m['eval/seconds']:.1f} s")
        if sample and self.sampler is not None:
            m |= self.sampler.run(model, step, state)
        return m
