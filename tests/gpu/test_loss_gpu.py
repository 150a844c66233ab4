"""The chunked loss's lm_head-gradient accumulation on CUDA: one matmul adds each chunk's bf16 product into the
fp32 accumulator (`addmm` with `out_dtype`), with no (V, D) temporary in the compute dtype."""
from __future__ import annotations

import torch

from raytune_ft.models import loss


def test_the_fused_accumulation_equals_the_fp32_sum_and_makes_no_vocab_sized_temporary(cuda):
    assert loss._fused_add_product(cuda, torch.bfloat16), "this torch cannot add a bf16 matmul into fp32 in place"
    v, d, c = 32_000, 1024, 512
    gen = torch.Generator(device=cuda).manual_seed(0)
    g = (torch.randn(c, v, device=cuda, generator=gen) * 1e-3).to(torch.bfloat16)
    h = torch.randn(c, d, device=cuda, generator=gen).to(torch.bfloat16)
    acc = torch.full((v, d), 0.5, device=cuda)
    want = acc + g.t().float() @ h.float()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss._add_product(acc, g, h)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < v * d * 2 / 2, f"{extra} new bytes: a (V, D) bf16 product was made"   # the product would be v*d*2
    err = ((acc - want).norm() / (want - 0.5).norm()).item()
    assert err < 1e-3, err                       # fp32 accumulation of bf16 inputs: no bf16 rounding of the sum
