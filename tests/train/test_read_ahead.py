"""The FSDP2 loop reads its data ahead in a thread (`batch.ReadAhead`), from before the model is built.

What must not change: the blocks, their order, the data counters a checkpoint holds at each step, the
resume position and the errors of the data path. What must: the pass is read while nobody asks for
it, `depth` blocks ahead and no further. The data here goes through the real `iter_blocks` (tokenized
rows packed with a window, skipped rows counted); no Ray: the thread and the counters are the subject.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from raytune_ft.data.packing import DataCounters
from raytune_ft.data.pipeline import iter_blocks
from raytune_ft.train.batch import EpochFeeds, RankSteps, ReadAhead
from raytune_ft.train.schedule_length import needs_counting_pass, schedule_settings
from tests.train.test_fsdp_loop import tiny_recipe

SEQ_LEN = 96
DATA = SimpleNamespace(seq_len=SEQ_LEN, pack_window=8, overlong="split", sources=None, max_skip_fraction=1.0)   # the rows include junk on purpose


def _rows(n: int = 60, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        if i % 7 == 3:   # a skipped row: counted under its reason, never packed
            rows.append({"input_ids": [], "mask": [], "skip_reason": "no_assistant_turn"})
            continue
        k = int(rng.integers(8, 70))
        rows.append({"input_ids": list(rng.integers(1, 500, k)), "mask": [j >= k // 3 for j in range(k)],
                     "skip_reason": ""})
    return rows


def _open(rows, seed=None):
    return lambda counters: iter_blocks(rows, DATA, counters=counters, shuffle_seed=seed)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(60)
def test_read_ahead_gives_the_same_blocks_and_the_same_counters_at_every_block():
    rows = _rows()
    plain_counters, plain_after = DataCounters(), []
    plain = []
    for block in _open(rows)(plain_counters):
        plain.append(block)
        plain_after.append(plain_counters.to_dict())
    assert len(plain) > 10 and plain_counters.rows_skipped > 0

    counters = DataCounters()
    ahead = ReadAhead(_open(rows), counters, depth=4)
    time.sleep(0.2)                      # the thread is ahead now; the counters must not show it
    assert counters.to_dict() == DataCounters().to_dict()
    got = []
    for block in ahead:
        got.append(block)
        assert counters.to_dict() == plain_after[len(got) - 1], len(got)
    assert len(got) == len(plain) and all(_same(a, b) for a, b in zip(got, plain))
    assert counters.to_dict() == plain_counters.to_dict()      # what was counted after the last block too
    with pytest.raises(StopIteration):
        next(ahead)


@pytest.mark.timeout(60)
def test_read_ahead_reads_before_it_is_asked_and_at_most_depth_blocks_ahead():
    produced = []

    def source(counters):
        for i in range(100):
            produced.append(i)
            counters.blocks += 1
            yield {"i": np.array([i])}

    ahead = ReadAhead(source, DataCounters(), depth=3)
    deadline = time.time() + 10
    while len(produced) < 4 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    # 3 in the queue and 1 in the thread's hand waiting for room: read while nobody asked, no further
    assert len(produced) == 4
    assert next(ahead)["i"][0] == 0
    deadline = time.time() + 10
    while len(produced) < 5 and time.time() < deadline:
        time.sleep(0.01)
    assert len(produced) == 5
    ahead.close()
    thread = ahead._thread
    thread.join(timeout=5)
    assert not thread.is_alive()          # close() ends a pass the run no longer reads


@pytest.mark.timeout(60)
def test_an_error_of_the_data_path_is_raised_where_the_loop_reaches_it():
    def source(counters):
        yield {"i": np.array([0])}
        yield {"i": np.array([1])}
        raise OSError("the object store went away")

    ahead = ReadAhead(source, DataCounters(), depth=8)
    assert [next(ahead)["i"][0] for _ in range(2)] == [0, 1]
    with pytest.raises(OSError, match="went away"):
        next(ahead)
    with pytest.raises(StopIteration):
        next(ahead)


def _run_feed(rows, *, epochs: int, read_ahead: int, state: dict, steps: int | None = None):
    """Steps of an EpochFeeds over `rows` (epoch e>0 shuffled with seed e); the position after each."""
    feed = EpochFeeds(lambda e, c: _open(rows, seed=e or None)(c), epochs=epochs,
                      steps=RankSteps(per_step=2, seq_len=SEQ_LEN), state=state, read_ahead=read_ahead)
    out = []
    while steps is None or len(out) < steps:
        blocks = feed.next_blocks()
        if blocks is None:
            break
        out.append(([b["input_ids"].copy() for b in blocks], feed.position()))
    feed.close()
    return out


@pytest.mark.timeout(120)
def test_epoch_feeds_read_ahead_match_the_plain_feed_across_epochs_and_a_resume():
    rows = _rows(40, seed=1)
    plain = _run_feed(rows, epochs=2, read_ahead=0, state={})
    ahead = _run_feed(rows, epochs=2, read_ahead=4, state={})
    assert len(plain) == len(ahead) > 4
    for (pb, pp), (ab, ap) in zip(plain, ahead):
        assert all(np.array_equal(x, y) for x, y in zip(pb, ab)) and pp == ap

    # resume in the second epoch from a checkpoint's position: the same remaining steps and positions
    cut = len(plain) - 3
    resumed = _run_feed(rows, epochs=2, read_ahead=4, state=dict(plain[cut - 1][1]))
    assert [p for _, p in resumed] == [p for _, p in plain[cut:]]
    assert all(np.array_equal(x, y) for (rb, _), (pb, _) in zip(resumed, plain[cut:]) for x, y in zip(rb, pb))


@pytest.mark.timeout(60)
def test_a_run_stopped_early_closes_its_read_ahead_thread():
    before = {t.ident for t in threading.enumerate()}
    _run_feed(_rows(200), epochs=1, read_ahead=4, state={}, steps=2)
    deadline = time.time() + 5
    while time.time() < deadline:
        left = [t for t in threading.enumerate() if t.ident not in before and t.name == "raytune-read-ahead"]
        if not left:
            break
        time.sleep(0.05)
    assert not left


def test_the_data_is_read_ahead_only_when_no_counting_pass_reads_the_shard_first(tmp_path):
    fixed = tiny_recipe(tmp_path, "ra", max_steps=8, schedule="cosine")
    counted = tiny_recipe(tmp_path, "ra", max_steps=None, schedule="cosine")
    constant = tiny_recipe(tmp_path, "ra", max_steps=None, schedule="constant")
    assert not needs_counting_pass(fixed, {}) and not needs_counting_pass(constant, {})
    assert needs_counting_pass(counted, {})
    # a resumed run whose checkpoint counted under today's settings reads it back: no pass, read ahead
    assert not needs_counting_pass(counted, {"counted_steps": 5, "counted_for": schedule_settings(counted)})
    assert needs_counting_pass(counted, {"counted_steps": 5, "counted_for": {"train.epochs": "0"}})


@pytest.mark.timeout(60)
def test_a_resumed_feed_read_ahead_replays_at_its_first_step_and_still_checks_the_fingerprint():
    """Opened before the model is built, the feed replays the trained blocks only when the loop first asks
    (after the attempt's storage check), and a changed data order still stops the run there."""
    from raytune_ft.train.batch import DataOrderChanged

    rows = _rows(40, seed=2)
    plain = _run_feed(rows, epochs=1, read_ahead=0, state={})
    position = dict(plain[2][1])

    early = EpochFeeds(lambda e, c: _open(rows)(c), epochs=1, steps=RankSteps(per_step=2, seq_len=SEQ_LEN),
                       state=position, read_ahead=4)
    assert early.feed.blocks_consumed == 0          # nothing replayed yet
    assert early.position()["blocks_consumed"] == position["blocks_consumed"]   # asked: replayed first
    assert [b["input_ids"].tolist() for b in early.next_blocks()] == [x.tolist() for x in plain[3][0]]
    early.close()

    changed = EpochFeeds(lambda e, c: _open(rows[1:])(c), epochs=1, steps=RankSteps(per_step=2, seq_len=SEQ_LEN),
                         state=position, read_ahead=4)      # constructed: no error yet
    with pytest.raises(DataOrderChanged):
        changed.next_blocks()
    changed.close()
