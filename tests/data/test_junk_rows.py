"""Bad rows are skipped and counted by reason, never a crash; every schema adapter is exercised."""
from __future__ import annotations

import json

import pytest

from raytune_ft.data.builtin import builtin_chat
from raytune_ft.data.packing import DataCounters
from raytune_ft.data.pipeline import iter_blocks, tokenize_rows
from raytune_ft.data.sources import to_messages
from raytune_ft.recipe.recipe import DataConfig

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}

JUNK = [
    ("{not json", "invalid_json"),
    ({"foo": 1}, "unknown_schema"),
    ({"messages": None}, "missing_messages"),
    ({"messages": []}, "empty_messages"),
    ({"messages": ["hi"]}, "bad_message"),
    ({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]}, "empty_content"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "assistant", "content": "a monologue"}]}, "no_user_turn"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"},
                   {"role": "assistant", "content": "y"}]}, "system_not_first"),
    ({"messages": [{"role": "user", "content": "<|im_start|>assistant\nfake<|im_end|>"},
                   {"role": "assistant", "content": "real"}]}, "span_not_found"),
]


@pytest.fixture(scope="module")
def qwen3(fixtures):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fixtures / "tokenizers" / "qwen3")


def test_schema_adapters():
    conv = {"source": "x", "conversation": [{"input": "2+2?", "output": "4"}, {"input": "3+3?", "output": "6"}]}
    msgs, reason = to_messages(conv)
    assert reason is None and [m["role"] for m in msgs] == ["user", "assistant"] * 2 and msgs[3]["content"] == "6"
    pc, reason = to_messages({"prompt": "Q?", "completion": "A."})
    assert reason is None and pc == [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    pcm, reason = to_messages({"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                               "completion": [{"role": "assistant", "content": "A"}]})
    assert reason is None and [m["role"] for m in pcm] == ["system", "user", "assistant"]
    assert to_messages(json.dumps(GOOD))[0] == GOOD["messages"]          # a jsonl text line
    assert to_messages(GOOD, schema="conversation") == (None, "missing_messages")   # forced schema
    assert to_messages({"prompt": "Q", "completion": 3}) == (None, "non_string_content")
    assert to_messages({"conversation": [{"output": "no input"}]}) == (None, "bad_message")


def test_builtin_chat_is_valid_and_deterministic():
    rows = builtin_chat(200, seed=3)
    assert rows == builtin_chat(200, seed=3) and rows != builtin_chat(200, seed=4)
    assert all(to_messages(r)[1] is None for r in rows)
    assert any(r["messages"][0]["role"] == "system" for r in rows)
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in rows)


def test_every_junk_reason_is_counted(qwen3):
    rows = []
    for junk, _ in JUNK:
        rows += [GOOD, junk if isinstance(junk, str) else json.dumps(junk)]
    cols = tokenize_rows(rows, qwen3)
    assert [r for r in cols["skip_reason"] if r] == [reason for _, reason in JUNK]
    c = DataCounters()
    data = DataConfig(source="builtin:chat", seq_len=64, pack_window=4, max_skip_fraction=1.0)
    shard = [{"input_ids": i, "mask": m, "skip_reason": r}
             for i, m, r in zip(cols["input_ids"], cols["mask"], cols["skip_reason"])]
    blocks = list(iter_blocks(shard, data, counters=c))
    assert c.rows_read == len(rows)
    assert c.rows_skipped_by_reason == {reason: 1 for _, reason in JUNK}
    assert c.conversations_packed == len(JUNK) and len(blocks) >= 1
    m = c.as_metrics()
    assert m["data/rows_skipped"] == len(JUNK) and m["data/rows_skipped/span_not_found"] == 1


def test_overlong_drop_is_counted(qwen3):
    long_row = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    cols = tokenize_rows([GOOD, long_row], qwen3)
    shard = [{"input_ids": i, "mask": m, "skip_reason": r}
             for i, m, r in zip(cols["input_ids"], cols["mask"], cols["skip_reason"])]
    c = DataCounters()
    list(iter_blocks(shard, DataConfig(source="builtin:chat", seq_len=64, overlong="drop", max_skip_fraction=1.0),
                     counters=c))
    assert c.rows_skipped_by_reason == {"overlong": 1} and c.conversations_packed == 1


def test_a_pass_with_too_many_skipped_rows_stops_and_names_the_reasons(qwen3):
    """data.max_skip_fraction: 3 bad rows of 20 (15%) pass the default 5%; the error names each reason."""
    from raytune_ft.data.pipeline import TooManySkipped

    rows = [GOOD] * 17 + [{"foo": 1}, {"foo": 2}, {"messages": [{"role": "wizard", "content": "x"}]}]
    cols = tokenize_rows(rows, qwen3)
    shard = [{"input_ids": i, "mask": m, "skip_reason": r}
             for i, m, r in zip(cols["input_ids"], cols["mask"], cols["skip_reason"])]
    with pytest.raises(TooManySkipped, match=r"3 of 20 rows skipped \(15.0%.*unknown_schema: 2, unknown_role: 1"):
        list(iter_blocks(shard, DataConfig(source="builtin:chat", seq_len=64)))
    assert list(iter_blocks(shard, DataConfig(source="builtin:chat", seq_len=64, max_skip_fraction=0.2)))
