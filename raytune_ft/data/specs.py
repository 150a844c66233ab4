"""The recipe's data sources as a list of `SourceSpec`s (one, or a mixture's), their files and their splits.

A source is `builtin:NAME[:N]`, `hf://org/name`, `s3://bucket/prefix` (or any URI the storage layer
accepts), or a local file or folder. Files are json, jsonl or parquet, plain or compressed (.gz, .bz2,
.zst, .lz4). Splits: a hub repo's or a folder's files are grouped the way the hub names them
(`<split>-00000-of-00003.parquet`, `<split>.jsonl`, `<split>/...`); a single file is one split, its own rows.
Checked here without Ray, in the recipe's validation: what cannot be read or names a split that does not
exist fails with a RecipeError that lists what exists.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from raytune_ft.data.sources import FIELD_NAMES, FORMATS, ROLES, Adapter
from raytune_ft.recipe.values import RecipeError

DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")
COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
SPEC_KEYS = ("source", "split", "revision", "schema", "fields", "roles", "weight", "max_rows",
             "validation_split", "validation_fraction", "name")
_SHARDED = re.compile(r"^(?P<split>.+?)-\d+-of-\d+")


@dataclass
class SourceSpec:
    """One source of the recipe's data, with everything its rows need to become messages."""
    source: str
    split: str = "train"
    revision: str | None = None
    schema: str = "auto"
    fields: dict[str, str] = field(default_factory=dict)
    roles: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    max_rows: int | None = None
    validation_split: str | None = None
    validation_fraction: float | None = None     # a mixture source's own carve (None: data.validation_fraction)
    name: str = ""

    @property
    def kind(self) -> str:
        return source_kind(self.source)


def adapter_of(spec: SourceSpec) -> Adapter:
    """The row -> messages adapter of a source: its format, field and role names."""
    return Adapter(spec.schema, spec.fields, spec.roles)


def one_stream(specs: list[SourceSpec]) -> bool:
    """Whether the sources are read as one stream in their rows' order: one source, each row used once. A weighted
    one goes the mixture's way, which uses each row its weight's times (README: 0.5 a seeded half, 2 twice)."""
    return len(specs) == 1 and specs[0].weight == 1


def source_kind(src: str) -> str:
    """builtin | hf | remote (an object store URI) | local."""
    if src.startswith("builtin:"):
        return "builtin"
    if src.startswith("hf://"):
        return "hf"
    return "remote" if "://" in src and not src.startswith("file://") else "local"


def source_specs(data) -> list[SourceSpec]:
    """The sources of a DataConfig: its `sources` (a mixture) when given, else its one `source`."""
    if not data.sources:
        return [SourceSpec(source=data.source, split=data.split, revision=data.revision, schema=data.schema,
                           fields=dict(data.fields), roles=dict(data.roles), max_rows=data.max_rows,
                           validation_split=data.validation_split, name=data.source)]
    specs, names = [], set()
    for entry in data.sources:
        spec = SourceSpec(**{"split": data.split, "schema": data.schema, "fields": dict(data.fields),
                             "roles": dict(data.roles), **entry})
        base = spec.name or spec.source if spec.split == data.split or spec.kind == "local" else \
            f"{spec.name or spec.source}:{spec.split}"
        spec.name = base if base not in names else f"{base}#{len(specs)}"
        names.add(spec.name)
        specs.append(spec)
    return specs


def is_data_file(name: str) -> bool:
    base = name.lower()
    for ext in COMPRESSED:
        base = base.removesuffix(ext)
    return base.endswith(DATA_EXTENSIONS)


def split_of(path: str, root: str) -> str:
    """The split a data file belongs to, named as the hub names them (module docstring)."""
    rel = os.path.relpath(path, root) if root and path.startswith(root) else os.path.basename(path)
    parts = rel.replace("\\", "/").split("/")
    stem = parts[-1].split(".")[0]
    if m := _SHARDED.match(stem):
        return m.group("split")
    if len(parts) > 1 and parts[-2] not in ("data", "default"):
        return parts[-2]
    return stem


def splits_of(files: list[str], root: str) -> dict[str, list[str]]:
    """The files of a folder or repo by split."""
    out: dict[str, list[str]] = {}
    for f in sorted(files):
        out.setdefault(split_of(f, root), []).append(f)
    return out


def pick_split(files: list[str], root: str, split: str, what: str, *, single_ok: bool) -> list[str]:
    """The files of `split`. A folder whose files name no such split is one split (`single_ok`: the
    training split) when asked for training rows; asked for a held-out split, it fails listing the splits."""
    by_split = splits_of(files, root)
    if split in by_split:
        return by_split[split]
    if single_ok:
        return sorted(files)
    raise RecipeError(f"{what}: split {split!r} does not exist in {root} (splits: {', '.join(by_split)})")


def local_files(path: str) -> list[str]:
    """The data files of a local file or folder (all of a folder's, recursively)."""
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names if is_data_file(f))


def check_specs(data) -> None:
    """Each source's entry is well formed and, for a local one, exists and has the splits named."""
    if data.sources and not isinstance(data.sources, list):
        raise RecipeError("data.sources: expected a list of {source, split, weight, ...}")
    for i, entry in enumerate(data.sources):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict) or "source" not in entry:
            raise RecipeError(f"{where}: expected an object with a 'source' (keys: {', '.join(SPEC_KEYS)})")
        unknown = sorted(set(entry) - set(SPEC_KEYS))
        if unknown:
            raise RecipeError(f"{where}.{unknown[0]}: unknown key (keys: {', '.join(SPEC_KEYS)})")
        w = entry.get("weight", 1.0)
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 < w <= 100:
            raise RecipeError(f"{where}.weight: {w!r} is out of range (allowed: > 0 and <= 100)")
        n = entry.get("max_rows")
        if n is not None and (not isinstance(n, int) or n < 1):
            raise RecipeError(f"{where}.max_rows: {n!r} is out of range (allowed: an integer >= 1)")
        f = entry.get("validation_fraction")
        if f is not None and (not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 <= f <= 0.5):
            raise RecipeError(f"{where}.validation_fraction: {f!r} is out of range (allowed: >= 0 and <= 0.5)")
    for i, spec in enumerate(source_specs(data)):
        _check_spec(spec, f"data.sources[{i}]" if data.sources else "data")


def _check_spec(spec: SourceSpec, where: str) -> None:
    src = spec.source
    if not isinstance(src, str) or not src.strip():
        raise RecipeError(f"{where}.source: must not be empty")
    if spec.schema not in ("auto", *FORMATS):
        raise RecipeError(f"{where}.schema: {spec.schema!r} is not one of auto, {', '.join(FORMATS)}")
    for k in spec.fields:
        if k not in FIELD_NAMES:
            raise RecipeError(f"{where}.fields.{k}: not a field of any format (fields: {', '.join(FIELD_NAMES)})")
    for k, names in spec.roles.items():
        if k not in ROLES:
            raise RecipeError(f"{where}.roles.{k}: not a chat role (roles: {', '.join(ROLES)})")
        if not isinstance(names, (list, str)):
            raise RecipeError(f"{where}.roles.{k}: expected a list of names, got {names!r}")
    if spec.kind == "builtin":
        from raytune_ft.data.builtin import builtin_source

        try:
            builtin_source(src)
        except ValueError as e:
            raise RecipeError(f"{where}.source: {e}") from None
    elif spec.kind == "remote":
        from raytune_ft.storage import fs as storage
        try:
            storage.resolve(src)
        except ValueError as e:
            raise RecipeError(f"{where}.source: {e}") from None
    elif spec.kind == "local":
        path = os.path.expanduser(src.removeprefix("file://"))
        if not os.path.exists(path):
            raise RecipeError(f"{where}.source: {src!r} does not exist (a local file or folder, "
                              "hf://org/dataset, s3://bucket/prefix or builtin:chat)")
        files = local_files(path)
        if not files:
            raise RecipeError(f"{where}.source: no .jsonl/.json/.parquet files (plain or compressed) under {src!r}")
        if spec.validation_split is not None:
            check_held_out_split(spec, files, path, where)


def check_held_out_split(spec: SourceSpec, files: list[str], root: str, where: str) -> None:
    """A named held-out split must exist, and not be the training split (a single file has one split)."""
    by_split = splits_of(files, root) if len(files) > 1 or os.path.isdir(root) else {}
    if spec.validation_split in by_split and spec.validation_split != spec.split:
        return
    have = (f"splits: {', '.join(by_split)}" if by_split else
            "a single file has one split, its own rows")
    raise RecipeError(
        f"{where}.validation_split: {spec.validation_split!r} does not exist in {spec.source} ({have}). "
        f"Unset it (--set {where}.validation_split=none) to hold out data.validation_fraction (5% by default) "
        "of the rows by content hash, never trained on")


HELD_OUT_SPLIT_NAMES = ("test", "validation")       # the hub's names of a held-out split


def follow_source(data, job_source: str, named: set[str]) -> str | None:
    """A job's split names belong to its own source (`job_source`): for another one (the user's `--set
    data.source=...` or `data.sources=[...]`), the names the user did not set (`named`: `split`,
    `validation_split`, ...) follow it. A local folder laid out as `train` plus `test` or `validation` trains on
    the one and holds out the other; any other source keeps the job's held-out split only where it has one, else
    its held-out rows are carved by content hash; a mixture's sources hold out their own. Returns a line saying
    what changed (None: nothing)."""
    if data.validation_split is None or "validation_split" in named:
        return None
    if "sources" in named:
        job_held, data.validation_split = data.validation_split, None
        return (f"data: the job's held-out split {job_held} is its own source's ({job_source}); the sources given "
                "hold out their own validation_split, or data.validation_fraction of their rows by content hash")
    if data.sources or data.mixture or data.source == job_source:
        return None
    path = os.path.expanduser(data.source.removeprefix("file://"))
    local = source_kind(data.source) == "local" and os.path.isdir(path)
    splits = set(splits_of(local_files(path), path)) if local else set()
    job_split, job_held = data.split, data.validation_split
    held = [s for s in HELD_OUT_SPLIT_NAMES if s in splits]
    if "split" not in named and data.split not in splits and len(held) == 1 and splits == {"train", held[0]}:
        data.split = "train"
    if job_held in splits and job_held != data.split:
        return None
    data.validation_split = held[0] if len(held) == 1 and held[0] != data.split else None
    took = (f"its split {data.validation_split}" if data.validation_split else
            "data.validation_fraction of its rows by content hash")
    trains = f", trained on its split {data.split}" if data.split != job_split else ""
    return (f"data: the job's held-out split {job_held} is its own source's ({job_source}); {data.source} "
            f"holds out {took}{trains}")
