"""The tokenizer of a recipe's model, and a reference to it that Ray processes can carry.

Light to import (no transformers until a tokenizer is loaded): Ray Data's processes (the Train
controller, the dataset manager, the split coordinator, the tokenizing tasks) unpickle the datasets'
map function, and a tokenizer object inside it would make each of them import transformers and rebuild
the tokenizer before doing anything. `TokenizerOf(model_cfg)` carries the
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
    return _tokenizer(model_cfg, _template_text(model_cfg.chat_template))


def _template_text(path: str | None) -> str | None:
    return Path(os.path.expanduser(path)).read_text() if path else None


def chat_template_text(model_cfg) -> str | None:
    """The chat template a recipe's tokenizer renders with (`tokenizer_for`), read from files without loading
    the tokenizer: model.chat_template, the tiny tokenizer's, or the tokenizer's own from a local folder or
    from this machine's copy of the hub's files. None where those files are not here (not downloaded yet)."""
    import json

    if model_cfg.chat_template:
        return _template_text(model_cfg.chat_template)
    if model_cfg.local_tiny:
        return CHATML_TEMPLATE
    source, revision = _source(model_cfg)
    jinja, config = (_tokenizer_file(source, revision, f) for f in ("chat_template.jinja", "tokenizer_config.json"))
    if jinja is not None:
        return Path(jinja).read_text()
    if config is None:
        return None
    template = json.loads(Path(config).read_text()).get("chat_template")
    if isinstance(template, list):      # named templates: the tokenizer renders with "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template or CHATML_TEMPLATE     # no template of its own: tokenizer_for gives it ChatML


def _tokenizer_file(source: str, revision: str | None, name: str) -> str | None:
    """The path of a tokenizer file: in a local folder, or the hub's copy in this machine's cache."""
    folder = Path(os.path.expanduser(source))
    if folder.is_dir():
        return str(folder / name) if (folder / name).is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(source, name, revision=revision)
    except ValueError:          # not a hub repo's name either (the tokenizer's own load says so)
        return None
    return found if isinstance(found, str) else None


# the tokenizer class AutoTokenizer chose for a (source, revision), by module and name: set where a
# tokenizer was loaded through it (the driver), carried by `TokenizerOf.of`
_CHOSEN: dict[tuple[str, str | None], str] = {}


def _source(model_cfg) -> tuple[str, str | None]:
    """(where the tokenizer files are, at which revision)."""
    revision = model_cfg.revision if model_cfg.tokenizer in (None, model_cfg.name) else None
    return model_cfg.tokenizer or model_cfg.name, revision


def _tokenizer(model_cfg, template: str | None, chosen: str | None = None):
    if model_cfg.local_tiny:
        tok = local_tokenizer()
    elif chosen and (cls := _tokenizer_class(chosen)) is not None:
        # the class AutoTokenizer chose in the driver, loaded the way AutoTokenizer ends: its from_pretrained.
        # AutoTokenizer itself would first read the model config through transformers' configuration
        # code, which imports torch (slow, in each tokenizing process before its first row)
        source, revision = _source(model_cfg)
        tok = cls.from_pretrained(source, revision=revision)
    else:
        from transformers import AutoTokenizer

        source, revision = _source(model_cfg)
        tok = AutoTokenizer.from_pretrained(source, revision=revision,
                                            trust_remote_code=model_cfg.trust_remote_code)
        cls = type(tok)
        # transformers' own classes only: a class of the model's remote code is loaded through AutoTokenizer
        if cls.__module__.startswith("transformers.") and not model_cfg.trust_remote_code:
            _CHOSEN[(source, revision)] = f"{cls.__module__}.{cls.__qualname__}"
    if template:
        tok.chat_template = template
    elif not getattr(tok, "chat_template", None):
        tok.chat_template = CHATML_TEMPLATE
    if tok.pad_token is None:
        vocab = tok.get_vocab()
        tok.pad_token = "<|endoftext|>" if "<|endoftext|>" in vocab else tok.eos_token
    return tok


def _tokenizer_class(chosen: str):
    """The tokenizer class `chosen` ("module.Class") names, where it is one of transformers' own tokenizer
    classes in this process's transformers; None otherwise (AutoTokenizer decides again). A name from
    elsewhere is never imported: it comes from a file or from another process."""
    if not (isinstance(chosen, str) and chosen.startswith("transformers.")):
        return None
    import importlib

    module, _, name = chosen.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):       # a transformers where the class moved or went
        return None
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


@dataclasses.dataclass(frozen=True)
class TokenizerOf:
    """The tokenizer of a model's settings (a ModelConfig's tokenizer fields), loaded where it is used. The
    chat template file (`model.chat_template`) travels as its text, read where the recipe was checked: a
    tokenizing task may run on a node that does not have the file."""
    name: str
    tokenizer: str | None
    revision: str | None
    trust_remote_code: bool
    local_tiny: bool
    chat_template_text: str | None
    # "module.Class" of the tokenizer AutoTokenizer chose where the settings were taken, if it loaded one
    # there: the tokenizing processes then load that class without AutoTokenizer's model config (and torch)
    tokenizer_class: str | None = None

    @classmethod
    def of(cls, model_cfg) -> "TokenizerOf":
        chosen = None if model_cfg.local_tiny else _CHOSEN.get(_source(model_cfg))
        return cls(model_cfg.name, model_cfg.tokenizer, model_cfg.revision, bool(model_cfg.trust_remote_code),
                   bool(model_cfg.local_tiny), _template_text(model_cfg.chat_template), chosen)

    def load(self):
        """This process's copy (loaded on the first call; callers must not change it)."""
        return _loaded(self)


@functools.lru_cache(maxsize=4)
def _loaded(ref: TokenizerOf):
    return _tokenizer(ref, ref.chat_template_text, ref.tokenizer_class)


# ---------------------------------------------------------------- the class AutoTokenizer chose, remembered

MEMO_NAME = "tokenizer_classes.json"
_MEMO_FILES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_MEMO_ENTRIES = 64


def _identity(model_cfg) -> str:
    """What decides the class AutoTokenizer picks: transformers' version, the source and revision, and for a
    local folder the name, size and time of each of its tokenizer and config files (a changed folder, or
    another transformers, is loaded again)."""
    import importlib.metadata
    import json

    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = None
    source, revision = _source(model_cfg)
    folder = Path(os.path.expanduser(source))
    files = []
    if folder.is_dir():
        source = str(folder.resolve())
        for p in sorted(folder.iterdir()):
            if p.suffix in _MEMO_FILES and p.is_file():
                st = p.stat()
                files.append([p.name, st.st_size, st.st_mtime_ns])
    return json.dumps([transformers_version, source, revision, bool(model_cfg.trust_remote_code), files])


def _read_memo(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            memo = json.load(f)
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def load_once(model_cfg, memo_path: str) -> None:
    """Load the model's tokenizer here (`tokenizer_for`: a tokenizer that cannot load raises), unless an earlier
    run of this user's loaded it from the same files: then take the class AutoTokenizer chose then, kept in the
    memo at `memo_path`, as chosen here. Either way `TokenizerOf.of` carries the class afterwards.

    Loading a tokenizer through AutoTokenizer imports transformers' configuration code and torch, on the way
    to the first step wherever nothing hides it (under `ray job submit`). The files the class was chosen from
    are the same (names, sizes and times) and so is transformers' version, so it loaded then and is the class
    the tokenizing processes load now. A memo only saves time: a failure to write it is ignored."""
    if model_cfg.local_tiny:
        tokenizer_for(model_cfg)
        return
    path = os.path.expanduser(memo_path)
    memo, key, source = _read_memo(path), _identity(model_cfg), _source(model_cfg)
    chosen = memo.get(key)
    if isinstance(chosen, str) and chosen.startswith("transformers."):
        _CHOSEN[source] = chosen
        return
    tokenizer_for(model_cfg)
    chosen = _CHOSEN.get(source)
    if chosen is not None:         # a class of the model's remote code is not remembered
        memo.pop(key, None)
        memo[key] = chosen
        for old in list(memo)[:-_MEMO_ENTRIES]:     # the oldest go first
            del memo[old]
        _write_memo(path, memo)


def _write_memo(path: str, memo: dict) -> None:
    import json
    import tempfile

    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tokenizer_classes.")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(memo, f, indent=1)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        pass
