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
    env = {k: v for k, v in os.environ.items() if k not in envmod.BYTECODE_ENV}
    env.update(environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "cache"), mode, str(src)], env=env,
                         capture_output=True, text=True, timeout=120)
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
