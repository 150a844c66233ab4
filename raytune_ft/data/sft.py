"""Render a conversation with its chat template and mark the tokens the assistant produces.

`render_sft(tokenizer, messages)` returns the token ids of the whole conversation exactly as the chat
template renders it, and a mask that is True on each assistant turn's own tokens (its content, any
think block the template renders for that turn, tool calls, and its end-of-turn token) and False on
everything else: system and user text, template scaffolding (`<|im_start|>assistant\\n`, the newline
after `<|im_end|>`), and system text the template injects (Qwen2's default system prompt, the
Qwen3.8 reasoning-effort message).

How spans are found. Templates that rewrite history (Qwen3 drops `<think>` blocks from earlier
assistant turns; Qwen3.8 injects a system message) make "render a prefix, diff against the full
rendering" wrong, and it is slow (quadratic in turns). So the conversation is rendered once, and the
spans are found in that one rendering:

* a template with `{% generation %}` markers: the template itself says where the assistant text is
  (jinja records character ranges; the same char -> token mapping as below is applied);
* a ChatML template (every Qwen template): each assistant turn is the text between
  `<|im_start|>assistant\\n` and the `<|im_end|>` that closes it. The number of such turns must equal
  the number of assistant messages, and each message's content must appear inside its turn; if not
  (a user message that contains a literal `<|im_start|>assistant`, a template that drops a turn),
  `SpanNotFound` is raised and the pipeline counts the row as skipped. A mask is never guessed.

Char spans become token spans through one tokenization with offsets. Rule at a span edge, where
one BPE token may straddle the boundary: a token belongs to a span iff its first character lies
inside the span. In ChatML both edges sit next to special tokens or the `\\n` of the header, so a
straddling token occurs only when content begins with whitespace that the byte-level pre-tokenizer
glues onto the header's `\\n` (e.g. content "\\nHi": the token "\\n\\n" starts in the header, so it
is not supervised); tests pin this rule.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ASSISTANT_HEADER = IM_START + "assistant\n"

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_GENERATION_TAGS = re.compile(r"{%-?\s*(end)?generation\s*-?%}")


class SpanNotFound(ValueError):
    """The assistant turns of a conversation could not be located in its rendering."""


def _has_generation_markers(template: str | None) -> bool:
    return bool(template) and bool(_GENERATION_TAG.search(template))


def _backend(tokenizer):
    """The Rust tokenizer under a transformers fast tokenizer (encode with offsets, no Python glue)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"render_sft needs a fast tokenizer with offsets; got {type(tokenizer).__name__}")
    return backend


def _expected_text(message: dict) -> str:
    """The part of an assistant message that every Qwen template renders verbatim.

    Templates trim content and Qwen3 splits an inline `<think>...</think>` off it, so the check uses
    the stripped text after the last `</think>`.
    """
    content = message.get("content") or ""
    if "</think>" in content:
        content = content.rsplit("</think>", 1)[1]
    return content.strip()


def find_assistant_spans(text: str, messages: Sequence[dict]) -> list[tuple[int, int]]:
    """Character spans [start, end) of each assistant turn in a ChatML rendering.

    A span starts right after `<|im_start|>assistant\\n` and ends right after the `<|im_end|>` that
    closes the turn. Raises SpanNotFound when the turns do not line up one-to-one with the assistant
    messages or a message's content is not inside its turn.
    """
    assistants = [m for m in messages if m.get("role") == "assistant"]
    spans: list[tuple[int, int]] = []
    pos = 0
    while True:
        start = text.find(ASSISTANT_HEADER, pos)
        if start < 0:
            break
        body = start + len(ASSISTANT_HEADER)
        end = text.find(IM_END, body)
        if end < 0:
            raise SpanNotFound("an assistant turn has no closing <|im_end|>")
        end += len(IM_END)
        spans.append((body, end))
        pos = end
    if len(spans) != len(assistants):
        raise SpanNotFound(f"rendering has {len(spans)} assistant turns for {len(assistants)} "
                           "assistant messages")
    for (s, e), msg in zip(spans, assistants):
        expected = _expected_text(msg)
        if expected and text.find(expected, s, e) < 0:
            raise SpanNotFound("an assistant message's content is not inside its rendered turn")
    return spans


def _generation_spans(tokenizer, messages, template, template_kwargs) -> tuple[str, list[tuple[int, int]]]:
    """Render with `{% generation %}` markers; return the text and the marked char spans."""
    # transformers' renderer records the character ranges of {% generation %} blocks.
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, generation_indices = render_jinja_template(
        conversations=[list(messages)], chat_template=template, return_assistant_tokens_mask=True,
        **{**tokenizer.special_tokens_map, **template_kwargs})
    text = rendered[0]
    spans = [(int(s), int(e)) for s, e in generation_indices[0]]
    n_assist = sum(1 for m in messages if m.get("role") == "assistant")
    if len(spans) != n_assist:
        raise SpanNotFound(f"{{% generation %}} marked {len(spans)} spans for {n_assist} assistant messages")
    return text, spans


def template_variables(template: str) -> set[str] | None:
    """The names a chat template reads from what it is given (its messages, `add_generation_prompt`, each
    template kwarg it uses), found in its source; None when it does not parse. A kwarg the template never
    names cannot change what it renders."""
    from jinja2 import TemplateSyntaxError, meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:       # {% generation %} is transformers' own tag: what it encloses is parsed, the tag itself dropped
        return set(meta.find_undeclared_variables(env.parse(_GENERATION_TAGS.sub("", template))))
    except TemplateSyntaxError:
        return None


def unread_template_kwargs(template: str, template_kwargs: dict) -> list[str] | None:
    """The keys of `template_kwargs` the chat template never reads (`chat_template=` is render_sft's own, not
    the template's); None when the template does not parse."""
    names = template_variables(template)
    if names is None:
        return None
    return [k for k in template_kwargs if k != "chat_template" and k not in names]


def spans_to_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Mark each token whose first character lies in one of the char spans (sorted, disjoint)."""
    starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
    mask = np.zeros(len(offsets), dtype=bool)
    for s, e in spans:
        lo = int(np.searchsorted(starts, s, "left"))
        hi = int(np.searchsorted(starts, e, "left"))
        mask[lo:hi] = True
    return mask


def render_sft(tokenizer, messages: Sequence[dict], **template_kwargs: Any) -> tuple[list[int], list[bool]]:
    """Token ids of the whole conversation as the chat template renders it, and the assistant mask.

    `template_kwargs` go to the template (`enable_thinking=False`, `reasoning_effort="low"`, ...);
    `chat_template=` overrides the tokenizer's own template. Raises SpanNotFound when the assistant
    turns cannot be located (the caller skips and counts the row), and when no token is supervised.
    """
    template = template_kwargs.pop("chat_template", None) or tokenizer.chat_template
    if not template:
        raise ValueError("the tokenizer has no chat template; pass chat_template=")
    if _has_generation_markers(template):
        text, spans = _generation_spans(tokenizer, messages, template, template_kwargs)
    else:
        text = tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                             **template_kwargs)
        spans = find_assistant_spans(text, messages)
    enc = _backend(tokenizer).encode(text, add_special_tokens=False)
    mask = spans_to_mask(enc.offsets, spans)
    if not mask.any():
        raise SpanNotFound("no token of the conversation is supervised")
    return enc.ids, mask.tolist()
