"""What every entry of compat is made of: the error, the installed version, an internal name, a private
attribute, and the library versions each was checked on."""
from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any

RAY, TORCH, MLFLOW, TRANSFORMERS = "ray 2.60.0", "torch 2.11.0, 2.13.0", "mlflow 3.17.2", "transformers 5.17.0, 5.25.0"
TORCHAO, PYARROW = "torchao 0.18.0", "pyarrow 25.0.1"


class CompatError(RuntimeError):
    """A library's internal that raytune_ft relies on is missing or changed in the installed version."""


def installed(package: str) -> str:
    """`package` and its installed version, as an error names them."""
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} (not installed)"


@dataclass(frozen=True)
class Internal:
    """`names` of `module`, a private part of `package`; `known`: the versions it was checked on; `why`:
    what the public API lacks."""

    package: str
    module: str
    names: tuple[str, ...]
    known: str
    why: str

    def load(self) -> Any:
        """The name (one) or a tuple of the names, or CompatError naming the installed version."""
        try:
            mod = importlib.import_module(self.module)
            found = tuple(getattr(mod, n) for n in self.names)
        except (ImportError, AttributeError) as e:
            raise CompatError(
                f"{installed(self.package)}: {self.module}.{'/'.join(self.names)} is not there ({e}). raytune_ft "
                f"uses it {self.why}; checked on {self.known}. Install a checked version, or update "
                "raytune_ft/compat/ for this one.") from e
        return found[0] if len(found) == 1 else found


def private_attr(obj: Any, name: str, package: str, known: str) -> Any:
    """`obj`'s private attribute `name`, or CompatError naming `package`'s installed version."""
    if not hasattr(obj, name):
        raise CompatError(f"{installed(package)}: {type(obj).__name__} has no {name}; checked on {known}. "
                          f"Update raytune_ft/compat/ for this {package}.")
    return getattr(obj, name)


def _codes(fn: Any, depth: int = 3) -> list:
    """The code of `fn` and of the functions its closure holds, `depth` wrappers deep: a method another library
    wrapped in place (torch's dynamo wraps nn.Module.__init__ in every process that compiles) still counts."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    inner = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
    return [code, *(x for f in inner if callable(f) and depth > 0 for x in _codes(f, depth - 1))]


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:           # a cell not assigned yet
        return False
    return True


@dataclass(frozen=True)
class PrivateAttr:
    """The private attribute `name` of `package`'s class `cls` (in `module`); `named_in`: for an attribute
    the class gets only on its instances, the method whose code sets or reads it; `known` and `why` as
    `Internal`'s."""

    package: str
    module: str
    cls: str
    name: str
    known: str
    why: str
    named_in: str | None = None

    def check(self) -> type:
        """The class, once it is found to still have the attribute (itself, or named in `named_in`'s code);
        CompatError naming the installed version otherwise."""
        owner = Internal(self.package, self.module, (self.cls,), self.known, self.why).load()
        if self.named_in is None:
            found = hasattr(owner, self.name)
        else:
            found = any(self.name in (*code.co_names, *code.co_consts)
                        for code in _codes(getattr(owner, self.named_in, None)))
        if not found:
            where = f"{self.cls}.{self.named_in} names no {self.name}" if self.named_in else \
                f"{self.cls} has no {self.name}"
            raise CompatError(f"{installed(self.package)}: {self.module}.{where}. raytune_ft uses it {self.why}; "
                              f"checked on {self.known}. Install a checked version, or update "
                              "raytune_ft/compat/ for this one.")
        return owner

    def read(self, obj: Any) -> Any:
        """`obj`'s value of the attribute, or CompatError naming the installed version."""
        return private_attr(obj, self.name, self.package, self.known)

    def write(self, obj: Any, value: Any) -> None:
        """Set it on `obj`, which must have it already: a name the library no longer reads would do nothing."""
        self.read(obj)
        setattr(obj, self.name, value)
