"""Template settings applied or refused (issue 57 item 9): a `data.template_kwargs` key the chat template never
reads is said before the run starts, taken out of the settings the run logs as applied and logged as ignored;
the `--local` tiny template reads the 27B template's kwargs (`enable_thinking`, `reasoning_effort`). Before,
`--local` rendered the same whatever they said, while MLflow logged them as applied."""
from __future__ import annotations

import json

import pytest

KWARGS = {"enable_thinking": True, "reasoning_effort": "low"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "It is 4."}]


def _reads(template: str) -> set[str]:
    """The names a template reads, by jinja's own parse (transformers' generation tags dropped)."""
    import re

    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return meta.find_undeclared_variables(env.parse(re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template)))


def test_the_tiny_template_reads_the_kwargs_the_27b_template_reads(fixtures):
    from raytune_ft.data.sft import render_sft
    from raytune_ft.models.tiny import local_tokenizer

    big = (fixtures / "templates" / "qwen3.8-27b.chat_template.jinja").read_text()
    tok = local_tokenizer()
    assert set(KWARGS) <= _reads(big) and set(KWARGS) <= _reads(tok.chat_template)
    plain = tok.apply_chat_template(CHAT, tokenize=False)
    low = tok.apply_chat_template(CHAT, tokenize=False, **KWARGS)
    assert low != plain and "low" in low.split("<|im_end|>")[0]          # the effort is system text
    assert tok.apply_chat_template(CHAT, tokenize=False, enable_thinking=False, reasoning_effort="low") == plain
    assert tok.apply_chat_template(CHAT[1:], tokenize=False, **KWARGS).startswith("<|im_start|>system\n")
    # the loss stays on the assistant's tokens alone
    ids, mask = render_sft(tok, CHAT, **KWARGS)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "It is 4.<|im_end|>"
    with pytest.raises(Exception, match="reasoning_effort"):
        tok.apply_chat_template(CHAT, tokenize=False, reasoning_effort="maximal")


def _recipe(tmp_path, fixtures, template: str | None):
    from raytune_ft.cli import _job_recipe

    rows = tmp_path / "rows.jsonl"
    rows.write_text((fixtures / "data" / "ultrachat_200k_train_sft_first16.jsonl").read_text())
    overrides = [f"data.source={rows}", "data.validation_split=none", f"tracking.storage_path={tmp_path}",
                 f"data.template_kwargs={json.dumps(KWARGS)}"]
    if template is not None:
        path = tmp_path / "template.jinja"
        path.write_text(template)
        overrides.append(f"model.chat_template={path}")
    return _job_recipe("qwen27b_b300", True, overrides)


def test_a_kwarg_the_chat_template_never_reads_is_said_before_the_run_and_logged_as_ignored(tmp_path, fixtures,
                                                                                           capsys):
    from raytune_ft.data.report import data_params
    from raytune_ft.driver.preflight import check_data_source
    from raytune_ft.tracking.mlflow_run import flat_params

    # Qwen3's template reads enable_thinking, not reasoning_effort
    qwen3 = json.loads((fixtures / "tokenizers" / "qwen3" / "tokenizer_config.json").read_text())["chat_template"]
    recipe = _recipe(tmp_path, fixtures, qwen3)
    notes = check_data_source(recipe)
    said = capsys.readouterr().out
    assert "template_kwargs ignored: reasoning_effort='low'" in said and "applied: enable_thinking" in said
    assert recipe.data.template_kwargs == {"enable_thinking": True}
    params = flat_params(recipe)
    assert params["data.template_kwargs.enable_thinking"] == "True"
    assert not any("reasoning_effort" in k for k in params)               # not logged as applied
    assert data_params(notes, {})["data.template_kwargs_ignored"].startswith("reasoning_effort='low'")
    # the tiny template of --local reads both: nothing said, both applied
    local = _recipe(tmp_path, fixtures, None)
    check_data_source(local)
    assert "ignored" not in capsys.readouterr().out and local.data.template_kwargs == KWARGS


def test_data_check_says_which_template_kwargs_apply(tmp_path, fixtures, capsys):
    from raytune_ft.cli import main

    qwen2 = json.loads((fixtures / "tokenizers" / "qwen2-0.5b" / "tokenizer_config.json").read_text())["chat_template"]
    template = tmp_path / "qwen2.jinja"
    template.write_text(qwen2)
    rows = fixtures / "data" / "ultrachat_200k_train_sft_first16.jsonl"
    common = ["data", "check", "qwen27b_b300", "--local", f"--set=data.source={rows}",
              "--set=data.validation_split=none", f"--set=data.template_kwargs={json.dumps(KWARGS)}",
              f"--png={tmp_path / 'h.png'}"]
    assert main(common + [f"--set=model.chat_template={template}"]) == 0
    out = capsys.readouterr().out
    assert ("template kwargs    applied: none; ignored, the chat template never reads them: enable_thinking=True, "
            "reasoning_effort='low'") in out
    assert main(common) == 0
    assert "template kwargs    applied: enable_thinking=True, reasoning_effort='low'\n" in capsys.readouterr().out
