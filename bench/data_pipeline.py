"""Benchmark (not a test): the data path on one CPU core, each figure beside its peer from the same run.

1. render + mask + pack throughput (tokens/s on one core): real Qwen3 tokenizer, Qwen3.8-27B template,
   the UltraChat rows of the fixtures, 20 passes; peer: TRL's training-template assistant mask
   (../shared/peers/data_peer.py, run as a subprocess under the same `taskset`).
2. packing at 32,768-token blocks: 20,000 lengths drawn from a lognormal fitted to the real rendered
   lengths (the peer's exact recipe, seed 0); efficiency, blocks, conversations cut; peers: TRL bfd and
   greedy chop, from the same peer run.

Rounds alternate peer and ours; the best of the rounds is kept for each (the host is shared).

Usage (project root): taskset -c 0 python bench/data_pipeline.py [--rounds 3] [--shared ../shared]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

FIXTURES = os.environ.get("RAYTUNE_FIXTURES", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures"))


def run_peer(shared: str) -> dict:
    """The peer script's two JSON lines, merged (it runs pinned like this process)."""
    cmd = [sys.executable, os.path.join(shared, "peers", "data_peer.py")]
    if hasattr(os, "sched_getaffinity"):
        cmd = ["taskset", "-c", ",".join(map(str, sorted(os.sched_getaffinity(0))))] + cmd
    out = subprocess.run(cmd, env={**os.environ, "SHARED": shared}, capture_output=True, text=True,
                         check=True).stdout
    merged: dict = {}
    for line in out.splitlines():
        if line.startswith("{"):
            merged.update(json.loads(line))
    return merged


def measure_ours(shared: str, passes: int = 20) -> dict:
    from transformers import AutoTokenizer

    from raytune_ft.data.packing import DataCounters, pack_blocks
    from raytune_ft.data.sft import render_sft

    tok = AutoTokenizer.from_pretrained(f"{FIXTURES}/tokenizers/qwen3")
    tok.chat_template = open(f"{FIXTURES}/templates/qwen3.8-27b.chat_template.jinja").read()
    rows = [json.loads(line) for line in open(f"{FIXTURES}/data/ultrachat_200k_train_sft_first16.jsonl")]
    render_sft(tok, rows[0]["messages"])                       # compile the template outside the clock
    lens: list[int] = []

    def examples():
        for p in range(passes):
            for r in rows:
                ids, mask = render_sft(tok, r["messages"])
                if p == 0:
                    lens.append(len(ids))
                yield ids, mask

    c = DataCounters()
    t = time.perf_counter()
    for _ in pack_blocks(examples(), 32768, counters=c):
        pass
    dt = time.perf_counter() - t
    out = {"render_mask_pack_tok_s": int(c.real_tokens / dt), "supervised_frac":
           round(c.supervised_tokens / c.real_tokens, 3), "tokens_per_conv_mean": int(np.mean(lens))}

    # Packing at 32k on the peer's synthetic lengths.
    lens_a = np.array(lens)
    mu, sd = np.log(lens_a).mean(), np.log(lens_a).std()
    rng = np.random.default_rng(0)
    L = np.clip(rng.lognormal(mu, sd, 20000).astype(int), 16, 32768)
    c = DataCounters()
    t = time.perf_counter()
    nb = sum(1 for _ in pack_blocks(((np.ones(int(x), np.int64), np.ones(int(x), bool)) for x in L),
                                    32768, counters=c))
    dt = time.perf_counter() - t
    out.update({"pack_blocks": nb, "pack_min_blocks": int(-(-int(L.sum()) // 32768)),
                "pack_efficiency": round(c.real_tokens / (nb * 32768), 5),
                "pack_convs_cut": c.conversations_split, "pack_convs_longer_than_block": int((L > 32768).sum()),
                "pack_seconds": round(dt, 2), "pack_tok_s": int(c.real_tokens / dt)})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shared", default=os.environ.get(
        "SHARED", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")))
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args(argv)
    peers, ours = [], []
    for _ in range(args.rounds):
        if not args.no_peer:
            peers.append(run_peer(args.shared))
        ours.append(measure_ours(args.shared))
    best = max(ours, key=lambda o: o["render_mask_pack_tok_s"])
    result = {"ours": best, "ours_all_tok_s": [o["render_mask_pack_tok_s"] for o in ours]}
    if peers:
        result["peer"] = max(peers, key=lambda p: p["trl_training_template_mask_tok_s"])
        result["peer_all_mask_tok_s"] = [p["trl_training_template_mask_tok_s"] for p in peers]
    import tokenizers
    import transformers
    import trl
    result["env"] = {"cpus_allowed": sorted(os.sched_getaffinity(0)), "loadavg": os.getloadavg(),
                     "python": platform.python_version(), "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "trl": trl.__version__, "numpy": np.__version__,
                     "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
