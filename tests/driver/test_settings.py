"""What a setting says is what the run does, in both loops: the LR floor on the last step, no clipping
when `train.max_grad_norm` is 0 or null, several epochs, a schedule as long as the data. (Tokens/s of a resumed run: tests/driver/test_s3_runs.py; the data
guard of a resume: tests/driver/test_s3_runs.py for the FSDP2 loop, tests/train/test_trl_resume_edges.py for TRL.)

The unit tests drive the functions the loops call (`lr_at`, `recipe_scheduler`, `clip_gradients`, the
TRL trainer on CPU); the `slow` ones run the real loops inside Ray Train on local Ray (gloo).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raytune_ft.recipe.recipe import Recipe, TrainConfig, validate
from tests.conftest import train_state
from tests.train.test_fsdp_loop import tiny_recipe


# ---------------------------------------------------------------- the LR floor, both loops

@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_lr_reaches_the_floor_on_the_last_step_in_both_loops(schedule):
    from raytune_ft.train.common import lr_at
    from raytune_ft.train.trl.trainer import recipe_scheduler

    t = TrainConfig(lr=2e-3, schedule=schedule, min_lr_ratio=0.1, warmup_steps=2)
    total = 10
    fsdp = [t.lr * lr_at(s, t, total) for s in range(total)]
    # the TRL loop: the scheduler the trainer steps after each optimizer step, on two parameter groups
    # (LoRA's multiplied LR), read as the optimizer sees it at each step
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [p1], "lr": t.lr}, {"params": [p2], "lr": 10 * t.lr}], lr=t.lr)
    sched = recipe_scheduler(opt, t, total)
    trl, trl_lora = [], []
    for _ in range(total):
        trl.append(opt.param_groups[0]["lr"])
        trl_lora.append(opt.param_groups[1]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(trl, fsdp, rtol=1e-12)
    np.testing.assert_allclose(trl_lora, [10 * x for x in fsdp], rtol=1e-12)
    assert fsdp[-1] == pytest.approx(0.1 * t.lr)              # the floor, on the last step
    assert fsdp[1] == fsdp[2] == pytest.approx(t.lr)          # warmup reaches the peak, decay starts there
    assert all(a > b for a, b in zip(fsdp[2:], fsdp[3:]))     # then falls every step
    # past the schedule's end (an estimate too short) the LR stays at the floor
    assert t.lr * lr_at(total + 5, t, total) == pytest.approx(0.1 * t.lr)


# ---------------------------------------------------------------- max_grad_norm = 0 / null

def _grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model(torch.randn(16, 8)).pow(2).sum().backward()
    return model, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("max_norm", [0.0, None])
def test_fsdp_no_clipping_leaves_gradients_unchanged(max_norm):
    from raytune_ft.train.fsdp_loop import clip_gradients

    model, before = _grads()
    norm = clip_gradients(list(model.parameters()), max_norm)
    for g, p in zip(before, model.parameters()):
        assert torch.equal(g, p.grad)
    assert float(norm) == pytest.approx(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]))))
    # a real limit does clip: the test can fail
    model, before = _grads()
    clip_gradients(list(model.parameters()), 1e-3)
    after = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float(torch.linalg.vector_norm(after)) == pytest.approx(1e-3, rel=1e-3)


def _trl_step_grads(fixtures_blocks, max_grad_norm):
    """Gradients the TRL loop's trainer hands its optimizer in its first step (CPU, no Ray)."""
    from transformers import TrainerCallback

    from raytune_ft.models.build import load_causal_lm
    from raytune_ft.train.batch import collate_blocks
    from raytune_ft.train.trl.base import Paused
    from raytune_ft.train.trl.data import facade, release_facades
    from raytune_ft.train.trl.loop import _sft_config
    from raytune_ft.train.trl.trainer import TrainerParts, trainer_class

    r = _tiny_trl_recipe()
    r.train.max_grad_norm = max_grad_norm
    seen = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            seen["grads"] = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]

    import tempfile

    from raytune_ft.models.tiny import local_tokenizer

    tok = local_tokenizer()
    lm = load_causal_lm(r.model, tokenizer_vocab_size=len(tok), device="cpu", dtype=torch.float32, seed=0)
    from raytune_ft.models.gated_delta import enable_packing

    enable_packing(lm)
    with tempfile.TemporaryDirectory() as out:
        args = _sft_config(r, out, 1, on_gpu=False, bf16=False, liger=False)
        args.save_strategy = "no"
        # as the loop hands them over; no save here, so no storage guard
        parts = TrainerParts(r, fixtures_blocks, [], Paused(), [], guard_for=lambda model: None)
        trainer = trainer_class()(parts, model=lm, args=args, train_dataset=facade(fixtures_blocks),
                                  processing_class=tok, data_collator=collate_blocks, callbacks=[Grab()])
        trainer.train()
    release_facades()
    return seen["grads"]


def _tiny_trl_recipe() -> Recipe:
    r = Recipe(job="settings_trl")
    r.model.local_tiny = True
    r.model.family = "qwen3"
    r.model.dtype = "float32"
    r.data.source = "builtin:chat:200"
    r.data.seq_len = 256
    r.data.pack_window = 64
    r.train.loop = "trl"
    r.train.lr = 1e-3
    r.train.schedule = "constant"
    r.train.log_every = 1
    r.train.checkpoint_every = 100
    r.scaling.num_workers = 1
    r.scaling.use_gpu = False
    r.scaling.backend = "gloo"
    r.scaling.max_failures = 0
    r.registry.enabled = False
    return r


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_no_clipping_leaves_gradients_unchanged():
    from raytune_ft.data.builtin import builtin_chat
    from raytune_ft.data.packing import pack_blocks
    from raytune_ft.data.sft import render_sft
    from raytune_ft.models.tiny import local_tokenizer

    tok = local_tokenizer()
    blocks = list(pack_blocks([render_sft(tok, row["messages"]) for row in builtin_chat(40, seed=3)], 256))[:1]
    unclipped = _trl_step_grads(blocks, 1e9)          # a limit far above the norm: the raw gradients
    for setting in (0.0, None):
        got = _trl_step_grads(blocks, setting)
        assert len(got) == len(unclipped)
        for a, b in zip(got, unclipped):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    clipped = _trl_step_grads(blocks, 1e-4)           # a real limit does clip: the test can fail
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in clipped])))
    assert norm == pytest.approx(1e-4, rel=1e-2)


# ---------------------------------------------------------------- FSDP2: epochs and schedule length

def _fsdp_recipe(storage, name: str, source: str, **train) -> Recipe:
    """test_fsdp_loop's tiny 2-worker recipe with the recipe's default schedule, no step cap, no periodic
    checkpoint, and the given data."""
    r = tiny_recipe(storage, name, **{"schedule": TrainConfig().schedule, "max_steps": None,
                                      "checkpoint_every": 1000, **train})
    r.job = "settings_fsdp"
    r.data.source = source
    r.data.pack_window = 16
    return validate(r)


def _fit(recipe: Recipe) -> tuple[dict, dict]:
    from raytune_ft.driver.launch import build_trainer

    result = build_trainer(recipe).fit()
    return result, {rank: train_state(result.checkpoint.path, rank) for rank in range(recipe.scaling.num_workers)}


def _data_rows(recipe: Recipe) -> list:
    from raytune_ft.data.pipeline import build_dataset
    from raytune_ft.models.tiny import local_tokenizer

    return [r for r in build_dataset(recipe.data, local_tokenizer(), split="train").take_all() if not r["skip_reason"]]


def _epoch_totals(states: dict, epoch: int) -> dict:
    from raytune_ft.data.packing import DataCounters

    total = DataCounters()
    for st in states.values():
        total.merge(DataCounters.from_dict(st["epoch_counters"][epoch]))
    return total.to_dict()


def _low_efficiency_source(path, n: int) -> str:
    """Conversations of ~150 tokens in 256-token blocks: one conversation per block, ~60% full."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()
    with open(path, "w") as f:
        for i in range(n):
            answer = " ".join(words[(i + k) % len(words)] for k in range(34 + i % 5))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"list {i}"},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def two_epochs(ray_local, tmp_path_factory):
    """Two epochs of poorly packed data (one conversation per block) under a cosine schedule whose length
    is counted: once straight, and once with a checkpoint every few steps and a worker dying after writing
    the second checkpoint inside the second epoch, so that Ray Train restarts the attempt from the first
    (one fit, one retry). Two fits serve the epoch, schedule and resume tests."""
    from tests.faults import fault_plan

    storage = tmp_path_factory.mktemp("two_epochs")
    src = _low_efficiency_source(storage / "long.jsonl", 16)
    settings = {"epochs": 2, "schedule": "cosine", "min_lr_ratio": 0.1}
    straight = _fsdp_recipe(storage, "straight", src, **settings)
    out = {"recipe": straight, "rows": _data_rows(straight)}
    _, out["full"] = _fit(straight)
    first_epoch, total = out["full"][0]["epoch_steps"][0], out["full"][0]["total_steps"]
    every = max(1, first_epoch // 2 - 1)
    at = out["at"] = (first_epoch // every + 1) * every       # the first checkpoint inside the second epoch
    assert first_epoch < at < at + every < total, (first_epoch, every, total)
    faulted = _fsdp_recipe(storage, "resumed", src, checkpoint_every=every, **settings)
    faulted.scaling.max_failures = 1
    with fault_plan(exit_after_write=f"{at + every}:1:after={at}"):
        _, out["resumed"] = _fit(faulted)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_epochs_train_every_block_twice_each_in_its_own_order(two_epochs):
    rows, states = two_epochs["rows"], two_epochs["full"]
    st = states[0]
    assert st["epoch"] == 1 and len(st["epoch_counters"]) == 2
    for epoch in (0, 1):
        c = _epoch_totals(states, epoch)
        assert c["conversations_packed"] == len(rows) == 16                      # every conversation
        assert c["real_tokens"] == sum(len(x["input_ids"]) for x in rows)         # every token, once
    # the two epochs saw the conversations in a different order (a different shuffle seed); the second
    # pass's own fingerprint is listed too once its reader ran to the end
    first, *second = st["epoch_fingerprints"]
    assert first != st["data_fingerprint"] and second in ([], [st["data_fingerprint"]]), st["epoch_fingerprints"]
    assert st["epoch_steps"][0] > 0 and st["steps_in_epoch"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_poorly_packed_data_over_two_epochs_trains_every_block_and_cosine_ends_at_its_floor(two_epochs):
    """One conversation per block, two epochs, a cosine schedule whose length is counted: every block of
    both passes is a step, and the LR falls on every step to the floor on the last."""
    r, states = two_epochs["recipe"], two_epochs["full"]
    steps = 0
    for epoch in (0, 1):
        c = _epoch_totals(states, epoch)
        assert c["real_tokens"] / (c["real_tokens"] + c["padding_tokens"]) < 0.9     # far below 0.995
        per_rank = [st["epoch_counters"][epoch] for st in states.values()]
        real_blocks = [e["blocks"] - e["equalisation_padding_blocks"] for e in per_rank]
        steps += -(-sum(real_blocks) // 2)      # ranks lend blocks: 2 a step, one per rank, until the last
    st = states[0]
    assert st["step"] == st["total_steps"] == steps
    assert [h["step"] for h in st["history"]] == list(range(1, steps + 1))
    lrs = [h["lr"] for h in st["history"]]
    assert lrs[-1] == pytest.approx(0.1 * r.train.lr)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_inside_the_second_epoch_matches_an_uninterrupted_run(two_epochs):
    full, resumed, at = (two_epochs[k] for k in ("full", "resumed", "at"))
    # the retry resumed from the checkpoint inside the second epoch, not one of the first
    assert resumed[0]["resumed_from"] == [at] and at > full[0]["epoch_steps"][0]
    full_l = [h["loss"] for h in full[0]["history"]]
    res_l = [h["loss"] for h in resumed[0]["history"]]
    assert len(res_l) == len(full_l)
    np.testing.assert_allclose(res_l, full_l, rtol=1e-5)
    np.testing.assert_allclose([h["lr"] for h in resumed[0]["history"]], [h["lr"] for h in full[0]["history"]])
    for rank in (0, 1):
        assert resumed[rank]["counters"] == full[rank]["counters"]


# ---------------------------------------------------------------- TRL: the data guard on resume

# ---------------------------------------------------------------- MFU: the peak it is relative to

def test_progress_line_names_the_peak_its_mfu_is_relative_to():
    from raytune_ft.planning.hardware import mfu_metrics
    from raytune_ft.train.common import WorkerLog

    m = {"step": 3, "loss": 1.0, "tokens_per_s": 1.0, **mfu_metrics(0.4 * 989e12, "NVIDIA H200")}
    line = WorkerLog.progress_line(m, 10, 1.0)
    assert "MFU 40.0% of 989 TFLOP/s" in line
    assert "MFU n/a" in WorkerLog.progress_line({**m, **mfu_metrics(1e12, None)}, 10, 1.0)
