"""The counted schedule length read back on resume only while the settings it was counted under hold.

Both loops count their LR schedule's length once (a pass over the data per epoch) and keep it in the
checkpoint; a re-submit with another train.epochs or data.max_rows must count again, not stop at the
old length. The FSDP2 loop's `_schedule_length` runs here on real packed blocks (no Ray: the count is
not a collective outside torch.distributed); the TRL loop's side is in tests/train/test_trl_resume_edges.py.
"""
from __future__ import annotations

import io
import json

import pytest

from raytune_ft.data.packing import pack_blocks
from raytune_ft.train.batch import EpochFeeds, RankSteps
from raytune_ft.train.schedule_length import run_schedule_steps, schedule_settings
from raytune_ft.train.common import WorkerLog
from raytune_ft.train.fsdp_loop import _schedule_length
from tests.train.test_fsdp_loop import tiny_recipe

SEQ_LEN = 64


def _blocks() -> list[dict]:
    conversations = [(list(range(1, 20 + 3 * i)), [False] * 5 + [True] * (14 + 3 * i)) for i in range(12)]
    return list(pack_blocks(conversations, SEQ_LEN))


def _recipe(tmp_path, **train):
    return tiny_recipe(tmp_path, "schedule", max_steps=None, schedule="cosine", **train)


class _Opened:
    """open_blocks for EpochFeeds: the same blocks every epoch, counting the passes opened."""

    def __init__(self, blocks):
        self.blocks, self.n = blocks, 0

    def __call__(self, epoch, counters):
        self.n += 1
        return iter(self.blocks)


def _length(recipe, state, opened: _Opened) -> tuple[int, str]:
    feed = EpochFeeds(opened, epochs=recipe.train.epochs, steps=RankSteps(per_step=1, seq_len=SEQ_LEN),
                      state=state.data.state_dict())
    out = io.StringIO()
    return _schedule_length(recipe, state, feed, WorkerLog(0, recipe, None, stream=out)), out.getvalue()


def test_fsdp_schedule_length_is_recounted_when_train_epochs_changed(tmp_path):
    from raytune_ft.train.state import TrainState

    def resumed(state: TrainState) -> TrainState:
        """A new attempt's state, read back from the train-state file's object as the checkpoint holds it."""
        again = TrainState()
        again.load_state_dict(json.loads(json.dumps(state.state_dict())))
        return again

    blocks = _blocks()
    assert len(blocks) > 2
    state = TrainState()
    assert _length(_recipe(tmp_path), state, _Opened(blocks))[0] == len(blocks)

    saved = resumed(state)
    opened = _Opened(blocks)
    total, said = _length(_recipe(tmp_path, epochs=2), saved, opened)
    assert total == 2 * len(blocks)
    assert "train.epochs" in said and "recounted" in said
    assert saved.state_dict()["counted_steps"] == total

    # the same settings again: read back, no pass over the data beyond the feed's own
    again = resumed(saved)
    opened = _Opened(blocks)
    total, said = _length(_recipe(tmp_path, epochs=2), again, opened)
    assert total == 2 * len(blocks) and opened.n == 1 and "counted" not in said


@pytest.mark.parametrize("setting, value", [("data.max_rows", 100), ("train.grad_accum", 2),
                                            ("scaling.num_workers", 4)])
def test_a_changed_setting_the_count_depends_on_is_named_and_recounted(tmp_path, setting, value):
    recipe = _recipe(tmp_path)
    state = {"counted_steps": 5, "counted_for": schedule_settings(recipe)}
    section, name = setting.split(".")
    setattr(getattr(recipe, section), name, value)
    said: list[str] = []
    assert run_schedule_steps(recipe, state, lambda: 9, said.append) == 9
    assert setting in said[0] and "recounted 9" in said[0]


def test_a_setting_the_count_does_not_depend_on_keeps_it(tmp_path):
    recipe = _recipe(tmp_path)
    state = {"counted_steps": 5, "counted_for": schedule_settings(recipe)}
    recipe.train.lr *= 10
    recipe.train.checkpoint_every += 1

    def count():
        raise AssertionError("counted again")

    assert run_schedule_steps(recipe, state, count, print) == 5
