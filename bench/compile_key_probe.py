"""Does torch.compile's FX graph cache key of a function calling an autotuned user Triton kernel depend on whether
the process autotuned the kernel itself before compiling (a cold run's kernel check) or read the autotune result
from Triton's cache (every later process)? GPU only.

    python bench/compile_key_probe.py          # three fresh processes on one pair of empty cache folders

Prints each process's key and whether it hit; `RESULT {"same_key": ...}` at the end (bench/NOTES.md, issue 36).
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile


def one_process(log_file: str) -> None:
    handler = logging.FileHandler(log_file)
    lg = logging.getLogger("torch._inductor.codecache")
    lg.setLevel(logging.DEBUG)
    lg.addHandler(handler)
    lg.propagate = False
    import torch
    import triton
    import triton.language as tl

    # cache_results: as flash-linear-attention's autotuners with FLA_CACHE_RESULTS=1
    @triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b in (128, 256, 512) for w in (2, 4)],
                     key=["n"], cache_results=True)
    @triton.jit
    def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)

    def scale(x):
        y = torch.empty_like(x)
        scale_kernel[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel())
        return y

    x = torch.randn(4096, device="cuda")
    scale(x)      # autotuned here in the first process, read from the cache in the later ones
    torch.compile(lambda t: scale(torch.relu(t) + 1.0) * 3.0)(x)
    torch.cuda.synchronize()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one_process(sys.argv[2])
        return 0
    work = tempfile.mkdtemp(prefix="compile_key_probe_")
    env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(work, "triton"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "inductor")}
    keys = []
    for name in ("cold", "warm-1", "warm-2"):
        log_file = os.path.join(work, f"{name}.log")
        subprocess.run([sys.executable, __file__, "--one", log_file], env=env, check=True, timeout=600)
        with open(log_file) as f:
            m = re.search(r"fx graph cache (hit|miss) for key (\w+)", f.read())
        keys.append(m.groups() if m else ("none", ""))
        print(name, *keys[-1], flush=True)
    print("RESULT " + json.dumps({"same_key": len({k for _, k in keys}) == 1, "lookups": [h for h, _ in keys],
                                  "logs": work}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
