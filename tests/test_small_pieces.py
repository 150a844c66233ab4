"""Small pieces: no function of the package over 80 lines, none with more than 6 parameters (`self`/`cls`,
`*args` and `**kwargs` not counted: what travels together goes in a typed object), and no comment or
docstring that points into bench/NOTES.md instead of giving its reason. Read with `ast` and as text;
nothing is imported.

The exception lists name what is still allowed, each with its reason (today only a signature another library
imposes, kept for good). Each entry must still be a violation, so the lists only shrink.
"""
from __future__ import annotations

import ast

from tests.test_structure import PKG, modules

MAX_LINES = 80
MAX_PARAMS = 6
NOTES = "NOTES.md"

# (module, function): why it is allowed
LONG: dict[tuple[str, str], str] = {}
MANY_PARAMS = {
    ("raytune_ft.models.attention", "raytune_varlen_attention"): (
        "registered with transformers' AttentionInterface, whose layers call it with transformers' own attention "
        "arguments (module, query, key, value, attention_mask, dropout=, scaling=, **kwargs), as they call "
        "transformers' eager_attention_forward: the signature is transformers'"),
}
# module: how many NOTES.md pointers it may still hold
NOTES_POINTERS: dict[str, int] = {}


def functions() -> dict[tuple[str, str], ast.FunctionDef]:
    """Every function and method of the package by (module, qualified name: `Class.method`, `outer.inner`)."""
    found = {}

    def walk(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[(module, prefix + child.name)] = child
                walk(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, module, f"{prefix}{child.name}.")
            else:
                walk(child, module, prefix)

    for module, path in modules().items():
        walk(ast.parse(path.read_text(), filename=str(path)), module, "")
    return found


def length(fn: ast.FunctionDef) -> int:
    return fn.end_lineno - fn.lineno + 1


def params(fn: ast.FunctionDef) -> list[str]:
    """The named parameters a caller passes: `self`/`cls` of a method left out."""
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
    return names[1:] if names and names[0] in ("self", "cls") else names


def test_no_function_is_over_80_lines():
    found = functions()
    assert len(found) > 500
    long = {f"{m}.{name}": length(fn) for (m, name), fn in found.items()
            if length(fn) > MAX_LINES and (m, name) not in LONG}
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_no_function_takes_more_than_6_parameters():
    many = {f"{m}.{name}": params(fn) for (m, name), fn in functions().items()
            if len(params(fn)) > MAX_PARAMS and (m, name) not in MANY_PARAMS}
    assert not many, "\n".join(f"{k}: {len(v)} {v}" for k, v in many.items())


def test_no_comment_points_into_the_notes():
    """A comment holds its reason in one line; the notes are a dated diary that ages."""
    counts = {m: path.read_text().count(NOTES) for m, path in modules().items()}
    over = {m: n for m, n in counts.items() if n > NOTES_POINTERS.get(m, 0)}
    assert not over, f"comments pointing into bench/{NOTES} (say the reason instead): {over}"


def test_every_exception_is_still_one():
    """The lists only shrink: an entry whose function was split, or whose file no longer points into the notes,
    leaves them."""
    found = functions()
    for key, why in LONG.items():
        assert key in found and length(found[key]) > MAX_LINES, f"{key} is no longer over {MAX_LINES} lines ({why})"
    for key, why in MANY_PARAMS.items():
        assert key in found and len(params(found[key])) > MAX_PARAMS, f"{key} no longer has too many ({why})"
    for module, n in NOTES_POINTERS.items():
        assert (PKG.parent / modules()[module]).read_text().count(NOTES) == n, f"{module}: lower NOTES_POINTERS"


def test_the_counts_are_the_ones_meant():
    """The counting itself: decorators aside, a def's lines to its last; `self`, `*args`, `**kwargs` not counted."""
    tree = ast.parse("class A:\n    def f(self, a, b, *args, c=1, **kw):\n        x = 1\n\n        return x\n")
    fn = tree.body[0].body[0]
    assert params(fn) == ["a", "b", "c"] and length(fn) == 4
