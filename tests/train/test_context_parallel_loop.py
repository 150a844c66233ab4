"""The FSDP2 loop with `scaling.context_parallel` (issue 59): two Ray Train workers forming one CP group train
the same steps as two data-parallel workers, on the same blocks each rank reads (real local Ray, gloo), and
the 27B job's --local run with CP 2 gives the suite's local run's losses."""
from __future__ import annotations

import json

import numpy as np
import pytest

from raytune_ft.recipe.recipe import RecipeError, apply_overrides, validate
from tests.conftest import local_job_process, train_state
from tests.train.test_fsdp_loop import fit, fixed_blocks, tiny_recipe


@pytest.mark.timeout(600)
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_two_workers_in_one_cp_group_train_as_two_data_parallel_workers(ray_local, tmp_path, micro_batch_size):
    """The group trains both ranks' blocks each step; a micro-batch of two blocks is one row of 512 tokens
    split over the group."""
    blocks = fixed_blocks(8)
    by_rank = {0: blocks[0::2], 1: blocks[1::2]}
    steps = 4 // micro_batch_size
    _, plain = fit(tiny_recipe(tmp_path, "dp2", micro_batch_size=micro_batch_size, max_steps=steps), by_rank)
    split = apply_overrides(tiny_recipe(tmp_path, "cp2", micro_batch_size=micro_batch_size, max_steps=steps),
                            ["scaling.context_parallel=2"])
    _, cp = fit(validate(split), by_rank)
    assert len(cp["history"]) == len(plain["history"]) == steps
    np.testing.assert_allclose([h["loss"] for h in cp["history"]], [h["loss"] for h in plain["history"]],
                               rtol=1e-4)
    np.testing.assert_allclose([h["grad_norm"] for h in cp["history"]],
                               [h["grad_norm"] for h in plain["history"]], rtol=1e-4)
    assert cp["tokens_total"] == plain["tokens_total"] > 0        # a block's tokens counted once, by its reader


@pytest.mark.timeout(900)
def test_a_cp_run_that_loses_a_worker_resumes_from_its_checkpoint_exactly(ray_local, tmp_path):
    """Under CP 2, rank 1 dies once the step-4 checkpoint is written locally (step 2's registered): Ray Train
    restarts the attempt from step 2, whose sharded model, optimizer and each rank's data position load into
    the CP mesh again, and every step's loss and gradient norm equal an uninterrupted CP run's."""
    from tests.faults import fault_plan

    blocks = fixed_blocks(12)
    by_rank = {0: blocks[0::2], 1: blocks[1::2]}
    cp2 = ["scaling.context_parallel=2"]
    _, straight = fit(validate(apply_overrides(tiny_recipe(tmp_path, "cp2-straight", max_steps=6), cp2)), by_rank)
    faulted = apply_overrides(tiny_recipe(tmp_path, "cp2-resumed", max_steps=6), cp2)
    faulted.scaling.max_failures = 1
    with fault_plan(exit_after_write="4:1:after=2"):
        _, resumed = fit(validate(faulted), by_rank)
    assert resumed["resumed_from"] == [2]
    assert len(resumed["history"]) == len(straight["history"]) == 6
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([h[key] for h in resumed["history"]], [h[key] for h in straight["history"]],
                                   rtol=1e-5)


@pytest.mark.timeout(900)
def test_the_local_job_with_context_parallel_2_trains_as_the_local_job(local_job, tmp_path):
    """`jobs/qwen27b_b300.py --local --set scaling.context_parallel=2` (its 2 workers one CP group): the
    losses and gradient norms of the suite's local run (CP 1) at each of its 20 steps, through its evaluation,
    samples, checkpoints and the cosine schedule."""
    runs = tmp_path / "runs"
    with local_job_process(tmp_path, ["scaling.context_parallel=2", "registry.enabled=false",
                                      f"tracking.storage_path={runs}"]) as (proc, _):
        out = proc.stdout.decode()
    assert proc.returncode == 0, out[-3000:]
    assert "context parallelism: groups of 2 ranks split each block into 4 chunks of 128 tokens" in out
    split = train_state(json.loads((runs / "qwen27b-local" / "summary.json").read_text())["checkpoint"])
    plain = train_state(local_job["summary"]["checkpoint"])
    assert len(split["history"]) == len(plain["history"]) == 20
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([h[key] for h in split["history"]], [h[key] for h in plain["history"]],
                                   rtol=1e-4)


def test_context_parallel_is_refused_where_it_cannot_split_or_run():
    r = tiny_recipe("runs", "refused")
    with pytest.raises(RecipeError, match="scaling.context_parallel: 3 does not divide scaling.num_workers=2"):
        validate(apply_overrides(r, ["scaling.context_parallel=3"]))
    with pytest.raises(RecipeError, match=r"data.seq_len: 250 must be a multiple of 2 x scaling.context_parallel"):
        validate(apply_overrides(r, ["scaling.context_parallel=2", "data.seq_len=250"]))
    with pytest.raises(RecipeError, match="FSDP2 loop only"):
        validate(apply_overrides(r, ["scaling.context_parallel=2", "data.seq_len=256", "train.loop=trl"]))
