"""The package's import structure: no import cycles, no module importing a layer above its own, no module
over 450 lines. Imports are read with `ast` (no module is imported), at any depth (a function-level import
counts; one under `if TYPE_CHECKING:` does not). Importing `a.b.c` also imports the packages `a.b` and
`a`, so those count as imported too, except the importer's own packages (already being imported).

Layers, lowest first (a module imports only its own layer or lower ones):
  1 base       typed_values, env, console, hardware, storage, storage_errors: values, the environment,
               printing, the machine, where files live; nothing of the project above them
  2 parts      recipe, recipe_sections, tracking, run_opening, lease, shapes, data.*, models.*: the typed recipe
               and the pieces a run is made of (data pipeline, model build, the MLflow store, the run's lease)
  3 library    train.* (but train.launch), registry.*: the training loops, checkpoints, registration
  4 driver     plan, projection, storage_plan, storage_check, endings, preflight, plots, train.launch: what the
               launching process checks, starts and reports around one fit
  5 run        start_ahead, run: one run, top-down
  6 entry      cli: the command line
A new top-level module has to be placed here (the test names it).
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "raytune_ft"
MAX_LINES = 450

LAYERS = {
    1: {"typed_values", "env", "console", "hardware", "storage", "storage_errors"},
    2: {"recipe", "recipe_sections", "tracking", "run_opening", "lease", "shapes", "data", "models"},
    3: {"train", "registry"},
    4: {"plan", "projection", "storage_plan", "storage_check", "endings", "preflight", "plots", "train.launch"},
    5: {"start_ahead", "run"},
    6: {"cli"},
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = ("raytune_ft", *path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The raytune_ft modules `path` (module `name`) imports, with the packages above each."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def add(module: str) -> None:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            # a module's own packages are being imported already when it runs: not an edge
            if prefix in known and (prefix == module or not (name + ".").startswith(prefix + ".")):
                out.add(prefix)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            add(module)
            for alias in node.names:   # `from raytune_ft import registry` imports the module registry
                if f"{module}.{alias.name}" in known:
                    add(f"{module}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out.discard(name)
    return out


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: _imported(path, name, set(found)) for name, path in found.items()}


def layer_of(module: str) -> int | None:
    """The layer of a module: the most specific entry of LAYERS that names it or a package above it."""
    rel = module.removeprefix("raytune_ft").lstrip(".")
    if not rel:
        return 0                    # the package's own __init__: imports nothing (checked below)
    parts = rel.split(".")
    for i in range(len(parts), 0, -1):
        for layer, names in LAYERS.items():
            if ".".join(parts[:i]) in names:
                return layer
    return None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 40 and graph["raytune_ft.cli"], "the package was not found or not parsed"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_cycle_finder_finds_a_cycle():
    """The finder itself: a cycle of three is reported, a chain is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph()
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (place them in LAYERS): {unplaced}"
    assert not graph["raytune_ft"], "raytune_ft/__init__.py imports modules of the package"
    upward = sorted(f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
                    for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))
    assert not upward, "\n".join(upward)


def test_the_low_layers_never_import_the_run():
    """The rule the layers exist for, spelled out: data, models and registry know nothing of a run."""
    graph = import_graph()
    top = {"raytune_ft.run", "raytune_ft.cli", "raytune_ft.train.launch", "raytune_ft.start_ahead"}
    low = [m for m in graph if m.startswith(("raytune_ft.data", "raytune_ft.models", "raytune_ft.registry"))]
    assert len(low) > 15
    assert not {(m, d) for m in low for d in graph[m] if d in top}


def test_no_module_over_450_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
