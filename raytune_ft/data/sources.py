"""Schema adapters: turn one raw dataset row into a list of chat messages, or say why not.

Schemas understood (`schema="auto"` picks by the row's fields, in this order):
  messages           {"messages": [{"role", "content"}, ...]}  (UltraChat 200k, trl-lib/Capybara)
  conversation       {"conversation": [{"input", "output"}, ...]} (the original LDJnr/Capybara)
  prompt_completion  {"prompt": str | messages, "completion": str | messages}

A row that cannot become a trainable conversation is not an error: `to_messages` returns
`(None, reason)` and the pipeline counts it under that reason. Reasons: invalid_json, unknown_schema,
missing_messages, empty_messages, bad_message, unknown_role, non_string_content, empty_content,
no_assistant_turn, no_user_turn, system_not_first.
"""
from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")

Messages = list[dict[str, str]]


def _plain(value: Any) -> Any:
    """Arrow/numpy values (parquet rows) to plain Python lists and dicts."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _check(messages: Any) -> tuple[Messages | None, str | None]:
    """Validate a message list; return it cleaned (role and content only, plus reasoning/tool fields)."""
    if messages is None:
        return None, "missing_messages"
    if not isinstance(messages, list):
        return None, "bad_message"
    if not messages:
        return None, "empty_messages"
    out: Messages = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return None, "bad_message"
        role = m.get("role")
        if role not in ROLES:
            return None, "unknown_role"
        content = m.get("content")
        if not isinstance(content, str):
            return None, "non_string_content"
        if not content.strip() and role != "system":
            return None, "empty_content"
        if role == "system" and i != 0:
            return None, "system_not_first"
        msg = {"role": role, "content": content}
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    if out[0]["role"] == "system" and not out[0]["content"].strip():
        out = out[1:]                 # an empty system message carries nothing; templates differ on it
    if not any(m["role"] == "assistant" for m in out):
        return None, "no_assistant_turn"
    if not any(m["role"] == "user" for m in out):
        return None, "no_user_turn"
    return out, None


def _from_conversation(turns: Any) -> tuple[Messages | None, str | None]:
    if turns is None:
        return None, "missing_messages"
    if not isinstance(turns, list):
        return None, "bad_message"
    messages: Messages = []
    for t in turns:
        if not isinstance(t, dict) or "input" not in t:
            return None, "bad_message"
        messages.append({"role": "user", "content": t.get("input")})
        if t.get("output") is not None:
            messages.append({"role": "assistant", "content": t.get("output")})
    return _check(messages)


def _as_turns(value: Any, role: str) -> Messages | None:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    return None


def _from_prompt_completion(prompt: Any, completion: Any) -> tuple[Messages | None, str | None]:
    p, c = _as_turns(prompt, "user"), _as_turns(completion, "assistant")
    if p is None or c is None:
        return None, "missing_messages" if prompt is None or completion is None else "non_string_content"
    return _check(p + c)


def detect_schema(row: dict) -> str | None:
    """The schema a row is in, by its fields; None when none fits."""
    if "messages" in row:
        return "messages"
    if "conversation" in row or "conversations" in row:
        return "conversation"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    return None


def to_messages(row: Any, schema: str = "auto") -> tuple[Messages | None, str | None]:
    """`(messages, None)` for a usable row, `(None, reason)` for one to skip. Never raises on data."""
    if isinstance(row, (str, bytes)):
        try:
            row = json.loads(row)
        except (ValueError, UnicodeDecodeError):
            return None, "invalid_json"
    if not isinstance(row, dict):
        return None, "unknown_schema"
    kind = detect_schema(row) if schema == "auto" else schema
    if kind == "messages":
        return _check(_plain(row.get("messages")))
    if kind == "conversation":
        turns = row.get("conversation", row.get("conversations"))
        return _from_conversation(_plain(turns))
    if kind == "prompt_completion":
        return _from_prompt_completion(_plain(row.get("prompt")), _plain(row.get("completion")))
    return None, "unknown_schema"
