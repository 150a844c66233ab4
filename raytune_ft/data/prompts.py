"""A prompt file (`train.sample_prompts`): a .jsonl/.json of prompts or conversations, each cut before its
last assistant turn. Read by the sampler and by the memory plan (which counts its prompts)."""
from __future__ import annotations

import json
import os
from typing import Any


def _as_messages(row: Any, where: str) -> list[dict]:
    if isinstance(row, str):
        return [{"role": "user", "content": row}]
    if isinstance(row, dict):
        for key in ("messages", "conversation", "prompt"):
            if key in row:
                return _as_messages(row[key], where)
    if isinstance(row, list) and row and all(isinstance(m, dict) and "role" in m and "content" in m for m in row):
        return [{"role": m["role"], "content": m["content"]} for m in row]
    raise ValueError(f"train.sample_prompts: {where} is not a prompt (a string, {{\"prompt\": ...}}, "
                     "{\"messages\": [...]} or a list of {role, content} turns)")


def read_prompt_file(path: str) -> list[list[dict]]:
    """The conversations of a .jsonl or .json prompt file, each cut before its last assistant turn."""
    with open(os.path.expanduser(path)) as f:
        text = f.read()
    if path.endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = json.loads(text)
        rows = rows if isinstance(rows, list) else [rows]
    out = []
    for i, row in enumerate(rows):
        messages = _as_messages(row, f"row {i + 1} of {path}")
        last_assistant = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last_assistant is not None:
            messages = messages[:last_assistant]
        if not messages:
            raise ValueError(f"train.sample_prompts: row {i + 1} of {path} has nothing before its assistant turn")
        out.append(messages)
    if not out:
        raise ValueError(f"train.sample_prompts: {path} holds no prompt")
    return out
