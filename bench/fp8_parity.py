"""Loss parity of float8 training (train.precision=fp8) against bf16 on a real learning problem.

A small qwen3_5 model (default: 4 layers, 3 gated-delta-net : 1 attention, hidden 1024, MLP 3072, the
27B's gated-delta-net and attention head shapes) with transformers' random init is trained from the
same initial weights once per precision, on the same packed blocks in the same order: real chat rows
(JSONL files, e.g. the fixtures' UltraChat and Capybara rows), rows of real text made from the running
Python's standard library (`--stdlib-rows`: the user turn names a module and quotes ten lines of it, the
assistant turn continues the file; a loss that stays near 1-2 nats for a few hundred steps, where the
builtin tasks are nearly memorised and their losses fall to 0.2) and the builtin chat tasks
(`--builtin-rows`), tokenized with a real tokenizer and the project's SFT masking, shuffled, packed by
the pipeline's packer, repeated only if the steps outrun them. `--bf16-seeds 2` adds a bf16 run from
other initial weights: how far two equally good bf16 runs lie apart, the spread float8 is read against. The step is the FSDP2 loop's (shard_packed_model, StepBatch,
forward_backward, clip, fused AdamW) with fp32 master weights, bf16 compute and, by default,
train.compile's compiled MLPs; float8 goes through the loop's own conversion (raytune_ft.train.fp8).

    python3 bench/fp8_parity.py --tokenizer /tmp/tok/qwen3 --rows DIR/*.jsonl --stdlib-rows 9000 \
        --builtin-rows 0 --bf16-seeds 2 --steps 300 --out $OUT
    python bench/fp8_parity.py --plot-from fp8_parity.json --out DIR     # the figure from a run's JSON
    SHAPE=tiny DEVICE=cpu python bench/fp8_parity.py --steps 6 --log-every 2 --warmup 2 --cpu-check

Prints a `RESULT {json}` line per run (losses, tokens/s, converted linears) and a final one with
the logged losses of each float8 recipe (and of each other bf16 seed) against bf16: at every
`--log-every` step after the warm-up, |fp8 - bf16| / bf16 of the step's loss (what the FSDP2 loop
logs: the loss of the logging step, no smoothing), its maximum and whether it is within `--tol`; and
the same for the mean loss of the `--log-every` steps up to each logged step (what Hugging Face's
Trainer logs). Writes fp8_parity.json and, where matplotlib is installed, fp8_parity.png to --out.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench import gpu_common as gc  # noqa: E402


def parity_config(vocab: int, layers: int, hidden: int, intermediate: int):
    """The parity model: qwen3_5 at `hidden` / `intermediate` with the 27B's head shapes (so the
    gated-delta-net and attention kernels are the 27B's); SHAPE=tiny: the project's tiny qwen3_5."""
    from raytune_ft.models.tiny import tiny_config

    if gc.SHAPE == "tiny":
        return tiny_config("qwen3_5", vocab, num_hidden_layers=layers)
    return tiny_config("qwen3_5", vocab, num_hidden_layers=layers, hidden_size=hidden,
                       intermediate_size=intermediate, num_attention_heads=24, num_key_value_heads=4,
                       head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                       linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=65536)


def load_tokenizer(path: str | None):
    """A real tokenizer folder (its own chat template; a pad token as the loop's tokenizer_for sets it),
    or the project's tiny tokenizer when no path is given."""
    from raytune_ft.models.build import tokenizer_for
    from raytune_ft.recipe.recipe import ModelConfig

    if path is None:
        return tokenizer_for(ModelConfig(local_tiny=True))
    return tokenizer_for(ModelConfig(name=path, tokenizer=path))


def stdlib_rows(n: int, context: int = 10, lines: int = 40) -> list[dict]:
    """Up to `n` chat rows of real text: the running Python's standard library (tests excluded, files
    in sorted order), then, if more are asked for, the installed transformers package's own source.
    The user turn names the file and quotes `context` lines, the assistant turn is the next `lines`
    lines. Deterministic for one Python and one transformers version."""
    import sysconfig

    import transformers

    rows: list[dict] = []
    for root in (sysconfig.get_paths()["stdlib"], os.path.dirname(transformers.__file__)):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in (
                "test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"))
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read().splitlines()
                rel = os.path.relpath(path, os.path.dirname(root))
                for start in range(context, len(text) - lines // 2, context + lines):
                    before = "\n".join(text[start - context:start])
                    after = "\n".join(text[start:start + lines])
                    if not after.strip():
                        continue
                    rows.append({"messages": [
                        {"role": "user", "content": f"Continue `{rel}` from line {start + 1}:\n```python\n{before}\n```"},
                        {"role": "assistant", "content": f"```python\n{after}\n```"}]})
                    if len(rows) >= n:
                        return rows
    return rows


def make_blocks(tok, row_files: list[str], builtin_rows: int, seq: int,
                stdlib: int = 0) -> tuple[list[dict], dict]:
    """Packed blocks of the rows (files, standard-library text, builtin chat tasks; shuffled with a
    fixed seed), in the pipeline's format."""
    import random

    from raytune_ft.data.builtin import builtin_chat
    from raytune_ft.data.packing import DataCounters, pack_blocks
    from raytune_ft.data.pipeline import tokenize_rows

    rows: list = []
    for f in row_files:
        with open(f) as fh:
            rows += [json.loads(line) for line in fh if line.strip()]
    n_file_rows = len(rows)
    text_rows = stdlib_rows(stdlib) if stdlib else []
    rows += text_rows
    rows += builtin_chat(builtin_rows, seed=0)
    random.Random(0).shuffle(rows)
    cols = tokenize_rows(rows, tok)
    examples = [(ids, mask) for ids, mask in zip(cols["input_ids"], cols["mask"]) if ids]
    counters = DataCounters()
    blocks = list(pack_blocks(examples, seq, counters=counters, pad_id=tok.pad_token_id or 0))
    info = {"file_rows": n_file_rows, "stdlib_rows": len(text_rows), "builtin_rows": builtin_rows,
            "python": sys.version.split()[0], "conversations": len(examples),
            "blocks": len(blocks), "real_tokens": counters.real_tokens,
            "supervised_tokens": counters.supervised_tokens}
    return blocks, info


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to `floor` of the peak (the recipes' default schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + np.cos(np.pi * progress))


def train_curve(cfg, init_state: dict, blocks: list[dict], dev: torch.device, a, precision: str) -> dict:
    """Train `a.steps` steps from `init_state` in `precision` ("bf16", "bf16:seed<k>" or "fp8:<recipe>")."""
    from raytune_ft.models.build import decoder_layers
    from raytune_ft.train import fp8
    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.fsdp_loop import compile_pointwise, forward_backward, shard_packed_model

    compute = torch.bfloat16
    lm = gc.build_random_lm(cfg, dev, torch.float32)
    lm.load_state_dict(init_state)
    rec: dict = {"bench": "fp8_parity_run", "precision": precision}
    recipe = precision.split(":", 1)[1] if precision.startswith("fp8") else None
    if recipe:
        if not a.cpu_check:
            fp8.check_fp8_supported(dev, recipe)
        names = fp8.convert_to_fp8(decoder_layers(lm), recipe, min_dim=16 if a.cpu_check else fp8.FP8_MIN_DIM)
        rec["fp8_linears"] = len(names)
    if a.compile:
        compile_pointwise(lm)
    model = shard_packed_model(lm, dev, compute_dtype=compute, activation_checkpointing=a.ac,
                               loss_chunk=a.loss_chunk)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda")
    losses, norms = [], []
    t0, tokens, timed_from = None, 0, min(a.warmup, a.steps - 1)
    for step in range(a.steps):
        if step == timed_from:
            gc.sync(dev)
            t0, tokens = time.perf_counter(), 0
        mb = StepBatch.from_blocks([blocks[step % len(blocks)]], dev)
        loss_sum, denom = forward_backward(model, [mb], 1, dev)
        norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0).detach())
        for g in opt.param_groups:
            g["lr"] = a.lr * lr_factor(step, a.warmup, a.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if recipe:
            fp8.precompute_fp8_scales(model, recipe)
        losses.append((loss_sum / denom).detach())
        tokens += mb.n_real
    gc.sync(dev)
    dt = time.perf_counter() - t0
    rec.update(losses=[round(float(x), 5) for x in torch.stack(losses).float().cpu()],
               grad_norms=[round(float(getattr(x, "full_tensor", lambda: x)()), 4) for x in norms],
               tok_per_s=round(tokens / dt), peak_gib=round(gc.peak_gib(dev), 2))
    del model, lm, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    return rec


def window_means(curve: list[float], every: int) -> list[float]:
    """The mean loss of the `every` steps up to each step (fewer at the start)."""
    return [float(np.mean(curve[max(0, i + 1 - every):i + 1])) for i in range(len(curve))]


def compare(curves: dict[str, list[float]], warmup: int, log_every: int, tol: float) -> dict:
    """Each other curve (float8 recipes, other bf16 seeds) against bf16 at the logged steps after
    warm-up (1-based step numbers): the step's loss, and the mean of the `log_every` steps up to it."""
    ref = curves["bf16"]
    ref_mean = window_means(ref, log_every)
    logged = [s for s in range(log_every, len(ref) + 1, log_every) if s > warmup and ref[s - 1] > 0]
    out = {"logged_steps": logged, "tol": tol}
    for name, cur in curves.items():
        if name == "bf16":
            continue
        cur_mean = window_means(cur, log_every)
        signed = [(cur[s - 1] - ref[s - 1]) / ref[s - 1] for s in logged]   # logged steps have ref > 0
        rel = [abs(x) for x in signed]
        rel_mean = [abs(cur_mean[s - 1] - ref_mean[s - 1]) / abs(ref_mean[s - 1]) for s in logged]
        every = [abs(c - r) / abs(r) for c, r in zip(cur[warmup:], ref[warmup:]) if r > 0]   # 0: no labels
        out[name] = {"max_rel_diff_logged": round(max(rel), 5) if rel else None,
                     "mean_rel_diff_logged": round(float(np.mean(rel)), 5) if rel else None,
                     "within_tol_logged": sum(r <= tol for r in rel),
                     "max_rel_diff_any_step": round(max(every), 5) if every else None,
                     "within_tol": bool(rel) and max(rel) <= tol,
                     "max_rel_diff_window_mean": round(max(rel_mean), 5) if rel_mean else None,
                     "within_tol_window_mean": bool(rel_mean) and max(rel_mean) <= tol,
                     "signed_mean_rel_diff_logged": round(float(np.mean(signed)), 5) if rel else None,
                     "final_loss": cur[-1], "final_loss_bf16": ref[-1]}
    return out


def plot(result: dict, path: str) -> str | None:
    """Both curves and the relative difference at the logged steps; None where matplotlib is absent."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    curves, cmp_ = result["curves"], result["compare"]
    fig = Figure(figsize=(9, 6.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    color = {name: f"C{i}" for i, name in enumerate(curves)}   # one colour per run in both panels
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, color=color[name], lw=1.0 if name == "bf16" else 0.8,
                alpha=0.9 if name == "bf16" else 0.8)
    ax.set_ylabel("training loss (per step)")
    ax.set_title(result.get("title", "float8 vs bf16"), fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    steps = cmp_["logged_steps"]
    ref = curves["bf16"]
    for name, ys in curves.items():
        if name != "bf16":
            ax2.plot(steps, [100 * (ys[s - 1] - ref[s - 1]) / ref[s - 1] for s in steps], marker=".", label=name,
                     color=color[name])
    tol = 100 * cmp_["tol"]
    ax2.axhspan(-tol, tol, color="green", alpha=0.08)
    ax2.axhline(0, color="black", lw=0.6)
    ax2.legend(fontsize=8)
    ax2.set_ylabel("(run - bf16) / bf16, %")
    ax2.set_xlabel(f"step (logged every {steps[1] - steps[0] if len(steps) > 1 else 1} after warm-up)")
    ax2.grid(alpha=0.3)
    fig.savefig(path)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the project's tiny one)")
    p.add_argument("--rows", nargs="*", default=[], help="JSONL chat files (globs allowed)")
    p.add_argument("--builtin-rows", type=int, default=6000, help="builtin chat tasks added to the rows")
    p.add_argument("--stdlib-rows", type=int, default=0,
                   help="rows of real text: the running Python's standard library, then transformers' source (above)")
    p.add_argument("--bf16-seeds", type=int, default=1,
                   help="bf16 runs from this many initial weights (seed 0 is the reference; the others "
                        "measure the run-to-run spread)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--seq", type=int, default=8192, help="tokens per packed block (one block per step)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30, help="LR warm-up steps, also excluded from the comparison")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tol", type=float, default=0.02)
    p.add_argument("--recipes", default="tensorwise,rowwise", help="float8 recipes to compare with bf16")
    p.add_argument("--ac", default="full", choices=["none", "full", "selective"])
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager (default: train.compile)")
    p.add_argument("--cpu-check", action="store_true",
                   help="run float8 on CPU (torch's CPU float8 matmul) at any size: checks the path only")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--plot-from", default=None, help="draw the figure from a fp8_parity.json and exit")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)

    if a.plot_from:
        with open(a.plot_from) as f:
            result = json.load(f)
        png = plot(result, os.path.join(a.out, "fp8_parity.png"))
        print(png or "matplotlib is not installed: no figure")
        return result

    dev = gc.device()
    gc.init_single_process_group(dev)
    if dev.type != "cuda" and not a.cpu_check:
        from raytune_ft.train.fp8 import check_fp8_supported

        check_fp8_supported(dev, a.recipes.split(",")[0])   # raises with the reason
    files = sorted(f for pat in a.rows for f in glob.glob(pat))
    tok = load_tokenizer(a.tokenizer)
    t = time.perf_counter()
    blocks, data = make_blocks(tok, files, a.builtin_rows, a.seq, stdlib=a.stdlib_rows)
    if len(blocks) < a.steps:
        print(f"note: {len(blocks)} blocks for {a.steps} steps: blocks repeat", flush=True)
    data["tokenize_s"] = round(time.perf_counter() - t, 1)
    cfg = parity_config(-(-len(tok) // 128) * 128, a.layers, a.hidden, a.intermediate)   # aligned lm_head
    def init_weights(seed: int) -> dict:
        lm = gc.build_random_lm(cfg, dev, torch.float32, seed=seed)
        state = {k: v.detach().cpu().clone() for k, v in lm.state_dict().items()}
        del lm
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return state

    init = init_weights(0)
    head = {"model": {k: getattr(cfg, k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                     "vocab_size")},
            "params_m": round(sum(v.numel() for v in init.values()) / 1e6, 1), "data": data,
            "steps": a.steps, "seq": a.seq, "lr": a.lr, "warmup": a.warmup, "compile": a.compile, "ac": a.ac,
            "master": "fp32", "compute": "bf16", "versions": gc.versions()}
    gc.emit({"bench": "fp8_parity_setup", **head})
    curves, runs = {}, {}
    recipes = [(f"fp8:{r}", 0) for r in a.recipes.split(",") if r]   # order: what a short call must keep first
    runs_to_make = [("bf16", 0), *recipes[:1], *[(f"bf16:seed{k}", k) for k in range(1, a.bf16_seeds)], *recipes[1:]]
    title = (f"qwen3_5 {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}: "
             f"{a.steps} steps x {a.seq} tokens, fp32 master, bf16 compute")
    result: dict = {}
    for precision, seed in runs_to_make:
        rec = train_curve(cfg, init if seed == 0 else init_weights(seed), blocks, dev, a, precision)
        gc.emit(rec)
        curves[precision] = rec["losses"]
        runs[precision] = {k: v for k, v in rec.items() if k not in ("losses", "grad_norms")}
        # written after every run, so a call that runs out of time keeps the curves it has
        result = {**head, "runs": runs, "curves": curves, "title": title,
                  "compare": compare(curves, a.warmup, a.log_every, a.tol)}
        with open(os.path.join(a.out, "fp8_parity.json"), "w") as f:
            json.dump(result, f)
    png = plot(result, os.path.join(a.out, "fp8_parity.png"))
    gc.emit({"bench": "fp8_parity", "compare": {k: v for k, v in result["compare"].items() if k != "logged_steps"},
             "runs": runs, "figure": png or "matplotlib absent: --plot-from fp8_parity.json elsewhere"})
    return result

if __name__ == "__main__":
    main()
