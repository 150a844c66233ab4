"""Row formats: one small pure adapter per format turns a raw dataset row into chat messages, or says why not.

Formats (`schema="auto"` picks by the row's fields, in this order):
  messages           {"messages": [{"role", "content"}, ...]}            OpenAI chat; UltraChat 200k, trl-lib/Capybara
  sharegpt           {"conversations": [{"from", "value"}, ...]}         human / gpt / system, tool roles mapped
  conversation       {"conversation": [{"input", "output"}, ...]}        the original LDJnr/Capybara
  alpaca             {"instruction", "input"?, "output", "system"?}     one exchange; input joins the instruction
  prompt_completion  {"prompt": str | messages, "completion": str | messages}

Other names are mapped in the recipe: `fields` maps a format's field to the row's (`{"messages": "dialog"}`,
`{"from": "speaker"}`), `roles` maps each chat role to the names rows use for it (`{"user": ["human", "user"]}`,
added to the defaults). The pipeline after an adapter sees only messages.

A row that cannot become a trainable conversation is not an error: `to_messages` returns `(None, reason)` and
the pipeline counts it under that reason; the reason is a `Skip`, a string (the key counted) whose `detail` says
the value that failed (`role 'robot' not in data.roles`). Reasons: invalid_json, unknown_schema, missing_messages,
empty_messages, bad_message, unknown_role, non_string_content, empty_content, no_assistant_turn,
no_user_turn, system_not_first.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("messages", "sharegpt", "conversation", "alpaca", "prompt_completion")
# the fields each format needs, by their own names (what `describe_formats` prints and `fields` maps)
FORMAT_FIELDS = {"messages": ("messages",), "sharegpt": ("conversations",), "conversation": ("conversation",),
                 "alpaca": ("instruction", "output"), "prompt_completion": ("prompt", "completion")}
# every field name an adapter reads, the keys `fields` may map
FIELD_NAMES = ("messages", "conversations", "conversation", "instruction", "input", "output", "system",
               "prompt", "completion", "role", "content", "from", "value")
# names rows use for each role (ShareGPT's, LLaMA-Factory's tool turns); the recipe's `roles` adds to these
DEFAULT_ROLE_NAMES = {"system": ("system",), "user": ("user", "human"),
                      "assistant": ("assistant", "gpt", "model", "function_call"),
                      "tool": ("tool", "observation", "function", "function_response", "ipython")}

Messages = list[dict[str, str]]


class Skip(str):
    """Why a row is skipped: the reason's key (the string itself, what the counts are kept by) and `detail`,
    the value that failed, for the skipped-row samples."""
    detail: str

    def __new__(cls, key: str, detail: str = "") -> "Skip":
        out = super().__new__(cls, key)
        out.detail = detail
        return out

    def __reduce__(self):
        return Skip, (str(self), self.detail)


def _short(value: Any, n: int = 80) -> str:
    """A value as it appears in a row, cut to `n` characters."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= n else text[:n] + "..."


class Adapter:
    """One source's row -> messages conversion: its format (or auto) with its field and role names."""

    def __init__(self, schema: str = "auto", fields: Mapping[str, str] | None = None,
                 roles: Mapping[str, Any] | None = None):
        self.schema = schema
        self.fields = {k: str(v) for k, v in (fields or {}).items()}
        self.role_of: dict[str, str] = {}
        for role, names in DEFAULT_ROLE_NAMES.items():
            self.role_of.update({n: role for n in names})
        for role, names in (roles or {}).items():
            self.role_of.update({str(n): role for n in ([names] if isinstance(names, str) else names)})

    def f(self, name: str) -> str:
        """The row's name for a format's field."""
        return self.fields.get(name, name)

    def detect(self, row: Mapping) -> str | None:
        """The format a row is in, by its (mapped) fields; None when none fits."""
        for fmt in FORMATS:
            if all(self.f(name) in row for name in FORMAT_FIELDS[fmt]):
                return fmt
        return None

    def __call__(self, row: Any) -> tuple[Messages | None, str | None]:
        """`(messages, None)` for a usable row, `(None, reason)` for one to skip. Never raises on data."""
        if isinstance(row, (str, bytes)):
            try:
                row = json.loads(row)
            except (ValueError, UnicodeDecodeError) as e:
                return None, Skip("invalid_json", f"{e} in {_short(row)!r}")
        if not isinstance(row, dict):
            return None, Skip("unknown_schema", f"a JSON {type(row).__name__}, not an object")
        kind = self.detect(row) if self.schema == "auto" else self.schema
        if kind is None:
            return None, Skip("unknown_schema", f"fields {', '.join(map(str, row)) or 'none'} fit no format")
        return getattr(self, "_" + kind)(row)

    def _messages(self, row):
        return self._turns(_plain(row.get(self.f("messages"))), self.f("role"), self.f("content"), self.f("messages"))

    def _sharegpt(self, row):
        turns, name = _plain(row.get(self.f("conversations"))), self.f("conversations")
        if isinstance(turns, list) and turns and isinstance(turns[0], dict) and self.f("from") not in turns[0]:
            return self._turns(turns, self.f("role"), self.f("content"), name)   # ShareGPT with role/content turns
        return self._turns(turns, self.f("from"), self.f("value"), name)

    def _turns(self, turns: Any, role_key: str, content_key: str, name: str):
        if turns is None:
            return None, Skip("missing_messages", f"{name} is null")
        if not isinstance(turns, list):
            return None, Skip("bad_message", f"{name} is a {type(turns).__name__}, not a list: {_short(turns)}")
        out = []
        for i, t in enumerate(turns, 1):
            if not isinstance(t, dict):
                return None, Skip("bad_message", f"message {i} is a {type(t).__name__}, not an object")
            msg = {"role": self.role_of.get(t.get(role_key), t.get(role_key)), "content": t.get(content_key)}
            if isinstance(t.get("reasoning_content"), str):
                msg["reasoning_content"] = t["reasoning_content"]
            out.append(msg)
        return check_messages(out)

    def _conversation(self, row):
        turns = _plain(row.get(self.f("conversation")))
        if turns is None:
            return None, Skip("missing_messages", f"{self.f('conversation')} is null")
        if not isinstance(turns, list):
            return None, Skip("bad_message", f"{self.f('conversation')} is a {type(turns).__name__}, not a list")
        messages: Messages = []
        for i, t in enumerate(turns, 1):
            if not isinstance(t, dict) or self.f("input") not in t:
                return None, Skip("bad_message", f"turn {i} has no {self.f('input')!r}: {_short(t)}")
            messages.append({"role": "user", "content": t.get(self.f("input"))})
            if t.get(self.f("output")) is not None:
                messages.append({"role": "assistant", "content": t.get(self.f("output"))})
        return check_messages(messages)

    def _alpaca(self, row):
        instruction, extra = row.get(self.f("instruction")), row.get(self.f("input"))
        output, system = row.get(self.f("output")), row.get(self.f("system"))
        if instruction is None or output is None:
            missing = self.f("instruction") if instruction is None else self.f("output")
            return None, Skip("missing_messages", f"{missing} is null")
        for name, v in (("instruction", instruction), ("output", output), ("input", extra or ""),
                        ("system", system or "")):
            if not isinstance(v, str):
                return None, Skip("non_string_content", f"{self.f(name)} is a {type(v).__name__}: {_short(v)}")
        prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        messages = [{"role": "system", "content": system}] if system and system.strip() else []
        return check_messages(messages + [{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": output}])

    def _prompt_completion(self, row):
        prompt, completion = _plain(row.get(self.f("prompt"))), _plain(row.get(self.f("completion")))
        p, c = _as_turns(prompt, "user"), _as_turns(completion, "assistant")
        if p is None or c is None:
            name, value = (self.f("prompt"), prompt) if p is None else (self.f("completion"), completion)
            if value is None:
                return None, Skip("missing_messages", f"{name} is null")
            return None, Skip("non_string_content", f"{name} is a {type(value).__name__}: {_short(value)}")
        return check_messages(p + c)


def _plain(value: Any) -> Any:
    """Arrow/numpy values (parquet rows) to plain Python lists and dicts."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _as_turns(value: Any, role: str) -> Messages | None:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    return None


def check_messages(messages: Any) -> tuple[Messages | None, str | None]:
    """Validate a message list; return it cleaned (role and content only, plus reasoning text)."""
    if messages is None:
        return None, Skip("missing_messages", "no messages")
    if not isinstance(messages, list):
        return None, Skip("bad_message", f"messages are a {type(messages).__name__}, not a list")
    if not messages:
        return None, Skip("empty_messages", "no turns in the list")
    out: Messages = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return None, Skip("bad_message", f"message {i + 1} is a {type(m).__name__}, not an object")
        role = m.get("role")
        if role not in ROLES:
            return None, Skip("unknown_role", f"message {i + 1}: role {_short(role)!r} not in data.roles" if
                              isinstance(role, str) else f"message {i + 1}: role is {_short(role)}")
        content = m.get("content")
        if not isinstance(content, str):
            return None, Skip("non_string_content",
                              f"message {i + 1} ({role}): content is {type(content).__name__}: {_short(content)}")
        if not content.strip() and role != "system":
            return None, Skip("empty_content", f"message {i + 1} ({role}) is empty")
        if role == "system" and i != 0:
            return None, Skip("system_not_first", f"message {i + 1} is a system message")
        msg = {"role": role, "content": content}
        if isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    if out[0]["role"] == "system" and not out[0]["content"].strip():
        out = out[1:]                 # an empty system message carries nothing; templates differ on it
    roles = ", ".join(m["role"] for m in out)
    if not any(m["role"] == "assistant" for m in out):
        return None, Skip("no_assistant_turn", f"roles: {roles}")
    if not any(m["role"] == "user" for m in out):
        return None, Skip("no_user_turn", f"roles: {roles}")
    return out, None


def detect_schema(row: dict) -> str | None:
    """The format a row is in, by its fields (default names); None when none fits."""
    return Adapter().detect(row)


def to_messages(row: Any, schema: str = "auto") -> tuple[Messages | None, str | None]:
    """`(messages, None)` for a usable row, `(None, reason)` for one to skip (default field and role names)."""
    return Adapter(schema)(row)


def describe_formats() -> str:
    """The accepted formats and the fields each needs, for error messages."""
    return "; ".join(f"{fmt} ({', '.join(FORMAT_FIELDS[fmt])})" for fmt in FORMATS)
