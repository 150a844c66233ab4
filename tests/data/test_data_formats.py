"""Training on a user's own rows: every row format's adapter on real rows (UltraChat, Capybara; their ShareGPT,
Alpaca and prompt/completion forms made from them here), field and role names mapped in the recipe, and the
checks before Ray: a file in no known format, a held-out split the source lacks, the held-out carve of a
small file."""
from __future__ import annotations

import json

import pytest

from raytune_ft.data.precheck import check_sources
from raytune_ft.data.sources import Adapter, to_messages
from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, validate

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


@pytest.fixture(scope="module")
def ultrachat(fixtures):
    return [json.loads(line) for line in open(fixtures / "data" / "ultrachat_200k_train_sft_first16.jsonl")]


@pytest.fixture(scope="module")
def capybara(fixtures):
    return [json.loads(line) for line in open(fixtures / "data" / "capybara_ldjnr_first16.jsonl")]


def _sharegpt(row: dict) -> dict:
    return {"id": row["prompt_id"], "conversations": [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]}
                                                      for m in row["messages"]]}


def test_each_format_gives_the_same_messages_on_real_rows(ultrachat, capybara):
    for row in ultrachat:
        messages = row["messages"]
        assert to_messages(row) == (messages, None)
        assert Adapter().detect(row) == "messages"
        sharegpt = _sharegpt(row)
        assert Adapter().detect(sharegpt) == "sharegpt" and to_messages(sharegpt) == (messages, None)
        first = {"prompt": messages[0]["content"], "completion": messages[1]["content"]}
        assert Adapter().detect(first) == "prompt_completion"
        assert to_messages(first) == (messages[:2], None)
    for row in capybara:
        turns = row["conversation"]
        expected = [m for t in turns for m in ({"role": "user", "content": t["input"]},
                                               {"role": "assistant", "content": t["output"]})]
        assert Adapter().detect(row) == "conversation" and to_messages(row) == (expected, None)
        alpaca = {"instruction": turns[0]["input"], "input": "", "output": turns[0]["output"],
                  "system": "You are helpful."}
        assert Adapter().detect(alpaca) == "alpaca"
        assert to_messages(alpaca) == ([{"role": "system", "content": "You are helpful."}] + expected[:2], None)


def test_alpaca_input_joins_the_instruction_and_sharegpt_tool_turns_map():
    msgs, _ = to_messages({"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"})
    assert msgs == [{"role": "user", "content": "Translate to French.\n\nGood morning"},
                    {"role": "assistant", "content": "Bonjour"}]
    row = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                             {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Paris"}}'},
                             {"from": "observation", "value": '{"temp": 18}'},
                             {"from": "gpt", "value": "18 degrees."}]}
    assert [m["role"] for m in to_messages(row)[0]] == ["user", "assistant", "tool", "assistant"]
    assert to_messages({"conversations": [{"from": "wizard", "value": "x"}, {"from": "gpt", "value": "y"}]}) == \
        (None, "unknown_role")


def test_field_and_role_names_are_mapped_from_the_recipe(ultrachat):
    """`--set data.fields.messages=dialog --set data.roles.user=[customer]` reads rows of other names."""
    r = apply_overrides(Recipe(), ["data.fields.messages=dialog", "data.fields.role=speaker",
                                   "data.fields.content=text", "data.roles.user=[customer, client]",
                                   "data.roles.assistant=agent"])
    assert r.data.fields == {"messages": "dialog", "role": "speaker", "content": "text"}
    assert r.data.roles == {"user": ["customer", "client"], "assistant": ["agent"]}
    adapter = Adapter(r.data.schema, r.data.fields, r.data.roles)
    names = {"user": "customer", "assistant": "agent", "system": "system"}
    for row in ultrachat[:4]:
        mine = {"dialog": [{"speaker": names[m["role"]], "text": m["content"]} for m in row["messages"]]}
        assert adapter.detect(mine) == "messages" and adapter(mine) == (row["messages"], None)
        assert to_messages(mine) == (None, "unknown_schema")       # without the mapping


def test_a_file_in_no_known_format_fails_naming_the_row_fields_and_formats(tmp_path, ultrachat):
    bad = tmp_path / "notes.jsonl"
    bad.write_text("".join(json.dumps({"id": i, "question": "q", "answer": "a"}) + "\n" for i in range(5)))
    r = validate(apply_overrides(Recipe(), [f"data.source={bad}"]))
    with pytest.raises(RecipeError) as e:
        check_sources(r.data)
    msg = str(e.value)
    assert "row 1 is in no known format" in msg and "its fields: id, question, answer" in msg
    for fmt in ("messages (messages)", "sharegpt (conversations)", "alpaca (instruction, output)",
                "prompt_completion (prompt, completion)", "conversation (conversation)"):
        assert fmt in msg
    good = tmp_path / "sharegpt.jsonl"
    good.write_text("".join(json.dumps(_sharegpt(row)) + "\n" for row in ultrachat))
    checks, _, _ = check_sources(validate(apply_overrides(Recipe(), [f"data.source={good}"])).data)
    assert [(c.format, c.rows_seen) for c in checks] == [("sharegpt", 16)]


def test_a_held_out_split_the_source_lacks_fails_listing_the_splits(tmp_path, fixtures):
    one = fixtures / "data" / "ultrachat_200k_train_sft_first16.jsonl"
    with pytest.raises(RecipeError, match="'test_sft' does not exist .*a single file has one split"):
        validate(apply_overrides(Recipe(), [f"data.source={one}", "data.validation_split=test_sft"]))
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (folder / name).write_text(one.read_text())
    with pytest.raises(RecipeError, match=r"'test_sft' does not exist in .*mine \(splits: test, train\)"):
        validate(apply_overrides(Recipe(), [f"data.source={folder}", "data.validation_split=test_sft"]))
    validate(apply_overrides(Recipe(), [f"data.source={folder}", "data.split=train", "data.validation_split=test"]))


def test_a_small_file_holds_out_at_least_one_row_and_at_most_validation_max_rows(tmp_path, ultrachat, capybara):
    """5% of 16 rows is less than one: the carve's threshold moves so that one row (of the file's own hashes)
    is held out; a cap of 2 rows on a 30% carve holds out exactly 2. The training rows are the rest, by content."""
    from raytune_ft.data.pipeline import tokenize_rows

    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ultrachat + capybara))
    for sets, held in ((["train.eval_every=5"], 1),
                       (["train.eval_every=5", "data.validation_fraction=0.3", "data.validation_max_rows=2"], 2)):
        data = validate(apply_overrides(Recipe(), [f"data.source={path}", "model.local_tiny=true", *sets])).data
        _, text, count = check_sources(data)
        assert count == held and f"{held} of 32 rows" in text
        lines = path.read_text().splitlines()
        from raytune_ft.data.rows import Carve
        from raytune_ft.models.tokenizer import tokenizer_for

        tok = tokenizer_for(Recipe().model.__class__(local_tiny=True))
        val = tokenize_rows(lines, tok, carve=Carve("validation", data.validation_fraction, data.seed))["input_ids"]
        cols = tokenize_rows(lines, tok, carve=Carve("train", data.validation_fraction, data.seed))
        # the held-out rows keep their place in the training stream, with no tokens, to be counted
        assert cols["skip_reason"].count("held_out") == held
        train = [ids for ids, why in zip(cols["input_ids"], cols["skip_reason"]) if why != "held_out"]
        assert len(val) == held and len(train) == 32 - held
        assert not {tuple(v) for v in val} & {tuple(t) for t in train}


@pytest.mark.slow
def test_a_job_on_a_file_in_no_known_format_exits_2_in_seconds_before_ray(tmp_path):
    """The issue's walk: a JSONL without chat fields started two worker groups and failed 38 s later inside a Ray
    traceback. Now the job reads its first rows before Ray starts: exit 2, one line naming the row, the fields
    seen and the formats accepted. Timed in the job's own CPU seconds (this machine's load does not count)."""
    import os
    import resource
    import subprocess
    import sys
    import time
    from pathlib import Path

    bad = tmp_path / "notes.jsonl"
    bad.write_text("".join(json.dumps({"id": i, "body": "text"}) + "\n" for i in range(20)))
    repo = Path(__file__).resolve().parents[2]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    out = subprocess.run([sys.executable, str(repo / "jobs" / "qwen27b_b300.py"), "--local",
                          f"--set=data.source={bad}", "--set=data.validation_split=none"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(repo), "RAYTUNE_LOCAL_STORAGE": str(tmp_path / "runs")})
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "row 1 is in no known format" in out.stderr and "its fields: id, body" in out.stderr
    assert "Traceback" not in out.stderr and "ray" not in out.stdout.lower()
    assert cpu < 5.0, f"{cpu:.1f} CPU seconds ({wall:.1f} s wall)"


def test_data_check_says_what_each_source_trains_on(tmp_path, ultrachat, capybara, capsys):
    """`raytune-ft data check`: per source rows, format, skipped, token percentiles, assistant share, overlong,
    blocks, packing and padding, the held-out set; a histogram PNG. Exit 1 when a run would stop for skipped
    rows, 2 for a file in no known format."""
    from raytune_ft.cli import main

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(_sharegpt(r)) + "\n" for r in ultrachat))
    b.write_text("".join(json.dumps(r) + "\n" for r in capybara) + '{"conversation": "not a list"}\n')
    sources = json.dumps([{"source": str(a), "name": "mine"}, {"source": str(b), "name": "capy", "weight": 2}])
    png = tmp_path / "h.png"
    rc = main(["data", "check", "qwen27b_b300", "--local", f"--set=data.sources={sources}",
               "--set=data.validation_split=none", "--set=data.seq_len=2048", "--set=data.max_skip_fraction=0.01",
               f"--png={png}"])
    out = capsys.readouterr().out
    assert rc == 1 and png.stat().st_size > 1000
    for text in ("source mine", "source capy (weight 2)", "format           sharegpt (sharegpt: ", "p50 ", "p99 ",
                 "assistant share", "longer than 2048 tokens: split into 2048-token pieces", "packing efficiency",
                 "skipped          1 {'bad_message': 1}", "held-out set", "a run would stop: 1 of"):
        assert text in out, text
    rc = main(["data", "check", "qwen27b_b300", "--local", f"--set=data.source={a}",
               "--set=data.validation_split=none", f"--png={png}"])
    assert rc == 0 and "skipped          0" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    assert main(["data", "check", "qwen27b_b300", "--local", f"--set=data.source={bad}",
                 "--set=data.validation_split=none"]) == 2
    assert "row 1 is in no known format" in capsys.readouterr().err


def test_a_mixtures_local_paths_are_made_absolute_where_the_run_is_launched(fixtures, monkeypatch):
    """Ray's workers read in folders of their own: a relative path in data.sources would name nothing there."""
    from raytune_ft.recipe.recipe import absolute_local_paths

    monkeypatch.chdir(fixtures / "data")
    sources = json.dumps([{"source": "capybara_ldjnr_first16.jsonl"}, {"source": "hf://trl-lib/Capybara"}])
    r = validate(absolute_local_paths(apply_overrides(Recipe(), [f"data.sources={sources}"])))
    assert [s["source"] for s in r.data.sources] == [str(fixtures / "data" / "capybara_ldjnr_first16.jsonl"),
                                                     "hf://trl-lib/Capybara"]
