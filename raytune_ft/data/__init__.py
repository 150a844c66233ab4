"""The data path: sources and schema adapters, SFT masks, packing, and the Ray Data pipeline.

    specs.source_specs      the recipe's sources (one, or a mixture's), their files and splits
    reading.read_source     a source's split as a Ray Dataset of raw rows (local, hf://, s3://, builtin): every
                            file, each row's JSON text with its file and row number (the checks read the same)
    sources.Adapter         raw row -> chat messages, or the reason to skip it and the value that failed
    precheck.check_sources  the first rows of each source and the held-out set, checked before Ray
    sft.render_sft          messages -> (token ids, assistant mask) for any Qwen chat template
    packing.pack_blocks     (ids, mask) stream -> fixed seq_len blocks with block-diagonal signals
    pipeline.build_dataset  a Ray Dataset of tokenized rows; iter_blocks in workers (equal steps: train/batch.py)
                            counts every row read: trained, held out or skipped (packing.DataCounters)
    local_pass.local_pass   the same pass here, on the run's ranks: what `raytune-ft data check` counts
"""
from raytune_ft.data.builtin import builtin_chat
from raytune_ft.data.packing import DataCounters, block_from_segments, pack_blocks, padding_block
from raytune_ft.data.sft import SpanNotFound, render_sft
from raytune_ft.data.sources import to_messages

__all__ = ["builtin_chat", "DataCounters", "block_from_segments", "pack_blocks", "padding_block",
           "SpanNotFound", "render_sft", "to_messages"]
