"""Peak host memory of registering a ~1B-parameter model: logged from the folder on disk vs loaded.

    python bench/registry_memory.py                       # ~1.1B Qwen2, bf16, sharded safetensors
    python bench/registry_memory.py --hidden 512 --layers 2   # a quick smoke run

Each measurement runs `raytune_ft.registry.register_checkpoint` in a fresh child process against a
local sqlite MLflow store and reports the child's peak RSS two ways: its own
getrusage(RUSAGE_SELF).ru_maxrss and the parent's psutil polling of the child's process tree.
A `baseline` child only imports the same libraries and loads the tokenizer: the floor.
The random weights are written tensor by tensor (never a whole model in RAM), so making the
model does not need the memory that is being measured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = Path(os.environ.get("RAYTUNE_FIXTURES", REPO / "tests" / "fixtures")) / "tokenizers" / "qwen2-0.5b"


def make_model(out: Path, hidden: int, layers: int, intermediate: int, shard_bytes: int = 1 << 30) -> int:
    """A random Qwen2 checkpoint (hf/ + raytune_meta.json) in bf16 shards; returns its parameter count."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    cfg = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=max(hidden // 128, 2),
                      num_key_value_heads=max(hidden // 512, 1), tie_word_embeddings=True,
                      max_position_embeddings=4096, dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen2ForCausalLM(cfg).state_dict().items()
                  if k != "lm_head.weight"}  # tied to the embedding: not stored
    gen = torch.Generator().manual_seed(0)
    # write each shard as soon as it is full (temporary names: the shard count is known at the end)
    written: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total_size = n_params = 0

    def flush():
        nonlocal shard, size
        if shard:
            tmp_name = f"shard-{len(written):05d}.tmp"
            save_file(shard, str(hf / tmp_name), metadata={"format": "pt"})
            written.append((tmp_name, list(shard)))
            shard, size = {}, 0

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        if size and size + t.numel() * 2 > shard_bytes:
            flush()
        shard[name] = t
        size += t.numel() * 2
        total_size += t.numel() * 2
        n_params += t.numel()
    flush()
    weight_map = {}
    for i, (tmp_name, keys) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(hf / tmp_name, hf / fname)
        weight_map.update({k: fname for k in keys})
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(str(hf))
    tok.save_pretrained(str(hf))
    (out / "raytune_meta.json").write_text(json.dumps(
        {"job": "bench", "model_name": "random-qwen2-1b", "family": "qwen2", "step": 0,
         "final_loss": 0.0, "run_name": "bench"}))
    return n_params


def child(mode: str, ckpt: str, tracking: str) -> None:
    """One measurement, in its own process; prints a JSON line with its own peak RSS."""
    t0 = time.time()
    import mlflow  # noqa: F401  (the same imports in every mode)
    import torch  # noqa: F401
    import transformers

    from raytune_ft import registry
    if mode == "baseline":
        transformers.AutoTokenizer.from_pretrained(str(Path(ckpt) / "hf"))
        version = None
    else:
        result = registry.register_checkpoint(ckpt, f"main.default.bench_{mode}", tracking_uri=tracking,
                                              log_from_disk=(mode == "disk"))
        version = result.version
    print("RESULT " + json.dumps({"mode": mode, "version": version, "seconds": round(time.time() - t0, 1),
                                  "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure(mode: str, ckpt: Path, tracking: str, env: dict) -> dict:
    import psutil

    proc = subprocess.Popen([sys.executable, __file__, "_child", mode, str(ckpt), tracking],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = 0
    done = threading.Event()

    def poll():
        nonlocal peak
        p = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                rss = p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
                peak = max(peak, rss)
            except psutil.Error:
                pass
            time.sleep(0.05)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n{err[-4000:]}")
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    res["polled_peak_mib"] = round(peak / 2**20)
    res["ru_maxrss_mib"] = round(res["ru_maxrss_mib"])
    return res


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return child(*argv[1:4])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5504)
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temp dir, removed after)")
    ap.add_argument("--modes", default="baseline,disk,memory")
    args = ap.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="regbench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=str(work / "tmp"))
    (work / "tmp").mkdir(exist_ok=True)
    try:
        ckpt = work / "checkpoint_000001"
        t0 = time.time()
        # made in a child too, so the parent stays small and its memory is not mistaken for ours
        make = subprocess.run([sys.executable, "-c", (
            "import sys; sys.path.insert(0, %r); from registry_memory import make_model; from pathlib import Path;"
            "print(make_model(Path(%r), %d, %d, %d))") % (str(Path(__file__).parent), str(ckpt), args.hidden,
                                                          args.layers, args.intermediate)],
            capture_output=True, text=True, env=env)
        if make.returncode:
            raise SystemExit(make.stderr[-4000:])
        n_params = int(make.stdout.strip().splitlines()[-1])
        size_gib = sum(f.stat().st_size for f in (ckpt / "hf").glob("*.safetensors")) / 2**30
        print(f"model: {n_params / 1e9:.3f}B parameters, {size_gib:.2f} GiB of bf16 safetensors "
              f"(made in {time.time() - t0:.0f}s)", flush=True)
        results = []
        for mode in args.modes.split(","):
            tracking = f"sqlite:///{work / f'mlflow_{mode}.db'}"
            res = measure(mode, ckpt, tracking, env)
            results.append(res)
            print(json.dumps(res), flush=True)
            shutil.rmtree(work / "mlartifacts", ignore_errors=True)  # keep the disk use to one copy
        import mlflow
        import torch
        import transformers
        print("SUMMARY " + json.dumps({
            "params": n_params, "safetensors_gib": round(size_gib, 2), "results": results,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "mlflow": mlflow.__version__,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
