"""The package's import structure: no import cycles, no module importing a layer above its own, no module
over 450 lines. Imports are read with `ast` (no module is imported), at any depth (a function-level import
counts; one under `if TYPE_CHECKING:` does not). Importing `a.b.c` also imports the packages `a.b` and
`a`, so those count as imported too, except the importer's own packages (already being imported).

Layers, lowest first (a module imports only its own layer or lower ones), by folder:
  1 base       env, console, compat, channel, recipe.values: the process environment, printing, the
               libraries' internals, a child process to talk to, the recipe's value checks and RecipeError
  2 storage    storage.*: the run's filesystem, its checks and errors, the run folder's lease
  3 parts      data.*, models.*: the data path and the model build
  4 recipe     recipe.recipe, recipe.sections: the typed recipe (its data section checks its sources)
  5 tracking   tracking.*: the MLflow run, rank 0's sender, plots, the runs table
  6 planning   planning.*: shapes, GPU specs and FLOPs, the memory plan, the disk a run needs, the projection
  7 library    train.*, registry.*: the training loops, checkpoints, registration
  8 driver     driver.*: one run, top-down (checks before Ray, lifecycle, launch, ending)
  9 entry      cli: the command line
A new top-level module has to be placed here (the test names it).
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "raytune_ft"
MAX_LINES = 450

LAYERS = {
    1: {"env", "console", "compat", "channel", "recipe", "recipe.values"},
    2: {"storage"},
    3: {"data", "models"},
    4: {"recipe.recipe", "recipe.sections"},
    5: {"tracking"},
    6: {"planning"},
    7: {"train", "registry"},
    8: {"driver"},
    9: {"cli"},
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
    top = {"raytune_ft.driver.run", "raytune_ft.cli", "raytune_ft.driver.launch", "raytune_ft.driver.start_ahead",
           "raytune_ft.driver.lifecycle"}
    low = [m for m in graph if m.startswith(("raytune_ft.data", "raytune_ft.models", "raytune_ft.registry"))]
    assert len(low) > 15
    assert not {(m, d) for m in low for d in graph[m] if d in top}


def test_no_module_over_450_lines():
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# the prefix of the tests' own environment variables (tests/faults.py's PLAN_FILE_ENV): the package reads none
TEST_VARIABLE_PREFIX = "RAYTUNE_TEST"


def test_the_package_imports_nothing_of_the_tests_and_reads_none_of_their_variables():
    """Test-only code stays in tests/: no package module imports from it, names one of its variables, or
    loads a plugin that a variable names (fault injection reaches the workers through the tests' own Ray
    runtime environment, tests/faults.py)."""
    from tests import faults

    assert faults.PLAN_FILE_ENV.startswith(TEST_VARIABLE_PREFIX)
    found = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            imported = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                        [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{name} imports {m}" for m in imported if m == "tests" or m.startswith("tests.")]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and TEST_VARIABLE_PREFIX in node.value:
                found.append(f"{name} names {node.value!r}")
    assert not found, "\n".join(found)


def _function(module: str, name: str) -> ast.FunctionDef:
    path = modules()[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_the_fsdp2_loop_takes_one_typed_context():
    """`_train` and `_finish` read what the attempt trains with from one dataclass (torchtitan's Trainer
    holds the same), not from a dozen positional parameters."""
    import dataclasses

    from raytune_ft.train import fsdp_loop

    for name in ("_train", "_finish"):
        fn = _function("raytune_ft.train.fsdp_loop", name)
        params = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
        assert len(params) <= 5, f"fsdp_loop.{name} takes {len(params)} parameters: {params}"
        first = getattr(fsdp_loop, ast.unparse(fn.args.args[0].annotation))
        assert dataclasses.is_dataclass(first), f"fsdp_loop.{name}'s first parameter is not a typed context"


def test_the_trl_report_callback_is_made_of_named_parts():
    """No class defined inside the callback's builder, and no function of the TRL loop's trainer and
    report modules longer than a page."""
    module = next(m for m in ("raytune_ft.train.trl.report", "raytune_ft.train.trl.trainer") if m in modules())
    fn = _function(module, "report_callback")
    nested = [n.name for n in ast.walk(fn) if isinstance(n, ast.ClassDef)]
    assert not nested, f"report_callback defines classes inside itself: {nested}"
    for name in ("raytune_ft.train.trl.trainer", module):
        tree = ast.parse(modules()[name].read_text())
        long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
                if isinstance(n, ast.FunctionDef) and n.end_lineno - n.lineno + 1 > 100}
        assert not long, f"{name}: functions over 100 lines: {long}"


# the libraries whose private names go through raytune_ft/compat/
PRIVATE_OF = ("ray", "torch", "mlflow", "transformers")
# modules another change of this round rewrites (the run's lifecycle): their private imports move to compat
# once it is merged; the list only shrinks
NOT_YET_MOVED: set[str] = set()


def private_imports(path: Path) -> list[str]:
    """`path`'s imports of a private module or name of PRIVATE_OF (`x._y`, `from x import _y`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules_, names = [a.name for a in node.names], []
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            modules_, names = [node.module], [a.name for a in node.names]
        else:
            continue
        for module in modules_:
            parts = module.split(".")
            if parts[0] in PRIVATE_OF and (any(p.startswith("_") for p in parts)
                                           or any(n.startswith("_") for n in names)):
                found.append(f"line {node.lineno}: {module} {names or ''}".rstrip())
    return found


def test_private_names_of_the_libraries_are_imported_in_compat_only():
    """An upgrade that moves one of them breaks in one place, loudly (compat.CompatError), not in a module
    that guessed a fallback."""
    found = {name: hits for name, path in modules().items()
             if not _in_compat(name) and name not in NOT_YET_MOVED and (hits := private_imports(path))}
    assert not found, "\n".join(f"{name}: {hits}" for name, hits in found.items())
    compat_modules = [path for name, path in modules().items() if _in_compat(name)]
    assert len(compat_modules) > 1
    assert all(private_imports(path) == [] for path in compat_modules)   # compat imports them by name, at use


def _in_compat(module: str) -> bool:
    return module == "raytune_ft.compat" or module.startswith("raytune_ft.compat.")


def _calls_in_order(body: ast.FunctionDef) -> list[str]:
    """The names a function calls (`f(...)` and `x.f(...)`), in the order they are written."""
    calls = sorted((n.lineno, n.col_offset, n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id)
                   for n in ast.walk(body) if isinstance(n, ast.Call)
                   and isinstance(n.func, (ast.Attribute, ast.Name)))
    return [name for _, _, name in calls]


def _callee_modules(module: str, name: str, local_objects: dict[str, str]) -> list[str]:
    """The package modules a function's calls go to, in the order they are written: a name imported from
    raytune_ft (at module or function level) goes to its module, `obj.f()` to `local_objects[obj]`'s, a call of
    a function defined in `module` itself to `module`. Calls into anything else are left out."""
    tree = ast.parse(modules()[module].read_text())
    body = _function(module, name)
    where: dict[str, str] = {}
    for node in [*tree.body, *ast.walk(body)]:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("raytune_ft"):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                where[alias.asname or alias.name] = target if target in modules() else node.module
    own = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    out = []
    for node in sorted((n for n in ast.walk(body) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            target = local_objects.get(f.value.id) or where.get(f.value.id)
        elif isinstance(f, ast.Name):
            target = module if f.id in own else where.get(f.id)
        else:
            target = None
        if target is not None:
            out.append(target)
    return out


# the base layer's helpers every layer calls (the process environment, printing): used, not a stop of the path
_UTILITIES = ("raytune_ft.env", "raytune_ft.console", "raytune_ft.channel")


def _stretches(seq: list[str]) -> list[str]:
    """`seq` with each run of one value kept once: a value that appears twice here was left and re-entered."""
    return [m for i, m in enumerate(seq) if i == 0 or seq[i - 1] != m]


def test_run_reads_top_down_each_step_once_and_holds_nothing_before_its_checks():
    """Issue 58 item 2: `_run` (what `run()` does inside its lifecycle) calls each step of a run once, in the
    order a run happens: every check before Ray in one call (the recipe, tracking store, storage, a finished
    run, the data and resources), then hold the folder, open tracking, start Ray, fit, summarize, register and
    close. A check after the hold would leave a refused run holding its folder."""
    steps = ["check_before_ray", "hold_folder", "start", "start_ray", "_fit", "_summarize", "_register_and_close"]
    assert [c for c in _calls_in_order(_function("raytune_ft.driver.run", "_run")) if c in steps] == steps
    run = _function("raytune_ft.driver.run", "run")
    assert [n.func.id for n in ast.walk(run) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id.startswith("_")] == ["_run"]
    checks = ["validate", "absolute_local_paths", "check_tracking_store", "check_durable_paths", "check_storage",
              "run_storage", "finished_run_summary", "check_data_source", "check_resources"]
    order = [c for c in _calls_in_order(_function("raytune_ft.driver.preflight", "check_before_ray")) if c in checks]
    assert sorted(order, key=checks.index) == order and set(order) == set(checks) and len(order) == len(checks)


def test_the_driver_path_leaves_each_module_once():
    """Issue 58 item 2, "no module is re-entered once the path has left it", at the driver's scale: the steps
    of `_run`, each taken to the module that does it (its own helpers: the driver itself), form one stretch per
    module (the checks, then the lifecycle's holds, then fit and end); and the checks before Ray, past their
    own module's helpers, go to each module once. Before, `_run` went run -> preflight -> run -> lifecycle and
    the checks went recipe -> storage -> recipe -> storage."""
    steps = [m for m in _callee_modules("raytune_ft.driver.run", "_run", {"life": "raytune_ft.driver.lifecycle"})
             if m not in _UTILITIES]
    assert steps[:2] == ["raytune_ft.driver.preflight", "raytune_ft.driver.lifecycle"], steps
    assert len(_stretches(steps)) == len(set(steps)), f"re-entered: {_stretches(steps)}"
    checks = [m.rsplit(".", 1)[0] if m.startswith("raytune_ft.storage") else m for m in
              _callee_modules("raytune_ft.driver.preflight", "check_before_ray", {})
              if m not in ("raytune_ft.driver.preflight", *_UTILITIES)]
    assert {"raytune_ft.recipe.recipe", "raytune_ft.storage"} <= set(checks)
    assert len(_stretches(checks)) == len(set(checks)), f"re-entered: {_stretches(checks)}"
    # the finder sees a re-entry where there is one
    assert len(_stretches(["a", "b", "a"])) != len({"a", "b"})


def test_bench_has_no_import_circle():
    """Issue 58 item 1: the bench's modules import each other in one direction (gpu_kit and gpu_lora read their
    figures from bench/figures.py, not from each other)."""
    root = PKG.parent / "bench"
    graph: dict[str, set[str]] = {}
    for path in sorted(root.glob("*.py")):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "bench":
                deps |= {node.module} if node.module != "bench" else {f"bench.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("bench.")}
        graph[f"bench.{path.stem}"] = deps - {f"bench.{path.stem}"}
    assert len(graph) > 10 and graph["bench.gpu_lora"]
    assert find_cycle(graph) is None, f"import cycle in bench/: {' -> '.join(find_cycle(graph))}"


def test_the_tests_mirror_the_package():
    """Issue 58 item 1: tests/ has a folder per package folder it tests (tests/gpu: the GPU suite), so a test is
    found beside the part it pins."""
    tests = Path(__file__).resolve().parent
    folders = {p.parent.name for p in tests.glob("*/__init__.py")} - {"gpu"}
    packages = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert folders and folders <= packages, folders - packages
    assert {"data", "driver", "train", "tracking", "storage", "planning"} <= folders
