"""Synthetic chat datasets made in code (no files, no network).

builtin:chat[:N] (`builtin_chat`), for `--local` runs and tests: a small learnable dataset.
builtin:lognormal[:N] (`builtin_lognormal`), for throughput runs at real shapes on machines without a
dataset hub: the peers' length distribution (../shared/peers/peer_trl.py: lognormal lengths, median
~900 tokens, sigma 0.8, clipped to 64..8192, ~30% prompt), in words of one token each in the Qwen
vocabularies, so a rendered conversation is about as long in tokens as the peer's.

Each conversation is one to three turns of simple, exactly learnable tasks (add two numbers, reverse
the words of a phrase, repeat a phrase, upper-case a word, count the words), sometimes with a system
message. The answers follow fixed patterns, so even a tiny model's loss falls visibly within a few
dozen steps.
"""
from __future__ import annotations

import hashlib
import json
import math
import random

import numpy as np

_WORDS = ("apple river stone cloud green quick lamp seven blue tiger paper north silver music "
          "garden window candle orange yellow rocket forest ocean violet winter summer bread").split()
_SYSTEMS = ("You are a helpful assistant.", "You are a precise assistant. Answer briefly.",
            "Answer exactly what is asked.")


def _phrase(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 5)))


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        p = _phrase(rng)
        return f"Reverse the words: {p}", " ".join(reversed(p.split()))
    if kind == 2:
        p = _phrase(rng)
        return f"Repeat after me: {p}", p
    if kind == 3:
        w = rng.choice(_WORDS)
        return f"Write {w} in capital letters.", w.upper()
    p = _phrase(rng)
    return f"How many words are in: {p}", f"There are {len(p.split())} words."


def builtin_chat(n_rows: int, seed: int = 0) -> list[dict]:
    """`n_rows` conversations `{"messages": [...]}`, the same for the same seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        for _ in range(rng.choice((1, 1, 2, 3))):
            question, answer = _task(rng)
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages})
    return rows


# Common English words that the Qwen2/Qwen3/Qwen3.5 byte-level BPE keeps as one token with their
# leading space (checked on the real Qwen3 vocabulary in tests/test_builtin_data.py).
_PLAIN = ("the of and to in is was for on that with as by at from his her an they which you were "
          "one all we can has there their been if more when will would who so no time two may first "
          "new some could these other than then now only its over also after where most made many "
          "before must through back years much way well down should because each just those people "
          "how too little state good very make world still own see men work long here between both "
          "life being under never day same another know while last might great old year off come "
          "since against go came right used take three small house water light place word part "
          "number great point city play line side land hand head high kind").split()


def builtin_lognormal(n_rows: int, seed: int = 0) -> list[dict]:
    """`n_rows` one-turn conversations `{"messages": [user, assistant]}` with the peers' lengths.

    Lengths in words: lognormal(log 900, 0.8) clipped to 64..8192 (numpy's generator with `seed`, as the
    peer draws its token counts); the user turn takes 30% of them, the assistant the rest."""
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(mean=math.log(900), sigma=0.8, size=n_rows), 64, 8192).astype(int)
    words = np.array(_PLAIN)
    rows = []
    for n in lens:
        picks = words[rng.integers(0, len(words), size=int(n))]
        p = max(1, int(n * 0.3))
        rows.append({"messages": [{"role": "user", "content": " ".join(picks[:p])},
                                  {"role": "assistant", "content": " ".join(picks[p:])}]})
    return rows


BUILTIN_SOURCES = {"chat": builtin_chat, "lognormal": builtin_lognormal}


def builtin_source(src: str):
    """`builtin:NAME[:N]` -> (the generator of NAME, N or None); ValueError naming the known ones."""
    parts = src.split(":")
    make = BUILTIN_SOURCES.get(parts[1]) if len(parts) > 1 else None
    if make is None or len(parts) > 3 or (len(parts) == 3 and not parts[2].isdigit()):
        raise ValueError(f"{src!r} is not a builtin dataset (known: "
                         f"{', '.join(f'builtin:{k}[:N]' for k in BUILTIN_SOURCES)})")
    return make, int(parts[2]) if len(parts) == 3 else None


def row_hash(row: dict) -> str:
    """A row's content hash: equal rows (the same messages) hash alike, however they were made."""
    return hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()


def split_rows(src: str, n_default: int, seed: int, held_out: bool) -> list[dict]:
    """The rows of `builtin:NAME[:N]` for one split: training rows are the generator's N rows with
    `seed`; held-out rows come from `seed + 1` with every row equal to a training row left out (a small
    generated dataset repeats rows across seeds), so evaluation never scores rows trained on."""
    make, n = builtin_source(src)
    n = n or n_default
    train = make(n, seed)
    if not held_out:
        return train
    seen = {row_hash(r) for r in train}
    draw = 2 * n + 64
    while True:
        rows = [r for r in make(draw, seed + 1) if row_hash(r) not in seen]
        if len(rows) >= n or draw > 64 * n + 4096:
            return rows[:n]
        draw *= 2
