"""Tiny and real-shaped model configs, and the project's own small tokenizer.

`--local` runs build the same architecture family as the real recipe at a tiny size from a config, and
tokenize with a small byte-level BPE that this project owns (generated here, shipped under
raytune_ft/assets/tiny_tokenizer/): no hub, no ../shared at run time. It carries Qwen's special tokens
and a ChatML template in Qwen's style, with `{% generation %}` markers so assistant-only loss masks come
from `apply_chat_template(..., return_assistant_tokens_mask=True)`.

`real_config(name)` gives the exact shapes of the three recipe models (random weights), for parameter
counts, FLOP figures and GPU benchmarks; `num_hidden_layers=` cuts them down.
"""
from __future__ import annotations

import functools
import os
import random
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"

# Qwen's special tokens, in Qwen's order (they sit at the end of the vocabulary, as in Qwen).
PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
THINK_TOKENS = ["<think>", "</think>"]      # added tokens, not "special": decode keeps them, as in Qwen3

TINY_VOCAB_SIZE = 2048                      # BPE vocabulary before the added tokens

# ChatML in the Qwen3 style, written for this project. The assistant's content and its <|im_end|> sit
# inside {% generation %} so transformers can return the assistant-token mask; the "\n" after <|im_end|>
# is template scaffolding and stays outside. `reasoning_content` renders as a <think> block;
# `enable_thinking=false` with a generation prompt pre-fills an empty think block, like Qwen3. It reads the
# 27B template's kwargs: `reasoning_effort` (xhigh, medium or low, else an error) adds a line of system text
# unless `enable_thinking=false`; given no effort, no line, so the default rendering stays as it was.
CHATML_TEMPLATE = (
    "{%- set effort = '' %}"
    "{%- if reasoning_effort is defined and not (enable_thinking is defined and enable_thinking is false) %}"
    "{%- if reasoning_effort not in ('xhigh', 'medium', 'low') %}"
    "{{- raise_exception('reasoning_effort ' ~ reasoning_effort ~ ': expected xhigh, medium or low') }}"
    "{%- endif %}"
    "{%- set effort = 'Reasoning effort: ' ~ reasoning_effort ~ '.' %}"
    "{%- endif %}"
    "{%- if effort and not (messages and messages[0]['role'] == 'system') %}"
    "{{- '<|im_start|>system\\n' + effort + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and effort %}"
    "{{- '<|im_start|>system\\n' + effort + '\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.get('reasoning_content') %}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message['content'] + '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# ----------------------------------------------------------------- tokenizer

_WORDS = (
    "the of and to a in is it you that he was for on are with as I his they be at one have this from or had "
    "by hot word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two has "
    "look more day could go come did number sound no most people my over know water than call first who may "
    "down side been now find any new work part take get place made live where after back little only round man "
    "year came show every good me give our under name very through just form sentence great think say help low "
    "line differ turn cause much mean before move right boy old too same tell does set three want air well also "
    "play small end put home read hand port large spell add even land here must big high such follow act why ask "
    "men change went light kind off need house picture try us again animal point mother world near build self "
    "earth father head stand own page should country found answer school grow study still learn plant cover food "
    "sun four between state keep eye never last let thought city tree cross farm hard start might story saw far "
    "sea draw left late run while press close night real life few north open seem together next white children "
    "begin got walk example ease paper group always music those both mark often letter until mile river car feet "
    "care second book carry took science eat room friend began idea fish mountain stop once base hear horse cut "
    "sure watch color face wood main enough plain girl usual young ready above ever red list though feel talk "
    "bird soon body dog family direct pose leave song measure door product black short numeral class wind "
    "question happen complete ship area half rock order fire south problem piece told knew pass since top whole "
    "king space heard best hour better true during hundred five remember step early hold west ground interest "
    "reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay against "
    "pattern slow center love person money serve appear road map rain rule govern pull cold notice voice unit "
    "power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest "
    "correct able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean "
    "warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course stay "
    "wheel full force blue object decide surface deep moon island foot system busy test record boat common gold "
    "possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire "
    "bring yes distant fill east paint language among assistant user system model train data function code "
    "python error value list string return import class def print loop file memory token please thanks sorry "
    "explain describe summary answer question step reason because therefore however example result"
).split()
_PUNCT = [".", ".", ".", "?", "!", ",", ";", ":"]


def _training_corpus(n_lines: int = 6000, seed: int = 1234) -> list[str]:
    """Deterministic English-ish text, digits, code-ish lines and chat scaffolding to train the BPE on."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 6
        if kind == 4:
            a, b = rng.randint(0, 9999), rng.randint(0, 999)
            lines.append(f"{a} + {b} = {a + b}. The year {rng.randint(1800, 2030)} had {rng.randint(1, 365)} days.")
            continue
        if kind == 5:
            name = rng.choice(_WORDS)
            lines.append(f"def {name}_{rng.randint(0, 9)}(x):\n    return x * {rng.randint(2, 9)}  # {rng.choice(_WORDS)}")
            continue
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT)
        if kind == 3:
            role = rng.choice(["user", "assistant", "system"])
            sentence = f"{role}\n{sentence}\n"
        lines.append(sentence)
    return lines


def build_tokenizer_files(out_dir: str | os.PathLike, vocab_size: int = TINY_VOCAB_SIZE) -> Path:
    """Train the project's tiny byte-level BPE and write tokenizer.json + tokenizer_config.json to out_dir.

    This is the script that generated raytune_ft/assets/tiny_tokenizer/ (run
    `python -m raytune_ft.models.tiny OUT_DIR` to regenerate); it is deterministic for a given
    `tokenizers` version.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_training_corpus(), trainer=trainer)

    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    fast.add_tokens(THINK_TOKENS, special_tokens=False)
    fast.pad_token = PAD_TOKEN
    fast.eos_token = EOS_TOKEN
    fast.bos_token = None
    fast.chat_template = CHATML_TEMPLATE
    fast.model_max_length = 1 << 20
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


@functools.lru_cache(maxsize=1)
def _load_local_tokenizer(path: str):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(path)
    # Whatever the saved config says, these are the contract.
    tok.pad_token, tok.eos_token = PAD_TOKEN, EOS_TOKEN
    tok.chat_template = CHATML_TEMPLATE
    return tok


def local_tokenizer():
    """The project's tiny tokenizer (a transformers PreTrainedTokenizerFast), deterministic, offline.

    Loaded from raytune_ft/assets/tiny_tokenizer/; if that folder is missing (a stripped install) it is
    generated once into ~/.cache/raytune_ft/tiny_tokenizer. Returns a fresh copy each call so callers
    may mutate it.
    """
    import copy

    path = ASSETS
    if not (path / "tokenizer.json").is_file():
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "raytune_ft" / "tiny_tokenizer"
        if not (cache / "tokenizer.json").is_file():
            build_tokenizer_files(cache)
        path = cache
    return copy.deepcopy(_load_local_tokenizer(str(path)))


# ----------------------------------------------------------------- configs

def _qwen3_5_layer_types(n_layers: int) -> list[str]:
    """Qwen3.5's pattern: every 4th layer full attention, the rest gated-delta-net."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)]


def tiny_config(family: str, vocab_size: int, **overrides: Any):
    """A tiny config of `family` (qwen3_5 | qwen3 | qwen2) for CPU runs and tests.

    qwen3_5: 4 layers, 3 gated-delta-net : 1 full attention, hidden 64, GQA 4/2 heads of 16, gated-delta-net
    2 key heads / 4 value heads of 16 (so the grouped value heads path runs), conv kernel 4.
    `overrides` are passed to the config class (e.g. num_hidden_layers=8: layer_types follow).
    """
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, use_cache=False, tie_word_embeddings=False, pad_token_id=None,
    )
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        kw = dict(common, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
        kw.update(overrides)
        kw.setdefault("layer_types", _qwen3_5_layer_types(kw["num_hidden_layers"]))
        return Qwen3_5TextConfig(**kw)
    if family == "qwen3":
        from transformers import Qwen3Config

        kw = dict(common, head_dim=16, rope_theta=1_000_000)
        kw.update(overrides)
        return Qwen3Config(**kw)
    if family == "qwen2":
        from transformers import Qwen2Config

        kw = dict(common, tie_word_embeddings=True, rope_theta=1_000_000)
        kw.update(overrides)
        return Qwen2Config(**kw)
    raise ValueError(f"model.family: {family!r} is not one of 'qwen3_5', 'qwen3', 'qwen2'")


REAL_MODELS = ("qwen3.8-27b", "qwen3-4b", "qwen2-0.5b")


def real_config(name: str, **overrides: Any):
    """The text-model config of a recipe model at its real shape (weights are not part of it).

    name: "qwen3.8-27b" (Qwen3.5 architecture, the language tower of Qwen/Qwen3.8-27B), "qwen3-4b",
    "qwen2-0.5b". `num_hidden_layers=N` cuts the model to N layers (Qwen3.5 keeps its 3:1 pattern).
    """
    key = name.lower().replace("_", "-").split("/")[-1]
    if key in ("qwen3.8-27b", "qwen3.5-27b", "qwen35-27b"):
        from transformers import Qwen3_5TextConfig

        kw: dict[str, Any] = dict(
            vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
            num_attention_heads=24, num_key_value_heads=4, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, tie_word_embeddings=False,
            max_position_embeddings=262144, rms_norm_eps=1e-6, use_cache=False,
            # Qwen3.5's published text rope: theta 1e7 on a quarter of each head, interleaved M-RoPE.
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})
        kw.update(overrides)
        kw.setdefault("layer_types", _qwen3_5_layer_types(kw["num_hidden_layers"]))
        return Qwen3_5TextConfig(**kw)
    if key in ("qwen3-4b",):
        from transformers import Qwen3Config

        kw = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1_000_000, rms_norm_eps=1e-6, use_cache=False)
        kw.update(overrides)
        return Qwen3Config(**kw)
    if key in ("qwen2-0.5b",):
        from transformers import Qwen2Config

        kw = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=131072, rope_theta=1_000_000, rms_norm_eps=1e-6, use_cache=False)
        kw.update(overrides)
        return Qwen2Config(**kw)
    raise ValueError(f"unknown real model {name!r} (known: {', '.join(REAL_MODELS)})")


if __name__ == "__main__":  # regenerate the shipped tokenizer: python -m raytune_ft.models.tiny OUT_DIR
    import sys

    print(build_tokenizer_files(sys.argv[1] if len(sys.argv) > 1 else ASSETS))
