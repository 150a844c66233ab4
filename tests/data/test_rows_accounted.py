"""Every row accounted for (issue 57, items 1, 2 and 6): a folder's every data file is read, by `data check` and
by the run alike, in the same order; the check counts what the run counts on the same number of ranks (rows,
held out, skipped by reason, conversations, pieces, tokens, blocks, padding), because it packs each rank's share
with the run's own code; every row read is trained, held out or skipped, per source; skipped rows are shown
with their file, row number and the value that failed, and written to the run folder with data.json."""
from __future__ import annotations

import gzip
import json
import os

import pytest

from raytune_ft.cli import _job_recipe

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


@pytest.fixture(scope="module")
def fixture_rows(fixtures):
    return {name: [json.loads(line) for line in open(fixtures / "data" / f"{name}.jsonl")]
            for name in ("ultrachat_200k_train_sft_first16", "capybara_ldjnr_first16")}


def _sharegpt(row: dict) -> dict:
    return {"conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in row["messages"]]}


def _short(row: dict, n: int = 300) -> dict:
    """A conversation's first exchange, cut short: the tiny model's 512-token blocks hold several."""
    return {"messages": [{"role": m["role"], "content": m["content"][:n]} for m in row["messages"][:2]]}


def mixed_folder(path, rows) -> str:
    """5 parquet rows, 8 jsonl rows, 4 zstd-compressed jsonl rows and a JSON array of 3: 20 rows in 4 files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    uc, cap = rows["ultrachat_200k_train_sft_first16"], rows["capybara_ldjnr_first16"]
    path.mkdir()
    pq.write_table(pa.Table.from_pylist([_short(r) for r in uc[:5]]), path / "a.parquet")
    (path / "b.jsonl").write_text("".join(json.dumps(_sharegpt(_short(r))) + "\n" for r in uc[5:13]))
    with pa.CompressedOutputStream(str(path / "c.jsonl.zst"), "zstd") as out:
        out.write("".join(json.dumps(_short(r)) + "\n" for r in uc[13:16] + uc[:1]).encode())
    (path / "d.json").write_text(json.dumps([{"instruction": t["input"][:200], "output": t["output"][:300]}
                                             for r in cap[:3] for t in r["conversation"][:1]]))
    return str(path)


def _local(*overrides: str):
    """The 27B job's --local recipe (2 ranks, 512-token blocks, a carved held-out set) with `overrides`."""
    return _job_recipe("qwen27b_b300", True, ["data.validation_split=none", *overrides])


def _weighted_mixture(tmp_path, rows) -> list[str]:
    """Two files, one with a row of an unknown role and a broken line, weighted 2 and 0.5."""
    uc, cap = rows["ultrachat_200k_train_sft_first16"], rows["capybara_ldjnr_first16"]
    a, b = tmp_path / "chat.jsonl", tmp_path / "more.jsonl"
    robot = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "Beep"}]}
    a.write_text("".join(json.dumps(_sharegpt(_short(r))) + "\n" for r in uc[:12]) + json.dumps(robot) + "\n{oops\n")
    b.write_text("".join(json.dumps({"prompt": t["input"][:200], "completion": t["output"][:200]}) + "\n"
                         for r in cap for t in r["conversation"][:1]))
    sources = [{"source": str(a), "name": "chat", "weight": 2}, {"source": str(b), "name": "more", "weight": 0.5}]
    return [f"data.sources={json.dumps(sources)}", "data.max_skip_fraction=0.5"]


def _check_counts(recipe) -> dict:
    """What `data check` counts for the recipe: its pre-checks, then the pass on the recipe's ranks."""
    from raytune_ft.data.check import data_pass
    from raytune_ft.data.precheck import check_sources
    from raytune_ft.models.tokenizer import tokenizer_for

    check_sources(recipe.data)
    counters, _ = data_pass(recipe, tokenizer_for(recipe.model), None)
    return counters.to_dict()


# ---------------------------------------------------------------- no Ray

def test_every_row_read_is_trained_held_out_or_skipped_per_source(tmp_path, fixture_rows):
    """Conservation on a weighted mixture with a carve and junk rows, on 3 ranks: each source's rows read (the
    file's rows, once each whatever the weight) are its trained, held-out and skipped rows; a trained row is
    used its weight's times (2: twice; 0.5: once or never)."""
    recipe = _local(*_weighted_mixture(tmp_path, fixture_rows), "scaling.num_workers=3")
    c = _check_counts(recipe)
    chat, more = c["by_source"]["chat"], c["by_source"]["more"]
    assert chat["rows_read"] == 14 and more["rows_read"] == 16
    for s in (chat, more):
        assert s["rows_read"] == s["trained"] + s["held_out"] + sum(s["rows_skipped_by_reason"].values())
        assert s["held_out"] >= 1 and s["trained"] > 0
    assert chat["rows_skipped_by_reason"] == {"unknown_role": 1, "invalid_json": 1}
    assert chat["conversations"] == 2 * chat["trained"]
    assert 0 < more["conversations"] < more["trained"]
    assert c["rows_read"] == 30 == c["rows_trained"] + c["rows_held_out"] + sum(c["rows_skipped_by_reason"].values())
    assert c["conversations"] == chat["conversations"] + more["conversations"] == c["conversations_packed"]
    assert chat["tokens"] + more["tokens"] == c["real_tokens"]


def test_data_check_shows_the_first_skipped_rows_with_the_value_that_failed(tmp_path, fixture_rows, capsys):
    """A ShareGPT row with "from": "robot": the check names the file, the row and the role, not just a count.
    A file whose every row is skipped stops before Ray with those rows in the error, where it used to send the
    user to `data check`, which printed the same error."""
    from raytune_ft.cli import main

    uc = fixture_rows["ultrachat_200k_train_sft_first16"]
    path = tmp_path / "chat.jsonl"
    robot = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "Beep"}]}
    path.write_text("".join(json.dumps(_sharegpt(_short(r))) + "\n" for r in uc[:10]) + json.dumps(robot) + "\n")
    rc = main(["data", "check", "qwen27b_b300", "--local", f"--set=data.source={path}",
               "--set=data.validation_split=none", "--set=data.max_skip_fraction=0.2", f"--png={tmp_path / 'h.png'}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "skipped          1 {'unknown_role': 1}" in out
    assert f"{path} row 11: unknown_role: message 2: role 'robot' not in data.roles" in out

    every = tmp_path / "robots.jsonl"
    every.write_text((json.dumps(robot) + "\n") * 3 + '{"messages": "none"}\n')
    rc = main(["data", "check", "qwen27b_b300", "--local", f"--set=data.source={every}",
               "--set=data.validation_split=none", f"--png={tmp_path / 'h.png'}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{every} row 1: unknown_role: message 2: role 'robot' not in data.roles" in err
    assert f"{every} row 4: bad_message: messages is a str, not a list: none" in err
    assert "data check" not in err


def test_a_folder_holding_a_file_the_run_cannot_read_is_refused_before_ray_naming_it(tmp_path, fixture_rows):
    """A folder's data files are all read or the run does not start: a gzipped parquet file and a CSV were
    left out silently (the run trained the jsonl alone)."""
    from raytune_ft.data.precheck import check_sources
    from raytune_ft.recipe.values import RecipeError

    folder = tmp_path / "mine"
    folder.mkdir()
    uc = fixture_rows["ultrachat_200k_train_sft_first16"]
    (folder / "train.jsonl").write_text("".join(json.dumps(_short(r)) + "\n" for r in uc[:8]))
    with gzip.open(folder / "more.parquet.gz", "wb") as f:
        f.write(b"PAR1 not really")
    (folder / "more.csv").write_text("prompt,completion\nhi,hello\n")
    recipe = _local(f"data.source={folder}")
    with pytest.raises(RecipeError) as e:
        check_sources(recipe.data)
    msg = str(e.value)
    assert msg.startswith("data.source: 2 file(s)") and "more.parquet.gz: a compressed parquet file" in msg
    assert "more.csv: a csv file" in msg


def _ended_run_data(tmp_path) -> tuple[dict, dict, str]:
    """A run's data counters with a trained, a held-out and a skipped row; the files its ending writes to its
    folder (`_data_files`), and the folder."""
    import pyarrow.fs as pafs

    from raytune_ft.data.packing import DataCounters
    from raytune_ft.data.sources import to_messages
    from raytune_ft.driver.run import _data_files, _data_record
    from raytune_ft.storage.fs import Storage

    c = DataCounters()
    c.count_row("chat.jsonl", "")
    c.count_row("chat.jsonl", "held_out")
    _, why = to_messages({"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "Beep"}]})
    c.count_row("chat.jsonl", why, where=("chat.jsonl", 3))
    c.by_source["chat.jsonl"]["tokens"] = 42
    data = c.to_dict()
    run_path = str(tmp_path / "runs" / "mine")
    os.makedirs(run_path)
    st = Storage(fs=pafs.LocalFileSystem(), root=str(tmp_path / "runs"), scheme="file")
    return data, _data_files(st, run_path, _data_record(data), data), run_path


def test_the_run_writes_data_json_and_the_skipped_rows_to_its_folder(tmp_path):
    """The run's ending: data.json (per-source tokens among its counts) and skipped_rows.jsonl go to the run
    folder (they went to MLflow alone, and no skipped row was written anywhere); the summary says trained, held
    out and skipped, in all and per source."""
    from raytune_ft.driver.run import RunSummary

    data, files, run_path = _ended_run_data(tmp_path)
    on_disk = json.load(open(os.path.join(run_path, "data.json")))
    assert on_disk["by_source"]["chat.jsonl"]["tokens"] == 42 and on_disk == files["data.json"]
    lines = open(os.path.join(run_path, "skipped_rows.jsonl")).read().splitlines()
    assert [json.loads(line) for line in lines] == files["skipped_rows.jsonl"] == [
        {"source": "chat.jsonl", "file": "chat.jsonl", "row": 3, "reason": "unknown_role",
         "detail": "message 2: role 'robot' not in data.roles"}]
    summary = "\n".join(RunSummary(job="j", run_name="mine", status="trained", data=data).lines())
    assert "  data             3 rows read: 1 trained (1 conversations), 1 held out, 1 skipped {'unknown_role': 1}" \
        in summary
    assert "    chat.jsonl: 3 rows read: 1 trained (1 conversations), 1 held out, 1 skipped {'unknown_role': 1}; " \
        "42 tokens" in summary


@pytest.mark.slow
def test_mlflow_gets_the_skipped_rows_as_json_lines_and_every_count_of_data_json(tmp_path):
    """The same two files in the MLflow run: the skipped rows one JSON line each, and data.json whole (its
    counts named *tokens were taken for credentials and dropped on the way)."""
    from mlflow import MlflowClient

    from raytune_ft.tracking.mlflow_run import RunEnd, end_run, start_run

    _, files, run_path = _ended_run_data(tmp_path)
    recipe = _job_recipe("qwen27b_b300", True, [f"tracking.storage_path={tmp_path / 'runs'}"])
    run_id = start_run(recipe)
    end_run(recipe, run_id, RunEnd(json_artifacts=files))
    client = MlflowClient(recipe.tracking_uri)
    got = client.download_artifacts(run_id, "skipped_rows.jsonl", str(tmp_path))
    assert open(got).read() == open(os.path.join(run_path, "skipped_rows.jsonl")).read()
    assert json.load(open(client.download_artifacts(run_id, "data.json", str(tmp_path)))) == files["data.json"]


# ---------------------------------------------------------------- local Ray

@pytest.mark.timeout(600)
def test_a_folder_of_parquet_and_jsonl_files_trains_every_row(ray_local, tmp_path, fixture_rows):
    """The issue's folder: the run read its parquet file alone (5 of 20 rows) while `data check` read all of
    them, and a carved held-out set of it failed after Ray had started. Now both read the 20 rows, file after
    file, every format reaching the adapters as the same JSON text."""
    from raytune_ft.data.check import data_check
    from raytune_ft.data.packing import DataCounters
    from raytune_ft.data.pipeline import build_dataset, iter_blocks
    from raytune_ft.models.tokenizer import tokenizer_for

    recipe = _local(f"data.source={mixed_folder(tmp_path / 'mine', fixture_rows)}")
    lines, ok = data_check(recipe, png=str(tmp_path / "h.png"))      # settles the carve, as the run's pre-checks
    tok = tokenizer_for(recipe.model)
    c = DataCounters()
    list(iter_blocks(build_dataset(recipe.data, tok), recipe.data, counters=c))
    assert c.rows_read == 20 and c.rows_skipped == 0
    assert c.rows_trained + c.rows_held_out == 20 and c.conversations == c.rows_trained
    rows = next(line for line in lines if line.startswith("  rows "))
    assert ok and rows == f"  rows             20: {c.rows_trained} to train on, {c.rows_held_out} held out, 0 skipped"
    val = build_dataset(recipe.data, tok, split="validation").take_all()
    assert len(val) == c.rows_held_out >= 1 and all(not r["skip_reason"] for r in val)


def _count_on_ranks(config):
    """Each rank: every named dataset's shard packed, the ranks' steps evened out, the counters summed."""
    import ray.train

    from raytune_ft.data.packing import DataCounters
    from raytune_ft.data.pipeline import gather_counters, iter_blocks
    from raytune_ft.train.batch import RankSteps, StepFeed

    rank = ray.train.get_context().get_world_rank()
    for name, recipe in config["recipes"].items():
        counters = DataCounters()
        blocks = iter_blocks(ray.train.get_dataset_shard(name), recipe.data, counters=counters)
        per_step = recipe.train.grad_accum * recipe.train.micro_batch_size
        for _ in StepFeed(blocks, steps=RankSteps(per_step, recipe.data.seq_len, rank=rank), counters=counters):
            pass
        total = gather_counters(counters)
        if rank == 0:
            with open(os.path.join(config["out"], f"{name}.json"), "w") as f:
                json.dump(total.to_dict(), f)


@pytest.mark.timeout(900)
def test_the_check_counts_what_the_run_counts_on_two_ranks(ray_local, tmp_path, fixture_rows):
    """`data check` and a 2-rank run (Ray Data's split, each rank packing its share, the ranks' steps evened out)
    count the same, all of it: rows, held out, skipped by reason and the rows shown, conversations, pieces,
    tokens, blocks, padding; for one file (examples/data/sharegpt.jsonl: the check said 38.1% padding where the
    run padded 69.0%), a folder of mixed formats and a weighted mixture."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytune_ft.data.pipeline import build_dataset, train_data_config
    from raytune_ft.models.tokenizer import tokenizer_for
    from tests.conftest import REPO

    recipes = {"single": _local(f"data.source={REPO / 'examples' / 'data' / 'sharegpt.jsonl'}"),
               "folder": _local(f"data.source={mixed_folder(tmp_path / 'mine', fixture_rows)}"),
               "mixture": _local(*_weighted_mixture(tmp_path, fixture_rows))}
    checked = {name: _check_counts(recipe) for name, recipe in recipes.items()}     # settles each carve first
    tok = tokenizer_for(recipes["single"].model)
    out = tmp_path / "out"
    out.mkdir()
    TorchTrainer(_count_on_ranks, train_loop_config={"recipes": recipes, "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False), torch_config=TorchConfig(backend="gloo"),
                 run_config=RunConfig(storage_path=str(tmp_path / "runs"), name="counts"),
                 datasets={name: build_dataset(r.data, tok) for name, r in recipes.items()},
                 dataset_config=train_data_config(list(recipes))).fit()
    for name in recipes:
        ran = json.loads((out / f"{name}.json").read_text())
        assert checked[name] == ran, name
    single = checked["single"]
    assert single["equalisation_padding_blocks"] > 0          # the padding the check left out before
    assert [(r["row"], r["reason"], r["detail"][:9]) for r in checked["mixture"]["skipped_rows"]] == \
        [(14, "invalid_json", "Expecting"), (13, "unknown_role", "message 2")]
