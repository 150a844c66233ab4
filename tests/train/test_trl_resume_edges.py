"""The TRL loop resumed: real local Ray, the Qwen3-4B recipe's --local job (tiny qwen3 on CPU, one worker),
workers SIGKILLed by the test fault plan (tests/faults.py, kill_at_step: deterministic, where a killer thread
outside raced the run on a busy host). Ray starts a new worker, which rebuilds the Hugging Face checkpoint
folder from the Ray checkpoint (weights, optimizer, scheduler, RNG), skips the packed blocks it already
trained on and carries on: nothing trained twice into the weights, nothing skipped.

With data.max_rows=40 a pass is 2 optimizer steps (4 packed blocks, 2 per step), its length counted.

- The epoch boundary (2 epochs, killed at the end of step 4, resumed from the step-2 checkpoint, epoch 2
  trained exactly as a straight run) and a finished run submitted again run once, on S3, in
  tests/driver/test_s3_runs.py, with this module's settings (EPOCH_TWO).
- "end": 1 epoch, killed once the last save of the pass (step 2) is registered, before the final
  checkpoint: the retry has nothing left to train and must finish, not fail in SFTTrainer.__init__.
- "grow": the same, its lease written as another job's before the kill (as if this job's heartbeat had gone
  stale and another job had taken the folder over): the retry's rank 0 must find the lease is not its job's
  and stop the run (the lease token reaches the workers through the loop's config); submitted again with a
  packing window that lays out other blocks, it stops (the data fingerprint); submitted again with its own
  data and train.epochs=2 it must recount its schedule and train the second epoch, not stop at the
  one-epoch count the checkpoint holds.
- "best", on two workers: lr 0.3 (constant) makes the first evaluation the best (the loss then jumps);
  rank 1 is killed once the step-2 checkpoint is registered, its local Hugging Face folders removed as on
  another node; train.load_best_at_end must still end on the step-1 weights, fetched from the run's storage
  by every rank.
"""
from __future__ import annotations


import pytest

from tests.faults import fault_plan

EPOCH_STEPS = 2
def _recipe(storage, run_name: str, max_failures: int, *overrides: str):
    """The Qwen3-4B recipe's --local job under `run_name`; `overrides` (key=value) applied last."""
    from raytune_ft.cli import _job_recipe

    return _job_recipe("qwen3_4b_full", True, [
        f"tracking.storage_path={storage}", f"tracking.run_name={run_name}", "train.log_every=1",
        f"scaling.max_failures={max_failures}", "registry.enabled=false", *overrides])


def _history(recipe, run_id: str, key: str) -> dict[int, list[float]]:
    from mlflow import MlflowClient

    out: dict[int, list[float]] = {}
    for m in MlflowClient(tracking_uri=recipe.tracking_uri).get_metric_history(run_id, key):
        out.setdefault(m.step, []).append(m.value)
    return out


def _weights(ckpt: str, fs=None) -> dict:
    """The hf/ weights of checkpoint folder `ckpt`, on `fs` (default: the local filesystem; an S3 one takes the
    folder without its s3:// scheme)."""
    import pyarrow.fs as pafs
    from safetensors.torch import load

    fs = fs or pafs.LocalFileSystem()
    out = {}
    for info in sorted(fs.get_file_info(pafs.FileSelector(f"{ckpt}/hf")), key=lambda i: i.path):
        if info.path.endswith(".safetensors"):
            with fs.open_input_stream(info.path) as f:
                out.update(load(f.read()))
    return out


COUNTED = ("train.max_steps=null", "data.max_rows=40", f"train.checkpoint_every={EPOCH_STEPS}",
           f"train.eval_every={EPOCH_STEPS}")
EPOCH_TWO = ("train.epochs=2", "train.log_every=1", *COUNTED)     # tests/driver/test_s3_runs.py's TRL runs too


def _run_with_fault(recipe, spec: str | None, **more: str):
    """run(recipe, local=True) with the fault hook set to `spec` (and the faults `more`) for this run: (result,
    None) or (None, the exception the run ended with)."""
    from raytune_ft.driver.run import run

    with fault_plan(**({"kill_at_step": spec, **more} if spec else {})):
        try:
            return run(recipe, local=True), None
        except Exception as e:  # noqa: BLE001 - some runs are meant to fail
            return None, e


@pytest.fixture(scope="module")
def runs(ray_local, tmp_path_factory):
    storage = tmp_path_factory.mktemp("trl_resume_edges")
    out = {}
    out["end"] = (r := _recipe(storage, "end", 1, *COUNTED)), _run_with_fault(r, f"{EPOCH_STEPS}:0:saved")
    out["grow_first"] = _run_with_fault(_recipe(storage, "grow", 1, *COUNTED), f"{EPOCH_STEPS}:0:saved",
                                        take_lease="1")
    # re-submitted with a packing window that lays out other blocks: it must stop, not resume on other data
    out["changed"] = _run_with_fault(_recipe(storage, "grow", 0, *EPOCH_TWO, "data.pack_window=8"), None)
    out["grow"] = (r := _recipe(storage, "grow", 0, *EPOCH_TWO)), _run_with_fault(r, None)
    best = ("train.max_steps=4", "train.lr=0.3", "train.schedule=constant", "train.warmup_steps=0",
            "train.eval_every=1", "train.checkpoint_every=1", "train.keep_checkpoints=5")
    out["best"] = (r := _recipe(storage, "best", 1, "scaling.num_workers=2", *best)), _run_with_fault(r, "2:1:saved")
    return out


def _finished(runs, name: str):
    recipe, (result, error) = runs[name]
    assert error is None, f"run {name!r} failed: {error!r}"
    return recipe, result


def _checkpoint_of_step(recipe, step: int) -> str:
    """The run's kept Ray checkpoint of optimizer step `step` reported during training (not the final one)."""
    import pyarrow.fs as pafs

    from raytune_ft.storage import fs as storage
    run_dir = f"{recipe.tracking.storage_path}/{recipe.tracking.run_name}"
    reported = storage.reported_checkpoints(pafs.LocalFileSystem(), run_dir)
    names = [n for n in reported.kept if reported.metrics[n].get("step") == step and not reported.metrics[n].get("done")]
    assert names, (step, reported.metrics)
    return f"{run_dir}/{names[-1]}"


def _same_weights(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and bool(a) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(2400)
def test_resume_at_the_last_save_of_a_pass_finishes(runs):
    from raytune_ft.train.checkpoint import read_meta

    recipe, end = _finished(runs, "end")
    assert end.steps == EPOCH_STEPS
    assert {s: len(v) for s, v in _history(recipe, end.mlflow_run_id, "train/loss").items()} == {1: 1, 2: 1}
    assert read_meta(end.checkpoint)["final"] is True
    # nothing trained after the last save: the final weights are that save's
    assert _same_weights(_weights(end.checkpoint), _weights(_checkpoint_of_step(recipe, EPOCH_STEPS)))


@pytest.mark.timeout(2400)
def test_resubmit_with_more_epochs_recounts_the_schedule(runs):
    from tests.conftest import train_state

    first, first_error = runs["grow_first"]
    # the retry found the folder's lease another job's (its token came through the loop's config) and stopped
    assert first is None and "is now held by job raysubmit_test_fault" in str(first_error), repr(first_error)
    changed, changed_error = runs["changed"]
    assert changed is None and "fingerprint mismatch" in str(changed_error), repr(changed_error)
    recipe, grow = _finished(runs, "grow")
    assert grow.steps == 2 * EPOCH_STEPS
    assert {3, 4} <= set(_history(recipe, grow.mlflow_run_id, "train/loss"))
    assert train_state(grow.checkpoint)["epoch"] == 1


@pytest.mark.timeout(2400)
def test_best_checkpoint_of_an_earlier_attempt_is_loaded_at_the_end_on_two_workers(runs):
    from mlflow import MlflowClient

    recipe, best = _finished(runs, "best")
    assert best.steps == 4 and recipe.scaling.num_workers == 2
    params = MlflowClient(recipe.tracking_uri).get_run(best.mlflow_run_id).data.params
    from raytune_ft.tracking.mlflow_run import startup_by_attempt

    attempts = set(startup_by_attempt(params))
    assert len(attempts) >= 2, f"no second attempt: the kill never happened ({sorted(attempts)})"
    assert_ended_on_the_best_first_step(recipe, best)


def assert_ended_on_the_best_first_step(recipe, best) -> None:
    """A 4-step run evaluated every step whose first evaluation is its best: its final checkpoint holds the
    step-1 weights (not step 4's) and says so in its meta."""
    from raytune_ft.train.checkpoint import read_meta

    evals = {s: v[-1] for s, v in _history(recipe, best.mlflow_run_id, "eval_loss").items()}
    assert min(evals, key=evals.get) == 1 and sorted(evals) == [1, 2, 3, 4]
    final = _weights(best.checkpoint)
    assert _same_weights(final, _weights(_checkpoint_of_step(recipe, 1)))
    assert not _same_weights(final, _weights(_checkpoint_of_step(recipe, 4)))
    meta = read_meta(best.checkpoint)
    assert meta["best_step"] == 1 and meta["weights_step"] == 1
