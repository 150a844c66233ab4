"""CP attention's cuDNN split (models/context_parallel/split_attention.py) on a GPU, in one run:

- exactness: out, dq, dk, dv of the split on cuDNN and of torch's varlen kernel (FlashAttention-2), each against the
  same split computed in fp32 plain torch ("math"), at three (queries x prefix keys) shapes, the 27B's widths
  (24 query heads, 4 KV heads, head dim 256), bf16;
- speed: forward + backward seconds of the split against the varlen kernel at a CP-8 rank's shapes (4,096 queries
  after 61,440 / 126,976 earlier keys of their conversation, and a causal square);
- the chunked loss's fused fp32 accumulation (models/loss.py `_add_product`) at the 27B's (V, D): its error against
  an fp32 product, the bytes it allocates, its seconds against the two-step sum.

    python bench/split_attention_check.py        # prints RESULT {json} lines
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention_kernels import HEAD_DIM, HEADS, KV_HEADS, _seconds  # noqa: E402


def _inputs(nq: int, n_prefix: int, grad: bool = False):
    import torch

    q = torch.randn(nq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k, v = (torch.randn(n_prefix + nq, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device="cuda") for n in (nq, n_prefix + nq))
    return q, k, v, cu_q, cu_k


def exactness(nq: int, n_prefix: int) -> dict:
    """Relative errors [out, dq, dk, dv] of the cuDNN split and of the varlen kernel against the fp32 split."""
    import torch
    from torch.nn.attention.varlen import varlen_attn

    from raytune_ft.models.context_parallel import split_attention as sa

    torch.manual_seed(0)
    q, k, v, cu_q, cu_k = _inputs(nq, n_prefix)
    g = torch.randn_like(q)
    runs = {}
    for name in ("cudnn", "math", "varlen"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if name == "varlen":
            o = varlen_attn(qq, kk, vv, cu_q, cu_k, nq, n_prefix + nq, window_size=(-1, 0))
        else:
            o = sa.prefix_causal_attention(qq, kk, vv, sa.Split(n_prefix, HEAD_DIM ** -0.5, sa.KERNELS[name]))
        o.backward(g)
        runs[name] = [t.float() for t in (o.detach(), qq.grad, kk.grad, vv.grad)]
    return {n: [round(((a - b).norm() / b.norm()).item(), 5) for a, b in zip(runs[n], runs["math"])]
            for n in ("cudnn", "varlen")}


def speed(nq: int, n_prefix: int) -> dict:
    from torch.nn.attention.varlen import varlen_attn

    from raytune_ft.models.context_parallel import split_attention as sa

    q, k, v, cu_q, cu_k = _inputs(nq, n_prefix, grad=True)
    flops = 4 * nq * (n_prefix + nq / 2) * HEADS * HEAD_DIM * 3.5      # forward + backward = 3.5 forwards
    split = _seconds(lambda: sa.prefix_causal_attention(q, k, v, sa.Split(n_prefix, HEAD_DIM ** -0.5,
                                                                             sa.KERNELS["cudnn"])).sum().backward(), 5)
    var = _seconds(lambda: varlen_attn(q, k, v, cu_q, cu_k, nq, n_prefix + nq,
                                       window_size=(-1, 0)).sum().backward(), 5)
    return {"split_cudnn_fwdbwd_s": round(split, 5), "varlen_fwdbwd_s": round(var, 5),
            "split_tflops": round(flops / split / 1e12, 1), "varlen_tflops": round(flops / var / 1e12, 1)}


def loss_accumulation(vocab: int = 248_320, hidden: int = 5120, chunk: int = 4096) -> dict:
    import torch

    from raytune_ft.models import loss

    g = torch.randn(chunk, vocab, device="cuda", dtype=torch.bfloat16) * 1e-3
    h = torch.randn(chunk, hidden, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(vocab, hidden, device="cuda")
    ref = acc.clone()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss._add_product(acc, g, h)
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    ref.add_(g.t().float() @ h.float())
    return {"fused": loss._fused_add_product(acc.device, g.dtype),
            "add_product_rel_err": ((acc - ref).norm() / ref.norm()).item(), "extra_gib": round(extra, 3),
            "s": round(_seconds(lambda: loss._add_product(acc, g, h), 3), 4),
            "two_step_s": round(_seconds(lambda: acc.add_(g.t() @ h), 3), 4)}


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("split_attention_check: needs a CUDA GPU (cuDNN's attention is CUDA-only)", file=sys.stderr)
        return 2
    from raytune_ft.models.context_parallel import split_attention as sa

    print("cuDNN attention:", sa.cudnn_attention_available(), torch.__version__, torch.backends.cudnn.version(),
          torch.cuda.get_device_name(), flush=True)
    for nq, n_prefix in ((1024, 0), (2048, 3000), (1536, 5)):
        print("RESULT", json.dumps({"shape": f"{nq}x{n_prefix}", "rel_err_vs_math_fp32 [out,dq,dk,dv]":
                                    exactness(nq, n_prefix)}), flush=True)
    for nq, n_prefix in ((4096, 61440), (4096, 126976), (4096, 0)):
        print("RESULT", json.dumps({"shape": f"{nq}x{n_prefix}", **speed(nq, n_prefix)}), flush=True)
    print("RESULT", json.dumps(loss_accumulation()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
