"""Defaults that follow the source (issue 57): a held-out split a job names for its own source does not bind a
source the user gives (`--set data.source=FILE` alone carves its held-out rows and says so; a folder laid out
as train + test holds out its test split); a split the user names must exist; `--dry-run` shows what empty
fields mean (the linears LoRA adapts, by name)."""
from __future__ import annotations

import json
import shutil

import pytest

from raytune_ft import cli
from raytune_ft.data.precheck import check_sources
from raytune_ft.recipe.recipe import RecipeError
from raytune_ft.recipe.sections import FSDP2_LORA_TARGETS


@pytest.fixture
def one_file(fixtures, tmp_path):
    path = tmp_path / "mine.jsonl"
    shutil.copy(fixtures / "data" / "ultrachat_200k_train_sft_first16.jsonl", path)
    return str(path)


@pytest.mark.parametrize("local", [False, True])
def test_a_users_file_alone_trains_with_a_carved_held_out_set(one_file, local, capsys):
    """The 27B LoRA job names UltraChat's test_sft: before, `--set data.source=FILE` stopped with
    "'test_sft' does not exist in FILE"."""
    recipe = cli._job_recipe("qwen27b_lora", local, [f"data.source={one_file}"])
    assert recipe.data.validation_split is None and recipe.data.validation_fraction == 0.05
    err = capsys.readouterr().err
    assert "the job's held-out split test_sft is its own source's" in err and "by content hash" in err
    _, text, count = check_sources(recipe.data)
    assert count >= 1 and text.startswith(f"{count} of 16 rows of {one_file} by content hash"), text
    # a mixture of the user's: its sources hold out their own rows
    mixture = cli._job_recipe("qwen27b_lora", local, [f"data.sources={json.dumps([{'source': one_file}])}"])
    assert mixture.data.validation_split is None and mixture.data.validation_fraction == 0.05
    _, text, count = check_sources(mixture.data)
    assert count >= 1 and text.startswith(f"{count} of 16 rows of {one_file} by content hash"), text
    # a split the user names must exist
    with pytest.raises(RecipeError, match="data.validation_split: 'test_sft' does not exist in .*mine.jsonl"):
        cli._job_recipe("qwen27b_lora", local, [f"data.source={one_file}", "data.validation_split=test_sft"])


def test_a_folder_of_train_and_test_files_holds_out_its_test_split(fixtures, tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    rows = (fixtures / "data" / "ultrachat_200k_train_sft_first16.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(rows[:12]) + "\n")
    (folder / "test.jsonl").write_text("\n".join(rows[12:]) + "\n")
    recipe = cli._job_recipe("qwen27b_lora", False, [f"data.source={folder}"])
    assert (recipe.data.split, recipe.data.validation_split) == ("train", "test")
    assert "holds out its split test, trained on its split train" in capsys.readouterr().err
    _, text, count = check_sources(recipe.data)
    assert count == 4 and f"split test of {folder}, 4 rows" in text, text
    # the job's own source keeps the job's split, and says nothing
    assert cli._job_recipe("qwen27b_lora", True, []).data.validation_split == "test_sft"
    assert "held-out split" not in capsys.readouterr().err


def test_dry_run_names_the_linears_lora_adapts(capsys):
    """The LoRA job's `lora_target_modules: []` means every linear of both layer kinds: the dry run says them."""
    assert cli.main(["run", "qwen27b_lora", "--dry-run"]) == 0
    out = capsys.readouterr().out
    recipe = json.loads(out[:out.index("\n}\n") + 2])
    assert recipe["train"]["lora_target_modules"] == list(FSDP2_LORA_TARGETS)
    assert recipe["tracking"]["tracking_uri"]
    assert cli.main(["run", "qwen2_05b_lora", "--dry-run"]) == 0        # named in the job: as named
    out = capsys.readouterr().out
    assert json.loads(out[:out.index("\n}\n") + 2])["train"]["lora_target_modules"] == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
