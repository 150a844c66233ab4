"""Private attributes of the libraries' objects (torch, Ray, transformers, TRL, torchao, MLflow, pyarrow) are
read and set in raytune_ft/compat/ only, where each is checked against the installed version and fails
loudly when it moved. The package is read with `ast` (nothing is imported); tests/test_structure.py does
the same for private imports.

What counts as reading one, outside compat/:
- `obj._name` (or getattr/hasattr/setattr/delattr with "_name"), single underscore, where `obj` is not
  `self`/`cls`, not a module of this package, and `_name` is not defined anywhere in the package;
- inside a class built on a library class, `self._name` / `super()._name` for a name the class does not
  define itself (in its body, or on `self` in its `__init__`): what it inherits from the library, except
  the library methods compat checks when the class is built (compat.TRAINER_INTERNALS,
  compat.RAY_TRAINER_INTERNALS);
- the protocols that hand out an object's private state (`__reduce__`, `__tensor_flatten__`, ...);
- importing a library module that is private in all but name (Ray's dashboard code).
Names starting `_raytune` are the package's own marks on objects it holds; namedtuple's `_replace`, `_asdict`,
... are its public methods.
"""
from __future__ import annotations

import ast

from raytune_ft import compat
from tests.test_structure import modules

# the libraries whose classes the package builds on
LIBRARIES = ("ray", "torch", "transformers", "trl", "torchao", "mlflow", "pyarrow", "peft", "accelerate")
# the pickling and tensor-subclass protocols: an object's private state, in the library's own private form
STATE_PROTOCOLS = {"__reduce__", "__reduce_ex__", "__getstate__", "__tensor_flatten__"}
# library modules that are private though their names are not
INTERNAL_MODULES = ("ray.dashboard",)
# library methods that compat checks on the class that overrides or calls them
CHECKED_METHODS = {*compat.TRAINER_INTERNALS, *compat.RAY_TRAINER_INTERNALS}
OWN_MARK = "_raytune"
# namedtuple's own methods: public, named with an underscore so that no field can take their names
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}

# deliberate exceptions, (module, the read as the finder writes it): why
ALLOWED = {
    ("raytune_ft.channel", "os._exit"): "Python's documented way to end a process at once (no library's)",
    ("raytune_ft.env", "getattr(env, '_data', None)"): "CPython's dict behind os.environ, copied in one C call "
                                                        "so another thread cannot tear it; no library's, and "
                                                        "without it the copy is retried",
}


def _private(name: str) -> bool:
    return (name.startswith("_") and not name.startswith("__") and not name.startswith(OWN_MARK)
            and name not in NAMEDTUPLE_API)


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Each name an import binds anywhere in the module, to what it imports."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _library_class(node: ast.ClassDef, aliases: dict[str, str]) -> bool:
    """Whether a base of the class is a library's class (compat hands out library classes too)."""
    for base in node.bases:
        target = aliases.get(_root(base) or "", "")
        if target.split(".")[0] in LIBRARIES or target == "raytune_ft.compat":
            return True
    return False


def _body_names(node: ast.ClassDef | ast.Module) -> set[str]:
    """What a class (or module) defines in its own body: functions, classes, attributes."""
    out = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(item.name)
        elif isinstance(item, ast.Assign):
            out |= {t.id for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
    return out


def _set_in_init(node: ast.ClassDef) -> set[str]:
    """What a class's `__init__` sets on `self`: its own state, not the library's."""
    inits = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"]
    return {n.attr for f in inits for n in ast.walk(f)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _root(n) == "self"}


def package_names(sources: dict[str, str]) -> set[str]:
    """The private names the package defines: functions, classes, module and class attributes, and what
    its own classes set on `self`. Of a class built on a library class, only what its `__init__` sets:
    the rest of its body and its other `self` stores may be the library's names."""
    out: set[str] = set()
    for source in sources.values():
        tree = ast.parse(source)
        aliases = _aliases(tree)
        library = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and _library_class(n, aliases)]
        inside_library = {id(n) for c in library for n in ast.walk(c) if n is not c}
        out |= {name for c in library for name in _set_in_init(c)}
        for node in ast.walk(tree):
            if id(node) in inside_library:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(node.name)
            elif isinstance(node, ast.ClassDef) and node not in library:
                out |= _body_names(node) | {node.name}
            elif isinstance(node, ast.Module):
                out |= _body_names(node)    # the same statements at module level
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _root(node) in ("self", "cls"):
                out.add(node.attr)
    return {n for n in out if n.startswith("_")}


def _written(node: ast.AST) -> str:
    return ast.unparse(node)


def private_reads(source: str, defined: set[str]) -> list[tuple[int, str]]:
    """Where `source` reads or sets a library's private attribute (see the module docstring): (line, the
    expression as `ast.unparse` writes it)."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    own_modules = {a for a, target in aliases.items() if target.startswith("raytune_ft")}
    found: list[tuple[int, str]] = []

    def outside(node: ast.AST, obj: ast.AST, name: str) -> None:
        """Rule one: another object's private attribute."""
        if not _private(name) or name in defined:
            return
        if isinstance(obj, ast.Name) and (obj.id in ("self", "cls") or obj.id in own_modules):
            return
        if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super":
            return    # only a library class's super() is the library's: rule two
        found.append((node.lineno, _written(node)))

    def inherited(cls: ast.ClassDef) -> None:
        """Rule two: what a class built on a library class inherits."""
        own = _body_names(cls) | _set_in_init(cls)
        for node in ast.walk(cls):
            if not isinstance(node, ast.Attribute) or not _private(node.attr):
                continue
            obj = node.value
            is_super = isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) and obj.func.id == "super"
            if not (is_super or (isinstance(obj, ast.Name) and obj.id in ("self", "cls"))):
                continue
            if (node.attr in own and not is_super) or node.attr in CHECKED_METHODS:
                continue
            found.append((node.lineno, _written(node)))

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _library_class(node, aliases):
            inherited(node)
        elif isinstance(node, ast.Attribute):
            if node.attr in STATE_PROTOCOLS:
                found.append((node.lineno, _written(node)))
            else:
                outside(node, node.value, node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            outside(node, node.args[0], node.args[1].value)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [(node.lineno, f"import {n}") for n in names if n.startswith(INTERNAL_MODULES)]
    return sorted(set(found))


def _package_reads() -> list[tuple[str, int, str]]:
    """Every read the finder finds outside compat: (module, line, expression)."""
    sources = {name: path.read_text() for name, path in modules().items()}
    assert len(sources) > 40 and "raytune_ft.compat.core" in sources
    defined = package_names(sources)
    assert {"_quick", "_take", "_write"} <= defined     # the package's own, read across its modules
    return [(name, line, text) for name, source in sources.items()
            if name != "raytune_ft.compat" and not name.startswith("raytune_ft.compat.")
            for line, text in private_reads(source, defined)]


def test_no_private_attribute_of_a_library_is_read_outside_compat():
    found = [f"{name}, line {line}: {text}" for name, line, text in _package_reads() if (name, text) not in ALLOWED]
    assert not found, "\n".join(found)


def test_every_allowed_exception_is_still_there():
    """An exception whose code went away leaves the list."""
    found = {(name, text) for name, _, text in _package_reads()}
    for key, why in ALLOWED.items():
        assert key in found, f"{key} is no longer found; drop it from ALLOWED ({why})"


DEFINED = {"_own_helper", "_take"}


def test_the_finder_finds_each_kind_of_read():
    """The finder itself, on the shapes the package had before compat took them over."""
    cases = {
        "local = t._local_tensor": "t._local_tensor",
        "w = getattr(t, '_local_tensor', t)": "getattr(t, '_local_tensor', t)",
        "lm.config._name_or_path = 'x'": "lm.config._name_or_path",
        "rebuild, (options,) = fs.__reduce__()": "fs.__reduce__",
        "from ray.dashboard.modules.job.common import JobInfoStorageClient": "import ray.dashboard.modules.job.common",
        ("import ray.train\n"
         "class C(ray.train.DataConfig):\n"
         "    def configure(self, name):\n"
         "        return self._resolve_execution_options(name), self._datasets_to_split\n"):
            "self._resolve_execution_options",
        ("from trl import SFTTrainer\n"
         "class T(SFTTrainer):\n"
         "    def _maybe_log_save_evaluate(self):\n"
         "        self._created_lr_scheduler = True\n"
         "        return self._globalstep_last_logged, self._get_learning_rate()\n"):
            "self._globalstep_last_logged",
        ("from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer\n"
         "class T(DataParallelTrainer):\n"
         "    def _not_checked(self):\n"
         "        return super()._not_checked()\n"):
            "super()._not_checked",
    }
    for source, expected in cases.items():
        hits = [text for _, text in private_reads(source, DEFINED)]
        assert expected in hits, (source, hits)
    trainer = [text for _, text in private_reads(list(cases)[-2], DEFINED)]
    assert sorted(trainer) == ["self._created_lr_scheduler", "self._globalstep_last_logged"]   # a checked method not
    assert len(private_reads(list(cases)[-3], DEFINED)) == 2


def test_the_finder_leaves_the_packages_own_names_alone():
    source = ("from raytune_ft.models import attention as att\n"
              "class Own:\n"
              "    def go(self, other):\n"
              "        self._state = 1\n"
              "        other._raytune_packed = True\n"
              "        return att._flash(), other._own_helper(), self.replayed()._take, self._state, other._replace(a=1)\n"
              "from trl import SFTTrainer\n"
              "class T(SFTTrainer):\n"
              "    _raytune_kept = -1\n"
              "    def _maybe_log_save_evaluate(self, *a):\n"
              "        self._raytune_kept = 1\n"
              "        return super()._maybe_log_save_evaluate(*a), self._get_learning_rate()\n")
    assert private_reads(source, DEFINED) == []
    assert {"_state", "_own_helper", "_take"} <= package_names({"m": source}) | DEFINED
    assert "_maybe_log_save_evaluate" not in package_names({"m": source})   # the library's, overridden
    assert private_reads("import os\nos._exit(0)", set()) == [(2, "os._exit")]   # found, then allowed by name
