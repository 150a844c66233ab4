"""Benchmark (not a test): the Ray Data path's tokens per CPU-second for a two-source mixture read from S3,
next to the same rows in one local file, in the same run.

Rows: the UltraChat and Capybara fixture rows, each made unique (a row number in its first user turn) and
repeated to `--rows` per source. Local: one jsonl holding both. S3: the UltraChat rows as jsonl and the
Capybara rows as jsonl.gz under two prefixes of a SeaweedFS server on loopback (tests/s3_server.py), mixed
as `data.sources` (weights 1); and the same two files as a local mixture, to tell the mixture's cost from S3's. Each configuration: `build_dataset` (read, adapt, for the mixture the seeded
sort, tokenize + mask with the real Qwen3 tokenizer and the Qwen3.8-27B template) consumed in this process by
`iter_blocks` (packing at 32,768 tokens). The figure is real tokens over the CPU seconds of this process and
every process of its local Ray (user + system, polled from /proc via psutil, so that processes that exit
during the pass count too): a core's worth of work whatever else
the machine runs. One warm-up pass of each first (Ray's processes start and import), then rounds alternate
the configurations; the best of each is kept.

Usage (project root): python bench/data_sources.py [--rows 512] [--rounds 3] [--processes 2]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("RAYTUNE_FIXTURES", REPO / "tests" / "fixtures"))


def _rows(n: int) -> tuple[list[str], list[str]]:
    """`n` unique UltraChat rows and `n` unique Capybara rows, as jsonl lines."""
    uc = [json.loads(line) for line in open(FIXTURES / "data" / "ultrachat_200k_train_sft_first16.jsonl")]
    cap = [json.loads(line) for line in open(FIXTURES / "data" / "capybara_ldjnr_first16.jsonl")]
    out_uc, out_cap = [], []
    for i in range(n):
        r = json.loads(json.dumps(uc[i % len(uc)]))
        r["messages"][0]["content"] = f"(#{i}) " + r["messages"][0]["content"]
        out_uc.append(json.dumps(r))
        c = json.loads(json.dumps(cap[i % len(cap)]))
        c["conversation"][0]["input"] = f"(#{i}) " + c["conversation"][0]["input"]
        out_cap.append(json.dumps(c))
    return out_uc, out_cap


class CpuMeter:
    """CPU seconds (user + system) of this process and all its descendants (the local Ray's processes),
    polled every `every` s so that a process that exits before the end still counts (up to its last poll)."""

    def __init__(self, every: float = 0.25):
        import threading

        self.every, self.seen, self.start = every, {}, {}
        self._stop = threading.Event()
        self._poll(self.start)
        self.seen = dict(self.start)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _poll(self, into: dict) -> None:
        import psutil

        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                into[(p.pid, p.create_time())] = t.user + t.system
            except psutil.Error:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._poll(self.seen)

    def stop(self) -> float:
        """The CPU seconds used since the meter started."""
        self._stop.set()
        self._thread.join()
        self._poll(self.seen)
        return sum(v - self.start.get(k, 0.0) for k, v in self.seen.items())


def measure(data, processes: int) -> dict:
    """One pass of the data path over `data`: tokens, wall and CPU seconds."""
    from raytune_ft.data.packing import DataCounters
    from raytune_ft.data.pipeline import build_dataset, iter_blocks

    template = str(FIXTURES / "templates" / "qwen3.8-27b.chat_template.jinja")
    c = DataCounters()
    meter, t0 = CpuMeter(), time.perf_counter()
    ds = build_dataset(data, str(FIXTURES / "tokenizers" / "qwen3"), chat_template=template, processes=processes)
    blocks = sum(1 for _ in iter_blocks(ds, data, counters=c))
    wall, cpu = time.perf_counter() - t0, meter.stop()
    return {"tokens": c.real_tokens, "rows": c.rows_read, "blocks": blocks, "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "tok_per_cpu_s": int(c.real_tokens / cpu), "tok_s_wall": int(c.real_tokens / wall)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512, help="rows per source")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--processes", type=int, default=2, help="tokenizing processes (data.tokenize_workers)")
    args = ap.parse_args(argv)
    import ray

    from raytune_ft.recipe.recipe import DataConfig
    from tests.s3_server import S3Server

    work = Path(tempfile.mkdtemp(prefix="bench_data_sources_"))
    uc, cap = _rows(args.rows)
    local = work / "mine.jsonl"
    local.write_text("\n".join(uc + cap) + "\n")
    parts = (work / "ultrachat.jsonl", work / "capybara.jsonl.gz")      # the mixture's two files, locally
    parts[0].write_text("\n".join(uc) + "\n")
    with gzip.open(parts[1], "wt") as f:
        f.write("\n".join(cap) + "\n")
    server = S3Server(work / "s3").start()
    try:
        bucket = server.bucket()
        fs = server.filesystem()
        with fs.open_output_stream(f"{bucket}/ultrachat/train.jsonl", compression=None) as f:
            f.write(("\n".join(uc) + "\n").encode())
        with fs.open_output_stream(f"{bucket}/capybara/train.jsonl.gz", compression=None) as f:
            f.write(gzip.compress(("\n".join(cap) + "\n").encode()))
        os.environ.update(server.env())
        ray.init(address="local", num_cpus=max(2, args.processes + 1), include_dashboard=False,
                 log_to_driver=False)
        configs = {
            "local_single_file": DataConfig(source=str(local), split="train"),
            "local_two_source_mixture": DataConfig(sources=[{"source": str(parts[0]), "name": "ultrachat"},
                                                            {"source": str(parts[1]), "name": "capybara"}]),
            "s3_two_source_mixture": DataConfig(sources=[{"source": f"s3://{bucket}/ultrachat", "name": "ultrachat"},
                                                         {"source": f"s3://{bucket}/capybara", "name": "capybara"}]),
        }
        runs: dict[str, list[dict]] = {k: [] for k in configs}
        for data in configs.values():     # a warm-up pass each: Ray's processes start and import outside the clock
            measure(data, args.processes)
        for _ in range(args.rounds):
            for name, data in configs.items():
                runs[name].append(measure(data, args.processes))
        ray.shutdown()
    finally:
        server.stop()
    best = {k: max(v, key=lambda r: r["tok_per_cpu_s"]) for k, v in runs.items()}
    import pyarrow
    import tokenizers
    import transformers

    result = {"best": best, "rounds": {k: [r["tok_per_cpu_s"] for r in v] for k, v in runs.items()},
              "ratio_s3_mixture_to_local": round(best["s3_two_source_mixture"]["tok_per_cpu_s"]
                                                 / best["local_single_file"]["tok_per_cpu_s"], 3),
              "env": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "python": platform.python_version(),
                      "ray": ray.__version__, "pyarrow": pyarrow.__version__, "transformers": transformers.__version__,
                      "tokenizers": tokenizers.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                      "rows_per_source": args.rows, "processes": args.processes}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
