"""Several micro-batches a step (train.grad_accum, and under context parallelism the C blocks a group trains):
each micro-batch's gradients are reduce-scattered in its own backward and accumulate in the shards.

FSDP2's other way, no gradient sync until the last micro-batch, holds every parameter's unsharded gradient on
every rank between micro-batches: the whole model's gradients, 54 GB for the 27B in bf16. That ran the 64-layer
model as rank 0 of a CP-8 group out of memory on an H100 at 65,536 and 131,072 tokens (74 GiB at the failure, the
plan 49 and 55 GiB with full recompute; bench/NOTES.md, 2026-12-07). World size 1 on gloo, in this process."""
from __future__ import annotations

import torch

from tests.train.test_fp8 import _blocks, _small_config, process_group  # noqa: F401 - the fixture


def test_each_micro_batch_reduces_its_gradients_into_the_shards(process_group):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.fsdp_loop import forward_backward, shard_packed_model

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(_small_config(), dtype=torch.float32, attn_implementation="sdpa")
    model = shard_packed_model(lm, cpu, compute_dtype=torch.float32, activation_checkpointing="full", loss_chunk=128)
    params = [p for p in model.parameters() if p.requires_grad]
    reduced_before: list[bool] = []     # at each micro-batch's forward: the earlier ones' gradients in the shards

    def before_forward(module, args, kwargs):
        reduced_before.append(all(p.grad is not None for p in params))

    handle = model.register_forward_pre_hook(before_forward, with_kwargs=True)
    mbs = [StepBatch.from_blocks([b], cpu) for b in _blocks(3)]
    loss_sum, denom = forward_backward(model, mbs, 1, cpu)
    handle.remove()
    assert reduced_before == [False, True, True], reduced_before
    accumulated = [p.grad.full_tensor().clone() for p in params]

    # the same gradients as one micro-batch at a time, summed by hand (reduction is linear)
    by_hand = [torch.zeros_like(g) for g in accumulated]
    for mb in mbs:
        model.zero_grad(set_to_none=True)
        ls, _ = model(mb.labels, **mb.kwargs)
        (ls / denom).backward()
        for acc, p in zip(by_hand, params):
            acc += p.grad.full_tensor()
    for a, b in zip(accumulated, by_hand):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert float(loss_sum) > 0
