"""`python -m bench gpu lora`: LoRA in the FSDP2 loop against full SFT, through the recipes, on one GPU.

Three runs through Ray Train as a user's jobs run (random weights of the real Qwen3.8-27B config, generated
conversations, 32,768-token blocks, no final checkpoint):
    full-16     jobs/qwen27b_b300.py on the 27B cut to 16 layers (bf16 master weights: fp32 ones and their
                AdamW states do not fit one GPU beside 32k activations)
    lora-16     jobs/qwen27b_lora.py on the same cut: the frozen bf16 base, adapters on every linear
    lora-64     jobs/qwen27b_lora.py on the real 64 layers (`--lora-seq`: its block length, 32,768 by default)
Each LoRA run's record holds `raytune-ft plan`'s total for the same recipe and GPU beside the measured peak;
its MFU counts the frozen base's forward and backward FLOPs (no weight gradients) plus the adapters', as the
loop logs it for a LoRA run. A last RESULT line compares lora-16 with full-16.
`--cpu-smoke`: the full and LoRA jobs' --local forms (tiny qwen3_5, local Ray on CPU), no 64-layer run.
`--part pair` runs the cut's two runs alone, `--part real` the 64-layer run alone (each fits one 600 s window).
"""
from __future__ import annotations

import json
import os

from bench import records

FULL_JOB, LORA_JOB = "jobs/qwen27b_b300.py", "jobs/qwen27b_lora.py"
CUT_LAYERS, REAL_LAYERS = 16, 64


def _on_job(part, job: str):
    """The part with its recipe script swapped (the kit's recipe runs name the 27B full-SFT job)."""
    part.argv = [job if a == FULL_JOB else a for a in part.argv]
    part.info["job"] = os.path.basename(job)[:-3]
    return part


def _settings(argv: list[str]) -> list[str]:
    """The `--set KEY=VALUE`s of a command line, in order."""
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"]


def planned_gib(job: str, argv: list[str], gpu: str | None) -> dict:
    """`raytune-ft plan`'s per-GPU total for the recipe this command line runs, on `gpu`."""
    from raytune_ft.cli import _job_recipe
    from raytune_ft.planning.plan import memory_plan

    recipe = _job_recipe(os.path.basename(job)[:-3], "--local" in argv, _settings(argv))
    plan = memory_plan(recipe, gpu=gpu)
    return {"plan_total_gib": round(plan.total_bytes / 2**30, 3), "plan_fits": plan.fits,
            "plan_gpu": plan.gpu.name if plan.gpu else "cpu"}


def _device_name() -> str | None:
    from raytune_ft.planning.hardware import current_device_name

    return current_device_name()


def _with_plan(part, gpu: str | None):
    """The part, its figures completed by the plan of the recipe it runs."""
    read = part.read
    part.read = lambda p, out, res: read(p, out, res) | planned_gib(LORA_JOB, p.argv, gpu)
    return part


def parts(kit) -> list:
    """The runs of `bench gpu lora` (each a gpu_kit.Part)."""
    from bench.figures import throughput_figures

    part = kit.o.part
    if part not in ("all", "pair", "real"):
        raise SystemExit(f"lora --part: pair, real or all, not {part}")
    kit.o.layers = kit.o.layers or CUT_LAYERS
    cut = kit.layers()
    gpu = None if kit.o.cpu_smoke else _device_name()
    runs = []
    if part != "real":
        full = _on_job(kit.recipe_run("lora", f"full-{cut}", ["--set", "train.master_weights=bf16"],
                                      throughput_figures), FULL_JOB)
        full.info["master_weights"] = "bf16"
        runs = [full, _with_plan(_on_job(kit.recipe_run("lora", f"lora-{cut}", [], throughput_figures), LORA_JOB),
                                 gpu)]
    if not kit.o.cpu_smoke and part != "pair":
        real = os.path.join(kit.work, f"qwen3.8-27b-{REAL_LAYERS}layers")
        big = kit.recipe_run("lora", f"lora-{REAL_LAYERS}layers", ["--set", f"model.name={real}",
                             "--set", f"data.seq_len={kit.o.lora_seq}"], throughput_figures)
        big.info |= {"layers": REAL_LAYERS, "seq_len": kit.o.lora_seq}

        def write_real_config(prepare=big.prepare):
            prepare()
            if not os.path.isdir(real):
                from raytune_ft.models.tiny import real_config

                real_config("qwen3.8-27b", num_hidden_layers=REAL_LAYERS).save_pretrained(real)

        big.prepare = write_real_config
        runs.append(_with_plan(_on_job(big, LORA_JOB), gpu))
    return runs


def compare(recs: list[dict], opts) -> dict | None:
    """One RESULT line and record: the cut's LoRA run over its full SFT (tokens/s, peak memory)."""
    fig = {r["label"].split("-")[0]: r["figures"] for r in recs
           if r["bench"] == "lora" and not r["label"].endswith("layers")}
    full, lora = fig.get("full") or {}, fig.get("lora") or {}
    if not (full.get("tok_s") and lora.get("tok_s")):
        return None
    ratio = {"bench": "lora", "label": "lora_over_full", "tok_s_ratio": round(lora["tok_s"] / full["tok_s"], 3),
             "peak_gib": {"full": full.get("peak_gib"), "lora": lora.get("peak_gib")}}
    print("RESULT " + json.dumps(ratio), flush=True)
    records.append(opts.results, {**ratio, "gpus": opts.gpus})
    return ratio
