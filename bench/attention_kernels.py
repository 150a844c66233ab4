"""Full attention's kernels at the 27B's widths (24 query heads, 4 KV heads, head dim 256), bf16, at the shapes a
rank of a CP-8 group runs: a 4,096-token chunk causal against itself, and against the 61,440 or 126,976 keys
before it (65,536- and 131,072-token blocks). Each kernel's forward and forward + backward TFLOP/s, in one run:

- `torch_varlen`: torch's varlen_attn, the kernel the packed and CP paths use (FlashAttention-2 inside torch),
  its KV heads as they are;
- `cudnn` and `flash`: torch's SDPA pinned to its cuDNN or FlashAttention-2 backend, with `enable_gqa` (`_gqa`) and
  with the KV heads repeated to the query heads (`_rep`).

FLOPs: 4 x queries x keys x heads x head dim forward (half for a causal square), 3.5x that forward + backward.
    python bench/attention_kernels.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256
SHAPES = [(4096, 4096, True), (4096, 61440, False), (4096, 126976, False)]   # (queries, keys, causal square)


def _seconds(fn, repeat: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def _kernels(tq: int, tk: int, causal: bool) -> dict:
    """{name: fn(backward: bool)} for one shape, inputs made once."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn

    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(tq, HEADS, HEAD_DIM, device=dev, dtype=bf16, requires_grad=True)
    k, v = (torch.randn(tk, KV_HEADS, HEAD_DIM, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=dev) for n in (tq, tk))
    window = (-1, 0) if causal else (-1, -1)

    def run(forward):
        def fn(backward: bool):
            out = forward()
            if backward:
                out.sum().backward()
        return fn

    out = {"torch_varlen": run(lambda: varlen_attn(q, k, v, cu_q, cu_k, tq, tk, window_size=window))}
    qs, ks, vs = (t.detach().transpose(0, 1)[None].contiguous().requires_grad_() for t in (q, k, v))
    rep = HEADS // KV_HEADS
    kr, vr = (t.detach().repeat_interleave(rep, 1).requires_grad_() for t in (ks, vs))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        for suffix, kk, vv, gqa in (("_gqa", ks, vs, True), ("_rep", kr, vr, False)):
            def sdpa(kk=kk, vv=vv, gqa=gqa, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qs, kk, vv, is_causal=causal, enable_gqa=gqa)
            out[name + suffix] = run(sdpa)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("attention_kernels: needs a CUDA GPU (the kernels compared are CUDA-only)", file=sys.stderr)
        return 2
    figures = {}
    for tq, tk, causal in SHAPES:
        fwd_flops = 4 * tq * tk * HEADS * HEAD_DIM / (2 if causal else 1)
        row = {}
        for name, fn in _kernels(tq, tk, causal).items():
            try:
                row[name] = {"fwd_tflops": round(fwd_flops / _seconds(lambda: fn(False), a.repeat) / 1e12, 1),
                             "fwd_bwd_tflops": round(3.5 * fwd_flops / _seconds(lambda: fn(True), a.repeat) / 1e12,
                                                     1)}
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is a result too
                row[name] = f"{type(e).__name__}: {str(e)[:160]}"
        figures[f"q{tq}_k{tk}_{'causal' if causal else 'all_earlier'}"] = row
        print(json.dumps({f"q{tq}_k{tk}": row}), flush=True)
    print("RESULT " + json.dumps({"bench": "attention_kernels", "figures": figures, "torch": torch.__version__,
                                  "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
