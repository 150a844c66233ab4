"""Build the model and tokenizer a recipe names: tiny from a config, or pretrained from a checkpoint.

Pretrained checkpoints are read with our own safetensors loader rather than `from_pretrained`, for two
reasons: the Qwen3.8-27B checkpoint is a vision-language model (Qwen3_5ForConditionalGeneration) whose
text tower sits under `model.language_model.*` and we train only that tower as a Qwen3_5ForCausalLM;
and under FSDP2 each rank must fill only its own shard. The flow for FSDP2:

    model = load_causal_lm(cfg, device="meta")              # no memory, packing enabled
    for layer in decoder_layers(model): fully_shard(layer)  # then fully_shard(model)
    model.to_empty(device="cuda")
    load_pretrained_weights_sharded(model, cfg)              # each rank reads only its rows (mmap)

`materialize_model(model, cfg, device)` does the last two steps for pretrained and tiny models alike (a
tiny model gets the same seeded random weights on every rank and at every world size).
"""
from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from raytune_ft.models.attention import ATTN_NAME
from raytune_ft.models.gated_delta import base_model, enable_packing, import_fla_ops_only
from raytune_ft.models.tiny import local_tokenizer, real_config, tiny_config
from raytune_ft.models.tokenizer import tokenizer_for  # noqa: F401 - its home before tokenizer.py

log = logging.getLogger(__name__)

# module wrappers whose parameters are the wrapped module's (base_layer.: a LoRA-wrapped linear's base weight)
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "base_layer.")
_ADAPTER_PARTS = (".lora_A.", ".lora_B.")   # LoRA's own weights: drawn by train/lora.py, never in a checkpoint


# ----------------------------------------------------------------- configs and checkpoints

def checkpoint_dir(model_cfg) -> Path:
    """A local folder holding the checkpoint: model_cfg.name if it is a folder, else a hub snapshot at
    model_cfg.revision (config, tokenizer and safetensors files only)."""
    local = Path(os.path.expanduser(model_cfg.name))
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_cfg.name, revision=model_cfg.revision,
                                  allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))


def text_config_for(model_cfg):
    """The text model's config for a pretrained recipe model. A vision-language Qwen3.5 checkpoint yields
    its `text_config`, to be built as Qwen3_5ForCausalLM. With `init="random"` and a name that is
    neither a local folder nor reachable, the project's copy of a known recipe model's config is used
    (`tiny.real_config`), so random-weight runs at the real shape need no hub."""
    from transformers import AutoConfig

    if getattr(model_cfg, "init", "pretrained") == "random":
        local = Path(os.path.expanduser(model_cfg.name))
        if (local / "config.json").is_file():
            cfg = AutoConfig.from_pretrained(str(local), trust_remote_code=model_cfg.trust_remote_code)
        else:
            try:
                cfg = real_config(model_cfg.name)
            except ValueError:  # not one of ours: ask the hub for its config (no weights are read)
                cfg = AutoConfig.from_pretrained(model_cfg.name, revision=model_cfg.revision,
                                                 trust_remote_code=model_cfg.trust_remote_code)
    else:
        cfg = AutoConfig.from_pretrained(str(checkpoint_dir(model_cfg)),
                                         trust_remote_code=model_cfg.trust_remote_code)
    text = getattr(cfg, "text_config", None)
    if text is not None and hasattr(text, "layer_types"):   # Qwen3.5 VL: train the language tower
        if getattr(cfg, "tie_word_embeddings", None) is not None:
            text.tie_word_embeddings = cfg.tie_word_embeddings
        cfg = text
    if model_cfg.max_position_embeddings is not None:
        cfg.max_position_embeddings = model_cfg.max_position_embeddings
    cfg.use_cache = False
    return cfg


def _checkpoint_keys(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / v for k, v in weight_map.items()}
    from safetensors import safe_open

    keys: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                keys[k] = f
    if not keys:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    return keys


def _clean_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def checkpoint_name(param_name: str, available: Iterable[str] | dict) -> str | None:
    """The checkpoint tensor for one of our CausalLM's parameters: the same name, or the VL layout
    (`model.language_model.*`, `language_model.model.*`)."""
    name = _clean_name(param_name)
    candidates = [name]
    if name.startswith("model."):
        rest = name[len("model."):]
        candidates += [f"model.language_model.{rest}", f"language_model.model.{rest}"]
    elif name.startswith("lm_head."):
        candidates += [f"language_model.{name}"]
    for c in candidates:
        if c in available:
            return c
    return None


# ----------------------------------------------------------------- build

def load_causal_lm(model_cfg, *, tokenizer_vocab_size: int | None = None, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32, attn_implementation: str | None = ATTN_NAME,
                   seed: int = 0) -> torch.nn.Module:
    """Build the recipe's causal LM (packing enabled: varlen full attention, boundary-correct
    gated-delta-net layers).

    local_tiny: tiny_config(family) with the tokenizer's vocabulary, seeded random weights.
    Otherwise the checkpoint at model_cfg.name/revision (a Qwen3.5 VL checkpoint loads as its text
    CausalLM). device="meta": the skeleton only, for FSDP2; fill it with `materialize_model`."""
    device = torch.device(device)
    if model_cfg.local_tiny:
        vocab = tokenizer_vocab_size or len(local_tokenizer())
        over = {}
        if model_cfg.max_position_embeddings is not None:
            over["max_position_embeddings"] = model_cfg.max_position_embeddings
        config = tiny_config(model_cfg.family, vocab, **over)
    else:
        config = text_config_for(model_cfg)
        if tokenizer_vocab_size and tokenizer_vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer_vocab_size} tokens but {model_cfg.name} has an "
                             f"embedding of {config.vocab_size}")
    model = _from_config(config, device if device.type == "meta" else torch.device("meta"), dtype,
                         model_cfg.trust_remote_code)
    enable_packing(model, attn_implementation)
    if device.type != "meta":
        materialize_model(model, model_cfg, device, seed=seed)
    return model


def _from_config(config, device: torch.device, dtype: torch.dtype, trust_remote_code: bool):
    if torch.cuda.is_available():    # transformers' Qwen3.5 code imports fla with itself there
        import_fla_ops_only()
    from transformers import AutoModelForCausalLM

    config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                 attn_implementation="sdpa")
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers, in order: the units to wrap with fully_shard / activation checkpointing."""
    return list(base_model(model).layers)


def _reset_rotary_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Recompute non-persistent rotary buffers (inv_freq), which to_empty() leaves uninitialised."""
    for mod in model.modules():
        if hasattr(mod, "inv_freq") and hasattr(mod, "config"):
            with torch.device("cpu"):
                fresh = type(mod)(config=mod.config)
            for name, buf in fresh.named_buffers(recurse=False):
                if hasattr(mod, name):
                    setattr(mod, name, buf.to(device))


def _local_view(param: torch.Tensor):
    """(tensor to write into, global offsets per dim, local shape) for a plain tensor or a DTensor shard."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        DTensor = ()
    if isinstance(param, DTensor):
        from raytune_ft import compat
        shape, offset = compat.TORCH_DTENSOR_OFFSETS.load()(param.shape, param.device_mesh, param.placements)
        return param.to_local(), tuple(offset), tuple(shape)
    return param, (0,) * param.dim(), tuple(param.shape)


def _fill(model: torch.nn.Module, get_slice: Callable[[str, tuple[slice, ...]], torch.Tensor],
          shape_of: Callable[[str], tuple[int, ...]], available, strict: bool = True) -> dict[str, list[str]]:
    """Copy every parameter / persistent buffer (or this rank's shard of it) from a source."""
    seen: set[int] = set()
    missing, loaded, mismatched = [], [], []
    tensors = list(model.named_parameters(remove_duplicate=False))
    from raytune_ft import compat

    non_persistent = {f"{n}.{b}" if n else b for n, m in model.named_modules()
                      for b in compat.TORCH_NON_PERSISTENT_BUFFERS.read(m)}
    tensors += [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n not in non_persistent]
    with torch.no_grad():
        for name, tensor in tensors:
            if id(tensor) in seen or any(p in name for p in _ADAPTER_PARTS):   # tied: one tensor, filled once
                continue
            key = checkpoint_name(name, available)
            if key is None:
                missing.append(name)
                continue
            if tuple(shape_of(key)) != tuple(tensor.shape):
                mismatched.append(f"{name} {tuple(tensor.shape)} vs checkpoint {key} {tuple(shape_of(key))}")
                continue
            local, offset, shape = _local_view(tensor)
            if local.numel() == 0:
                seen.add(id(tensor))
                continue
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            local.copy_(get_slice(key, index).to(dtype=local.dtype))
            seen.add(id(tensor))
            loaded.append(name)
    # A tied lm_head is the embedding; a checkpoint need not store it.
    tied_ok = {n for n in missing if n.endswith("lm_head.weight")
               and getattr(model.config, "tie_word_embeddings", False)}
    missing = [n for n in missing if n not in tied_ok]
    if mismatched:
        raise ValueError(f"checkpoint does not fit the model: {len(mismatched)} tensors differ in shape, "
                         f"e.g. {mismatched[:3]}")
    if missing and strict:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[:5]}")
    return {"loaded": loaded, "missing": missing}


def load_pretrained_weights_sharded(model: torch.nn.Module, model_cfg, *, strict: bool = True) -> dict:
    """Fill a materialised (to_empty'd) model — plain or FSDP2-sharded — from the recipe's safetensors.

    Each rank reads only the rows of each tensor it owns (safetensors get_slice over a memory map), so no
    rank holds the whole model. Vision tower and MTP weights of a VL checkpoint are never read."""
    from safetensors import safe_open

    folder = checkpoint_dir(model_cfg)
    key_files = _checkpoint_keys(folder)
    handles: dict[Path, Any] = {}

    def get_slice(key: str, index: tuple[slice, ...]) -> torch.Tensor:
        f = key_files[key]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt", device="cpu")
        sl = handles[f].get_slice(key)
        return sl[index] if index else sl[:]

    def shape_of(key: str) -> tuple[int, ...]:
        f = key_files[key]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return tuple(handles[f].get_slice(key).get_shape())

    report = _fill(model, get_slice, shape_of, key_files, strict=strict)
    device = next(model.parameters()).device
    _finish_filled(model, device)
    log.info("raytune_ft: loaded %d tensors from %s", len(report["loaded"]), folder)
    return report


def _finish_filled(model: torch.nn.Module, device: torch.device) -> None:
    """After filling the weights: recompute the rotary buffers and tie lm_head to the embedding (plain
    models; FSDP2 keeps tied weights as one parameter)."""
    _reset_rotary_buffers(model, device)
    if hasattr(model, "tie_weights") and not _is_sharded(model):
        model.tie_weights()


def _is_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def _seeded_reference_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The full state of a freshly initialised copy of `model`'s architecture on CPU, with `seed`."""
    from transformers import AutoModelForCausalLM

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        with torch.device("cpu"):
            # a copy: from_config writes the attention implementation into the config it is given
            ref = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=torch.float32,
                                                   attn_implementation="sdpa")
    finally:
        torch.random.set_rng_state(state)
    return ref.state_dict()


def materialize_model(model: torch.nn.Module, model_cfg, device: str | torch.device, *, seed: int = 0) -> torch.nn.Module:
    """Allocate a meta (possibly FSDP2-sharded) model on `device` and fill it: pretrained weights; for
    local_tiny the seeded random init (identical on every rank and at every world size); for
    init="random" transformers' own init of each module, drawn on each rank's shard (`random_init_`)."""
    device = torch.device(device)
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device=device)
    if not model_cfg.local_tiny and getattr(model_cfg, "init", "pretrained") == "random":
        random_init_(model, seed=seed)
    elif model_cfg.local_tiny:
        ref = _seeded_reference_state(model, seed)

        def get_slice(key, index):
            return ref[key][index] if index else ref[key]

        _fill(model, get_slice, lambda key: tuple(ref[key].shape), ref)
        _finish_filled(model, device)
    else:
        load_pretrained_weights_sharded(model, model_cfg)
    return model


_WHOLE_INIT_NUMEL = 1 << 22


def random_init_(model: torch.nn.Module, *, seed: int = 0) -> torch.nn.Module:
    """transformers' random init of a materialised model, in place, plain or FSDP2-sharded.

    Each module's `_init_weights` runs on local views of its (sharded) parameters: a DTensor shard is
    swapped for its local tensor while the module is initialised, so every rank draws only its own rows
    and no rank ever holds a full layer. Row-sharding keeps fan-in (dims 1+) intact, so shape-dependent
    inits (Kaiming for convolutions) are those of the full tensor. Shards draw from `seed + rank`: the
    weights are random either way, and no two ranks repeat the same rows."""
    from torch.distributed.tensor import DTensor

    from raytune_ft import compat

    init_fn = compat.TRANSFORMERS_INIT_WEIGHTS.read(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    device = next(model.parameters()).device
    state = torch.random.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    torch.manual_seed(seed + (rank if _is_sharded(model) else 0))
    try:
        with torch.no_grad():
            for module in model.modules():
                swapped: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
                for kind in ("_parameters", "_buffers"):
                    table = getattr(module, kind)
                    for name, t in list(table.items()):
                        if not isinstance(t, DTensor):
                            continue
                        # small tensors (norms, A_log, dt_bias, biases) are drawn whole and sliced: some
                        # inits size them from the module (num_v_heads), not from the tensor
                        whole = torch.empty(t.shape, dtype=t.dtype, device=device) \
                            if t.numel() <= _WHOLE_INIT_NUMEL else None
                        swapped[(kind, name)] = (t, whole)
                        view = whole if whole is not None else t.to_local()
                        table[name] = torch.nn.Parameter(view, requires_grad=False) \
                            if kind == "_parameters" else view
                try:
                    init_fn(module)
                finally:
                    for (kind, name), (t, whole) in swapped.items():
                        getattr(module, kind)[name] = t
                        if whole is not None:
                            local, offset, shape = _local_view(t)
                            if local.numel():
                                local.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
    finally:
        torch.random.set_rng_state(state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
    _finish_filled(model, device)
    return model
