"""The JIT caches of a worker (Triton, tilelang, FLA autotune, TorchInductor) in one fingerprinted folder:
the environment points every cache there, the folder goes to the run's storage as one tar after the first
step, and a second node (another local root) starts from it. Real local filesystems throughout; the
cache contents are files written by the test (no GPU here to JIT anything)."""
from __future__ import annotations

import json
import os

import pyarrow.fs as pafs
import pytest

from raytune_ft.env import scoped_env
from raytune_ft.train import jit_cache

CACHE_VARS = ("TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLA_CACHE_RESULTS",
              "RAYTUNE_KERNEL_VERDICTS")


@pytest.fixture
def clean_env():
    """The cache variables unset for the test and put back afterwards."""
    with scoped_env(keep=CACHE_VARS):
        for k in CACHE_VARS:
            os.environ.pop(k, None)
        yield


def test_fingerprint_names_the_gpu_and_changes_with_any_version():
    base = {"torch": "2.13.0", "triton": "3.6.0", "flash-linear-attention": "0.6.0", "tilelang": "0.1.7"}
    fp = jit_cache.fingerprint("NVIDIA H200", base, driver="570.124.06", model="qwen3_5 hidden 5120").name
    assert fp.startswith("nvidia-h200-") and "/" not in fp
    assert jit_cache.fingerprint("NVIDIA H200", dict(base), driver="570.124.06", model="qwen3_5 hidden 5120").name == fp
    assert jit_cache.fingerprint("NVIDIA B300", base, driver="570.124.06", model="qwen3_5 hidden 5120").name != fp
    for pkg in base:
        assert jit_cache.fingerprint("NVIDIA H200", {**base, pkg: "9.9"}, driver="570.124.06",
                                     model="qwen3_5 hidden 5120").name != fp, pkg
    assert jit_cache.fingerprint("NVIDIA H200", base, driver="580.65.06", model="qwen3_5 hidden 5120").name != fp
    assert jit_cache.fingerprint("NVIDIA H200", base, driver="570.124.06", model="qwen3 hidden 2560").name != fp
    assert jit_cache.fingerprint(None, base).name.startswith("cpu-")


def test_every_cache_variable_points_into_the_fingerprinted_folder(tmp_path, clean_env):
    fp = jit_cache.fingerprint("NVIDIA H200")
    cache = jit_cache.open_cache(str(tmp_path / "jit"), fp, remote=None, log=print)
    assert cache.folder == str(tmp_path / "jit" / fp.name)
    for var in ("TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "RAYTUNE_KERNEL_VERDICTS"):
        assert os.environ[var].startswith(cache.folder + os.sep), var
        assert os.path.isdir(os.environ[var])
    assert os.environ["FLA_CACHE_RESULTS"] == "1"


def test_a_cache_variable_the_user_set_is_kept(tmp_path, clean_env):
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path / "mine")
    jit_cache.open_cache(str(tmp_path / "jit"), jit_cache.fingerprint(None), remote=None, log=print)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "jit"))


def test_inductor_s_own_default_inherited_from_a_driver_is_replaced(tmp_path, clean_env):
    """Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR once a process asks for its cache; a
    command-line run's driver that did so handed it to its local Ray workers, and their graphs missed the
    job's cache folder (the first re-submit then found none of them)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    inherited = cache_dir()           # what a driver that touched Inductor leaves in its environment
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == inherited
    cache = jit_cache.open_cache(str(tmp_path / "jit"), jit_cache.fingerprint(None), remote=None, log=print)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(cache.folder, "inductor")


def _fill(folder: str) -> dict[str, bytes]:
    files = {"triton/ab12/kernel.cubin": b"\x7fELF cubin", "triton/ab12/kernel.json": b'{"num_warps": 4}',
             "tilelang/kern/lib.so": b"\x7fELF so", "inductor/fxgraph/xy/graph": b"graph"}
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(folder, rel)), exist_ok=True)
        with open(os.path.join(folder, rel), "wb") as f:
            f.write(data)
    return files


def test_saved_after_the_first_step_and_restored_on_a_second_node(tmp_path, clean_env):
    storage = (pafs.LocalFileSystem(), str(tmp_path / "storage"))
    lines: list[str] = []
    h200 = jit_cache.fingerprint("NVIDIA H200")
    first = jit_cache.open_cache(str(tmp_path / "node1"), h200, remote=storage, log=lines.append)
    files = _fill(first.folder)                       # what the first step JIT-compiled
    assert first.save(log=lines.append)
    tar = f"{storage[1]}/jit_cache/{h200.name}.tar"
    assert os.path.isfile(tar), lines

    second = jit_cache.open_cache(str(tmp_path / "node2"), h200, remote=storage, log=lines.append)
    for rel, data in files.items():
        with open(os.path.join(second.folder, rel), "rb") as f:
            assert f.read() == data, rel
    assert any("restored" in ln for ln in lines), lines
    # what the node unpacked, for the start-up figures: the files, the tar's size, the time it took
    tar_mib = os.path.getsize(tar) / 2**20
    assert second.restored["files"] == len(files) and abs(second.restored["mib"] - tar_mib) <= 0.05
    assert 0 <= second.restored["download_s"] <= second.restored["restore_s"]
    assert first.restored is None         # the first node found no set: nothing unpacked
    # nothing new was compiled on the second node: no second upload
    mtime = os.stat(tar).st_mtime_ns
    assert not second.save(log=lines.append)
    assert os.stat(tar).st_mtime_ns == mtime
    # a re-submit on the first node does not unpack its own upload again, and uploads what is new
    again = jit_cache.open_cache(str(tmp_path / "node1"), h200, remote=storage, log=lines.append)
    assert not again.save(log=lines.append)
    with open(os.path.join(again.folder, "triton", "new.cubin"), "wb") as f:
        f.write(b"new kernel")
    assert again.save(log=lines.append)
    # another GPU gets a folder (and a tar) of its own
    other = jit_cache.open_cache(str(tmp_path / "node2"), jit_cache.fingerprint("NVIDIA B300"), remote=storage,
                                 log=lines.append)
    assert other.folder != second.folder and not os.listdir(os.path.join(other.folder, "triton"))


def test_a_broken_cache_never_fails_the_run(tmp_path, clean_env):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    lines: list[str] = []
    # the local root is a file, the storage path lies below a file: both fail, neither raises
    cpu = jit_cache.fingerprint(None)
    assert jit_cache.open_cache(str(blocker / "jit"), cpu, remote=None, log=lines.append) is None
    cache = jit_cache.open_cache(str(tmp_path / "jit"), cpu, remote=(pafs.LocalFileSystem(), str(blocker / "s")),
                                 log=lines.append)
    _fill(cache.folder)
    assert not cache.save(log=lines.append)
    assert any("JIT cache" in ln for ln in lines), lines
    # a torn tar on the storage (its fingerprint this node's) is skipped at start
    bad = (pafs.LocalFileSystem(), str(tmp_path / "torn"))
    os.makedirs(tmp_path / "torn" / "jit_cache")
    (tmp_path / "torn" / "jit_cache" / f"{cpu.name}.tar").write_bytes(b"not a tar")
    (tmp_path / "torn" / "jit_cache" / f"{cpu.name}.json").write_text(json.dumps(cpu.as_dict()))
    assert jit_cache.open_cache(str(tmp_path / "jit3"), cpu, remote=bad, log=lines.append) is not None
    assert "JIT cache not restored" in lines[-1], lines


H100 = "NVIDIA H100 80GB HBM3"
VERSIONS = {"torch": "2.11.0+cu130", "triton": "3.6.0", "flash-linear-attention": "0.6.0", "tilelang": "0.1.15",
            "causal-conv1d": "none", "flash-attn": "none"}
WIDTHS = "qwen3_5 hidden 5120 mlp 17408 attention 24/4x256 vocab 248320"


def _node(gpu: str = H100, **versions: str):
    return jit_cache.fingerprint(gpu, {**VERSIONS, **versions}, driver="570.124.06", model=WIDTHS)


def _open(tmp_path, node: str, fp, storage):
    lines: list[str] = []
    cache = jit_cache.open_cache(str(tmp_path / node), fp, remote=storage, log=lines.append)
    got = {rel: open(os.path.join(cache.folder, rel), "rb").read() for rel in jit_cache._files(cache.folder)}
    return got, [ln for ln in lines if "JIT cache" in ln]


def test_a_set_is_refused_for_another_torch_or_gpu_with_a_line_and_restored_for_the_same(tmp_path, clean_env):
    """The set an H100 node saved under the run's storage: a node with another torch, or another GPU, loads
    nothing of it and says in one line what differs; a node of the same fingerprint unpacks all of it."""
    storage = (pafs.LocalFileSystem(), str(tmp_path / "storage"))
    first = jit_cache.open_cache(str(tmp_path / "node1"), _node(), remote=storage, log=print)
    files = _fill(first.folder)
    assert first.save(log=print)
    key = json.loads((tmp_path / "storage" / "jit_cache" / f"{_node().name}.json").read_text())
    assert key == {"gpu": H100, "driver": "570.124.06", "versions": VERSIONS, "model": WIDTHS}

    got, lines = _open(tmp_path, "torch", _node(torch="2.13.0"), storage)
    assert got == {} and len(lines) == 1, lines
    assert f"the nearest, {_node().name}, was built for torch 2.11.0+cu130 (here 2.13.0)" in lines[0]
    assert "not loaded" in lines[0] and "GPU" not in lines[0]

    got, lines = _open(tmp_path, "gpu", _node("NVIDIA H200"), storage)
    assert got == {} and len(lines) == 1, lines
    assert f"was built for GPU '{H100}' (here 'NVIDIA H200')" in lines[0] and "torch" not in lines[0]

    got, lines = _open(tmp_path, "same", _node(), storage)
    assert got == files
    assert len(lines) == 1 and lines[0].startswith(
        f"JIT cache: restored {len(files)} files (") and f"from {storage[1]}/jit_cache/{_node().name}.tar in " in lines[0]


def test_a_set_under_this_nodes_name_is_loaded_only_with_this_nodes_fingerprint_beside_it(tmp_path, clean_env):
    """The name is a hash; what is loaded is decided by the fingerprint stored with the set. A tar without one
    (or with another one) under this node's name is left alone, said in one line."""
    storage = (pafs.LocalFileSystem(), str(tmp_path / "storage"))
    sets = tmp_path / "storage" / "jit_cache"
    other = jit_cache.open_cache(str(tmp_path / "node1"), _node(triton="3.5.1"), remote=storage, log=print)
    _fill(other.folder)
    assert other.save(log=print)
    mine = _node()
    os.rename(sets / f"{_node(triton='3.5.1').name}.tar", sets / f"{mine.name}.tar")
    got, lines = _open(tmp_path, "node2", mine, storage)
    assert got == {} and len(lines) == 1, lines
    assert lines[0].endswith(f"{mine.name}.tar not loaded: no fingerprint beside it")
    os.rename(sets / f"{_node(triton='3.5.1').name}.json", sets / f"{mine.name}.json")
    got, lines = _open(tmp_path, "node3", mine, storage)
    assert got == {} and lines[0].endswith("not loaded: triton 3.5.1 (here 3.6.0)"), lines


def test_the_fingerprint_holds_the_driver_and_the_models_widths(tmp_path, monkeypatch):
    from raytune_ft.train import jit_fingerprint
    from tests.planning.test_plan import job

    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  "
                       "(dvs-builder@U16-I3-B03-4-3)  Tue Feb 25 04:07:21 UTC 2025\nGCC version:  gcc version 12.3.0\n")
    monkeypatch.setattr(jit_fingerprint, "_DRIVER_FILE", str(version))
    assert jit_fingerprint.driver_version() == "570.124.06"
    assert jit_cache.fingerprint(H100, VERSIONS).driver == "570.124.06"
    assert jit_cache.fingerprint(None, VERSIONS).driver == "none"
    monkeypatch.setattr(jit_fingerprint, "_DRIVER_FILE", str(tmp_path / "absent"))
    assert jit_fingerprint.driver_version() == "none"
    # the 27B's full SFT and LoRA jobs compile the same kernels: one set; the 4B's widths are its own
    b300, lora, small = (jit_fingerprint.model_widths(job(n).recipe()) for n in ("qwen27b_b300", "qwen27b_lora",
                                                                                "qwen3_4b_full"))
    assert b300 == lora and "hidden 5120" in b300 and "gated-delta" in b300
    assert small != b300 and "hidden 2560" in small
    unknown = job("qwen27b_b300").recipe()
    unknown.model.name = "someone/unknown-model"
    assert jit_fingerprint.model_widths(unknown) == "someone/unknown-model"
    # every package the kernels come from is in the key
    assert {"torch", "triton", "flash-linear-attention", "tilelang", "causal-conv1d", "flash-attn"} <= \
        set(jit_fingerprint.VERSIONED)


def test_a_relative_cache_dir_is_refused_before_ray_starts():
    from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, validate

    r = Recipe()
    apply_overrides(r, ["train.cache_dir=jit"])
    with pytest.raises(RecipeError, match="train.cache_dir"):
        validate(r)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compile_keys_are_written_for_comparison_when_asked(tmp_path):
    """RAYTUNE_COMPILE_KEYS=1 (issue 36: the first re-submit after a cold run found none of its graphs): each
    process writes the details of its compile cache keys into <cache>/keys/<pid>.log; a real Inductor compile
    on CPU, in a fresh process."""
    import subprocess
    import sys
    import textwrap

    from tests.conftest import REPO, env_with_path

    code = textwrap.dedent(f"""
        import os, torch
        from raytune_ft.train import jit_cache
        cache = jit_cache.open_cache({str(tmp_path)!r}, jit_cache.fingerprint(None), remote=None, log=print)
        torch.compile(lambda x: (x * 2).relu())(torch.randn(8))
        print(cache.folder)
    """)
    env = env_with_path(REPO, drop=("TORCHINDUCTOR_CACHE_DIR",))
    env["RAYTUNE_COMPILE_KEYS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = out.stdout.strip().splitlines()[-1]
    (log,) = (p for p in os.listdir(os.path.join(folder, "keys")))
    text = open(os.path.join(folder, "keys", log)).read()
    assert "FX graph cache hash details for key" in text and "Autograd graph cache hash details" in text
    assert "hash details" not in out.stderr      # the file only


_COMPILE_IN_A_COPY = """
import os, sys, torch
from torch._dynamo.utils import counters
import raytune_ft
from raytune_ft.models.build import decoder_layers
from raytune_ft.models.tiny import tiny_config
from raytune_ft.train import jit_cache
from raytune_ft.train.fsdp_model import compile_pointwise
from transformers import AutoModelForCausalLM
assert raytune_ft.__file__.startswith(os.getcwd()), raytune_ft.__file__
jit_cache.open_cache(sys.argv[1], jit_cache.fingerprint(None), remote=None, log=print)
torch.manual_seed(0)
lm = AutoModelForCausalLM.from_config(tiny_config("qwen3", 512), dtype=torch.float32)
compile_pointwise(lm)
layer = decoder_layers(lm)[0]
x = torch.randn(1, 16, lm.config.hidden_size, requires_grad=True)
layer.mlp(layer.post_attention_layernorm(x)).sum().backward()
print("COUNTS", counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"],
      counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"])
"""

_DRIVER = """
import subprocess, sys
from torch._inductor.runtime.cache_dir_utils import cache_dir
cache_dir()     # as a command-line run's driver that touched Inductor before starting its local workers
sys.exit(subprocess.run([sys.executable, *sys.argv[1:]]).returncode)
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_submit_from_another_folder_finds_the_command_line_runs_graphs(tmp_path):
    """Two copies of the repository in different folders (a command-line run's, and Ray's copy of the working
    folder for a `ray job submit`) compile the loop's compiled modules (`compile_pointwise`) of the same model
    with the same cache root: the second finds every graph the first compiled. The first runs as a worker of
    a driver that touched Inductor's cache before (its default folder in the environment); the second starts
    clean, as the cluster's workers do."""
    import shutil
    import subprocess
    import sys

    from tests.conftest import REPO

    root = tmp_path / "jit"
    counts = []
    for name, argv in (("cli", ["-c", _DRIVER, "-c", _COMPILE_IN_A_COPY, str(root)]),
                       ("_ray_pkg_0123abcd", ["-c", _COMPILE_IN_A_COPY, str(root)])):
        copy = tmp_path / name
        shutil.copytree(os.path.join(REPO, "raytune_ft"), copy / "raytune_ft",
                        ignore=shutil.ignore_patterns("__pycache__"))
        env = {k: v for k, v in os.environ.items() if k not in CACHE_VARS}
        env |= {"PYTHONPATH": str(copy), "TMPDIR": str(tmp_path / f"tmp-{name}")}
        os.makedirs(env["TMPDIR"])
        out = subprocess.run([sys.executable, *argv], cwd=copy, env=env, capture_output=True, text=True,
                             timeout=500)
        assert out.returncode == 0, out.stderr[-3000:]
        counts.append([int(x) for x in out.stdout.split("COUNTS")[-1].split()])
    (hit1, miss1, aot_hit1, aot_miss1), (hit2, miss2, aot_hit2, aot_miss2) = counts
    assert miss1 > 0 and hit1 == 0 and aot_miss1 > 0
    assert (hit2, miss2) == (miss1, 0) and (aot_hit2, aot_miss2) == (aot_miss1, 0)


def test_the_kernel_checks_verdicts_travel_with_the_cache_to_a_second_node(tmp_path, clean_env):
    """Issue 60 item 5: an all-pass kernel check kept in node 1's folder goes up with its tar; node 2 of the
    same fingerprint restores it and its check runs no kernel."""
    from raytune_ft.models import kernel_check as kc
    from tests.models.test_kernel_check import CFG, F32, Counted

    storage = (pafs.LocalFileSystem(), str(tmp_path / "storage"))
    h200 = jit_cache.fingerprint("NVIDIA H200")
    first = jit_cache.open_cache(str(tmp_path / "node1"), h200, remote=storage, log=print)
    ran = Counted()
    kc.check_kernels(kc.KernelUse(CFG, "cpu", F32, verdicts_dir=os.environ["RAYTUNE_KERNEL_VERDICTS"]),
                     paths=ran.paths(), log_line=print)
    assert ran.runs > 0 and first.save(log=print)
    for k in CACHE_VARS:                  # node 2: its own process environment
        os.environ.pop(k, None)
    second = jit_cache.open_cache(str(tmp_path / "node2"), h200, remote=storage, log=print)
    assert os.environ["RAYTUNE_KERNEL_VERDICTS"].startswith(second.folder + os.sep)
    recalled = Counted()
    lines: list[str] = []
    kc.check_kernels(kc.KernelUse(CFG, "cpu", F32, verdicts_dir=os.environ["RAYTUNE_KERNEL_VERDICTS"]),
                     paths=recalled.paths(), log_line=lines.append)
    assert recalled.runs == 0 and "from the JIT cache" in lines[0], lines
