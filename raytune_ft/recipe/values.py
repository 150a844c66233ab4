"""Typed values of a recipe: parse `--set` text into an annotated type, check a value against one, and
check a number's range. Generic over annotations (it knows no recipe section), so the recipe module
reads it and it reads nothing of the project."""
from __future__ import annotations

import json
import typing
from typing import Any, Literal


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the field and what it allows."""


def coerce(path: str, raw: str, tp: Any) -> Any:
    """Parse the text of `--set path=raw` into the annotated type `tp`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or str(origin) == "types.UnionType" or type(tp).__name__ == "UnionType":
        non_none = [a for a in args if a is not type(None)]
        if raw.lower() in ("none", "null", ""):
            if type(None) in args:
                return None
        # a number where the union allows one (`str | int`: "0" is 0, "prompts.jsonl" stays text)
        for number in (a for a in non_none if a in (int, float) and len(non_none) > 1):
            try:
                return coerce(path, raw, number)
            except RecipeError:
                continue
        return coerce(path, raw, next((a for a in non_none if a not in (int, float)), non_none[0]))
    if origin is Literal:
        if raw not in args:
            raise RecipeError(f"{path}: {raw!r} is not one of {', '.join(map(repr, args))}")
        return raw
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise RecipeError(f"{path}: {raw!r} is not a boolean (true/false)")
    if tp is int:
        try:
            return int(raw.replace("_", ""))
        except ValueError:
            raise RecipeError(f"{path}: {raw!r} is not an integer") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise RecipeError(f"{path}: {raw!r} is not a number") from None
    if tp is str:
        return raw
    # lists, tuples, dicts: JSON, or comma-separated for lists/tuples
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        if origin in (list, tuple):            # a, b or [a, b]: names without quotes
            value = [v.strip() for v in raw.strip().removeprefix("[").removesuffix("]").split(",") if v.strip()]
        else:
            raise RecipeError(f"{path}: {raw!r} is not valid JSON for {tp}") from None
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list, got {raw!r}")
        inner = args[0] if args else str
        if origin is tuple and len(args) >= 2 and args[1] is not Ellipsis:
            if len(value) != len(args):
                raise RecipeError(f"{path}: expected {len(args)} values, got {len(value)}")
            return tuple(coerce(f"{path}[{i}]", str(v), a) for i, (v, a) in enumerate(zip(value, args)))
        items = [coerce(f"{path}[{i}]", v if isinstance(v, str) else json.dumps(v), inner)
                 for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{path}: expected a JSON object, got {raw!r}")
        return value
    return value


def check_value(path: str, value: Any, tp: Any) -> None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if type(tp).__name__ == "UnionType" or origin is typing.Union:
        if value is None and type(None) in args:
            return
        for a in args:
            if a is type(None):
                continue
            try:
                check_value(path, value, a)
                return
            except RecipeError:
                continue
        raise RecipeError(f"{path}: {value!r} has the wrong type (expected {tp})")
    if origin is Literal:
        if value not in args:
            raise RecipeError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
    elif origin in (list, tuple):
        ok = isinstance(value, (list, tuple))
    elif origin is dict:
        ok = isinstance(value, dict)
    else:
        ok = True
    if not ok:
        raise RecipeError(f"{path}: {value!r} has the wrong type (expected {getattr(tp, '__name__', tp)})")


def check_range(path: str, value: float, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> None:
    bad = (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi)
    if bad:
        lo_txt = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_txt = "" if hi is None else f"<= {hi}"
        allowed = " and ".join(t for t in (lo_txt, hi_txt) if t)
        raise RecipeError(f"{path}: {value!r} is out of range (allowed: {allowed})")


def did_you_mean(name: str, known, prefix: str = "", suffix: str = "") -> str:
    """' (did you mean <prefix><nearest><suffix>?)' for a misspelled `name` among `known`, or '' when none
    is close."""
    import difflib

    near = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{near[0]}{suffix}?)" if near else ""
