"""The base checkpoint's own layout, for exports that load where the base loads.

The loop trains the text tower of a Qwen3.5 checkpoint as a Qwen3_5ForCausalLM (models/build.py). When the
base is a Qwen3_5ForConditionalGeneration (the published 27B: the text tower under
`model.language_model.*`, a vision tower under `model.visual.*`, MTP weights under `mtp.*`), an export in
the CausalLM's own names is a different model from the base's: serving stacks that load the base refuse it.
`BaseLayout` writes the trained tensors under the base's key names, copies every tensor the run did not
train (vision tower, MTP) from the base's files unchanged, and writes the base's config and processor
files, so `from_pretrained` of the base's class loads the export. A text-only base keeps the CausalLM's
names (`BaseLayout()`), and so do random and tiny models, which have no base files.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

# files of a vision-language checkpoint besides weights, config and tokenizer: what its processor reads
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


@dataclass
class BaseLayout:
    """How exports name and complete the trained text tower. `folder`: a conditional-generation base's
    checkpoint folder; None: a text-only base (the CausalLM's own names, nothing copied)."""

    folder: Path | None = None
    base_keys: dict = field(default_factory=dict)     # tensor name -> its safetensors file in `folder`

    @property
    def conditional(self) -> bool:
        return self.folder is not None

    def name(self, text_name: str) -> str:
        """The base's key for a parameter of the trained CausalLM (`model.layers.0...`, `lm_head.weight`)."""
        if not self.conditional:
            return text_name
        from raytune_ft.models.build import checkpoint_name

        found = checkpoint_name(text_name, self.base_keys)
        if found is not None:
            return found
        return "model.language_model." + text_name[len("model."):] if text_name.startswith("model.") else text_name

    def module_path(self, text_module: str) -> str:
        """The base's path of a module of the trained CausalLM (adapters name their targets by it)."""
        if not self.conditional:
            return text_module
        return self.name(text_module + ".weight")[:-len(".weight")]

    def untouched(self, written: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base's tensors the export did not write (vision tower, MTP), read one at a time."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for key, f in self.base_keys.items():
            if key not in written:
                by_file.setdefault(Path(f), []).append(key)
        for f, keys in sorted(by_file.items()):
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for key in keys:
                    yield key, fh.get_tensor(key)

    def write_config(self, out_dir: str, hf_config, dtype: torch.dtype, arch: str) -> None:
        """config.json (the base's own, for a conditional base, with its text part as trained) and the
        base's processor files."""
        if not self.conditional:
            cfg = hf_config.__class__.from_dict(hf_config.to_dict())
            cfg.dtype, cfg.use_cache, cfg.architectures = dtype, True, [arch]
            cfg.save_pretrained(out_dir)
            return
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(self.folder))
        cfg.dtype = dtype
        cfg.text_config.dtype = dtype
        cfg.text_config.use_cache = True
        cfg.save_pretrained(out_dir)
        for name in PROCESSOR_FILES:
            if (self.folder / name).is_file():
                shutil.copy2(self.folder / name, Path(out_dir) / name)

    @property
    def architecture(self) -> str | None:
        """The base's model class (None for a text-only base: the trained CausalLM's)."""
        if not self.conditional:
            return None
        return (json.loads((self.folder / "config.json").read_text()).get("architectures") or [None])[0]


def is_conditional_checkpoint(folder: Path) -> bool:
    """Whether a checkpoint folder holds a vision-language model whose text tower we train alone."""
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return False
    cfg = json.loads(cfg_file.read_text())
    return "text_config" in cfg and "vision_config" in cfg


def base_layout(model_cfg) -> BaseLayout:
    """The layout of the recipe model's base checkpoint: conditional for a vision-language checkpoint, else
    text-only (tiny and random-init models have no base files to follow)."""
    if model_cfg.local_tiny or getattr(model_cfg, "init", "pretrained") == "random":
        return BaseLayout()
    from raytune_ft.models.build import _checkpoint_keys, checkpoint_dir

    folder = checkpoint_dir(model_cfg)
    if not is_conditional_checkpoint(folder):
        return BaseLayout()
    return BaseLayout(folder=folder, base_keys={k: str(v) for k, v in _checkpoint_keys(folder).items()})
