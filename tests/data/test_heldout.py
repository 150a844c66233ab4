"""The local job's held-out rows are disjoint from its training rows by content hash.

The generated chat (builtin:chat) draws from a small vocabulary of tasks, so two seeds repeat rows;
evaluating on rows the model trained on would make the validation loss look better than it is.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from raytune_ft.cli import resolve
from raytune_ft.data.builtin import builtin_chat, row_hash, split_rows
from raytune_ft.data.pipeline import BUILTIN_DEFAULT_ROWS

REPO = Path(__file__).resolve().parents[2]


def _local_recipe():
    spec = importlib.util.spec_from_file_location("job_qwen27b_b300", REPO / "jobs" / "qwen27b_b300.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return resolve(job.recipe, job.local, local=True, overrides=[])


def test_local_job_heldout_rows_share_no_content_with_training_rows():
    data = _local_recipe().data
    assert data.source.startswith("builtin:") and data.validation_split not in (None, data.split)
    train = split_rows(data.source, BUILTIN_DEFAULT_ROWS, data.seed, held_out=False)
    held = split_rows(data.source, BUILTIN_DEFAULT_ROWS, data.seed, held_out=True)
    evaluated = held[:data.validation_max_rows]
    assert len(evaluated) == data.validation_max_rows
    assert len(held) == len(train)
    assert not {row_hash(r) for r in held} & {row_hash(r) for r in train}


def test_heldout_rows_are_deterministic_and_the_seeds_really_collide():
    """The filter is needed (the raw seeds share rows) and gives the same rows every time."""
    raw = {row_hash(r) for r in builtin_chat(600, 1)} & {row_hash(r) for r in builtin_chat(600, 0)}
    assert raw, "the raw generator no longer repeats rows across seeds: the filter is untested"
    a = split_rows("builtin:chat:600", BUILTIN_DEFAULT_ROWS, 0, held_out=True)
    assert a == split_rows("builtin:chat:600", BUILTIN_DEFAULT_ROWS, 0, held_out=True)
    assert len(a) == 600


def _held_out_rank(rank: int, world: int, port: int, out: str, fail: bool) -> None:
    """One gloo rank of test_rank_0_alone_reads_the_held_out_split: Ray Train's dataset shard is a list of
    rows here (no Ray in these processes: read_rows takes an iterable of row dicts); the reads are counted."""
    import json

    import numpy as np
    import ray.train

    from raytune_ft.recipe.recipe import Recipe
    from raytune_ft.train.evaluate import start_reading_held_out
    from tests.conftest import spawned_gloo_rank

    reads = []

    def shard(name):
        reads.append(name)
        if fail:
            raise OSError("validation source gone")
        return [{"input_ids": np.arange(i, i + 5, dtype=np.int32), "mask": np.ones(5, dtype=bool),
                 "skip_reason": ""} for i in range(3)]

    ray.train.get_dataset_shard = shard
    with spawned_gloo_rank(rank, world, port):
        recipe = Recipe()
        recipe.train.eval_every = 10
        try:
            rows = start_reading_held_out(recipe, rank=rank, world=world)()
            got = {"ids": [r["input_ids"].tolist() for r in rows]}
        except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
            got = {"error": f"{type(e).__name__}: {e}"}
        got["reads"] = reads
        Path(out, f"r{rank}.json").write_text(json.dumps(got))


def test_rank_0_alone_reads_the_held_out_split_and_every_rank_gets_its_rows(tmp_path):
    """One read of the held-out split per attempt (each rank's own read would run the split's whole
    pipeline again, with tokenizing processes of its own): rank 1 gets rank 0's rows, and rank 0's read
    error is raised on rank 1 too, not left waiting."""
    import json

    import torch.multiprocessing as mp

    from tests.mlflow_server import free_port

    for fail in (False, True):
        out = tmp_path / str(fail)
        out.mkdir()
        mp.spawn(_held_out_rank, args=(2, free_port(), str(out), fail), nprocs=2)
        r0, r1 = (json.loads((out / f"r{r}.json").read_text()) for r in (0, 1))
        assert r0["reads"] == ["validation"] and r1["reads"] == []
        if fail:
            assert r0["error"] == "OSError: validation source gone"
            assert r1["error"] == "RuntimeError: reading the held-out split failed on rank 0: OSError: validation source gone"
        else:
            assert r0["ids"] == r1["ids"] == [list(range(i, i + 5)) for i in range(3)]
