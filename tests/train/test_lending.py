"""Equal steps on every rank without padding while any rank has data (issue 50 item 6): a rank whose share
ran dry is lent blocks by the others (`train/lending.py`), and a resume inside the lending replays exactly.

Two real gloo ranks (torch.multiprocessing), each feeding its own fixed blocks through the real `StepFeed`:
the shares are what Ray Data's split gives a small file (every row on one rank) and an odd split; the
Ray Data side of the same case is tests/data/test_data_pipeline.py's two-worker run."""
from __future__ import annotations

import numpy as np
import pytest

from raytune_ft.data.packing import DataCounters, block_from_segments

SEQ_LEN = 8
# blocks each rank packed from its share: (rank 0, rank 1)
SHARES = {"one_rank_has_all": (20, 0), "odd_total": (7, 2), "resume": (15, 4)}


def _blocks(rank: int, n: int) -> list[dict]:
    """`n` blocks whose first token names them: 1000 x (rank + 1) + index."""
    return [block_from_segments([(np.full(SEQ_LEN, 1000 * (rank + 1) + i), np.ones(SEQ_LEN, bool))], SEQ_LEN)
            for i in range(n)]


def _run(rank: int, n: int, per_step: int, skip: int = 0, fingerprint=None) -> dict:
    """One pass of a StepFeed: the block names trained at each step, and its position after each step."""
    from raytune_ft.train.batch import RankSteps, StepFeed

    counters = DataCounters()
    feed = StepFeed(iter(_blocks(rank, n)), steps=RankSteps(per_step, SEQ_LEN, rank=rank), counters=counters,
                    skip_blocks=skip, fingerprint=fingerprint)
    steps, positions = [], []
    while (got := feed.next_blocks()) is not None:
        assert len(got) == per_step
        steps.append([int(b["input_ids"][0]) for b in got])     # 0: an all-padding block
        positions.append((feed.blocks_consumed, feed.fingerprint))
    return {"steps": steps, "positions": positions, "padding": counters.equalisation_padding_blocks}


def _rank_main(rank, world, port, q):
    from raytune_ft.train.schedule_length import count_steps
    from tests.conftest import spawned_gloo_rank

    with spawned_gloo_rank(rank, world, port):
        out = {}
        for name, per_step in (("one_rank_has_all", 2), ("odd_total", 2), ("resume", 1)):
            n = SHARES[name][rank]
            out[name] = _run(rank, n, per_step)
            out[name]["counted"] = count_steps(iter(_blocks(rank, n)), per_step)
        # resumed from the checkpoint of step 6 (rank 1 dry since step 5, lent one block a step since)
        at = out["resume"]["positions"][5]
        out["resumed"] = _run(rank, SHARES["resume"][rank], 1, skip=at[0], fingerprint=at[1])
        q.put((rank, out))
        q.close()
        q.join_thread()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_dry_rank_is_lent_blocks_and_a_resume_inside_the_lending_is_exact():
    from tests.conftest import run_gloo_ranks

    got = run_gloo_ranks(_rank_main)

    def trained(name):
        return sorted(x for r in (0, 1) for step in got[r][name]["steps"] for x in step if x)

    every = {name: sorted(1000 * (r + 1) + i for r in (0, 1) for i in range(SHARES[name][r])) for name in SHARES}
    for name in SHARES:
        assert trained(name) == every[name]                                  # each block once, none lost
        assert len(got[0][name]["steps"]) == len(got[1][name]["steps"]) == got[0][name]["counted"]
    # a small file's rows all on rank 0: 20 blocks make 5 steps of 2 blocks on each of 2 ranks, no padding
    # (before: 10 steps, rank 1 running 20 all-padding blocks, half of what was trained)
    one = got[0]["one_rank_has_all"], got[1]["one_rank_has_all"]
    assert len(one[0]["steps"]) == 5 and one[0]["padding"] == one[1]["padding"] == 0
    assert all(x for step in one[1]["steps"] for x in step)                  # rank 1 trains rank 0's blocks
    # 9 blocks in steps of 4: 3 steps, the 3 padding blocks all in the last
    odd = got[0]["odd_total"], got[1]["odd_total"]
    assert len(odd[0]["steps"]) == 3 and odd[0]["padding"] + odd[1]["padding"] == 3
    assert all(x for r in (0, 1) for step in odd[r]["steps"][:-1] for x in step)
    # the resumed pass trains the same blocks on the same ranks as the uninterrupted one from step 7 on
    for r in (0, 1):
        assert got[r]["resumed"]["steps"] == got[r]["resume"]["steps"][6:]
        assert got[r]["resumed"]["positions"] == got[r]["resume"]["positions"][6:]
    assert got[1]["resume"]["steps"][6][0] < 2000                           # lent by rank 0 at that point
