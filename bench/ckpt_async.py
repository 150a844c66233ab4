"""Checkpoint saves synchronous against in the background: the same recipe run twice, train.async_checkpoint off
then on, a checkpoint every `--ckpt-every` steps (default 2), each save's seconds the training loop was held
(`checkpoint/blocked_s`, from the run's MLflow store) side by side.

    python -m bench gpu ckpt [--layers 2 --set train.master_weights=bf16] [--ckpt-every 2] [--local-copies DIR]
                             [--cpu-smoke|--dry-run]

The kit's options (bench/gpu_kit.py) and its 27B cut through Ray Train; train.keep_checkpoints=1, so one
registered checkpoint, the one being uploaded and each rank's local copy of it share the disk.
`--local-copies DIR` puts the local copies there instead (the job's TMPDIR, e.g. /dev/shm: the disk then
holds two checkpoints, not three). Each run is one record; the
pair's RESULT says `async_over_sync` (the mean held seconds of the background saves over the synchronous
ones; issue 36's goal: at most 0.2) and the tokens/s of each run.
"""
from __future__ import annotations

import argparse
import json
import sys

from bench import gpu_kit, records

MODES = ("off", "on")


def save_figures(summary: dict) -> dict:
    """Each save's held seconds and, for a background save, its write-and-upload seconds; tokens/s."""
    w = gpu_kit.metric_windows(summary, names=("checkpoint/blocked_s", "checkpoint/background_s"))
    blocked = [round(v, 3) for _, v in sorted(w["checkpoint/blocked_s"].items())]
    fig = {"saves": len(blocked), "blocked_s": blocked,
           "blocked_s_mean": round(sum(blocked) / len(blocked), 3) if blocked else None,
           "background_s": [round(v, 2) for _, v in sorted(w["checkpoint/background_s"].items())]}
    try:
        fig |= {k: v for k, v in gpu_kit.throughput_figures(summary).items() if k in ("tok_s", "peak_gib")}
    except Exception as e:  # noqa: BLE001 - the held seconds stand without it
        fig["tok_s"] = f"unreadable ({type(e).__name__})"
    return fig


def parts(kit: gpu_kit.Kit, local_copies: str | None = None, modes=MODES) -> list[gpu_kit.Part]:
    every = kit.o.ckpt_every or 2
    out = []
    for mode in modes:
        extra = ["--set", f"train.async_checkpoint={mode}", "--set", f"train.checkpoint_every={every}",
                 "--set", "train.keep_checkpoints=1"]
        part = kit.recipe_run("speed", f"ckpt-async-{mode}", extra, save_figures)
        part.bench = "ckpt"
        part.info |= {"async_checkpoint": mode, "checkpoint_every": every}
        if local_copies:       # the workers inherit the job's environment (a local Ray)
            part.env["TMPDIR"] = local_copies
        out.append(part)
    return out


def main(argv: list[str]) -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--local-copies", default=None)
    own.add_argument("--modes", default=",".join(MODES), help="the runs' order, e.g. on,off")
    mine, argv = own.parse_known_args(argv)
    modes = tuple(mine.modes.split(","))
    if sorted(modes) != sorted(MODES):
        print(f"--modes {mine.modes}: give each of {', '.join(MODES)} once", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="python -m bench gpu ckpt", description=__doc__.split("\n\n")[0])
    gpu_kit.add_arguments(p)
    opts = p.parse_args(["speed", *argv])     # the kit's options; its subcommand argument is not this bench's
    opts.bench = "ckpt"
    gpu_kit.resolve(opts)
    if not opts.cpu_smoke and not opts.gpus and not opts.dry_run:
        print("no GPU found (nvidia-smi lists none): run with --cpu-smoke or --dry-run", file=sys.stderr)
        return 2
    recs = gpu_kit.run_parts("ckpt", parts(gpu_kit.Kit(opts), mine.local_copies, modes), opts)
    if opts.dry_run:
        return 0
    held = {r["settings"]["async_checkpoint"]: r["figures"].get("blocked_s_mean") for r in recs}
    pair = {"bench": "ckpt", "label": "pair", "blocked_s_mean": held,
            "tok_s": {r["settings"]["async_checkpoint"]: r["figures"].get("tok_s") for r in recs}}
    if held.get("off") and held.get("on") is not None:
        pair["async_over_sync"] = round(held["on"] / held["off"], 3)
    print("RESULT " + json.dumps(pair), flush=True)
    records.append(opts.results, {**pair, "gpus": opts.gpus})
    return 0 if all(r["exit"] == 0 for r in recs) and "async_over_sync" in pair else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
