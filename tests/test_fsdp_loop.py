"""The FSDP2 loop on local Ray with CPU workers: loss normalisation, resume, export.

Each test runs the real loop (`train_fsdp`) inside a real Ray Train TorchTrainer on gloo.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from raytune_ft.recipe import Recipe, validate
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
    from raytune_ft.train.launch import build_trainer

    result = build_trainer(recipe, mlflow_run_id=None, blocks_by_rank=blocks_by_rank).fit()
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
    not its preemption watcher (env.ray_train_defaults: GPU runs only)."""
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


@pytest.fixture(scope="module")
def straight(ray_local, tmp_path_factory):
    """An uninterrupted 8-step run with a checkpoint every 4 steps and the final hf/ export: the resume
    test's reference and the export test's checkpoint (one run for both)."""
    recipe = tiny_recipe(tmp_path_factory.mktemp("straight"), "straight", max_steps=8, checkpoint_every=4)
    result, state = fit(recipe)
    return recipe, result, state


@pytest.mark.timeout(500)
def test_resume_gives_same_losses_as_uninterrupted(straight, tmp_path):
    """Stop after a checkpoint at step 4, re-submit the same run name: steps 5..8 match a straight run.

    The partial runs end without a final checkpoint (train.save_final=false), so their latest one is a
    step-4 (then step-8) checkpoint to resume from; a finished run is not trained again. The straight run
    reads its data when the loop asks (the CPU default), the others read it ahead from before the model
    is built (train.read_ahead=on, the GPU default), and write their checkpoints in the background
    (train.async_checkpoint=on, the GPU default): the same steps either way. The two attempts run through
    the driver (`run`), whose summary reports each attempt's own tokens/s."""
    from raytune_ft.run import run

    recipe, _, full = straight
    assert recipe.train.read_ahead == "auto"
    first = tiny_recipe(tmp_path, "resumed", max_steps=5, checkpoint_every=4, save_final=False, read_ahead="on",
                        async_checkpoint="on")
    s1 = run(first, local=True, register=False)
    part = train_state(s1.checkpoint)
    assert part["step"] == 4
    again = tiny_recipe(tmp_path, "resumed", max_steps=9, checkpoint_every=4, save_final=False, read_ahead="on",
                        async_checkpoint="on")
    s2 = run(again, local=True, register=False)
    resumed = train_state(s2.checkpoint)
    assert resumed["step"] == 8 and resumed["resumed_from"] == [4]
    # tokens/s of a resumed run: its own attempt's tokens over its own seconds, not the run's tokens
    assert s1.attempt_tokens == s1.tokens > 0 and s1.tokens_per_s == pytest.approx(s1.tokens / s1.attempt_seconds)
    assert s2.steps == 9 and s2.tokens > s2.attempt_tokens > 0
    assert s2.tokens > resumed["tokens_total"] > part["tokens_total"] > 0       # steps 9, 8 and 4
    assert s2.tokens_per_s == pytest.approx(s2.attempt_tokens / s2.attempt_seconds)   # this attempt's
    assert s2.run_seconds > s2.attempt_seconds                                        # earlier attempt's too
    assert s2.run_tokens_per_s == pytest.approx(s2.tokens / s2.run_seconds)
    assert s2.tokens_per_s != pytest.approx(s2.tokens / s2.attempt_seconds)          # the old, inflated figure
    assert any("this attempt" in line for line in s2.lines())
    full_l = {h["step"]: h["loss"] for h in full["history"]}
    res_l = {h["step"]: h["loss"] for h in resumed["history"]}
    assert sorted(res_l) == list(range(1, 9))
    for s in range(1, 9):
        assert res_l[s] == pytest.approx(full_l[s], rel=1e-5), (s, res_l, full_l)
    # a re-submit whose data no longer lays out the same blocks must not resume silently
    changed = tiny_recipe(tmp_path, "resumed", max_steps=10, checkpoint_every=4, read_ahead="on")
    # a window under the packer's first one (64 conversations): the first blocks differ. A larger window
    # than 128 would lay out the same first blocks, and resuming on them is right (the fingerprint compares
    # the blocks themselves, not the settings)
    changed.data.pack_window = 16
    with pytest.raises(Exception, match="fingerprint mismatch"):
        fit(changed)


@pytest.mark.timeout(400)
def test_exported_folder_matches_trained_weights(straight):
    """The hf/ export loads with transformers and gives the same logits as the DCP-checkpointed model."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from raytune_ft.models.build import load_causal_lm
    from raytune_ft.train.fsdp_model import PackedCausalLM

    r, result, state = straight
    ckpt = result.checkpoint.path
    assert state["step"] == 8            # the final checkpoint, the one with the export
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(ckpt, "hf"), dtype=torch.float32)
    ref = PackedCausalLM(load_causal_lm(r.model, device="cpu", dtype=torch.float32))
    state = {"app": {"model": ref.state_dict()}}
    dcp.load(state, checkpoint_id=os.path.join(ckpt, "dcp"))
    ref.load_state_dict(state["app"]["model"])
    ids = torch.randint(0, hf.config.vocab_size, (1, 32))
    with torch.no_grad():
        a = hf(ids).logits
        b = ref.lm(ids).logits
    assert not torch.equal(b, ref.lm.lm_head(torch.zeros(1, 1, hf.config.hidden_size)).expand_as(b))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # training moved the weights away from the seeded initialisation
    init = load_causal_lm(r.model, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(init(ids).logits, a, atol=1e-3)


@pytest.mark.timeout(300)
def test_schedule_length_is_counted_as_the_feed_runs_it(ray_local, tmp_path):
    """A decaying schedule needs its step count before training: counted from the packed blocks, exactly."""
    from raytune_ft.data.packing import pack_blocks
    from raytune_ft.data.pipeline import build_dataset, iter_blocks
    from raytune_ft.models.tiny import local_tokenizer
    from raytune_ft.train.batch import count_steps

    r = tiny_recipe(tmp_path, "count", max_steps=None, schedule="cosine", grad_accum=3)
    ds = build_dataset(r.data, local_tokenizer(), split="train")
    rows = [(row["input_ids"], row["mask"]) for row in ds.take_all() if not row["skip_reason"]]
    actual = len(list(pack_blocks(rows, r.data.seq_len, window=r.data.pack_window)))
    assert actual > 3
    assert count_steps(iter_blocks(ds, r.data), 3) == -(-actual // 3)
