"""Sample generations from the model being trained: a fixed set of prompts, greedy and bounded.

Every rank generates the same prompts together. FSDP2 gathers each layer's weights inside its forward,
a collective, so every rank must run every forward: with the same inputs on every rank and the next
token broadcast from rank 0 (bitwise-equal logits are not guaranteed across devices), all ranks stop
at the same step. No KV cache: each step is one packed forward over every unfinished sequence (the
training path, with its conversation boundaries), and the logits are computed at each sequence's last
position only. For the bounded lengths sampled here a step's time is the reading of the weights, which a
cache would not save: `train/probe.py` keeps them gathered for the round where they fit, and runs the
forwards eagerly (each generation step has a length of its own: through the compiled modules every new
length would recompile the training step's graphs).

Prompts (`train.sample_prompts`): a .jsonl/.json file of prompts (a string, {"prompt": ...}) or
conversations ({"messages": [...]}, or a list of turns), rendered with the chat template and its
generation prompt; or N, the first N usable held-out conversations cut before their last assistant
turn (the tokens before its supervised span: the template's assistant header included).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from raytune_ft.data.prompts import read_prompt_file  # noqa: F401  (the sampler's prompt files)

SAMPLES_TABLE = "samples.json"          # the MLflow table artifact
COLUMNS = ("step", "prompt", "completion", "tokens", "seconds", "base_completion")


@dataclass
class SamplePrompt:
    ids: list[int]
    text: str                            # what the table shows: the prompt as the model reads it


def render_prompts(tokenizer, conversations: Sequence[list[dict]], template_kwargs: dict) -> list[SamplePrompt]:
    """Each conversation rendered with the chat template and its generation prompt, tokenized as the
    training data is (no special tokens added beyond the template's)."""
    out = []
    for messages in conversations:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True,
                                             **template_kwargs)
        out.append(SamplePrompt(tokenizer(text, add_special_tokens=False)["input_ids"], text))
    return out


def held_out_prompts(rows: Sequence[dict], n: int, tokenizer) -> list[SamplePrompt]:
    """The first `n` usable held-out rows ({input_ids, mask, skip_reason}) cut before their last
    supervised span, i.e. what the model sees when it starts the conversation's last answer."""
    out = []
    for row in rows:
        if len(out) == n:
            break
        if row.get("skip_reason"):
            continue
        mask = [bool(m) for m in row["mask"]]
        ends = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        start = ends[-1] if ends else 0
        if start == 0:
            continue
        ids = [int(t) for t in row["input_ids"][:start]]
        out.append(SamplePrompt(ids, tokenizer.decode(ids)))
    return out


def stop_token_ids(tokenizer, template_kwargs: dict) -> list[int]:
    """The tokens that end a completion: the tokenizer's eos and the template's end-of-turn token (the
    last supervised token of a rendered answer, whatever the template calls it)."""
    from raytune_ft.data.sft import render_sft

    ids, mask = render_sft(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                           **template_kwargs)
    last = max(i for i, m in enumerate(mask) if m)
    stops = {int(ids[last])}
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    return sorted(stops)


@torch.no_grad()
def generate_greedy(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_ids: Sequence[int],
                    device: torch.device) -> list[tuple[list[int], float]]:
    """Greedy completions of `prompts` from a `PackedCausalLM` (sharded or not): for each, the new token
    ids (its stop token included, as `generate` returns them) and the seconds until it finished.

    A collective under torch.distributed: every rank calls it with the same prompts and runs the same
    forwards; rank 0's tokens are the ones every rank continues with."""
    from raytune_ft.models.gated_delta import packed_forward_kwargs
    from raytune_ft.train.probe import probe_uncompiled

    stops = set(int(s) for s in stop_ids)
    seqs = [list(map(int, p)) for p in prompts]
    out: list[list[int]] = [[] for _ in seqs]
    seconds = [0.0] * len(seqs)
    active = [i for i in range(len(seqs)) if max_new_tokens > 0]
    t0 = time.perf_counter()
    with probe_uncompiled(model):
        while active:
            lens = [len(seqs[i]) for i in active]
            cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
            kwargs = packed_forward_kwargs({
                "input_ids": torch.tensor([t for i in active for t in seqs[i]]),
                "position_ids": torch.cat([torch.arange(n) for n in lens]), "cu_seqlens": cu}, device=device)
            logits = model(None, logits_at=(cu[1:] - 1).long().to(device), **kwargs)
            nxt = logits.argmax(-1)
            if dist.is_initialized():
                dist.broadcast(nxt, src=0)
            still = []
            for i, tok in zip(active, nxt.tolist()):
                seqs[i].append(tok)
                out[i].append(tok)
                if tok in stops or len(out[i]) >= max_new_tokens:
                    seconds[i] = time.perf_counter() - t0
                else:
                    still.append(i)
            active = still
    return list(zip(out, seconds))


@dataclass(frozen=True)
class Completion:
    """Where a greedy completion stops: after `max_new_tokens` new tokens, or at one of `stop_ids`."""
    max_new_tokens: int
    stop_ids: list[int]


class Sampler:
    """The run's sample prompts, generated at the start (base model), at each checkpoint and at the end;
    rank 0 appends each round's rows to the MLflow table `samples.json`. The base model's completions
    travel in the train state, so a resumed run still shows them beside the new ones."""

    def __init__(self, prompts: list[SamplePrompt], tokenizer, completion: Completion, *, device: torch.device,
                 rank: int, log):
        self.prompts, self.tok, self.max_new_tokens = prompts, tokenizer, completion.max_new_tokens
        self.stop_ids, self.device, self.rank, self.log = completion.stop_ids, device, rank, log

    def run(self, model, step: int, state) -> dict:
        """Generate every prompt at `step` (a collective); the rows go to `state.samples` (`state`: the
        checkpoint's evaluation part, train/state.EvaluationState) and, on rank 0, to MLflow. Returns
        samples/seconds and samples/tokens."""
        was_training = model.training
        model.eval()
        t0 = time.perf_counter()
        try:
            done = generate_greedy(model, [p.ids for p in self.prompts], max_new_tokens=self.max_new_tokens,
                                   stop_ids=self.stop_ids, device=self.device)
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - t0
        completions = [self._text(ids) for ids, _ in done]
        if step == 0 or state.sample_base is None:
            state.sample_base = completions if step == 0 else [""] * len(completions)
        base = state.sample_base
        rows = [{"step": step, "prompt": p.text, "completion": c, "tokens": len(ids), "seconds": round(s, 3),
                 "base_completion": b}
                for p, c, (ids, s), b in zip(self.prompts, completions, done, base)]
        state.samples = rows
        self._log_table(rows)
        n_tokens = sum(len(ids) for ids, _ in done)
        self.log.info(f"samples at step {step}: {len(rows)} prompts, {n_tokens} tokens in {seconds:.1f} s; "
                      f"first: {completions[0][:160]!r}")
        return {"samples/seconds": seconds, "samples/tokens": n_tokens}

    def _text(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=True)

    def _log_table(self, rows: list[dict]) -> None:
        if self.rank == 0:    # mlflow appends the rows to the table already in the run
            self.log.log_table({c: [r[c] for r in rows] for c in COLUMNS}, SAMPLES_TABLE,
                               "MLflow sample table not logged ({error}); training goes on")
