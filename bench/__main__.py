"""Benchmarks of raytune_ft (bench/README.md).

    python -m bench gpu suite|speed|fp8|parity|kernel-check|startup|imports|eval|all [--gpus 0,1] [--dry-run|--cpu-smoke]
    python -m bench gpu ckpt [...]      checkpoint saves, synchronous against background (bench/ckpt_async.py)
    python -m bench gpu shape [...]     the 27B at 64 layers as rank 0 of N on a fake process group (bench/shape.py)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gpu_kit  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["gpu", "ckpt"]:
        from bench import ckpt_async

        return ckpt_async.main(argv[2:])
    if argv[:2] == ["gpu", "shape"]:
        from bench import shape

        return shape.main(argv[2:])
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="area", required=True)
    gpu = sub.add_parser("gpu", help="the GPU benchmarks and the GPU test suite, each part recorded in "
                                     "bench/results/<date>.jsonl")
    gpu_kit.add_arguments(gpu)
    opts = p.parse_args(argv)
    return gpu_kit.main(opts)


if __name__ == "__main__":
    sys.exit(main())
