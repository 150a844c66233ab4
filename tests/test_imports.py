"""The package's layers hold: no module of raytune_ft imports, directly or through others, one that imports it;
and the driver's path after `TorchTrainer.fit()` imports no torch (checked in a fresh Python).

Every import statement counts, those inside functions too (a lazy import is still an arrow between
layers). `from raytune_ft.a import b` is an arrow to raytune_ft.a.b when b is a module, else to
raytune_ft.a; a submodule does not count as importing its package's __init__ (Python runs it first,
but the package's names are not what the submodule asked for).
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO, env_with_path

PKG = REPO / "raytune_ft"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The raytune_ft modules `name` (at `path`) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            targets = [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in known else base_name
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:      # `import raytune_ft.a.b.C` style: the longest module prefix
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_the_walk_sees_the_package():
    graph = import_graph()
    assert len(graph) > 30
    # arrows the layers are known to have: the walk must find them, or it proves nothing
    assert "raytune_ft.recipe.recipe" in graph["raytune_ft.planning.plan"] and "raytune_ft.planning.hardware" in graph["raytune_ft.planning.plan"]
    assert "raytune_ft.registry.task" in graph["raytune_ft.registry"]
    assert "raytune_ft.registry.base" in graph["raytune_ft.registry.task"]


def test_the_walk_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_circle_in_raytune_ft():
    found = cycles(import_graph())
    assert found == [], "import circles (modules that reach each other):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in found)


def test_registry_parts_never_import_the_entry():
    graph = import_graph()
    parts = [m for m in graph if m.startswith("raytune_ft.registry.") and m != "raytune_ft.registry.task"]
    assert parts
    for m in parts:
        assert not graph[m] & {"raytune_ft.registry", "raytune_ft.registry.task"}, m
    assert not {m for m in graph["raytune_ft.registry.base"] if m.startswith("raytune_ft.registry")}


AFTER_FIT = textwrap.dedent("""
    import json, sys
    import pyarrow.fs as pafs
    from raytune_ft.train.checkpoint_meta import read_meta, read_meta_at, read_train_state, write_meta, write_train_state
    alone = "torch" in sys.modules
    # what run.py, endings.py and the registry entry import once fit returned, and the readers called
    import raytune_ft.driver.endings, raytune_ft.tracking.plots, raytune_ft.driver.run, raytune_ft.tracking.opening, raytune_ft.tracking.mlflow_run
    from raytune_ft.registry import find_registered_version, run_registration
    from raytune_ft.registry.base import RegistrationOutcome
    ckpt = sys.argv[1]
    write_meta(ckpt, {"step": 3, "final": True})
    write_train_state(ckpt, 0, {"counters": {"real_tokens": 5}})
    read_back = [read_meta_at(pafs.LocalFileSystem(), ckpt), read_meta(ckpt),
                 read_train_state(pafs.LocalFileSystem(), ckpt, 0), raytune_ft.driver.run.merged_data_counters(ckpt)["real_tokens"]]
    print(json.dumps({"alone": alone, "after_fit": "torch" in sys.modules, "read_back": read_back}))
""")


def test_the_checkpoint_meta_and_the_drivers_after_fit_path_import_no_torch(tmp_path):
    """Reading a finished run's meta (run._summarize, endings) and registering it from the driver cost no
    torch import (about 2 s on 2 cores): train/checkpoint_meta.py holds the JSON readers, torch-free."""
    out = subprocess.run([sys.executable, "-c", AFTER_FIT, str(tmp_path)], cwd=tmp_path, env=env_with_path(REPO),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"alone": False, "after_fit": False,
                   "read_back": [{"step": 3, "final": True}, {"step": 3, "final": True},
                                 {"counters": {"real_tokens": 5}}, 5]}


def test_the_checkpoint_still_exports_the_meta_readers():
    from raytune_ft.train import checkpoint, checkpoint_meta

    for name in checkpoint_meta.__all__:
        assert getattr(checkpoint, name) is getattr(checkpoint_meta, name), name
