"""Held-out sets that never meet the training rows, however they are named (issue 57): a capped mixture holds
out its share of `data.validation_max_rows` per source after the carve (never 0); a named held-out split's
rows are left out of training by content (counted as `in_held_out`), the data check and the run agreeing on
the count; the held-out line gives the rows of every kind of held-out set."""
from __future__ import annotations

import json

import pytest

from raytune_ft.data.builtin import builtin_chat
from raytune_ft.data.packing import DataCounters
from raytune_ft.data.precheck import check_sources
from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, validate


@pytest.fixture(scope="module")
def tok_path(fixtures):
    return str(fixtures / "tokenizers" / "qwen3")


@pytest.fixture(scope="module")
def real_rows(fixtures):
    return [line for name in ("ultrachat_200k_train_sft_first16", "capybara_ldjnr_first16")
            for line in (fixtures / "data" / f"{name}.jsonl").read_text().splitlines()]


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _mixture(tmp_path, rows: int, *sets: str) -> Recipe:
    """Two sources of generated chat rows (a few conversations in both), evaluation on."""
    sources = [{"source": _jsonl(tmp_path / f"{name}.jsonl", builtin_chat(rows, seed)), "name": name}
               for name, seed in (("a", 1), ("b", 2))]
    return validate(apply_overrides(Recipe(), [f"data.sources={json.dumps(sources)}", "train.eval_every=5",
                                               "data.seq_len=1024", "model.local_tiny=true", *sets]))


def _folder(tmp_path, real_rows, *sets: str) -> Recipe:
    """train.jsonl of 20 rows and test.jsonl repeating 3 of them, named as the held-out split."""
    folder = tmp_path / "mine"
    folder.mkdir(parents=True)
    _jsonl(folder / "train.jsonl", real_rows[:20])
    _jsonl(folder / "test.jsonl", [real_rows[4], real_rows[11], real_rows[17]])
    return validate(apply_overrides(Recipe(), [f"data.source={folder}", "data.split=train",
                                               "data.validation_split=test", "train.eval_every=5",
                                               "data.seq_len=8192", "model.local_tiny=true", *sets]))


def test_a_capped_mixture_holds_out_its_share_of_each_source_after_the_carve(tmp_path):
    """2 x 400 rows capped at 40: each source holds out its 5% up to 20 rows, a at 21 rows capped to 20, b's 17
    (before, the cap cut each source's raw rows to 20 before the carve took 5% of them: 1 row); capped at 20:
    10 of each."""
    _, text, count = check_sources(_mixture(tmp_path, 400, "data.validation_max_rows=40").data)
    assert count == 37 and "20 of 400 rows of a " in text and "17 of 400 rows of b " in text, text
    _, text, count = check_sources(_mixture(tmp_path, 400, "data.validation_max_rows=20").data)
    assert count == 20 and "10 of 400 rows of a " in text and "10 of 400 rows of b " in text, text
    # uncapped, small sources: 5% of b's 10 rows is none; its threshold moves to hold out one
    _, text, count = check_sources(_mixture(tmp_path, 10).data)
    assert "1 of 10 rows of b by content hash (seed 42; validation_fraction 0.05 -> " in text and count == 3, text
    # a cap below one row a source is refused before Ray, naming the sources
    with pytest.raises(RecipeError, match=r"data.validation_max_rows: 1 .* of the 2 sources that evaluate \(a, b\)"):
        check_sources(_mixture(tmp_path, 400, "data.validation_max_rows=1").data)


def test_a_named_splits_row_count_is_said_and_the_first_n_only_when_it_has_more(tmp_path, real_rows):
    data = _folder(tmp_path, real_rows, "data.validation_max_rows=64").data
    _, text, count = check_sources(data)
    assert count == 3 and "split test of" in text and ", 3 rows;" in text and "first" not in text, text
    data = _folder(tmp_path / "capped", real_rows, "data.validation_max_rows=2").data
    _, text, count = check_sources(data)
    assert count == 2 and "the first 2 rows" in text, text


def test_data_check_leaves_out_the_rows_a_named_split_repeats(tmp_path, real_rows):
    from raytune_ft.data.check import data_check

    recipe = _folder(tmp_path, real_rows, "data.validation_max_rows=64")
    lines, ok = data_check(recipe, png=str(tmp_path / "h.png"))
    text = "\n".join(lines)
    assert ok and "0 held out" in text and "17 to train on" in text and "3 {'in_held_out': 3}" in text, text


@pytest.mark.timeout(300)
def test_a_run_trains_without_the_rows_a_named_split_repeats_and_agrees_with_the_check(ray_local, tmp_path,
                                                                                       real_rows, tok_path):
    from raytune_ft.data.check import data_check
    from raytune_ft.data.pipeline import build_dataset, iter_blocks

    recipe = _folder(tmp_path, real_rows, "data.validation_max_rows=64", f"model.tokenizer={tok_path}",
                     "model.local_tiny=false")
    data = recipe.data
    check_sources(data)
    c = DataCounters()
    blocks = list(iter_blocks(build_dataset(data, tok_path), data, counters=c))
    assert blocks and c.rows_read == 20 and c.rows_skipped_by_reason == {"in_held_out": 3}
    assert c.conversations_packed == 17
    train = {tuple(r["input_ids"]) for r in build_dataset(data, tok_path).take_all() if not r["skip_reason"]}
    val = [tuple(r["input_ids"]) for r in build_dataset(data, tok_path, split="validation").take_all()]
    assert len(val) == 3 and len(train) == 17 and not set(val) & train
    # the data check, with the run's tokenizer, says what the run trained
    lines, _ = data_check(recipe, png=str(tmp_path / "h.png"))
    text = "\n".join(lines)
    assert f"rows             {c.rows_read}" in text and f"{c.conversations_packed} to train on" in text, text
    assert f"{c.rows_skipped} {c.rows_skipped_by_reason}" in text, text


@pytest.mark.timeout(300)
def test_a_capped_mixture_evaluates_its_share_of_each_source_and_never_trains_on_it(ray_local, tmp_path, tok_path):
    from raytune_ft.data.pipeline import build_dataset

    data = _mixture(tmp_path, 400, "data.validation_max_rows=20").data
    check_sources(data)
    val = build_dataset(data, tok_path, split="validation").take_all()
    assert [sum(r["source"] == s for r in val) for s in (0, 1)] == [10, 10]
    train = build_dataset(data, tok_path).take_all()
    trained = {tuple(r["input_ids"]) for r in train if not r["skip_reason"]}
    assert trained and not {tuple(r["input_ids"]) for r in val} & trained
    # every row is trained, held out or skipped for its content: 800 in all (a held-out row may keep a place in
    # the training stream, to be counted there)
    placed = [r for r in train if r["skip_reason"] != "held_out"]
    assert len(placed) + len(val) == 800 and all(r["skip_reason"] in ("", "in_held_out") for r in placed)
