"""Python's bytecode where the image keeps none (env.keep_bytecode, recipe `train.bytecode_cache`).

A container image that sets PYTHONDONTWRITEBYTECODE over an install without bytecode (uv's default) makes
every process of every job compile torch and the rest from source. The job then keeps its compiled modules
in `<cache_dir>/bytecode`, for itself and the processes it starts. Real interpreters and a real filesystem;
the decision's probe of torch's install is pointed at a stand-in package folder (the venv's own torch
cannot be made bytecode-less or read-only here). The whole path through `ray job submit` is in
tests/driver/test_job_submit.py.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from raytune_ft import env as envmod
from raytune_ft.recipe.recipe import Recipe, apply_overrides
from raytune_ft.recipe.values import RecipeError
from tests.conftest import REPO

# in a fresh Python started with `environ`: keep_bytecode, then import a module of `src`, then start a child
# Python that imports another; prints what each saw
_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys
    from raytune_ft.env import keep_bytecode
    got = keep_bytecode(sys.argv[1], sys.argv[2])
    sys.path.insert(0, sys.argv[3])
    import first_module
    child = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import second_module;"
                            "print(sys.pycache_prefix)", sys.argv[3]], capture_output=True, text=True, check=True)
    print(json.dumps({"set": got, "prefix": sys.pycache_prefix, "child_prefix": child.stdout.strip()}))
""")


def _run(tmp_path, mode: str, **environ) -> dict:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "first_module.py").write_text("X = 1\n")
    (src / "second_module.py").write_text("Y = 2\n")
    return _python(_SCRIPT, [str(tmp_path / "cache"), mode, str(src)], environ, timeout=120)


def _python(script: str, args: list[str], environ: dict, timeout: int) -> dict:
    """`script` in a fresh Python, without this process's bytecode variables, plus `environ`: its last line's JSON."""
    env = {k: v for k, v in os.environ.items() if k not in envmod.BYTECODE_ENV}
    env.update(environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _compiled(root, name: str) -> list:
    return sorted(p.name for p in root.rglob(f"{name}.*.pyc")) if root.exists() else []


@pytest.mark.timeout(300)
def test_without_bytecode_writing_the_job_and_its_children_keep_it_in_the_cache_folder(tmp_path):
    got = _run(tmp_path, "on", PYTHONDONTWRITEBYTECODE="1")
    folder = str(tmp_path / "cache" / "bytecode")
    assert got["set"] == {"PYTHONPYCACHEPREFIX": folder, "PYTHONDONTWRITEBYTECODE": ""}
    assert got["prefix"] == folder and got["child_prefix"] == folder
    # compiled into the cache folder, by this process and by the one it started; nothing beside the sources
    cache = tmp_path / "cache" / "bytecode"
    assert _compiled(cache, "first_module") and _compiled(cache, "second_module")
    assert not (tmp_path / "src" / "__pycache__").exists()


@pytest.mark.timeout(300)
def test_a_python_that_writes_bytecode_or_a_prefix_the_user_set_is_left_alone(tmp_path):
    # bytecode writing on (the venv's site-packages is writable here): nothing to do, even with "on"
    got = _run(tmp_path, "on")
    assert got["set"] == {} and got["prefix"] is None
    assert _compiled(tmp_path / "src" / "__pycache__", "first_module")
    # the user's own prefix wins
    mine = tmp_path / "mine"
    got = _run(tmp_path, "on", PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(mine))
    assert got["set"] == {} and got["prefix"] == str(mine)
    assert not (tmp_path / "cache").exists()
    # off: as Python was
    got = _run(tmp_path, "off", PYTHONDONTWRITEBYTECODE="1")
    assert got["set"] == {} and got["prefix"] is None and not (tmp_path / "cache").exists()


def _stand_in_torch(tmp_path, with_bytecode: bool):
    pkg = tmp_path / "site" / "torch"
    pkg.mkdir(parents=True)
    init = pkg / "__init__.py"
    init.write_text("")
    if with_bytecode:
        pyc = importlib.util.cache_from_source(str(init))
        os.makedirs(os.path.dirname(pyc))
        open(pyc, "wb").close()
    return importlib.machinery.ModuleSpec("torch", None, origin=str(init))


@pytest.mark.parametrize("with_bytecode, expected", [(False, True), (True, False)])
def test_auto_acts_only_where_the_install_shipped_no_bytecode(tmp_path, monkeypatch, with_bytecode, expected):
    spec = _stand_in_torch(tmp_path, with_bytecode)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "torch" else None)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert envmod._bytecode_missing("auto") is expected
    assert envmod._bytecode_missing("on") is True       # "on": whenever Python writes none itself
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    if not sys.flags.dont_write_bytecode:
        assert envmod._bytecode_missing("on") is False  # it writes its own beside the sources


def test_the_recipe_switch_takes_three_values():
    r = Recipe()
    assert r.train.bytecode_cache == "auto"
    with pytest.raises(RecipeError, match="bytecode_cache"):
        apply_overrides(r, ["train.bytecode_cache=yes"])


# node A (an earlier run): keep_bytecode, import, then rank 0's save of the node's bytecode set to the storage;
# node B (a fresh node): keep_bytecode, the driver's restore from the storage, then the same import. Each prints
# the module's value and the stat of its compiled file before and after the import.
_NODE = textwrap.dedent("""
    import json, os, sys
    from raytune_ft.env import keep_bytecode
    from raytune_ft.recipe.recipe import Recipe, apply_overrides
    from raytune_ft.train import jit_cache
    role, root, storage, src = sys.argv[1:5]
    keep_bytecode(root, "on")
    recipe = apply_overrides(Recipe(), [f"tracking.storage_path={storage}", f"train.cache_dir={root}"])
    lines = []
    restored = jit_cache.restore_bytecode(recipe, lines.append)
    sys.path.insert(0, src)
    folder = os.path.join(root, "bytecode")
    def pyc():
        found = [os.path.join(d, n) for d, _, ns in os.walk(folder) for n in ns if n.startswith("first_module.")]
        return [os.stat(found[0]).st_mtime_ns, os.path.getsize(found[0])] if found else None
    before = pyc()
    import first_module
    after = pyc()
    if role == "save":
        restored.save(lines.append)
    print(json.dumps({"value": first_module.X, "before": before, "after": after, "lines": lines,
                      "restored": restored.restored if restored else None}))
""")


def _node(tmp_path, role: str, root: str) -> dict:
    return _python(_NODE, [role, str(tmp_path / root), str(tmp_path / "storage"), str(tmp_path / "src")],
                   {"PYTHONDONTWRITEBYTECODE": "1"}, timeout=240)


@pytest.mark.timeout(600)
def test_a_fresh_node_imports_the_bytecode_an_earlier_run_left_in_the_storage_and_never_a_stale_module(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "first_module.py").write_text("X = 1\n")
    first = _node(tmp_path, "save", "node_a")
    assert first["value"] == 1 and first["before"] is None and first["after"]   # compiled here, then saved
    assert any("Bytecode cache: saved" in line for line in first["lines"]), first["lines"]
    sets = os.listdir(tmp_path / "storage" / "jit_cache" / "bytecode")
    assert any(n.endswith(".tar") for n in sets) and any(n.endswith(".json") for n in sets)

    fresh = _node(tmp_path, "load", "node_b")     # another local root: nothing compiled on it yet
    assert fresh["restored"] and fresh["restored"]["files"] >= 1
    assert fresh["before"] is not None, "the driver's restore comes before the imports"
    assert fresh["after"] == fresh["before"], "the restored module was compiled again"
    assert fresh["value"] == 1

    # the negative control: a source that changed since the set was built is compiled again, never read stale
    (tmp_path / "src" / "first_module.py").write_text("X = 22\n")
    changed = _node(tmp_path, "load", "node_c")
    assert changed["before"] is not None and changed["after"] != changed["before"]
    assert changed["value"] == 22


def test_a_bytecode_set_of_other_versions_is_named_and_not_loaded(tmp_path, monkeypatch):
    import pyarrow.fs as pafs

    from raytune_ft.train import jit_cache

    remote = (pafs.LocalFileSystem(), str(tmp_path / "storage"))
    old = jit_cache.bytecode_fingerprint({"torch": "2.11.0", "ray": "2.60.0"})
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "a" / "bytecode"))
    built = jit_cache.open_bytecode(str(tmp_path / "a"), remote, print, fp=old)
    (tmp_path / "a" / "bytecode" / "m.cpython-311.pyc").write_bytes(b"x")
    assert built.save(print)
    lines: list[str] = []
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "b" / "bytecode"))
    here = jit_cache.bytecode_fingerprint({"torch": "2.13.0", "ray": "2.60.0"})
    got = jit_cache.open_bytecode(str(tmp_path / "b"), remote, lines.append, fp=here)
    assert got is not None and got.restored is None
    assert not os.path.exists(tmp_path / "b" / "bytecode" / "m.cpython-311.pyc")
    assert any("torch 2.11.0 (here 2.13.0)" in line and "Bytecode cache" in line for line in lines), lines
    # a prefix of the user's own (or none): the job keeps no bytecode folder, so no set is read or written
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "mine"))
    assert jit_cache.open_bytecode(str(tmp_path / "b"), remote, print, fp=here) is None
