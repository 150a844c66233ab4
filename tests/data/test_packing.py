"""pack_blocks: consistent block fields, no token lost or duplicated, labels masked at boundaries."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raytune_ft.data.packing import (IGNORE_INDEX, DataCounters, best_fit_decreasing,
                                     block_from_segments, pack_blocks, padding_block)


def make_examples(lengths, seed=0):
    """Conversations whose ids encode (conversation, position) so every token is traceable."""
    rng = np.random.default_rng(seed)
    out = []
    for c, n in enumerate(lengths):
        ids = (c + 1) * 100_000 + np.arange(n)
        mask = rng.random(n) < 0.6
        out.append((ids, mask))
    return out


def check_block(block, seq_len):
    """cu_seqlens, position_ids resets and seq_idx must describe the same segments."""
    assert set(block) == {"input_ids", "labels", "position_ids", "seq_idx", "cu_seqlens"}
    for k in ("input_ids", "labels", "position_ids"):
        assert block[k].dtype == np.int64 and block[k].shape == (seq_len,)
    assert block["seq_idx"].dtype == np.int32 and block["seq_idx"].shape == (seq_len,)
    cu = block["cu_seqlens"]
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == seq_len and np.all(np.diff(cu) > 0)
    starts = np.flatnonzero(block["position_ids"] == 0)
    assert starts.tolist() == cu[:-1].tolist()
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        assert np.all(block["seq_idx"][a:b] == s)
        assert block["position_ids"][a:b].tolist() == list(range(b - a))
        assert block["labels"][a] == IGNORE_INDEX                  # first token of each segment
    return cu


def unpack(blocks, seq_len):
    """Real segments (not padding) of all blocks as (ids, labels) pairs."""
    segs = []
    for b in blocks:
        cu = check_block(b, seq_len)
        for a, e in zip(cu[:-1], cu[1:]):
            ids = b["input_ids"][a:e]
            if ids[0] >= 100_000:                                 # real tokens; padding id is 0
                segs.append((ids, b["labels"][a:e]))
            else:
                assert np.all(ids == 0) and np.all(b["labels"][a:e] == IGNORE_INDEX)
                assert e == seq_len                               # padding is the final segment
    return segs


def test_fields_and_labels():
    ids, mask = np.arange(5) + 100_000, np.array([False, True, True, False, True])
    b = block_from_segments([(ids, mask), (ids[:3], np.ones(3, bool))], 12, pad_id=7)
    assert b["cu_seqlens"].tolist() == [0, 5, 8, 12]
    assert b["seq_idx"].tolist() == [0] * 5 + [1] * 3 + [2] * 4
    assert b["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert b["labels"].tolist() == [-100, 100001, 100002, -100, 100004, -100, 100001, 100002] + [-100] * 4
    assert b["input_ids"][8:].tolist() == [7] * 4
    full = block_from_segments([(ids, mask)], 5)                  # no padding: no padding segment
    assert full["cu_seqlens"].tolist() == [0, 5]
    pad = padding_block(8)
    assert pad["cu_seqlens"].tolist() == [0, 8] and np.all(pad["labels"] == IGNORE_INDEX)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=0, max_size=120),
       seq_len=st.sampled_from([64, 128, 257]), window=st.integers(1, 40))
def test_no_token_lost_or_duplicated(lengths, seq_len, window):
    examples = make_examples(lengths)
    c = DataCounters()
    blocks = list(pack_blocks(examples, seq_len, window=window, counters=c))
    segs = unpack(blocks, seq_len)
    # Reassemble each conversation from its pieces (split pieces appear in order).
    got: dict[int, list[np.ndarray]] = {}
    for ids, labels in segs:
        conv = int(ids[0]) // 100_000 - 1
        got.setdefault(conv, []).append((ids, labels))
    # the pieces kept: a conversation that fits whole, else each piece with a supervised token after its first
    kept = {conv: [s for s in range(0, n, seq_len) if n <= seq_len or examples[conv][1][s + 1:s + seq_len].any()]
            for conv, n in enumerate(lengths)}
    assert sorted(got) == [conv for conv, starts in kept.items() if starts]
    for conv, pieces in got.items():
        ids0, mask0 = examples[conv]
        pieces.sort(key=lambda p: int(p[0][0]))
        ids = np.concatenate([p[0] for p in pieces])
        assert ids.tolist() == np.concatenate([ids0[s:s + seq_len] for s in kept[conv]]).tolist()   # once, in order
        want = np.where(mask0, ids0, IGNORE_INDEX)
        for ids_p, labels_p in pieces:                            # labels: mask, minus first token
            off = int(ids_p[0]) - (conv + 1) * 100_000
            exp = want[off:off + len(ids_p)].copy()
            exp[0] = IGNORE_INDEX
            assert labels_p.tolist() == exp.tolist()
        assert len(pieces) == len(kept[conv])                    # cut only when longer than a block
    assert c.blocks == len(blocks)
    assert c.real_tokens == sum(min(seq_len, n - s) for conv, n in enumerate(lengths) for s in kept[conv])
    assert c.real_tokens + c.padding_tokens == len(blocks) * seq_len
    assert c.conversations_split == sum(1 for n in lengths if n > seq_len)
    assert c.pieces_unsupervised == sum(-(-n // seq_len) - len(kept[conv]) for conv, n in enumerate(lengths))
    assert c.supervised_tokens == sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in blocks)


def test_overlong_policies():
    examples = make_examples([10, 250, 30])
    c = DataCounters()
    blocks = list(pack_blocks(examples, 100, overlong="split", counters=c))
    assert c.conversations_split == 1 and c.real_tokens == 290
    assert c.conversations_packed == 2 + 3                        # pieces 100 + 100 + 50
    c2 = DataCounters()
    blocks2 = list(pack_blocks(examples, 100, overlong="drop", counters=c2))
    assert c2.rows_skipped_by_reason == {"overlong": 1} and c2.real_tokens == 40
    assert len(blocks2) == 1 and len(blocks) == 3
    with pytest.raises(ValueError):
        list(pack_blocks(examples, 100, overlong="truncate"))


def test_tail_is_packed_and_padding_counted():
    c = DataCounters()
    blocks = list(pack_blocks(make_examples([40, 40, 40]), 100, window=1000, counters=c))
    assert len(blocks) == 2 and c.padding_tokens == 80 and c.conversations_packed == 3


def test_best_fit_decreasing_and_efficiency():
    assert sorted(map(sorted, best_fit_decreasing([60, 50, 40, 30, 20], 100))) == [[0, 2], [1, 3, 4]]
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(1400), 0.6, 4000).astype(int), 16, 32768)
    c = DataCounters()
    n = sum(1 for _ in pack_blocks(((np.ones(k, np.int64), np.ones(k, bool)) for k in lengths), 32768,
                                   counters=c))
    assert n == -(-int(lengths.sum()) // 32768)                   # the fewest blocks possible here
    assert c.as_metrics()["data/packing_efficiency"] > 0.995


def test_deterministic():
    ex = make_examples(list(range(1, 200, 7)))
    a = list(pack_blocks(ex, 128, window=8))
    b = list(pack_blocks(ex, 128, window=8))
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b)) and len(a) == len(b)


def test_counters_merge_and_metrics():
    a = DataCounters(rows_read=3, blocks=1, real_tokens=10, padding_tokens=6)
    a.skip("empty_content")
    b = DataCounters(rows_read=2, blocks=1, real_tokens=16)
    b.skip("empty_content", 2)
    b.skip("unknown_role")
    m = a.merge(b).as_metrics()
    assert m["data/rows_read"] == 5 and m["data/rows_skipped"] == 4
    assert m["data/rows_skipped/empty_content"] == 3 and m["data/rows_skipped/unknown_role"] == 1
    assert m["data/packing_efficiency"] == pytest.approx(26 / 32)
    assert all(isinstance(v, (int, float)) for v in m.values())
    assert DataCounters.from_dict(a.to_dict()) == a


def test_counters_count_only_the_blocks_taken():
    """A run that stops early (train.max_steps) reports the blocks it drew, not the whole packing window."""
    import itertools

    rng = np.random.default_rng(0)
    examples = [(rng.integers(1, 100, size=n), np.ones(n, dtype=bool)) for n in rng.integers(10, 60, size=200)]
    c = DataCounters()
    taken = list(itertools.islice(pack_blocks(examples, 128, window=256, counters=c), 3))
    assert c.blocks == 3
    assert 0 < c.conversations_packed <= sum(len(b["cu_seqlens"]) - 1 for b in taken)
    assert c.real_tokens + c.padding_tokens == 3 * 128
    full = DataCounters()
    n_all = sum(1 for _ in pack_blocks(examples, 128, window=256, counters=full))
    assert full.blocks == n_all > 3 and full.conversations_packed == 200


def test_the_first_block_leaves_after_the_first_small_window_not_the_whole_one():
    """The windows ramp up from RAMP_FROM conversations: a run's first step waits for 64 conversations to
    be tokenized, not `window` (2,048 by default); the layout stays deterministic and loses no tokens."""
    from raytune_ft.data.packing import RAMP_FROM

    rng = np.random.default_rng(3)
    examples = [(rng.integers(1, 100, size=n), np.ones(n, dtype=bool)) for n in rng.integers(10, 60, size=600)]
    read = []

    def stream():
        for e in examples:
            read.append(1)
            yield e

    blocks = pack_blocks(stream(), 128, window=2048)
    next(blocks)
    assert len(read) == RAMP_FROM == 64
    rest = list(blocks)
    again = list(pack_blocks(examples, 128, window=2048))
    assert len(again) == len(rest) + 1 and all((a["input_ids"] == b["input_ids"]).all()
                                              for a, b in zip(again[1:], rest))
    c = DataCounters()
    list(pack_blocks(examples, 128, window=2048, counters=c))
    assert c.real_tokens == sum(len(e[0]) for e in examples) and c.conversations_packed == 600
