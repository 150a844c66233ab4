"""The data path: sources and schema adapters, SFT masks, packing, and the Ray Data pipeline.

    sources.to_messages     raw row -> chat messages, or the reason to skip it
    sft.render_sft          messages -> (token ids, assistant mask) for any Qwen chat template
    packing.pack_blocks     (ids, mask) stream -> fixed seq_len blocks with block-diagonal signals
    pipeline.build_dataset  a Ray Dataset of tokenized rows; iter_blocks in workers (equal steps: train/batch.py)
"""
from raytune_ft.data.builtin import builtin_chat
from raytune_ft.data.packing import DataCounters, block_from_segments, pack_blocks, padding_block
from raytune_ft.data.sft import SpanNotFound, render_sft
from raytune_ft.data.sources import to_messages

__all__ = ["builtin_chat", "DataCounters", "block_from_segments", "pack_blocks", "padding_block",
           "SpanNotFound", "render_sft", "to_messages"]
