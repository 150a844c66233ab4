"""The FSDP2 loop on local Ray with CPU workers: loss normalisation, the schedule's length.

Each test runs the real loop (`train_fsdp`) inside a real Ray Train TorchTrainer on gloo. Resume (a re-submit
and Ray's restarts, the same losses as an uninterrupted run, read-ahead and background checkpoints on, a
resumed run's tokens/s, the data guard) runs on S3 in tests/driver/test_s3_runs.py; the hf/ export against the DCP
checkpoint on the suite's `--local` job, in tests/driver/test_local_job.py.
"""
from __future__ import annotations


import numpy as np
import pytest

from raytune_ft.recipe.recipe import Recipe, validate
from tests.conftest import train_state


def tiny_recipe(storage, name: str, **train) -> Recipe:
    r = Recipe(job="fsdp_test")
    r.model.local_tiny = True
    r.model.dtype = "float32"
    r.data.source = "builtin:chat:400"
    r.data.seq_len = 256
    r.data.pack_window = 128
    r.train.lr = 2e-3
    r.train.schedule = "constant"
    r.train.max_steps = 4
    r.train.log_every = 1
    r.train.checkpoint_every = 2
    r.train.activation_checkpointing = "none"
    for k, v in train.items():
        setattr(r.train, k, v)
    r.scaling.num_workers = 2
    r.scaling.use_gpu = False
    r.scaling.backend = "gloo"
    r.scaling.max_failures = 0
    r.tracking.storage_path = str(storage)
    r.tracking.run_name = name
    r.registry.enabled = False
    return validate(r)


def fit(recipe: Recipe, blocks_by_rank=None):
    from raytune_ft.driver.launch import build_trainer

    result = build_trainer(recipe, blocks_by_rank=blocks_by_rank).fit()
    return result, train_state(result.checkpoint.path)


def fixed_blocks(n: int, seq_len: int = 256):
    from raytune_ft.data.builtin import builtin_chat
    from raytune_ft.data.packing import pack_blocks
    from raytune_ft.data.sft import render_sft
    from raytune_ft.models.tiny import local_tokenizer

    tok = local_tokenizer()
    examples = [render_sft(tok, row["messages"]) for row in builtin_chat(300, seed=7)]
    blocks = list(pack_blocks(examples, seq_len, window=64))[:n]
    assert len(blocks) == n
    # blocks with very different supervised counts, so a mean of per-rank means would differ
    return blocks


@pytest.mark.timeout(400)
def test_two_workers_equal_one_worker_with_accumulation(ray_local, tmp_path):
    """Step k of 2 workers x 1 block equals 1 worker x 2 accumulated blocks: the loss is the global
    token mean, not a mean of per-rank means. These CPU runs start Ray Train's controller and workers but
    not its preemption watcher (env.ray_train_defaults: GPU runs only) nor, on this Ray without a dashboard,
    its placement-group cleaner."""
    import time

    from tests.conftest import actors_started_since

    t0 = time.time()
    blocks = fixed_blocks(8)
    # make rank 1's blocks carry far fewer supervised tokens than rank 0's
    for b in blocks[1::2]:
        keep = np.flatnonzero(b["labels"] != -100)[:5]
        lab = np.full_like(b["labels"], -100)
        lab[keep] = b["labels"][keep]
        b["labels"] = lab
    r2 = tiny_recipe(tmp_path, "two")
    _, two = fit(r2, {0: blocks[0::2], 1: blocks[1::2]})
    r1 = tiny_recipe(tmp_path, "one", grad_accum=2)
    r1.scaling.num_workers = 1
    _, one = fit(r1, {0: blocks})
    l2 = [h["loss"] for h in two["history"]]
    l1 = [h["loss"] for h in one["history"]]
    assert len(l1) == len(l2) == 4
    np.testing.assert_allclose(l2, l1, rtol=1e-5, atol=1e-6)
    g2 = [h["grad_norm"] for h in two["history"]]
    g1 = [h["grad_norm"] for h in one["history"]]
    np.testing.assert_allclose(g2, g1, rtol=1e-4)
    # the per-rank-means average would be visibly different: the test can fail
    assert l1[0] > 0
    started = actors_started_since(t0)
    assert "TrainController" in started and "RayTrainWorker" in started, started
    assert "PreemptionWatcher" not in started, started
    # this Ray has no dashboard, so no state API: no placement-group cleaner (launch.without_blind_callbacks)
    assert "PlacementGroupCleaner" not in started, started


@pytest.mark.timeout(300)
def test_schedule_length_is_counted_as_the_feed_runs_it(ray_local, tmp_path):
    """A decaying schedule needs its step count before training: counted from the packed blocks, exactly."""
    from raytune_ft.data.packing import pack_blocks
    from raytune_ft.data.pipeline import build_dataset, iter_blocks
    from raytune_ft.models.tiny import local_tokenizer
    from raytune_ft.train.schedule_length import count_steps

    r = tiny_recipe(tmp_path, "count", max_steps=None, schedule="cosine", grad_accum=3)
    ds = build_dataset(r.data, local_tokenizer(), split="train")
    rows = [(row["input_ids"], row["mask"]) for row in ds.take_all() if not row["skip_reason"]]
    actual = len(list(pack_blocks(rows, r.data.seq_len, window=r.data.pack_window)))
    assert actual > 3
    assert count_steps(iter_blocks(ds, r.data), 3) == -(-actual // 3)
