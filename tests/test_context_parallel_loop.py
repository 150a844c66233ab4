"""The FSDP2 loop with `scaling.context_parallel` (issue 59): two Ray Train workers forming one CP group train
the same steps as two data-parallel workers, on the same blocks each rank reads (real local Ray, gloo)."""
from __future__ import annotations

import numpy as np
import pytest

from raytune_ft.recipe.recipe import RecipeError, apply_overrides, validate
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


def test_context_parallel_is_refused_where_it_cannot_split_or_run():
    r = tiny_recipe("runs", "refused")
    with pytest.raises(RecipeError, match="scaling.context_parallel: 3 does not divide scaling.num_workers=2"):
        validate(apply_overrides(r, ["scaling.context_parallel=3"]))
    with pytest.raises(RecipeError, match=r"data.seq_len: 250 must be a multiple of 2 x scaling.context_parallel"):
        validate(apply_overrides(r, ["scaling.context_parallel=2", "data.seq_len=250"]))
    with pytest.raises(RecipeError, match="FSDP2 loop only"):
        validate(apply_overrides(r, ["scaling.context_parallel=2", "data.seq_len=256", "train.loop=trl"]))
