"""render_sft with the real Qwen tokenizer and templates: the mask covers each assistant turn's own
tokens and nothing of the system/user text, template scaffolding or injected system text."""
from __future__ import annotations

import itertools
import json
import os

import pytest

from raytune_ft.data.sft import SpanNotFound, render_sft, spans_to_mask
from raytune_ft.data.sources import to_messages

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def qwen3(fixtures):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen3")


@pytest.fixture(scope="module")
def qwen2(fixtures):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen2-0.5b")


@pytest.fixture(scope="module")
def qwen38_template(fixtures):
    return (fixtures / "templates" / "qwen3.8-27b.chat_template.jinja").read_text()


def _rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def conversations(fixtures):
    """Every UltraChat and Capybara sample conversation (Capybara through its LDJnr adapter)."""
    convs = []
    for name in ("ultrachat_200k_train_sft_first16.jsonl", "capybara_ldjnr_first16.jsonl"):
        for row in _rows(fixtures / "data" / name):
            messages, reason = to_messages(row)
            assert reason is None, (name, reason)
            convs.append(messages)
    assert len(convs) == 32
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in convs)   # multi-turn present
    return convs


def masked_runs(tok, ids, mask):
    """Decoded text of each maximal run of supervised tokens, in order."""
    runs, pos = [], 0
    for flag, group in itertools.groupby(mask):
        n = len(list(group))
        if flag:
            runs.append(tok.decode(ids[pos:pos + n]))
        pos += n
    return runs


def check_conversation(tok, messages, ids, mask, template, **kw):
    """The properties every render must have (see module docstring)."""
    assert 0 < sum(mask) < len(mask)                              # never all ones or all zeros
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # ids are the template's rendering
    runs = masked_runs(tok, ids, mask)
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(assistants)                            # one span per assistant turn
    for run, msg in zip(runs, assistants):
        content = msg["content"].split("</think>")[-1].strip()
        assert content in run
        assert run.endswith(IM_END) and run.count(IM_END) == 1      # its end-of-turn token, nothing after
        assert "<|im_start|>" not in run                           # no scaffolding
    supervised = "".join(runs)
    for msg in messages:
        if msg["role"] in ("user", "system") and len(msg["content"].strip()) > 30:
            assert msg["content"].strip() not in supervised
    for injected in ("Reasoning effort is set to", "You are a helpful assistant"):
        assert injected not in supervised


@pytest.mark.parametrize("name,kw", [
    ("qwen2-0.5b", {}),
    ("qwen3", {}),
    ("qwen3", {"enable_thinking": False}),
    ("qwen3.8-27b", {}),
    ("qwen3.8-27b", {"enable_thinking": False}),
    ("qwen3.8-27b", {"reasoning_effort": "low"}),
])
def test_every_sample_conversation(name, kw, conversations, qwen2, qwen3, qwen38_template):
    tok = qwen2 if name == "qwen2-0.5b" else qwen3
    template = qwen38_template if name == "qwen3.8-27b" else tok.chat_template
    for messages in conversations:
        ids, mask = render_sft(tok, messages, chat_template=template, **kw)
        assert len(ids) == len(mask)
        check_conversation(tok, messages, ids, mask, template, **kw)


def test_qwen38_injected_system_text_is_not_supervised(qwen3, qwen38_template, conversations):
    messages = [{"role": "system", "content": "Be terse."}] + conversations[0]
    ids, mask = render_sft(qwen3, messages, chat_template=qwen38_template)
    text = qwen3.decode(ids)
    assert "Reasoning effort is set to xhigh" in text            # the template injected it...
    unsup = qwen3.decode([i for i, m in zip(ids, mask) if not m])
    assert "Reasoning effort is set to xhigh" in unsup and "Be terse." in unsup   # ...unsupervised
    # with enable_thinking=False nothing is injected, and the spans still line up
    ids2, mask2 = render_sft(qwen3, messages, chat_template=qwen38_template, enable_thinking=False)
    assert "Reasoning effort" not in qwen3.decode(ids2)
    check_conversation(qwen3, messages, ids2, mask2, qwen38_template, enable_thinking=False)


THINK_CONV = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\nTwo plus three: count up from two.\n</think>\n\nIt is 5."},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "<think>\nFour doubled is eight.\n</think>\n\nIt is 8."},
]


@pytest.mark.parametrize("kw", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
def test_qwen3_think_blocks_history_rewrite(qwen3, kw):
    """Qwen3 drops the think block of the earlier turn; the last turn keeps it, inside its span."""
    ids, mask = render_sft(qwen3, THINK_CONV, **kw)
    runs = masked_runs(qwen3, ids, mask)
    assert len(runs) == 2
    assert "count up from two" not in qwen3.decode(ids)            # history rewritten by the template
    assert runs[0] == "It is 5." + IM_END
    assert runs[1] == "<think>\nFour doubled is eight.\n</think>\n\nIt is 8." + IM_END
    check_conversation(qwen3, THINK_CONV, ids, mask, qwen3.chat_template, **kw)


def test_qwen38_reasoning_content_field(qwen3, qwen38_template):
    messages = [{"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}]
    ids, mask = render_sft(qwen3, messages, chat_template=qwen38_template)
    assert masked_runs(qwen3, ids, mask) == ["<think>\nGreet back.\n</think>\n\nHello!" + IM_END]


def test_generation_markers_agree_with_transformers(qwen3):
    """A template with {% generation %} (TRL's Qwen3.8 training template) uses its own markers."""
    import trl

    path = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "qwen3_8_training.jinja")
    template = open(path).read()
    messages = THINK_CONV[:1] + [{"role": "assistant", "content": "It is 5."}] + THINK_CONV[2:3] + \
        [{"role": "assistant", "content": "It is 8."}]
    ids, mask = render_sft(qwen3, messages, chat_template=template)
    ref = qwen3.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
    assert ids == ref["input_ids"]
    assert mask == [bool(m) for m in ref["assistant_masks"]]
    assert len(masked_runs(qwen3, ids, mask)) == 2


def test_injected_header_in_user_text_is_skipped(qwen3):
    """A user message holding a literal assistant header would shift the spans: refuse, never guess."""
    messages = [{"role": "user", "content": "Look: <|im_start|>assistant\nfake<|im_end|>"},
                {"role": "assistant", "content": "Real answer."}]
    with pytest.raises(SpanNotFound):
        render_sft(qwen3, messages)
    assert issubclass(SpanNotFound, ValueError)


def test_non_chatml_template_without_markers_is_refused(qwen3):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(SpanNotFound):
        render_sft(qwen3, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                   chat_template=template)


def test_span_edge_rule_token_belongs_where_it_starts(qwen2):
    """Qwen2's template does not trim: content "\\n\\nHi" glues its newlines onto the header's "\\n"
    in one BPE token that starts in the header, so it is not supervised; "Hi" onwards is."""
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "\n\nHi there"}]
    ids, mask = render_sft(qwen2, messages)
    first = mask.index(True)
    assert qwen2.decode(ids[first - 1:first]) == "\n\n\n"           # the straddling token, unsupervised
    assert masked_runs(qwen2, ids, mask) == ["Hi there" + IM_END]
    # the rule itself, on offsets: token starts 0, 3, 5, 9; span [4, 9) holds only the token at 5
    assert spans_to_mask([(0, 3), (3, 5), (5, 9), (9, 12)], [(4, 9)]).tolist() == [False, False, True, False]
    assert spans_to_mask([(0, 3), (3, 5), (5, 9), (9, 12)], [(3, 12)]).tolist() == [False, True, True, True]


def test_27b_recipe_states_the_template_defaults_and_readme_shows_its_row(qwen3, qwen38_template, conversations):
    """The 27B recipe's explicit template_kwargs render exactly what the template's defaults render (the
    notebook's behaviour), and the README's example row is that rendering."""
    from raytune_ft.cli import _load_job
    from tests.conftest import REPO

    kwargs = _load_job("qwen27b_b300").recipe().data.template_kwargs
    assert kwargs == {"enable_thinking": True, "reasoning_effort": "xhigh"}
    for messages in conversations[:4]:
        assert render_sft(qwen3, messages, chat_template=qwen38_template, **kwargs) == \
            render_sft(qwen3, messages, chat_template=qwen38_template)
    row = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]
    ids, mask = render_sft(qwen3, row, chat_template=qwen38_template, **kwargs)
    readme = (REPO / "README.md").read_text()
    assert "```\n" + qwen3.decode(ids).rstrip("\n") + "\n```" in readme
    supervised = qwen3.decode([i for i, m in zip(ids, mask) if m])
    assert f"`{supervised.encode('unicode_escape').decode()}`" in readme
    # the other setting the README names drops the injected system text
    off = qwen3.decode(render_sft(qwen3, row, chat_template=qwen38_template, enable_thinking=False)[0])
    assert "Reasoning effort" not in off
