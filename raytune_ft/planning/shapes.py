"""The dimensions of a Qwen-family decoder that memory and FLOPs depend on, for the plan.

`model_shape(recipe)` reads them from the real config (the tiny one with `model.local_tiny`, a local
folder's config.json, or models/tiny.py's real configs) and falls back to a table of known shapes when
transformers' config for the model is not importable. Parameter counts are derived from the module
definitions of transformers' Qwen2 / Qwen3 / Qwen3.5 layers (tests/planning/test_plan.py checks them against
instantiated models).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from raytune_ft.planning import hardware
from raytune_ft.recipe.recipe import Recipe


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Qwen-family decoder that memory and FLOPs depend on."""

    family: str                      # qwen3_5 | qwen3 | qwen2
    vocab: int
    hidden: int
    intermediate: int
    layer_types: tuple[str, ...]     # "full_attention" | "linear_attention" (gated-delta-net) per layer
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    attention_bias: bool = False     # bias on q/k/v/o (qwen3, qwen3_5 when set); qwen2 always has q/k/v bias
    lin_k_heads: int = 0             # gated-delta-net (qwen3_5 only)
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    conv_kernel: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def n_full_attention(self) -> int:
        return self.layer_types.count("full_attention")

    @property
    def n_linear_attention(self) -> int:
        return self.layer_types.count("linear_attention")

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelShape":
        """From a transformers config of Qwen2, Qwen3 or Qwen3.5 (text)."""
        mt = str(getattr(cfg, "model_type", ""))
        family = "qwen3_5" if mt.startswith("qwen3_5") else ("qwen3" if mt.startswith("qwen3") else "qwen2")
        n = cfg.num_hidden_layers
        types = tuple(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kw: dict[str, Any] = {}
        if family == "qwen3_5":
            kw = dict(lin_k_heads=cfg.linear_num_key_heads, lin_v_heads=cfg.linear_num_value_heads,
                      lin_k_dim=cfg.linear_key_head_dim, lin_v_dim=cfg.linear_value_head_dim,
                      conv_kernel=cfg.linear_conv_kernel_dim)
        return cls(family=family, vocab=cfg.vocab_size, hidden=cfg.hidden_size,
                   intermediate=cfg.intermediate_size, layer_types=types, heads=cfg.num_attention_heads,
                   kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                   tied=bool(getattr(cfg, "tie_word_embeddings", False)),
                   attention_bias=bool(getattr(cfg, "attention_bias", False)), **kw)

    # ---- parameters, from the module definitions of transformers' Qwen2/Qwen3/Qwen3.5 layers

    def linears(self, kind: str) -> dict[str, tuple[int, int]]:
        """The matmul weights of one decoder layer of `kind`: name -> (in_features, out_features)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = {"gate_proj": (h, self.intermediate), "up_proj": (h, self.intermediate),
               "down_proj": (self.intermediate, h)}
        if kind == "full_attention":
            # Qwen3.5's attention gates its output: q_proj emits the query and the gate
            q_out = 2 * q if self.family == "qwen3_5" else q
            return {"q_proj": (h, q_out), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), **mlp}
        kd, vd = self.lin_k_heads * self.lin_k_dim, self.lin_v_heads * self.lin_v_dim
        return {"in_proj_qkv": (h, 2 * kd + vd), "in_proj_z": (h, vd), "in_proj_b": (h, self.lin_v_heads),
                "in_proj_a": (h, self.lin_v_heads), "out_proj": (vd, h), **mlp}

    def layer_params(self, kind: str) -> int:
        """All parameters of one decoder layer of `kind` (matmuls, biases, norms, conv, gates)."""
        n = sum(i * o for i, o in self.linears(kind).values())
        n += 2 * self.hidden                                   # input and post-attention RMSNorm
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if kind == "full_attention":
            if self.family == "qwen2":
                n += q + 2 * kv                                # q/k/v biases
            else:
                n += 2 * self.head_dim                         # q_norm, k_norm
                if self.attention_bias:
                    q_out = 2 * q if self.family == "qwen3_5" else q
                    n += q_out + 2 * kv + self.hidden
        else:
            conv_dim = 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim
            n += conv_dim * self.conv_kernel                   # depthwise causal conv, no bias
            n += 2 * self.lin_v_heads                          # dt_bias, A_log
            n += self.lin_v_dim                                # gated RMSNorm over a value head
        return n

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """Embeddings, final norm and (untied) lm_head: the FSDP2 root unit."""
        return self.embedding_params * (1 if self.tied else 2) + self.hidden

    @property
    def total_params(self) -> int:
        return self.root_params + sum(self.layer_params(k) for k in self.layer_types)

    @property
    def max_layer_params(self) -> int:
        return max(self.layer_params(k) for k in set(self.layer_types))

    def lora_params(self, r: int, targets: list[str]) -> int:
        """Trainable LoRA parameters: r x (in + out) for each targeted linear of each layer."""
        if r <= 0:
            return 0
        return sum(r * (i + o) for kind in self.layer_types for i, o in self.adapted_linears(kind, targets).values())

    def adapted_linears(self, kind: str, targets: list[str]) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of a `kind` layer that LoRA's `targets` adapt (none named, or "all-linear":
        every one)."""
        return {name: io for name, io in self.linears(kind).items()
                if not targets or "all-linear" in targets or name in targets}

    def flops_per_token(self, mean_conversation_tokens: float) -> float:
        """Training FLOPs per token (raytune_ft.planning.hardware's method) over conversations of the mean length."""
        matmul = self.total_params - (0 if self.tied else self.embedding_params)   # the input embedding is a lookup
        return hardware.flops_per_token(matmul, self.n_full_attention * self.heads * self.head_dim,
                                        mean_conversation_tokens)

    def describe(self) -> str:
        if self.family == "qwen3_5":
            layers = (f"{self.n_layers} layers = {self.n_linear_attention} gated-delta-net + "
                      f"{self.n_full_attention} full attention")
        else:
            layers = f"{self.n_layers} layers"
        return (f"{self.family}: {layers}, hidden {self.hidden}, MLP {self.intermediate}, "
                f"{self.heads}/{self.kv_heads} heads of {self.head_dim}, vocab {self.vocab:,}"
                f"{', tied embeddings' if self.tied else ''}")


# Known real shapes, used when raytune_ft.models.tiny.real_config is not importable (it is the source of
# truth; tests/planning/test_plan.py checks this table against it). Keys: the last part of the hub id, lower case.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "qwen3.8-27b": ModelShape(
        family="qwen3_5", vocab=248320, hidden=5120, intermediate=17408,
        layer_types=tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)),
        heads=24, kv_heads=4, head_dim=256, tied=False, lin_k_heads=16, lin_v_heads=48, lin_k_dim=128,
        lin_v_dim=128, conv_kernel=4),
    "qwen3-4b": ModelShape(family="qwen3", vocab=151936, hidden=2560, intermediate=9728,
                           layer_types=("full_attention",) * 36, heads=32, kv_heads=8, head_dim=128, tied=True),
    "qwen2-0.5b": ModelShape(family="qwen2", vocab=151936, hidden=896, intermediate=4864,
                             layer_types=("full_attention",) * 24, heads=14, kv_heads=2, head_dim=64, tied=True),
}


def _model_key(name: str) -> str:
    return name.lower().replace("_", "-").rstrip("/").split("/")[-1]


def model_config(recipe: Recipe) -> tuple[Any, str]:
    """The transformers config of the recipe's model (None when only the table knows it) and its source."""
    m = recipe.model
    if m.local_tiny:
        from raytune_ft.models.tiny import local_tokenizer, tiny_config

        return tiny_config(m.family, vocab_size=len(local_tokenizer())), "tiny config (models/tiny.py)"
    path = os.path.expanduser(m.name)
    if os.path.isfile(os.path.join(path, "config.json")):
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(path)
        return getattr(cfg, "text_config", None) or cfg, f"{path}/config.json"
    try:
        from raytune_ft.models.tiny import real_config

        return real_config(m.name), "real config (models/tiny.py real_config)"
    except (ImportError, ValueError):
        return None, ""


def model_shape(recipe: Recipe) -> tuple[ModelShape, str]:
    """The recipe's model shape and where it came from; raises ValueError for an unknown model."""
    cfg, source = model_config(recipe)
    if cfg is not None:
        return ModelShape.from_config(cfg), source
    key = _model_key(recipe.model.name)
    if key in KNOWN_SHAPES:
        return KNOWN_SHAPES[key], "table of known shapes (shapes.py)"
    raise ValueError(f"model.name: no shape known for {recipe.model.name!r} (known: {', '.join(KNOWN_SHAPES)}, "
                     "or a local folder with config.json)")


# Float8 matmuls need every dimension a multiple of 16 (MXFP8: of its 32-element scaling block).
# Below FP8_MIN_DIM on either side a projection gains less from float8 than its casts cost (torchao's
# own tables put the break-even near 1k x 1k on Hopper); the 27B's gated-delta-net gates
# (5120 -> 48) are the case this skips.
FP8_MIN_DIM = 512


def fp8_linear_filter_dims(in_features: int, out_features: int, recipe: str = "tensorwise",
                           min_dim: int = FP8_MIN_DIM) -> bool:
    """Whether float8 converts a linear of this shape (train/fp8.py's filter; the memory plan counts the same)."""
    multiple = 32 if recipe == "mxfp8" else 16
    return (in_features % multiple == 0 and out_features % multiple == 0
            and min(in_features, out_features) >= min_dim)
