"""A small synthetic chat dataset made in code, for `--local` runs and tests (no files, no network).

Each conversation is one to three turns of simple, exactly learnable tasks (add two numbers, reverse
the words of a phrase, repeat a phrase, upper-case a word, count the words), sometimes with a system
message. The answers follow fixed patterns, so even a tiny model's loss falls visibly within a few
dozen steps.
"""
from __future__ import annotations

import random

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
