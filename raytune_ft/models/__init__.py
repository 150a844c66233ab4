"""The model layer: build Qwen3.5 / Qwen3 / Qwen2 causal LMs that train on packed blocks.

- tiny.py: the project's tiny tokenizer, tiny configs (--local) and real-shaped configs;
- build.py: load_causal_lm / decoder_layers / materialize_model (FSDP2 meta flow);
- tokenizer.py: tokenizer_for, and TokenizerOf (a model's tokenizer settings, for Ray Data's processes);
- attention.py: "raytune_varlen" full attention over cu_seqlens (FlashAttention / torch varlen / SDPA);
- gated_delta.py: gated-delta-net layers that restart at each conversation; enable_packing;
- loss.py: chunked cross-entropy (no full logits); model FLOPs and GPU peaks live in raytune_ft/planning/hardware.py.

Submodules import transformers lazily where they can; import what you need from them directly. Nothing
is imported here: the plan and the tiny configs need no modelling code, and transformers' modelling code
imports every quantization library installed (torchao among them) on its way in.
"""
