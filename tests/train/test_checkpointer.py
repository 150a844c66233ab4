"""The FSDP2 loop's background checkpoints (train/checkpointer.py), in-process on a one-rank gloo group with
DCP's real async_save, a real Ray Train storage context over a local folder and the real hook seam.

Two stand-ins, for what needs a running Ray Train attempt: Ray Train's report (a barrier with the
controller) is a function recording what it was handed, and the storage guard (its free-space check reads
the attempt's storage through Ray Train's context) lets every save through.
"""
from __future__ import annotations

import io
import threading

import pytest
import torch

from tests.train.test_train_state import full, one_rank_group, sharded_model_and_optimizer, train


class LetThrough:
    """The storage guard's interface, without its check (see the module's docstring)."""

    def check(self, step: int, final: bool = False) -> None:
        pass

    def write(self, fn, step: int):
        return fn()


def _saver(tmp_path, state, *, background: bool, reports: list):
    from ray.train.v2._internal.execution.storage import StorageContext

    from raytune_ft.recipe.recipe import Recipe
    from raytune_ft.train.checkpointer import Checkpointer, SaveSettings
    from raytune_ft.train.common import WorkerLog

    storage = StorageContext(str(tmp_path / "runs"), "run")
    log = WorkerLog(0, Recipe(), None, stream=io.StringIO())
    return Checkpointer(state, LetThrough(), log, SaveSettings(0, torch.device("cpu"), background, {"job": "test"}),
                        storage=storage, report=lambda metrics, ckpt, name: reports.append((metrics, ckpt, name)))


def _load_weights(path: str):
    from raytune_ft.train import checkpoint as ckpt_io
    from raytune_ft.train.state import TrainState

    model, opt = sharded_model_and_optimizer()
    state = TrainState(model, opt)
    ckpt_io.load_train_checkpoint(path, state, 0)
    return {k: full(v) for k, v in model.state_dict().items()}, state


@pytest.mark.timeout(120)
def test_a_background_save_holds_the_state_of_its_step_and_is_reported_only_once_complete(tmp_path):
    from raytune_ft.train import hooks
    from raytune_ft.train.state import TrainState

    release = threading.Event()
    hooks.clear()
    hooks.attach("checkpoint.written", lambda step, rank: release.wait(60))   # the write is slow
    reports: list = []
    try:
        with one_rank_group():
            torch.manual_seed(0)
            model, opt = sharded_model_and_optimizer()
            state = TrainState(model, opt)
            saver = _saver(tmp_path, state, background=True, reports=reports)
            train(model, opt, 2)
            state.schedule.step = 2
            at_save = {k: full(v).clone() for k, v in model.state_dict().items()}
            saver.save({"step": 2, "loss": 1.5})
            train(model, opt, 3)          # the loop trains on while the save is written
            state.schedule.step = 5
            saver.poll()
            assert reports == [] and saver.in_flight is not None, "reported before its files were complete"
            release.set()
            saver.wait()
            saver.close()
            assert len(reports) == 1
            metrics, persisted, name = reports[0]
            assert metrics == {"step": 2, "loss": 1.5} and persisted.path.endswith(name)
            weights, loaded = _load_weights(persisted.path)
            assert all(torch.equal(weights[k], at_save[k]) for k in at_save)      # step 2's, not step 5's
            assert not all(torch.equal(full(v), at_save[k]) for k, v in model.state_dict().items())
            assert loaded.step == 2
    finally:
        hooks.clear()


@pytest.mark.timeout(120)
def test_a_failed_background_save_is_raised_at_the_next_step_and_never_reported(tmp_path):
    from raytune_ft.train import hooks
    from raytune_ft.train.state import TrainState

    def fail(step, rank):
        raise OSError("disk gone")

    hooks.clear()
    hooks.attach("checkpoint.written", fail)
    reports: list = []
    try:
        with one_rank_group():
            model, opt = sharded_model_and_optimizer()
            state = TrainState(model, opt)
            saver = _saver(tmp_path, state, background=True, reports=reports)
            train(model, opt, 1)
            state.schedule.step = 1
            saver.save({"step": 1})
            saver.in_flight.future.exception(timeout=60)      # the writer thread has failed by now
            with pytest.raises(OSError, match="disk gone"):
                saver.poll()
            assert saver.in_flight is None and reports == []
            saver.close()
    finally:
        hooks.clear()


@pytest.mark.timeout(120)
def test_a_synchronous_save_is_complete_and_reported_when_it_returns(tmp_path):
    from raytune_ft.train.state import TrainState

    reports: list = []
    with one_rank_group():
        model, opt = sharded_model_and_optimizer()
        state = TrainState(model, opt)
        saver = _saver(tmp_path, state, background=False, reports=reports)
        train(model, opt, 1)
        state.schedule.step = 1
        at_save = {k: full(v).clone() for k, v in model.state_dict().items()}
        blocked = saver.save({"step": 1}, final=True)
        assert len(reports) == 1 and saver.in_flight is None and blocked > 0
        weights, _ = _load_weights(reports[0][1].path)
        assert all(torch.equal(weights[k], at_save[k]) for k in at_save)


@pytest.mark.timeout(120)
def test_background_saves_go_on_when_torchs_stager_closes_itself_after_each_stage(tmp_path, monkeypatch):
    """torch 2.11's DefaultStager closes its copier at the end of each stage (pytorch#183413): a GPU run's
    second background save failed with KeyError: <class 'type'>, and replacing the stager then pinned its host
    buffers again inside every save. The saves go on with one stager and its buffers. The torch here (2.13)
    does not close, so its _stage is wrapped to do what 2.11's does, and compat is told it runs on such a
    torch: the stand-ins of this test, for a torch not installed."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from raytune_ft import compat
    from raytune_ft.train.state import TrainState

    monkeypatch.setattr(compat.torch_internals, "_stager_closes_copier", lambda: True)

    stage = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    reports: list = []
    with one_rank_group():
        model, opt = sharded_model_and_optimizer()
        state = TrainState(model, opt)
        saver = _saver(tmp_path, state, background=True, reports=reports)
        first = saver.stager
        for step in (1, 2, 3):
            train(model, opt, 1)
            state.schedule.step = step
            at_save = {k: full(v).clone() for k, v in model.state_dict().items()}
            saver.save({"step": step})
            saver.wait()
        copier = saver.stager._state_dict_stager
        assert saver.stager is first and len(copier._cached_storage_mapping) > 0   # the buffers of save 1
        saver.close()
        assert len(copier._cached_storage_mapping) == 0                            # freed at the end
        assert [m["step"] for m, _, _ in reports] == [1, 2, 3]
        weights, loaded = _load_weights(reports[-1][1].path)
        assert loaded.step == 3 and all(torch.equal(weights[k], at_save[k]) for k in at_save)
