"""Context parallelism's communication per step (issue 59): what `raytune-ft plan` states under CP, its time at
the GPU's NVLink bandwidth against the step's compute, and the projection's step with it. The traffic itself is
held to what the model's exchanges move on gloo ranks in tests/models/test_context_parallel.py."""
from __future__ import annotations

import pytest

from raytune_ft.planning.cp_comms import COLLECTIVE_LATENCY_S, CpStep, cp_exchange
from raytune_ft.planning.plan import memory_plan
from raytune_ft.planning.shapes import KNOWN_SHAPES
from raytune_ft.recipe.checkpointing import FULL, NONE, parse_checkpointing
from raytune_ft.recipe.recipe import apply_overrides
from tests.planning.test_plan import job

LONG = ["data.seq_len=131072", "scaling.context_parallel=8"]


def _shape():
    return KNOWN_SHAPES["qwen3.8-27b"]


def test_a_recomputed_layer_gathers_again_and_a_step_counts_the_groups_blocks():
    shape = _shape()
    step = CpStep(cp=8, tokens=131072)
    none, full = cp_exchange(shape, step, NONE), cp_exchange(shape, step, FULL)
    # no recompute: a gather and its gradient per layer part; full: one more gather each
    assert none.collectives == 8 * (2 * 16 + 2 * 2 * 48) and full.collectives == 8 * (3 * 16 + 2 * 3 * 48)
    assert full.bytes == pytest.approx(none.bytes * 3 / 2)
    attention_only = cp_exchange(shape, step, parse_checkpointing("attention"))
    assert attention_only.attention_bytes == pytest.approx(full.attention_bytes)
    assert attention_only.state_bytes == pytest.approx(none.state_bytes)
    # two micro-batches a rank: twice the blocks the group trains, twice the traffic
    assert cp_exchange(shape, CpStep(8, 131072, grad_accum=2), NONE).bytes == pytest.approx(2 * none.bytes)
    # the K/V a step moves: 16 layers x gather and gradient x 8 blocks of 131,072 x 4 x 2 x 256 x 2 B, 7/8 of it
    assert none.attention_bytes == pytest.approx(16 * 2 * 8 * 131072 * 4 * 2 * 256 * 2 * 7 / 8)


def test_the_plan_states_the_cp_traffic_and_its_time_on_each_gpu():
    recipe = apply_overrides(job("qwen27b_b300").recipe(), LONG)
    b300, h100 = memory_plan(recipe, gpu="B300"), memory_plan(recipe, gpu="H100")
    x = b300.cp_exchange
    assert x.link_gb_s == 900.0 and h100.cp_exchange.link_gb_s == 450.0
    assert x.seconds == pytest.approx(x.bytes / 900e9 + x.collectives * COLLECTIVE_LATENCY_S)
    # each rank computes 1/8 of the group's 8 blocks a step: one block's tokens at the plan's rate
    assert x.compute_s == pytest.approx(131072 / b300.tokens_per_s_per_gpu)
    text = b300.render()
    assert "CP traffic" in text and "CP time" in text and "not overlapped" in text
    assert x.seconds / x.compute_s < 0.05 and "small beside compute" in text
    without = memory_plan(job("qwen27b_b300").recipe())
    assert without.cp_exchange is None and "CP traffic" not in without.render()


def test_the_projection_adds_the_exchange_and_gathers_the_layers_for_each_block():
    from raytune_ft.planning.projection import project

    recipe = apply_overrides(job("qwen27b_b300").recipe(), LONG)
    plan = memory_plan(recipe)
    proj = project(recipe, plan)
    base = project(job("qwen27b_b300").recipe(), memory_plan(job("qwen27b_b300").recipe()))
    # the same tokens per rank and step as without CP (a rank holds 1/8 of 8 blocks), from the CP measurement
    # (65,536 tokens a block as one of 8: slower per token than 32,768 without CP), scaled to the block
    from raytune_ft.planning.projection import MEASURED_64_CP

    assert proj.item("measured step").value == MEASURED_64_CP["s_per_step"] and MEASURED_64_CP["cp"] == 8
    ratio = proj.item("peak ratio").value
    assert proj.item("compute per step").value == pytest.approx(
        MEASURED_64_CP["s_per_step"] / ratio * recipe.data.seq_len / MEASURED_64_CP["seq"]
        * proj.item("recompute").value)
    assert proj.item("compute per step").value > 4 * base.item("compute per step").value
    P, root = plan.shape.total_params, plan.shape.root_params
    gathers = 2 * (P - root) * 2 + root * 2
    # each of the 8 micro-batches gathers the layers again and reduce-scatters its gradients (fp32) into the shards
    assert proj.item("communication").value == pytest.approx(8 * (gathers + P * 4) * 7 / 8 / 900e9)
    x = plan.cp_exchange
    assert proj.item("step with CP").value == pytest.approx(
        proj.item("step").value + x.bytes / 900e9 + x.collectives * COLLECTIVE_LATENCY_S)
    assert proj.item("training").value == pytest.approx(plan.steps * proj.item("step with CP").value)
