"""Step counts that hold (issue 57 item 5): `train.max_steps` past one pass over the data repeats the data, as
transformers' `max_steps` does, each pass after the first in a new seeded order, and a resume inside a later
pass is exact; a run that ends before its stated steps says why. (The local job, 35 steps a pass, printed
`step 35/200` and ended at 35 without a word.)"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from raytune_ft.data.packing import DataCounters, block_from_segments

SEQ_LEN = 96
DATA = SimpleNamespace(seq_len=SEQ_LEN, pack_window=8, overlong="split", sources=None, max_skip_fraction=1.0)


def _rows(n: int = 40, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(8, 70))
        rows.append({"input_ids": [1000 * (i + 1) + j for j in range(k)], "mask": [j >= k // 3 for j in range(k)],
                     "skip_reason": ""})
    return rows


def _feeds(rows, state: dict):
    """Passes over `rows` until the loop stops, each after the first shuffled by its own seed (as
    `batch.worker_blocks` does), from the checkpointed `state`."""
    from raytune_ft.data.pipeline import iter_blocks
    from raytune_ft.train.batch import EpochFeeds, RankSteps

    def open_blocks(epoch, counters):
        return iter_blocks(rows, DATA, counters=counters, shuffle_seed=(7 + epoch) if epoch else None)

    return EpochFeeds(open_blocks, epochs=None, steps=RankSteps(per_step=2, seq_len=SEQ_LEN), state=state)


def _conversations(blocks) -> list[int]:
    """The rows a step's blocks hold, by the id of their first token."""
    return [int(b["input_ids"][s]) // 1000 for b in blocks for s in b["cu_seqlens"][:-1] if b["input_ids"][s]]


def test_steps_past_one_pass_repeat_the_data_in_a_new_order_and_resume_exactly():
    rows = _rows()
    feed = _feeds(rows, {})
    steps, positions = [], []
    for _ in range(30):
        steps.append(feed.next_blocks())
        positions.append(feed.position())
    assert feed.epoch >= 2 and all(b is not None for b in steps), "the data is repeated, not stopped at one pass"
    n1, n2 = feed.epoch_steps[:2]
    first, second = (sum((_conversations(s) for s in part), []) for part in (steps[:n1], steps[n1:n1 + n2]))
    assert sorted(first) == sorted(second) == list(range(1, len(rows) + 1))     # each pass: every row once
    assert first != second                                                      # in a new order
    # a resume inside the third pass trains what the uninterrupted run trained from there
    at = next(i for i, p in enumerate(positions) if p["epoch"] == 2 and p["steps_in_epoch"] == 2)
    resumed = _feeds(rows, positions[at])
    for i in range(at + 1, 30):
        got = resumed.next_blocks()
        assert [b["input_ids"].tolist() for b in got] == [b["input_ids"].tolist() for b in steps[i]], i
    assert resumed.position()["data_fingerprint"] == positions[-1]["data_fingerprint"]


def _block(first: int) -> dict:
    return block_from_segments([(np.arange(first, first + 8), np.ones(8, bool))], 8)


def test_the_fsdp_loops_feed_runs_train_max_steps_past_one_pass(tmp_path):
    from raytune_ft.train.fsdp_loop import _open_data
    from tests.train.test_fsdp_loop import tiny_recipe

    recipe = tiny_recipe(tmp_path, "repeat", max_steps=7)
    recipe.data.seq_len = 8
    feed = _open_data(recipe, {"blocks_by_rank": {0: [_block(100), _block(200), _block(300)]}}, {}, rank=0,
                      device=torch.device("cpu"))
    got = [feed.next_blocks() for _ in range(7)]
    assert all(b is not None for b in got) and feed.epoch == 2
    assert [int(b[0]["input_ids"][0]) for b in got] == [100, 200, 300] * 2 + [100]


def test_a_feed_with_no_data_ends_instead_of_repeating_nothing():
    from raytune_ft.train.batch import EpochFeeds, RankSteps

    feed = EpochFeeds(lambda e, c: iter(()), epochs=None, steps=RankSteps(per_step=1, seq_len=8), state={})
    assert feed.next_blocks() is None and feed.done


def test_the_summary_says_how_many_passes_the_steps_took():
    from raytune_ft.driver.run import RunSummary

    lines = RunSummary(job="j", run_name="r", status="trained", steps=200, passes=6).lines()
    assert "  steps            200 (6 passes over the data)" in lines
    assert "  steps            35" in RunSummary(job="j", run_name="r", status="trained", steps=35, passes=1).lines()


def test_a_run_short_of_its_steps_says_why():
    from raytune_ft.train.schedule_length import short_of_steps

    line = short_of_steps(30, 35, DataCounters(blocks_unsupervised=4))
    assert "ends at step 30, short of the 35 steps" in line and "no supervised token" in line


@pytest.mark.timeout(400)
def test_a_run_past_one_pass_trains_its_steps_and_takes_no_empty_step(ray_local, tmp_path):
    """The real loop on local Ray, 2 workers: 3 blocks each a pass, the middle step holding no supervised token
    on either rank. 7 steps at 2 steps a pass: 4 passes, no loss of 0, the schedule ending on the 7th step
    (before: 3 steps, the second logged as loss 0.0000 and grad norm 0.000)."""
    from tests.train.test_fsdp_loop import fit, fixed_blocks, tiny_recipe

    blocks = fixed_blocks(4)
    empty = dict(blocks[0], labels=np.full_like(blocks[0]["labels"], -100))
    recipe = tiny_recipe(tmp_path, "passes", max_steps=7, schedule="cosine", checkpoint_every=3)
    result, state = fit(recipe, {0: [blocks[0], empty, blocks[1]], 1: [blocks[2], empty, blocks[3]]})
    history = state["history"]
    assert [h["step"] for h in history] == list(range(1, 8))
    assert min(h["loss"] for h in history) > 0 and min(h["grad_norm"] for h in history) > 0
    assert history[-1]["lr"] == pytest.approx(recipe.train.lr * recipe.train.min_lr_ratio)
    # rank 0's counters: the empty step of each of the first 3 passes read past (the 4th ends first)
    assert result.metrics["passes"] == 4 and result.metrics["data/blocks_unsupervised"] == 3


@pytest.mark.timeout(900)
def test_the_trl_loop_trains_train_max_steps_past_one_pass(ray_local, tmp_path):
    """The TRL loop (the Qwen3-4B recipe's --local job, 2 steps a pass on 40 rows): Hugging Face's trainer asks
    for pass after pass until max_steps; it had stopped at the end of the first, its warning in a log file."""
    from raytune_ft.driver.run import run
    from tests.train.test_trl_resume_edges import EPOCH_STEPS, _recipe as trl_recipe

    recipe = trl_recipe(tmp_path, "trl_passes", 0, "data.max_rows=40", "train.max_steps=5", "train.eval_every=0",
                        "train.load_best_at_end=false", "train.checkpoint_every=5")
    summary = run(recipe, local=True)
    assert EPOCH_STEPS == 2 and summary.steps == 5 and summary.passes == 3
    assert "  steps            5 (3 passes over the data)" in summary.lines()
