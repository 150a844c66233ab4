"""The FSDP2 loop's checkpoint as typed parts (train/state.py), in-process on a one-rank gloo group.

- A checkpoint written as the loop wrote them before the parts existed (a frozen copy of that writer here:
  DCP's model and optimizer under app.model / app.optim with the replicated entries under app.rank{R}, and
  a flat train-state file of the 19 keys five modules wrote) resumes into the parts: weights, optimizer
  moments, and each part's values; a save by the new code writes the same train-state object.
- Each part saves and loads itself; a key an older checkpoint lacks keeps the part's fresh value.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

COUNTERS = {"rows_read": 120, "rows_skipped_by_reason": {"too_long": 2}, "conversations_packed": 118}
# every key the FSDP2 loop wrote into train_state/rank{R}.json before the typed parts, as it wrote them
BEFORE_PARTS = {
    "step": 2, "blocks_consumed": 4,
    "history": [{"step": 1, "loss": 2.5, "lr": 0.001, "grad_norm": 1.25},
                {"step": 2, "loss": 2.25, "lr": 0.001, "grad_norm": 1.0}],
    "counters": COUNTERS, "resumed_from": [0], "counted_steps": 10,
    "counted_for": {"train.epochs": "0a1b2c3d", "data.seq_len": "deadbeef"}, "total_steps": 10,
    "epoch": 0, "data_fingerprint": 305419896, "steps_in_epoch": 2, "epoch_steps": [], "epoch_fingerprints": [],
    "epoch_counters": [COUNTERS], "tokens_total": 2048, "run_train_seconds": 3.5,
    "eval_history": [{"step": 2, "eval_loss": 2.4}],
    "samples": [{"step": 2, "prompt": "Hi", "completion": "Hello", "tokens": 2, "seconds": 0.1,
                 "base_completion": "Hey"}],
    "sample_base": ["Hey"],
}


@contextlib.contextmanager
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_model_and_optimizer():
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _FrozenWriterBeforeParts:
    """The DCP layout of the loop's checkpoints before the typed parts, frozen here (it must not follow the
    code it checks): DTensor entries under model / optim, every other leaf under rank{R}."""

    def __init__(self, model, optimizer, rank: int):
        self.model, self.optimizer, self.rank = model, optimizer, rank

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.tensor import DTensor

        def split(tree):
            if isinstance(tree, DTensor):
                return tree, None
            if isinstance(tree, dict):
                sharded, local = {}, {}
                for k, v in tree.items():
                    s, lo = split(v)
                    if s is not None:
                        sharded[k] = s
                    if lo is not None:
                        local[k] = lo
                return (sharded or None), (local or None)
            return None, tree

        msd, osd = get_state_dict(self.model, self.optimizer)
        sharded, local = split({"model": msd, "optim": osd})
        return {**(sharded or {}), f"rank{self.rank}": local or {}}

    def load_state_dict(self, state) -> None:     # DCP saves only what has both (its Stateful protocol)
        raise NotImplementedError


def write_before_parts(directory: str, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"app": _FrozenWriterBeforeParts(model, optimizer, 0)}, checkpoint_id=os.path.join(directory, "dcp"))
    os.makedirs(os.path.join(directory, "train_state"))
    with open(os.path.join(directory, "train_state", "rank0.json"), "w") as f:
        json.dump(BEFORE_PARTS, f)


def test_a_checkpoint_written_before_the_typed_parts_resumes_into_them(tmp_path):
    from raytune_ft.train import checkpoint as ckpt_io
    from raytune_ft.train.state import TrainState

    folder = str(tmp_path / "checkpoint_before_parts")
    with one_rank_group():
        torch.manual_seed(0)
        model, opt = sharded_model_and_optimizer()
        train(model, opt, 2)
        write_before_parts(folder, model, opt)
        weights = {k: full(v).clone() for k, v in model.state_dict().items()}
        moments = {k: {n: full(t).clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}

        torch.manual_seed(1)
        fresh, fresh_opt = sharded_model_and_optimizer()
        state = TrainState(fresh, fresh_opt)
        reads: list[str] = []
        ckpt_io.load_train_checkpoint(folder, state, 0, reads=reads)

        loaded = {k: full(v) for k, v in fresh.state_dict().items()}
        assert weights.keys() == loaded.keys() and all(torch.equal(weights[k], loaded[k]) for k in weights)
        loaded_moments = fresh_opt.state_dict()["state"]
        for k, s in moments.items():
            for n, t in s.items():
                assert torch.equal(t, full(loaded_moments[k][n])), (k, n)
        assert state.step == 2 and state.schedule.total_steps == 10 and state.schedule.counted_steps == 10
        assert state.schedule.counted_for == BEFORE_PARTS["counted_for"]
        assert state.data.blocks_consumed == 4 and state.data.data_fingerprint == 305419896
        assert state.data.epoch_counters == [COUNTERS] and state.data.counters == COUNTERS
        assert [h["loss"] for h in state.progress.history] == [2.5, 2.25]
        assert state.progress.tokens_total == 2048 and state.progress.resumed_from == [0]
        assert state.evaluation.evaluated_at(2) and state.evaluation.sampled_at(2)
        assert state.evaluation.sample_base == ["Hey"]
        # the new code writes the object the old one wrote: readers of the file (plots, summary) see no change
        assert state.state_dict() == BEFORE_PARTS
        assert sorted(os.path.basename(p) for p in reads) == [".metadata", "__0_0.distcp", "rank0.json"]

        # training resumes: one more step from the loaded state equals one from the original
        torch.manual_seed(7)
        train(model, opt, 1)
        torch.manual_seed(7)
        train(fresh, fresh_opt, 1)
        assert all(torch.equal(full(a), full(b)) for a, b in zip(model.state_dict().values(),
                                                                 fresh.state_dict().values()))


def test_each_part_saves_and_loads_itself():
    from raytune_ft.train.state import DataPosition, EvaluationState, Progress, Schedule, TrainState

    state = TrainState()
    assert state.sharded == {}
    state.schedule.step = 6
    state.progress.history.append({"step": 6, "loss": 1.0})
    state.progress.resumed(4)
    state.evaluation.add_eval(6, 0.9)
    saved = state.state_dict()
    parts = {"schedule": Schedule, "data": DataPosition, "progress": Progress, "evaluation": EvaluationState}
    owned = [k for cls in parts.values() for k in cls.keys()]
    assert len(owned) == len(set(owned)) == 19     # one owner per key, as many keys as the file had
    assert set(saved) <= set(owned)

    again = TrainState()
    again.load_state_dict(saved)
    assert again.state_dict() == saved and again.progress.resumed_from == [4]
    # a part never shares a list with what it was loaded from or saved to
    saved["history"].append({"step": 7})
    assert len(again.progress.history) == 1 and len(state.progress.history) == 1
    # a key an older checkpoint lacks keeps the part's fresh value
    older = TrainState()
    older.load_state_dict({"step": 3})
    assert older.step == 3 and older.data.counters == {} and older.evaluation.eval_history is None


def test_a_fault_plan_reaches_the_hook_points_through_the_tests_dispatcher():
    """What Ray's worker_process_setup_hook does in the workers of the tests' Rays (tests/faults.py), here in
    this process: the dispatcher follows the plan on file when a point fires, and nothing once it is gone."""
    from raytune_ft.train import hooks
    from tests.faults import attach_handlers, fault_plan

    hooks.clear()
    try:
        attach_handlers()
        assert hooks.value("storage.free_bytes", 123, step=4) == 123     # no plan on file: unchanged
        hooks.fire("checkpoint.written", step=4, rank=1)
        with fault_plan(free_bytes="1000@8", fail_after_write="4:1"):
            assert hooks.value("storage.free_bytes", 10**12, step=4) == 10**12
            assert hooks.value("storage.free_bytes", 10**12, step=8) == 1000
            hooks.fire("checkpoint.written", step=4, rank=0)             # another rank: nothing
            with pytest.raises(OSError, match="rank 1 could not write the step-4 checkpoint"):
                hooks.fire("checkpoint.written", step=4, rank=1)
        hooks.fire("checkpoint.written", step=4, rank=1)                 # the plan is gone with its block
        with pytest.raises(ValueError, match="unknown faults"):
            with fault_plan(exit_later="1:0"):
                pass
    finally:
        hooks.clear()


def test_the_trl_loops_checkpoint_parts_are_the_fsdp2_loops_typed_parts(tmp_path):
    """The TRL loop saves and resumes its train state as train/state.py's parts (no untyped dict): what a
    rank saved at a step comes back as the same typed parts, in the FSDP2 loop's file layout."""
    import pyarrow.fs as pafs

    from raytune_ft.recipe.recipe import Recipe
    from raytune_ft.train.schedule_length import schedule_settings
    from raytune_ft.train.state import Progress, TrainState
    from raytune_ft.train.trl.checkpoint import resume_state, save_train_state, trl_train_state
    from raytune_ft.train.trl.data import RankBlocks

    recipe = Recipe()
    blocks = RankBlocks(recipe, rank=1, flag_device=torch.device("cpu"), epoch=1, skip_blocks=12, fingerprint=99)
    blocks.counted_steps = 40
    save_train_state(str(tmp_path), 1, trl_train_state(7, blocks, Progress(tokens_total=1000, run_train_seconds=3.5)))
    back = resume_state(pafs.LocalFileSystem(), str(tmp_path), 1)
    assert isinstance(back, TrainState) and back.step == 7
    assert (back.data.epoch, back.data.blocks_consumed, back.data.data_fingerprint) == (1, 12, 99)
    assert back.schedule.counted_steps == 40 and back.schedule.counted_for == schedule_settings(recipe)
    assert (back.progress.tokens_total, back.progress.run_train_seconds) == (1000, 3.5)
    with open(tmp_path / "train_state" / "rank1.json") as f:
        assert set(json.load(f)) <= {k for part in TrainState().json_parts.values() for k in part.keys()}
