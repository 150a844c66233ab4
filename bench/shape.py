"""The 27B recipe at its real depth on one GPU: rank 0 of an N-rank FSDP2 group on torch's fake process group.

    python -m bench gpu shape                       # 64 layers, rank 0 of 8, the recipe's 32,768-token blocks
    python -m bench gpu shape --ranks 8 --master bf16 --seq 32768 --steps 10
    python -m bench gpu shape --cpu-smoke           # the same path: the recipe's tiny model, on CPU
    python -m bench gpu shape --cp 8 --seq 131072 --whole   # rank 0 of a CP-8 group, one conversation a block

One process, no Ray: the recipe (jobs/qwen27b_b300.py, `--set` overrides on top) goes through the FSDP2 loop's
own building blocks, in the loop's order: `build_fsdp_model` (tokenizer, the model on the meta device, the
start-up kernel check at the model's real widths, float8 conversion with `--precision fp8`, `train.compile`,
activation checkpointing, the chunked loss, FSDP2 sharding, random init of this rank's shard), fused AdamW,
then `forward_backward` and `clip_gradients` on packed blocks in the pipeline's format
(`data.packing.block_from_segments`, the seed's conversation lengths). The process group is torch's fake one
(backend "fake"): this rank holds 1/N of the parameters, gradients and optimizer state, and every collective
returns at once without moving data. So memory and compute per rank are the real ones; the weights other
ranks would send are whatever the all-gather buffer held (the loss is not meaningful) and no communication
time is in the step.

`--master auto` (the default) runs the shipped setting when the memory plan says it fits this GPU, else the
closest one that does, tried in order: bf16 master weights, twice the ranks, half the block. The record says
which, and why.

After the steps, with `--ckpt` (default on a GPU), this rank's DCP shard of model and optimizer is written in
the background as the loop's checkpointer does it (`dcp.async_save` through a pinned-memory stager): the
seconds the loop was held, the write's seconds, the shard's bytes; then read back into the model and
optimizer (`dcp_io.load`) and timed.

`--cp C` (`scaling.context_parallel`): this process is rank 0 of a data-parallel x context-parallel mesh on
the same fake group. A step trains the C blocks its CP group drew, each split over the group in the CP loop's
own layout (`train.context_parallel.cp_step_batch`: zigzag chunks, global positions), this rank's share of
each as one micro-batch. The gathers of keys, values, conv inputs and state summaries move nothing (their
buffers hold whatever memory they were given), so the step's time has no communication in it: `raytune-ft
plan` states that part from the model and the mesh. Tokens and FLOPs per rank are the group's over C.
`--whole`: each block is one conversation (the long-context case) instead of the seed's conversation lengths.

Prints `RESULT {json}` and appends a dated record (bench/results/<date>.jsonl).
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench gpu shape", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8, help="the FSDP2 group this process is rank 0 of (default 8)")
    p.add_argument("--layers", type=int, default=64, help="decoder layers (default 64: the whole 27B)")
    p.add_argument("--seq", type=int, default=None, help="tokens per packed block (default: the recipe's)")
    p.add_argument("--master", default="auto", choices=["auto", "fp32", "bf16"],
                   help="master weights; auto: the recipe's when the plan fits this GPU, else the closest fit")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--fp8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "mxfp8"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warm", type=int, default=2, help="steps left out of the timed figures (compiles, JIT)")
    p.add_argument("--ckpt", default="auto", choices=["auto", "on", "off"],
                   help="a background DCP save of this rank's shard and its read-back (auto: on a GPU)")
    p.add_argument("--ckpt-dir", default=None, help="where the shard is written (default: a temporary folder)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: tests/fixtures/tokenizers/qwen3)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe setting, last")
    p.add_argument("--workdir", default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="the recipe's tiny local model on CPU, 3 steps")
    p.add_argument("--results", default=None, help="folder of the dated records")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel group this rank belongs to (scaling.context_parallel; default 1)")
    p.add_argument("--whole", action="store_true", help="each block one conversation, not the seed's lengths")
    p.add_argument("--profile", action="store_true",
                   help="one more step under torch.profiler: GPU time by kernel kind and by phase, and the gap")
    p.add_argument("--memory-peak", action="store_true",
                   help="one more step under CUDA memory history: what is live at its peak, by allocating line")
    return p.parse_args(argv)


def candidates(ranks: int, seq: int, master: str) -> list[dict]:
    """The shipped setting first, then the closest ones that take less memory per rank."""
    if master != "auto":
        return [{"ranks": ranks, "seq": seq, "master": master}]
    return [{"ranks": ranks, "seq": seq, "master": "fp32"}, {"ranks": ranks, "seq": seq, "master": "bf16"},
            {"ranks": 2 * ranks, "seq": seq, "master": "fp32"}, {"ranks": ranks, "seq": seq // 2, "master": "bf16"}]


def make_recipe(a, setting: dict, model_dir: str | None):
    """jobs/qwen27b_b300.py's recipe for `setting`: its real widths at `--layers`, random weights."""
    from jobs import qwen27b_b300 as job
    from raytune_ft.recipe.recipe import apply_overrides

    r = job.recipe()
    sets = [f"scaling.num_workers={setting['ranks']}", f"train.master_weights={setting['master']}",
            f"data.seq_len={setting['seq']}", "registry.enabled=false"]
    if a.cp > 1:
        sets += [f"scaling.context_parallel={a.cp}"]
    if a.cpu_smoke:
        r = job.local(r)
        sets += [f"scaling.num_workers={setting['ranks']}", "train.compile=true"]
    else:
        tok = a.tokenizer or os.path.join(REPO, "tests", "fixtures", "tokenizers", "qwen3")
        sets += [f"model.name={model_dir}", "model.init=random", "model.revision=none", f"model.tokenizer={tok}",
                 # a speed figure of a fallback path is no figure: a fast kernel that fails the start-up check
                 # stops the run in seconds (`--set train.kernels=check` measures the paths that passed)
                 "train.kernels=strict"]
    if a.precision == "fp8":
        sets += ["train.precision=fp8", f"train.fp8_recipe={a.fp8_recipe}"]
    return apply_overrides(r, sets + a.set)


def plausible(a, device_name: str | None, model_dir: str | None) -> tuple[list[dict], list[dict]]:
    """The candidates worth a try on this GPU, shipped first: those whose plan (an upper estimate) is within
    the GPU's whole memory; each plan's verdict beside it. A try that runs out of memory moves to the next."""
    from raytune_ft.planning.hardware import gpu_spec
    from raytune_ft.planning.plan import memory_plan

    seq = a.seq or (512 if a.cpu_smoke else 32768)
    cands = candidates(a.ranks, seq, a.master)
    spec = gpu_spec(device_name)
    if spec is None:
        return cands[:1], []
    tried = []
    for c in cands:
        plan = memory_plan(make_recipe(a, c, model_dir), gpu=device_name)
        tried.append({**c, "plan_gib": round(plan.total_bytes / 2**30, 1), "plan_fits_with_margin": plan.fits,
                      "tried": plan.total_bytes <= spec.memory_bytes})
    keep = [c for c, t in zip(cands, tried) if t["tried"]]
    return keep or cands[-1:], tried


def init_fake_group(ranks: int, device) -> None:
    """Rank 0 of `ranks` on torch's fake process group: collectives return at once, moving nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)


def blocks(cfg, seq: int, n: int, seed: int = 0, whole: bool = False) -> list[dict]:
    import numpy as np

    from bench import gpu_common as gc

    rng = np.random.default_rng(seed)
    return [gc.packed_block([seq] if whole else gc.seed_lengths(seq, rng), cfg.vocab_size, rng) for _ in range(n)]


def cp_mesh_group(ranks: int, cp: int, device):
    """Rank 0's CP group on the fake process group (the loop's `cp_group` also makes a gloo group on the
    host to pool the blocks, which the fake group does not need: this process holds every block)."""
    from torch.distributed.device_mesh import init_device_mesh

    from raytune_ft.train.context_parallel import CPGroup

    mesh = init_device_mesh(device.type, (ranks // cp, cp), mesh_dim_names=("dp", "cp"))
    return CPGroup(cp, 0, mesh.get_group("cp"), None)


def step_batches(step_blocks: list[dict], device, cp) -> list:
    """One step's micro-batches for rank 0: its block, or under CP its share of each of the group's blocks."""
    from raytune_ft.train.context_parallel import cp_step_batch
    from raytune_ft.train.fsdp_loop import StepBatch

    if cp is None:
        return [StepBatch.from_blocks(step_blocks, device)]
    return [cp_step_batch([b], device, cp, owned=i == 0) for i, b in enumerate(step_blocks)]


def compile_counts() -> dict:
    from torch._dynamo.utils import counters

    return {k: int(v) for k, v in {**{f"inductor.{k}": v for k, v in counters["inductor"].items()},
                                  **{f"aot.{k}": v for k, v in counters["aot_autograd"].items()}}.items()
            if "cache" in k}


def checkpoint_round(state, rank: int, device, folder: str) -> dict:
    """This rank's DCP shard written in the background as the loop's checkpointer stages it (pinned host
    copy, the loop held only for the staging), then read back into the model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from raytune_ft.train import dcp_io

    from torch.distributed.checkpoint import default_planner

    # Rank 0's plan alone fails DCP's global check (every tensor's chunks fill the tensor): the other ranks'
    # chunks are missing. The check still runs and its verdict is recorded; the save goes on with rank 0's own
    # chunks, which are what this rank writes in a real run
    check, verdicts = default_planner._validate_global_plan, []

    def lenient(plan, metadata):
        found = check(plan, metadata)
        verdicts.append(len(found) if isinstance(found, list) else (0 if found else 1))
        return [] if isinstance(found, list) else True

    default_planner._validate_global_plan = lenient
    cuda = device.type == "cuda"
    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=cuda))
    out: dict = {"folder": folder}
    try:
        t0 = time.perf_counter()
        # no_dist: on the fake group rank 0's plan would come back N times and DCP's de-duplication hand some
        # of its chunks to "other ranks", which write nothing: this rank plans and writes its own shard alone
        parts, where = {"app": dcp_io.ShardedTrainState(state.sharded, rank)}, os.path.join(folder, dcp_io.DCP_DIR)
        if "no_dist" in inspect.signature(dcp.async_save).parameters:
            fut = dcp.async_save(parts, checkpoint_id=where, async_stager=stager, no_dist=True)
            out["held_s"] = round(time.perf_counter() - t0, 2)
            getattr(fut, "upload_completion", fut).result()
        else:
            out["mode"] = "synchronous: this torch's async_save has no no_dist"
            dcp.save(parts, checkpoint_id=where, no_dist=True)
        out["write_s"] = round(time.perf_counter() - t0, 2)
    finally:
        stager.close()
        default_planner._validate_global_plan = check
    out["global_plan_check"] = (f"{verdicts[0]} tensors not covered by rank 0's chunks alone (expected on the fake "
                                "group; not enforced here)" if verdicts and verdicts[0] else "passed")
    out |= read_back(state, rank, device, folder)
    if "read_error" in out:     # what the folder held, then the same shard written synchronously and read
        out["files"] = {f: os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs}
        shutil.rmtree(folder, ignore_errors=True)
        for p in state.sharded["model"].model.parameters():    # the failed read left them zero
            getattr(p, "_local_tensor", p).data.uniform_(-0.01, 0.01)
        t0 = time.perf_counter()
        dcp.save({"app": dcp_io.ShardedTrainState(state.sharded, rank)},
                 checkpoint_id=os.path.join(folder, dcp_io.DCP_DIR), no_dist=True)
        out["sync_write_s"] = round(time.perf_counter() - t0, 2)
        out["sync"] = read_back(state, rank, device, folder)
    return out


def read_back(state, rank: int, device, folder: str) -> dict:
    """The folder's size, then its shard read into the model and optimizer (weights zeroed first, so the
    read must bring them back)."""
    import pyarrow.fs as pafs
    import torch

    from raytune_ft.train import dcp_io

    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
    out: dict = {"bytes": size, "gib": round(size / 2**30, 2)}
    weights = [p for p in state.sharded["model"].model.parameters()]

    def sums() -> list[str]:
        # as text, so a NaN weight (the fake group's gradients are whatever its buffers held) equals itself
        return [repr(float(getattr(p, "_local_tensor", p).float().sum())) for p in weights[:4]]

    before = sums()
    for p in weights:
        getattr(p, "_local_tensor", p).data.zero_()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    try:
        # no_dist: as the write, this rank plans its read alone (the fake group's gather returns no plans)
        opened = dcp_io.load(pafs.LocalFileSystem(), folder, state.sharded, rank, no_dist=True)
    except Exception as e:  # noqa: BLE001 - recorded; the caller tries the synchronous write
        return out | {"read_error": f"{type(e).__name__}: {str(e)[:300]}"}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out["read_s"] = round(time.perf_counter() - t0, 2)
    out["read_files"] = [os.path.basename(p) for p in opened]
    out["restored"] = before == sums()
    return out


def main(argv=None) -> int:
    a = parse(argv)
    from raytune_ft.env import ALLOC_CONF_DEFAULT, ALLOC_CONF_ENV

    os.environ.setdefault(ALLOC_CONF_ENV, ALLOC_CONF_DEFAULT)     # as the job's workers run (before CUDA starts)
    import torch

    cuda = torch.cuda.is_available() and not a.cpu_smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    device_name = torch.cuda.get_device_name(device) if cuda else None
    if a.cpu_smoke:
        a.steps, a.warm = min(a.steps, 3), 1
    work = a.workdir or tempfile.mkdtemp(prefix="raytune_shape_")
    model_dir = None
    if not a.cpu_smoke:
        from raytune_ft.models.tiny import real_config

        model_dir = os.path.join(work, f"qwen3.8-27b-{a.layers}layers")
        real_config("qwen3.8-27b", num_hidden_layers=a.layers).save_pretrained(model_dir)
    settings, tried = plausible(a, device_name, model_dir)
    out_of_memory = []
    base = {"bench": "shape", "plans": tried, "out_of_memory": out_of_memory, "layers": a.layers, "cp": a.cp,
            "precision": a.precision, "device": device_name or "cpu"}
    signal.signal(signal.SIGTERM, _cut)     # `timeout` ends a long run: its steps so far are still recorded
    from raytune_ft.models.kernel_check import KernelCheckError

    for setting in settings:
        rec = {**base, "setting": setting, "steps": a.steps, "warm": a.warm,
               "shipped": {"ranks": a.ranks, "seq": a.seq or 32768, "master": "fp32"}}
        try:
            run_setting(a, setting, model_dir, device, rec)
        except KernelCheckError as e:
            print(f"[shape] {e}", flush=True)
            return _record(a, {**rec, "kernel_check_failed": str(e).splitlines()[1:]}, 3)
        except StepsCut as e:
            return _record(a, {**rec, "cut": f"{e} after {len(rec.get('step_s', []))} of {a.steps} steps"}, 124)
        except torch.OutOfMemoryError as e:
            out_of_memory.append({**setting, "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1),
                                  "error": str(e).split("\n")[0][:200]})
            print(f"[shape] out of memory at {setting}: trying the next setting", flush=True)
        if out_of_memory and out_of_memory[-1].get("seq") == setting["seq"] and \
                out_of_memory[-1].get("master") == setting["master"] and out_of_memory[-1]["ranks"] == setting["ranks"]:
            import gc as pygc

            pygc.collect()          # the failed try's model and optimizer, once the exception is gone
            torch.cuda.empty_cache()
            continue
        return _record(a, rec, 0)
    return _record(a, base, 1)            # no setting fitted: a result too


def _record(a, rec: dict, rc: int) -> int:
    """Print `rec` with the package versions as the RESULT line, append it to the dated records; `rc`."""
    from bench import gpu_common as gc
    from bench import records

    rec = {**rec, "versions": gc.versions()}
    gc.emit(rec)
    if a.results or not a.cpu_smoke:
        records.append(a.results or records.DEFAULT_RESULTS_DIR, rec)
    return rc


class StepsCut(Exception):
    """The run was told to stop (SIGTERM, as `timeout` sends) before its last step."""


def _cut(signum, frame) -> None:
    raise StepsCut(f"stopped by signal {signum}")


def diagnose(rec: dict, key: str, run: Callable[[], dict]) -> bool:
    """One more step under a diagnostic (the profiler, the memory history): its result in `rec[key]`, or, where it
    raised, the error there, so that the timed steps' record is still written. Whether it gave a result."""
    try:
        rec[key] = run()
        return True
    except Exception as e:  # noqa: BLE001 - what stopped it is the finding; the timed steps stand
        rec[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(f"[shape] {key} failed: {rec[key]['error']}", flush=True)
        return False


def run_setting(a, setting: dict, model_dir: str | None, device, rec: dict) -> None:
    """Build, step, time and (optionally) checkpoint one setting on the fake group; figures into `rec`."""
    import torch
    import torch.distributed as dist

    from raytune_ft.planning.hardware import flops_per_block, gpu_spec

    cuda = device.type == "cuda"
    device_name = torch.cuda.get_device_name(device) if cuda else None
    recipe = make_recipe(a, setting, model_dir)
    if device_name:
        from raytune_ft.planning.plan import memory_plan

        rec["plan_gib"] = round(memory_plan(recipe, gpu=device_name).total_bytes / 2**30, 2)
    if dist.is_initialized():
        dist.destroy_process_group()
    init_fake_group(setting["ranks"], device)
    cp = cp_mesh_group(setting["ranks"], a.cp, device) if a.cp > 1 else None
    from raytune_ft.train.common import WorkerLog
    from raytune_ft.train.batch import real_seq_lens
    from raytune_ft.train.fsdp_loop import clip_gradients, forward_backward
    from raytune_ft.train.fsdp_model import build_fsdp_model
    from raytune_ft.train.fp8 import precompute_fp8_scales
    from raytune_ft.train.state import TrainState

    log = WorkerLog(0, recipe)
    t0 = time.perf_counter()
    model, lm, _ = build_fsdp_model(recipe, device, log)
    if cuda:
        torch.cuda.synchronize(device)
    rec["build_s"] = round(time.perf_counter() - t0, 1)
    rec["build_parts_s"] = {k: round(v, 2) for k, v in {**log.startup.seconds, **log.startup.parts}.items() if v}
    from raytune_ft.models.attention import DISABLED_KERNELS

    rec["kernels_off"] = sorted(DISABLED_KERNELS)      # with train.kernels=check: the paths measured are fallbacks
    params = [p for p in model.parameters() if p.requires_grad]
    t = recipe.train
    opt = torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, fused=cuda)
    rec["local_params"] = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    rec["params"] = sum(p.numel() for p in params)
    fp8 = t.fp8_recipe if t.precision == "fp8" else None
    group_blocks = cp.size if cp else 1          # a CP group trains the blocks its C members drew
    data = blocks(lm.config, setting["seq"], a.steps * group_blocks, whole=a.whole)
    per_step = [data[i * group_blocks:(i + 1) * group_blocks] for i in range(a.steps)]
    rec["conversations"] = "whole block" if a.whole else "seed lengths"
    step_s, flops, flops_gdn, tokens, losses = [], [], [], [], []
    model.train()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)   # a failed larger setting's peak is not this one's
    for i, step_blocks in enumerate(per_step):
        ts = time.perf_counter()
        mbs = step_batches(step_blocks, device, cp)
        loss_sum, denom = forward_backward(model, mbs, setting["ranks"], device)
        clip_gradients(params, t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if fp8:
            precompute_fp8_scales(model, fp8)
        if cuda:
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - ts)
        # this rank's part: its block, or 1/C of each of its group's C blocks (zigzag balances the causal work)
        lens = [[int(n) for n in real_seq_lens(b)] for b in step_blocks]
        tokens.append(sum(map(sum, lens)) / group_blocks)
        flops.append(sum(flops_per_block(lm.config, ls) for ls in lens) / group_blocks)
        flops_gdn.append(sum(flops_per_block(lm.config, ls, include_linear_attention=True)
                             for ls in lens) / group_blocks)
        losses.append(round(float(loss_sum / denom), 4))
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
        rec |= {"step_s": [round(x, 2) for x in step_s], "losses": losses}      # a cut run records these
        if cuda:
            rec["peak_gib"] = round(peak, 2)
        print(f"[shape] step {i + 1}/{a.steps}: {step_s[-1]:.2f} s, {tokens[-1]} tokens, peak {peak:.1f} GiB",
              flush=True)
        if i == 0:
            rec["compile_counts"] = compile_counts()
    timed = slice(a.warm, None)
    dt = sum(step_s[timed])
    peak = gpu_spec(device_name).peak_bf16_tflops * 1e12 if device_name and gpu_spec(device_name) else 0.0
    rec.update(step_s=[round(s, 2) for s in step_s], s_per_step=round(statistics.median(step_s[timed]), 3),
               first_step_s=round(step_s[0], 1),
               compile_s=round(step_s[0] - statistics.median(step_s[timed]), 1),
               tok_s_per_rank=round(sum(tokens[timed]) / dt), losses=losses)
    if peak:
        rec["mfu"] = round(sum(flops[timed]) / dt / peak, 4)
        rec["mfu_with_gdn"] = round(sum(flops_gdn[timed]) / dt / peak, 4)
        rec["peak_tflops"] = peak / 1e12
    if cuda:
        rec["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        rec["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
    if (a.profile or a.memory_peak) and cuda:
        from bench.memory_peak import memory_peak
        from bench.step_profile import profile_step

        def one_step(phase) -> None:
            mbs = step_batches(per_step[-1], device, cp)
            with phase("forward_backward"):
                forward_backward(model, mbs, setting["ranks"], device)
            with phase("clip"):
                clip_gradients(params, t.max_grad_norm)
            with phase("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)
            if fp8:
                with phase("fp8_scales"):
                    precompute_fp8_scales(model, fp8)

        if a.profile and diagnose(rec, "profile", lambda: profile_step(one_step, device)):
            print(f"[shape] profile: {rec['profile']['by_kind_share']} gap {rec['profile']['gap_ms']} ms of "
                  f"{rec['profile']['wall_ms']} ms", flush=True)
        if a.memory_peak and diagnose(rec, "memory_peak", lambda: memory_peak(
                lambda: one_step(lambda name: contextlib.nullcontext()), device)):
            print(f"[shape] memory peak: {rec['memory_peak']['peak_gib']} GiB, by site "
                  f"{rec['memory_peak']['by_site_gib']}", flush=True)
    if a.ckpt == "on" or (a.ckpt == "auto" and cuda):
        folder = a.ckpt_dir or tempfile.mkdtemp(prefix="raytune_shape_ckpt_")
        os.makedirs(folder, exist_ok=True)
        free = shutil.disk_usage(folder).free
        need = 3 * sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else
                       p.numel() * p.element_size() for p in params)
        if free < need * 1.1:
            rec["checkpoint"] = {"skipped": f"{need / 1e9:.1f} GB needed, {free / 1e9:.1f} GB free"}
        else:
            try:
                rec["checkpoint"] = checkpoint_round(TrainState(model, opt), 0, device, folder)
            except Exception as e:  # noqa: BLE001 - what stopped it is the finding
                rec["checkpoint"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            finally:
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
