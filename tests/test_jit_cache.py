"""The JIT caches of a worker (Triton, tilelang, FLA autotune, TorchInductor) in one fingerprinted folder:
the environment points every cache there, the folder goes to the run's storage as one tar after the first
step, and a second node (another local root) starts from it. Real local filesystems throughout; the
cache contents are files written by the test (no GPU here to JIT anything)."""
from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest

from raytune_ft.env import scoped_env
from raytune_ft.train import jit_cache

CACHE_VARS = ("TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLA_CACHE_RESULTS")


@pytest.fixture
def clean_env():
    """The cache variables unset for the test and put back afterwards."""
    with scoped_env(keep=CACHE_VARS):
        for k in CACHE_VARS:
            os.environ.pop(k, None)
        yield


def test_fingerprint_names_the_gpu_and_changes_with_any_version():
    base = {"torch": "2.13.0", "triton": "3.6.0", "flash-linear-attention": "0.6.0", "tilelang": "0.1.7"}
    fp = jit_cache.fingerprint("NVIDIA H200", base)
    assert fp.startswith("nvidia-h200-") and "/" not in fp
    assert jit_cache.fingerprint("NVIDIA H200", dict(base)) == fp
    assert jit_cache.fingerprint("NVIDIA B300", base) != fp
    for pkg in base:
        assert jit_cache.fingerprint("NVIDIA H200", {**base, pkg: "9.9"}) != fp, pkg
    assert jit_cache.fingerprint(None, base).startswith("cpu-")


def test_every_cache_variable_points_into_the_fingerprinted_folder(tmp_path, clean_env):
    cache = jit_cache.open_cache(str(tmp_path / "jit"), "NVIDIA H200", remote=None, log=print)
    assert cache.folder == str(tmp_path / "jit" / jit_cache.fingerprint("NVIDIA H200"))
    for var in ("TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert os.environ[var].startswith(cache.folder + os.sep), var
        assert os.path.isdir(os.environ[var])
    assert os.environ["FLA_CACHE_RESULTS"] == "1"


def test_a_cache_variable_the_user_set_is_kept(tmp_path, clean_env):
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path / "mine")
    jit_cache.open_cache(str(tmp_path / "jit"), None, remote=None, log=print)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "jit"))


def test_inductor_s_own_default_inherited_from_a_driver_is_replaced(tmp_path, clean_env):
    """Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR once a process asks for its cache; a
    command-line run's driver that did so handed it to its local Ray workers, and their graphs missed the
    job's cache folder (the first re-submit then found none of them)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    inherited = cache_dir()           # what a driver that touched Inductor leaves in its environment
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == inherited
    cache = jit_cache.open_cache(str(tmp_path / "jit"), None, remote=None, log=print)
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
    first = jit_cache.open_cache(str(tmp_path / "node1"), "NVIDIA H200", remote=storage, log=lines.append)
    files = _fill(first.folder)                       # what the first step JIT-compiled
    assert first.save(log=lines.append)
    tar = f"{storage[1]}/jit_cache/{jit_cache.fingerprint('NVIDIA H200')}.tar"
    assert os.path.isfile(tar), lines

    second = jit_cache.open_cache(str(tmp_path / "node2"), "NVIDIA H200", remote=storage, log=lines.append)
    for rel, data in files.items():
        with open(os.path.join(second.folder, rel), "rb") as f:
            assert f.read() == data, rel
    assert any("restored" in ln for ln in lines), lines
    # nothing new was compiled on the second node: no second upload
    mtime = os.stat(tar).st_mtime_ns
    assert not second.save(log=lines.append)
    assert os.stat(tar).st_mtime_ns == mtime
    # a re-submit on the first node does not unpack its own upload again, and uploads what is new
    again = jit_cache.open_cache(str(tmp_path / "node1"), "NVIDIA H200", remote=storage, log=lines.append)
    assert not again.save(log=lines.append)
    with open(os.path.join(again.folder, "triton", "new.cubin"), "wb") as f:
        f.write(b"new kernel")
    assert again.save(log=lines.append)
    # another GPU gets a folder (and a tar) of its own
    other = jit_cache.open_cache(str(tmp_path / "node2"), "NVIDIA B300", remote=storage, log=lines.append)
    assert other.folder != second.folder and not os.listdir(os.path.join(other.folder, "triton"))


def test_a_broken_cache_never_fails_the_run(tmp_path, clean_env):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    lines: list[str] = []
    # the local root is a file, the storage path lies below a file: both fail, neither raises
    assert jit_cache.open_cache(str(blocker / "jit"), None, remote=None, log=lines.append) is None
    cache = jit_cache.open_cache(str(tmp_path / "jit"), None, remote=(pafs.LocalFileSystem(), str(blocker / "s")),
                                 log=lines.append)
    _fill(cache.folder)
    assert not cache.save(log=lines.append)
    assert any("JIT cache" in ln for ln in lines), lines
    # a torn tar on the storage is skipped at start
    bad = (pafs.LocalFileSystem(), str(tmp_path / "torn"))
    os.makedirs(tmp_path / "torn" / "jit_cache")
    (tmp_path / "torn" / "jit_cache" / f"{jit_cache.fingerprint(None)}.tar").write_bytes(b"not a tar")
    assert jit_cache.open_cache(str(tmp_path / "jit3"), None, remote=bad, log=lines.append) is not None


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
        cache = jit_cache.open_cache({str(tmp_path)!r}, None, remote=None, log=print)
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
jit_cache.open_cache(sys.argv[1], None, remote=None, log=print)
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
