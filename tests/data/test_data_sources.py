"""The data path on local Ray with a user's own files: a single file's held-out rows never meet its trained
rows (checked by content), compressed files, and a two-source mixture: interleaved by the seed, the same on
every build, weights applied, and counted per source (read, skipped by reason, tokens, blocks)."""
from __future__ import annotations

import gzip
import json

import pytest

from raytune_ft.data.packing import DataCounters
from raytune_ft.data.pipeline import build_dataset, iter_blocks
from raytune_ft.data.precheck import check_sources
from raytune_ft.recipe.recipe import Recipe, apply_overrides, validate


@pytest.fixture(scope="module")
def tok_path(fixtures):
    return str(fixtures / "tokenizers" / "qwen3")


@pytest.fixture(scope="module")
def rows(fixtures):
    return {name: (fixtures / "data" / f"{name}.jsonl").read_text().splitlines()
            for name in ("ultrachat_200k_train_sft_first16", "capybara_ldjnr_first16")}


def _ids(ds) -> list[tuple]:
    """The token ids of the rows a dataset trains or evaluates (not those kept in their place, marked)."""
    return [tuple(r["input_ids"]) for r in ds.take_all() if not r["skip_reason"]]


@pytest.mark.timeout(300)
def test_a_single_file_run_never_evaluates_on_rows_it_trains_on(ray_local, tmp_path, rows, tok_path):
    """The issue's walk: a 32-row file of the user's own, evaluation on. Before, the held-out set was the whole
    file (the split named did not exist and was ignored); now it is carved by content hash: disjoint from the
    trained rows, together all of them, and the same rows on a second build."""
    path = tmp_path / "mine.jsonl"
    lines = rows["ultrachat_200k_train_sft_first16"] + rows["capybara_ldjnr_first16"]
    path.write_text("\n".join(lines) + "\n")
    recipe = validate(apply_overrides(Recipe(), [f"data.source={path}", "train.eval_every=5", "data.seq_len=8192"]))
    _, text, held = check_sources(recipe.data)
    assert held >= 1 and text.startswith(f"{held} of 32 rows")
    train = _ids(build_dataset(recipe.data, tok_path, split="train"))
    val = _ids(build_dataset(recipe.data, tok_path, split="validation"))
    assert len(val) == held and len(train) == 32 - held
    assert not set(val) & set(train)
    assert len(set(val) | set(train)) == 32
    assert _ids(build_dataset(recipe.data, tok_path, split="validation")) == val


@pytest.mark.timeout(300)
def test_compressed_jsonl_and_a_json_array_are_read(ray_local, tmp_path, rows, tok_path):
    folder = tmp_path / "gz"
    folder.mkdir()
    with gzip.open(folder / "part-a.jsonl.gz", "wt") as f:
        f.write("\n".join(rows["ultrachat_200k_train_sft_first16"][:10]) + "\n")
    (folder / "part-b.json").write_text(json.dumps([json.loads(r) for r in rows["capybara_ldjnr_first16"][:6]]))
    data = validate(apply_overrides(Recipe(), [f"data.source={folder}", "data.seq_len=8192"])).data
    out = build_dataset(data, tok_path).take_all()
    assert len(out) == 16 and all(r["skip_reason"] == "" and len(r["input_ids"]) > 0 for r in out)


def _mixture(tmp_path, rows, weight_b: float = 1.0) -> Recipe:
    a, b = tmp_path / "ultrachat.jsonl", tmp_path / "capybara.jsonl"
    a.write_text("\n".join(rows["ultrachat_200k_train_sft_first16"] + ['{"foo": 1}']) + "\n")   # one junk row
    b.write_text("\n".join(rows["capybara_ldjnr_first16"]) + "\n")
    sources = [{"source": str(a), "name": "ultrachat"}, {"source": str(b), "name": "capybara", "weight": weight_b}]
    return validate(apply_overrides(Recipe(), [f"data.sources={json.dumps(sources)}", "data.seq_len=4096",
                                               "data.pack_window=8", "data.max_skip_fraction=0.2"]))


@pytest.mark.timeout(300)
def test_a_two_source_mixture_is_interleaved_deterministically_and_counted_per_source(ray_local, tmp_path, rows,
                                                                                      tok_path):
    data = _mixture(tmp_path, rows).data
    out = build_dataset(data, tok_path).take_all()
    order = [r["source"] for r in out]
    assert sorted(order) == [0] * 17 + [1] * 16
    assert order != sorted(order) and order != sorted(order, reverse=True)     # interleaved, not one then the other
    assert [tuple(r["input_ids"]) for r in build_dataset(data, tok_path).take_all()] == \
        [tuple(r["input_ids"]) for r in out]
    c = DataCounters()
    blocks = list(iter_blocks(build_dataset(data, tok_path), data, counters=c))
    u, cap = c.by_source["ultrachat"], c.by_source["capybara"]
    assert (u["rows_read"], u["rows_skipped_by_reason"], u["conversations"], u["pieces"]) == \
        (17, {"unknown_schema": 1}, 16, 16)
    assert (cap["rows_read"], cap["rows_skipped_by_reason"], cap["conversations"], cap["pieces"]) == (16, {}, 16, 16)
    assert u["tokens"] + cap["tokens"] == c.real_tokens and min(u["tokens"], cap["tokens"]) > 0
    assert 0 < u["blocks"] <= len(blocks) and 0 < cap["blocks"] <= len(blocks)
    # resume: skipping the first blocks of a fresh build gives exactly the rest (the fingerprint's premise)
    again = list(iter_blocks(build_dataset(data, tok_path), data, skip_blocks=2))
    assert len(blocks) > 2 and [b["input_ids"].tolist() for b in again] == [b["input_ids"].tolist() for b in blocks[2:]]
    merged = DataCounters().merge(c).merge(c)
    assert merged.by_source["capybara"]["rows_read"] == 32
    # weight 2: every capybara row twice; 0.5: a seeded half
    twice = build_dataset(_mixture(tmp_path, rows, 2.0).data, tok_path).take_all()
    assert sum(r["source"] == 1 for r in twice) == 32
    halved = build_dataset(_mixture(tmp_path, rows, 0.5).data, tok_path).take_all()
    half = sum(r["source"] == 1 and not r["skip_reason"] for r in halved)
    assert 2 <= half <= 14
    # the rows drawn no time keep one place each, so every row read is counted once
    assert sum(r["source"] == 1 and r["skip_reason"] == "not_drawn" for r in halved) == 16 - half


@pytest.mark.timeout(300)
def test_the_27b_jobs_ultrachat_capybara_mixture_reads_both_hub_datasets(ray_local, tmp_path, rows, tok_path,
                                                                          monkeypatch):
    """`--set data.mixture=ultrachat_capybara` on the 27B job, read from the hub's offline stand-in laid out as
    both repos: each source's own split, weights as stated (Capybara's rows twice), each source's held-out split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytune_ft.cli import _job_recipe
    from raytune_ft.data.pipeline import HF_ROOT_ENV

    uc = [json.loads(r) for r in rows["ultrachat_200k_train_sft_first16"]]
    cap = [{"messages": [m for t in json.loads(r)["conversation"] for m in
                         ({"role": "user", "content": t["input"]}, {"role": "assistant", "content": t["output"]})]}
           for r in rows["capybara_ldjnr_first16"]]
    for repo, parts in (("HuggingFaceH4/ultrachat_200k", {"train_sft": uc[:12], "test_sft": uc[12:]}),
                        ("trl-lib/Capybara", {"train": cap[:10], "test": cap[10:]})):
        (tmp_path / repo / "data").mkdir(parents=True)
        for split, part in parts.items():
            pq.write_table(pa.Table.from_pylist(part), tmp_path / repo / "data" / f"{split}-00000-of-00001.parquet")
    monkeypatch.setenv(HF_ROOT_ENV, str(tmp_path))
    recipe = _job_recipe("qwen27b_b300", False, ["data.mixture=ultrachat_capybara", "data.seq_len=8192"])
    assert [(s["name"], s["weight"]) for s in recipe.data.sources] == [("ultrachat", 1.0), ("capybara", 2.0)]
    checks, held, _ = check_sources(recipe.data)
    assert [c.format for c in checks] == ["messages", "messages"]
    assert "split test_sft of ultrachat" in held and "split test of capybara" in held
    train = build_dataset(recipe.data, tok_path).take_all()
    assert sum(r["source"] == 0 for r in train) == 12 and sum(r["source"] == 1 for r in train) == 20
    val = build_dataset(recipe.data, tok_path, split="validation").take_all()
    assert sum(r["source"] == 0 for r in val) == 4 and sum(r["source"] == 1 for r in val) == 6
