"""The class AutoTokenizer chose, remembered (models/tokenizer.py): the memo holds it per transformers
version, and a tokenizing process imports a carried class only where it is one of transformers' own
tokenizer classes (else AutoTokenizer decides there again). Real Qwen tokenizers from tests/fixtures."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sys

import pytest

from raytune_ft.models import tokenizer as tokmod
from raytune_ft.recipe.recipe import Recipe


@pytest.fixture
def model_cfg(fixtures, tmp_path):
    import shutil

    folder = tmp_path / "tokenizer"
    shutil.copytree(fixtures / "tokenizers" / "qwen3", folder)
    cfg = Recipe().model
    cfg.name, cfg.local_tiny, cfg.tokenizer, cfg.chat_template = str(folder), False, None, None
    return cfg


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.setattr(tokmod, "_CHOSEN", {})
    tokmod._loaded.cache_clear()
    yield
    tokmod._loaded.cache_clear()


def test_a_memo_written_under_another_transformers_version_is_not_used(model_cfg, tmp_path, monkeypatch):
    memo = tmp_path / "cache" / tokmod.MEMO_NAME
    real_version = importlib.metadata.version

    with monkeypatch.context() as m:        # an earlier run under another transformers
        m.setattr(importlib.metadata, "version",
                  lambda name: "0.0.1" if name == "transformers" else real_version(name))
        tokmod.load_once(model_cfg, str(memo))
    chosen_then = tokmod.TokenizerOf.of(model_cfg).tokenizer_class
    assert chosen_then and chosen_then.startswith("transformers.")
    # what that transformers chose is not this one's choice: a class only that version has, say
    written = json.loads(memo.read_text())
    memo.write_text(json.dumps({k: "transformers.PreTrainedTokenizerFast" for k in written}))

    tokmod._CHOSEN.clear()
    tokmod.load_once(model_cfg, str(memo))
    assert tokmod.TokenizerOf.of(model_cfg).tokenizer_class == chosen_then     # loaded again here
    assert sorted(json.loads(memo.read_text()).values()) == sorted(["transformers.PreTrainedTokenizerFast",
                                                                    chosen_then])


def test_a_carried_class_from_outside_transformers_is_never_imported(model_cfg, tmp_path, monkeypatch):
    planted = tmp_path / "planted_tokenizer_module.py"
    planted.write_text("import os\nos.environ['RAYTUNE_TEST_PLANTED_IMPORTED'] = '1'\nclass Tok: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RAYTUNE_TEST_PLANTED_IMPORTED", raising=False)
    expected = type(tokmod.tokenizer_for(model_cfg))

    for carried in ("planted_tokenizer_module.Tok",              # not transformers': never imported
                    "transformers.PretrainedConfig",             # transformers', not a tokenizer
                    "transformers.NoSuchTokenizerFast"):         # a class another transformers has
        tokmod._loaded.cache_clear()
        ref = dataclasses.replace(tokmod.TokenizerOf.of(model_cfg), tokenizer_class=carried)
        tok = ref.load()                                          # AutoTokenizer decides here instead
        assert type(tok) is expected, carried
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "planted_tokenizer_module" not in sys.modules
    import os

    assert "RAYTUNE_TEST_PLANTED_IMPORTED" not in os.environ
