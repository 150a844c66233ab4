"""The tokenizer of a recipe's model, and a reference to it that Ray processes can carry.

Light to import (no transformers until a tokenizer is loaded): Ray Data's processes (the Train
controller, the dataset manager, the split coordinator, the tokenizing tasks) unpickle the datasets'
map function, and a tokenizer object inside it would make each of them import transformers and rebuild
the tokenizer before doing anything (bench/NOTES.md, start-up). `TokenizerOf(model_cfg)` carries the
model's settings instead; the tokenizing tasks load it once per process.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

from raytune_ft.models.tiny import CHATML_TEMPLATE, local_tokenizer


def tokenizer_for(model_cfg):
    """The tokenizer of a recipe's model: the project's tiny one for local_tiny runs, else AutoTokenizer
    from model_cfg.tokenizer (or name, at revision). model_cfg.chat_template (a jinja file) replaces the
    tokenizer's template; a tokenizer without a template gets our ChatML one; a missing pad token becomes
    <|endoftext|> when the vocabulary has it, else the eos token."""
    if model_cfg.local_tiny:
        tok = local_tokenizer()
    else:
        from transformers import AutoTokenizer

        source = model_cfg.tokenizer or model_cfg.name
        revision = model_cfg.revision if model_cfg.tokenizer in (None, model_cfg.name) else None
        tok = AutoTokenizer.from_pretrained(source, revision=revision,
                                            trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.chat_template:
        tok.chat_template = Path(os.path.expanduser(model_cfg.chat_template)).read_text()
    elif not getattr(tok, "chat_template", None):
        tok.chat_template = CHATML_TEMPLATE
    if tok.pad_token is None:
        vocab = tok.get_vocab()
        tok.pad_token = "<|endoftext|>" if "<|endoftext|>" in vocab else tok.eos_token
    return tok


@dataclasses.dataclass(frozen=True)
class TokenizerOf:
    """The tokenizer of a model's settings (a ModelConfig's tokenizer fields), loaded where it is used."""
    name: str
    tokenizer: str | None
    revision: str | None
    trust_remote_code: bool
    chat_template: str | None
    local_tiny: bool

    @classmethod
    def of(cls, model_cfg) -> "TokenizerOf":
        return cls(model_cfg.name, model_cfg.tokenizer, model_cfg.revision, bool(model_cfg.trust_remote_code),
                   model_cfg.chat_template, bool(model_cfg.local_tiny))

    def load(self):
        """This process's copy (loaded on the first call; callers must not change it)."""
        return _loaded(self)


@functools.lru_cache(maxsize=4)
def _loaded(ref: TokenizerOf):
    return tokenizer_for(ref)
