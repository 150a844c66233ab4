"""The model layer: build Qwen3.5 / Qwen3 / Qwen2 causal LMs that train on packed blocks.

- tiny.py: the project's tiny tokenizer, tiny configs (--local) and real-shaped configs;
- build.py: load_causal_lm / tokenizer_for / decoder_layers / materialize_model (FSDP2 meta flow);
- attention.py: "raytune_varlen" full attention over cu_seqlens (FlashAttention / torch varlen / SDPA);
- gated_delta.py: gated-delta-net layers that restart at each conversation; enable_packing;
- loss.py: chunked cross-entropy (no full logits); model FLOPs and GPU peaks live in raytune_ft/hardware.py.

Submodules import transformers lazily where they can; import what you need from them directly.
"""
from raytune_ft.models.attention import ATTN_NAME, select_attention_backend
from raytune_ft.models.build import (decoder_layers, load_causal_lm, load_pretrained_weights_sharded,
                                     materialize_model, tokenizer_for)
from raytune_ft.models.gated_delta import enable_packing, packed_forward_kwargs
from raytune_ft.models.loss import chunked_cross_entropy
from raytune_ft.models.tiny import local_tokenizer, real_config, tiny_config

__all__ = [
    "ATTN_NAME", "select_attention_backend", "decoder_layers", "load_causal_lm",
    "load_pretrained_weights_sharded", "materialize_model", "tokenizer_for", "enable_packing",
    "packed_forward_kwargs", "chunked_cross_entropy", "local_tokenizer", "real_config", "tiny_config",
]
