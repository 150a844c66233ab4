"""From a checkpoint to the Hugging Face folder MLflow logs: find it, or merge a LoRA adapter into its base.

Registration only reads the checkpoint: a merged model is written beside it (`<checkpoint>.merged_hf`),
under a temporary name first, so a crash never leaves a half folder that looks finished. A checkpoint on
object storage (s3://...) is read through `local_checkpoint`: only the files registration needs (the meta
file and hf/, or adapter/), streamed file by file into a temporary folder that MLflow logs from; the
DCP shards, trainer and train state are never fetched.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Iterator

from raytune_ft.env import public_uri, scrub
from raytune_ft.registry.base import CHAT_TASK, RegistrationError, logger


def _is_hf_folder(p: Path) -> bool:
    return (p / "config.json").is_file() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))


def _adapter_folder(p: Path) -> Path | None:
    for cand in (p / "adapter", p):
        if (cand / "adapter_config.json").is_file():
            return cand
    return None


META_FILE = "raytune_meta.json"


def _files_to_fetch(rel_paths: list[str]) -> set[str]:
    """Of a checkpoint's files, those registration reads: the meta file and the model folder only."""
    present = set(rel_paths)
    if "hf/config.json" in present:
        wanted = ("hf/", "adapter/")           # adapter/: a LoRA run's, merged in training and logged too
    elif "adapter/adapter_config.json" in present:
        wanted = ("adapter/", "base/")         # base/: the random base of a --local LoRA run
    else:
        wanted = ("",)                          # a plain Hugging Face folder: its top-level files
    return {r for r in present
            if r == META_FILE or any(r.startswith(w) and (w or "/" not in r) for w in wanted)}


@contextlib.contextmanager
def local_checkpoint(checkpoint_path: str | os.PathLike) -> Iterator[Path]:
    """The checkpoint as a local folder: itself, or for a URI a temporary copy of what registration reads."""
    from raytune_ft.storage import fs as storage
    if not storage.is_uri(str(checkpoint_path)) or str(checkpoint_path).startswith("file://"):
        yield Path(str(checkpoint_path).removeprefix("file://"))
        return
    st = storage.resolve(str(checkpoint_path))
    base = st.root.rstrip("/") + "/"
    rels = [i.path[len(base):] for i in storage.list_files(st.fs, st.root) if i.path.startswith(base)]
    if not rels:
        raise RegistrationError(f"checkpoint {checkpoint_path!s} does not exist or is empty")
    wanted = _files_to_fetch(rels)
    with tempfile.TemporaryDirectory(prefix="raytune_register_") as tmp:
        local = Path(tmp) / st.root.rstrip("/").rsplit("/", 1)[-1]
        logger.info("reading %d files of %s for registration", len(wanted), public_uri(str(checkpoint_path)))
        storage.download(st.fs, st.root, str(local), only=wanted.__contains__)
        yield local


def merged_folder_for(checkpoint_path: str | os.PathLike) -> Path:
    """Where the merged model of a LoRA checkpoint goes: a sibling of the checkpoint, never inside."""
    p = Path(checkpoint_path).resolve()
    return p.parent / f"{p.name}.merged_hf"


def resolve_hf_folder(checkpoint_path: str | os.PathLike, *, base_model: str | None = None) -> Path:
    """The Hugging Face folder to register for a checkpoint.

    `checkpoint/hf` (full fine-tune, or a LoRA run that merged already), a plain HF folder given
    directly, or, for a LoRA checkpoint (`checkpoint/adapter`), the adapter merged into its base
    model and written beside the checkpoint (reused if a previous attempt completed it).
    """
    p = Path(checkpoint_path)
    if not p.is_dir():
        raise RegistrationError(f"checkpoint {checkpoint_path!s} is not a directory")
    if _is_hf_folder(p / "hf"):
        return p / "hf"
    if _is_hf_folder(p):
        return p
    adapter = _adapter_folder(p)
    if adapter is not None:
        out = merged_folder_for(p)
        if _is_hf_folder(out) and (out / ".merge_complete").is_file():
            return out
        return merge_lora(adapter, out, base_model=base_model)
    raise RegistrationError(
        f"checkpoint {checkpoint_path!s} holds neither a Hugging Face folder (hf/ with config.json "
        "and *.safetensors) nor a PEFT adapter (adapter/ with adapter_config.json)")


def merge_lora(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
               base_model: str | None = None) -> Path:
    """Merge a PEFT LoRA adapter into its base model and save a safetensors HF folder at `out_dir`.

    The base is `base_model`, else the checkpoint's base/ (the random base of a --local run), else the
    adapter's `base_model_name_or_path` at its `revision` (a local folder or a hub id), loaded as the
    base's own class (a Qwen3_5ForConditionalGeneration stays one: the merged folder is in the base's
    layout). The folder is written under a temporary name and renamed, so a crash leaves no half folder
    that a later attempt would take for a finished one. The adapter's files are only read.
    """
    from peft import PeftConfig, PeftModel
    from transformers import AutoTokenizer

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    peft_cfg = PeftConfig.from_pretrained(str(adapter_dir))
    beside = adapter_dir.parent / "base"
    base_ref = base_model or (str(beside) if _is_hf_folder(beside) else peft_cfg.base_model_name_or_path)
    if not base_ref:
        raise RegistrationError(f"{adapter_dir}/adapter_config.json names no base_model_name_or_path")
    revision = None if base_model or Path(base_ref).is_dir() else peft_cfg.revision
    logger.info("merging LoRA adapter %s into base %s", adapter_dir, base_ref)
    model = _base_class(base_ref, revision).from_pretrained(base_ref, dtype="auto", revision=revision)
    model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    # the adapter folder carries the tokenizer the run trained with (chat template included)
    tok_src = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_ref
    tokenizer = AutoTokenizer.from_pretrained(str(tok_src))

    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(str(tmp), max_shard_size="5GB", safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / ".merge_complete").write_text(json.dumps({"adapter": str(adapter_dir), "base": base_ref}))
        if out_dir.exists():  # an unfinished earlier attempt: replace it
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    del model
    return out_dir


def _base_class(base_ref: str, revision: str | None):
    """The class the base checkpoint names (its config's architectures), else AutoModelForCausalLM."""
    import transformers
    from transformers import AutoConfig

    archs = getattr(AutoConfig.from_pretrained(base_ref, revision=revision), "architectures", None) or []
    return (getattr(transformers, archs[0], None) if archs else None) or transformers.AutoModelForCausalLM


def count_parameters(hf_dir: str | os.PathLike) -> int:
    """Number of parameters in the folder's *.safetensors files, read from their headers only."""
    total = 0
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            n = 1
            for d in info["shape"]:
                n *= d
            total += n
    return total


def hf_config(hf_dir: Path) -> dict[str, Any]:
    """The folder's config.json as a dict."""
    with open(hf_dir / "config.json") as f:
        return json.load(f)


ADAPTER_ARTIFACT = "lora_adapter"    # a LoRA run's PEFT adapter, logged in the model's run beside the model


def version_tags(meta: dict[str, Any], ckpt: Path) -> dict[str, str]:
    """The registered version's tags: the base model and its revision it was trained from; for a LoRA run,
    that the version is the merged model and where its PEFT adapter is (an artifact of the same run)."""
    tags = {}
    if (ckpt / "base" / "config.json").is_file():     # a --local tiny or random base, kept in the checkpoint
        tags = {"raytune.base_model": "base/ of the checkpoint (random weights)", "raytune.base_model_revision": "none"}
    elif meta.get("model_name"):
        tags = {"raytune.base_model": str(meta["model_name"]),
                "raytune.base_model_revision": str(meta.get("revision") or "unpinned")}
    if (ckpt / "adapter" / "adapter_config.json").is_file():
        tags |= {"raytune.lora": "merged", "raytune.lora_adapter_artifact": ADAPTER_ARTIFACT}
    return tags


def build_metadata(hf_dir: Path, meta: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """The MLmodel metadata: task, pretrained name, family, parameter count, the run's facts."""
    cfg = hf_config(hf_dir)
    md: dict[str, Any] = {
        "task": CHAT_TASK,
        "pretrained_model_name": meta.get("model_name") or cfg.get("_name_or_path") or "unknown",
        "model_family": meta.get("family") or cfg.get("model_type") or "unknown",
        "parameter_count": count_parameters(hf_dir),
        "architecture": (cfg.get("architectures") or ["unknown"])[0],
    }
    for key in ("job", "run_name", "step", "final_loss", "lora"):
        if key in meta:
            md[f"raytune_{key}"] = meta[key]
    tags = version_tags(meta, hf_dir.parent)      # what it was trained from, as the version's tags say
    if "raytune.base_model" in tags:
        md["base_model"], md["base_model_revision"] = tags["raytune.base_model"], tags["raytune.base_model_revision"]
    md.update(scrub(extra or {}))
    md["task"] = CHAT_TASK  # MLflow checks it against the flavor's task: the caller cannot change it
    return scrub(md)
