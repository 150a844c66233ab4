"""The typed recipe: one object describes a run, validated before Ray starts.

Everything else reads a `Recipe`; this module reads only its sections (recipe_sections.py). A field is
changed from the command line with `--set section.field=value`; an unknown section or field,
a value of the wrong type or out of range fails here with a message that names the field.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from raytune_ft.recipe.checkpointing import check_checkpointing
from raytune_ft.recipe.sections import (DataConfig, ModelConfig, RegistryConfig, ScalingConfig, TrackingConfig,
                                       TrainConfig, validate_registry_name)
from raytune_ft.recipe.values import RecipeError, check_value, coerce, did_you_mean

__all__ = ["RecipeError", "Recipe", "ModelConfig", "DataConfig", "TrainConfig", "ScalingConfig", "TrackingConfig",
           "RegistryConfig", "validate", "apply_overrides", "recipe_from_dict", "absolute_local_paths",
           "on_local_cpu", "validate_registry_name"]


@dataclass
class Recipe:
    job: str = "qwen27b_b300"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    @property
    def run_dir(self) -> str:
        return os.path.join(os.path.expanduser(self.tracking.storage_path), self.tracking.run_name)

    @property
    def tracking_uri(self) -> str:
        if self.tracking.tracking_uri:
            return self.tracking.tracking_uri
        if "://" in self.tracking.storage_path:
            # sqlite cannot live on object storage: the launching machine keeps the store (its artifacts go
            # to the run folder, and a copy of it when the run ends)
            where = self.tracking.storage_path.split("://", 1)[1].split("?", 1)[0].strip("/")
            home = os.path.expanduser(os.environ.get("RAYTUNE_TRACKING_HOME", TRACKING_HOME))
            return "sqlite:///" + os.path.join(os.path.abspath(home), where, self.tracking.run_name, "mlflow.db")
        return "sqlite:///" + os.path.join(os.path.abspath(self.run_dir), "mlflow.db")


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe) if f.name != "job"}
# where the default MLflow store of a run on object storage lives, on the machine that launches it
# (RAYTUNE_TRACKING_HOME moves it)
TRACKING_HOME = "~/.raytune_ft/tracking"


# ---------------------------------------------------------------- overrides

def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Recipe)
    return {name: hints[name] for name in SECTIONS}


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Apply `section.field=value` strings in order; unknown names fail with the allowed ones."""
    classes = _section_classes()
    for item in overrides or []:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected section.field=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if "." not in key:
            raise RecipeError(f"--set {key}: expected section.field (sections: {', '.join(classes)})")
        section, name = key.split(".", 1)
        # a near name is the answer; the whole list only when there is none
        if section not in classes:
            near = did_you_mean(section, classes, suffix="." + name)
            raise RecipeError(f"{key}: unknown section {section!r}" + (near or f" (sections: {', '.join(classes)})"))
        cls = classes[section]
        hints = typing.get_type_hints(cls)
        field_name, _, sub = name.partition(".")
        if sub and typing.get_origin(hints.get(field_name)) is dict:   # one key of a mapping: data.fields.messages=dialog
            value_type = typing.get_args(hints[field_name])[1]
            getattr(getattr(recipe, section), field_name)[sub] = coerce(key, raw.strip(), value_type)
            continue
        if name not in hints:
            raise RecipeError(f"{key}: unknown field {name!r} of {section}"
                              + (did_you_mean(name, hints, section + ".") or f" (fields: {', '.join(hints)})"))
        setattr(getattr(recipe, section), name, coerce(key, raw.strip(), hints[name]))
    return recipe


# ---------------------------------------------------------------- validation

def _check_types(recipe: Recipe) -> None:
    classes = _section_classes()
    for section, cls in classes.items():
        obj = getattr(recipe, section)
        if not isinstance(obj, cls):
            raise RecipeError(f"{section}: expected {cls.__name__}, got {type(obj).__name__}")
        for name, tp in typing.get_type_hints(cls).items():
            check_value(f"{section}.{name}", getattr(obj, name), tp)


def nodes_of(scaling: ScalingConfig) -> int:
    """How many nodes the scaling needs at least: GPU workers fill nodes of scaling.gpus_per_node."""
    return -(-scaling.num_workers // scaling.gpus_per_node) if scaling.use_gpu else 1


def check_tracking_store(recipe: Recipe, nodes: int, why: str) -> None:
    """A run over more than one node needs a tracking store every node reaches: a sqlite file or a
    file: store exists on one machine only, and rank 0 on another node would open an empty one of its
    own there (the run's metrics lost)."""
    uri = recipe.tracking_uri
    if nodes <= 1 or not (uri.startswith(("sqlite:", "file:")) or "://" not in uri):
        return
    raise RecipeError(
        f"tracking.tracking_uri: {uri} is a file on one machine, and this run spans {nodes} nodes ({why}): "
        "rank 0 may run on another node, where that file does not exist. Run an MLflow tracking server "
        "every node reaches (on the head node: mlflow server --host 0.0.0.0 --port 5000 "
        "--backend-store-uri sqlite:///$HOME/mlflow.db) and set --set tracking.tracking_uri=http://<head "
        "node>:5000 (or databricks)")


def validate(recipe: Recipe) -> Recipe:
    """Check every field for type and range; raise RecipeError naming the first bad one."""
    _check_types(recipe)
    recipe.model.validate()
    recipe.data.validate(recipe.model)
    recipe.data.settle_held_out(recipe.train.reads_held_out())
    recipe.train.validate(recipe.data, recipe.registry)
    check_checkpointing(recipe.train.activation_checkpointing, recipe.model.family)
    recipe.scaling.validate()
    _check_context_parallel(recipe)
    if recipe.train.precision == "fp8" and not recipe.scaling.use_gpu:
        raise RecipeError("train.precision: fp8 needs GPUs with float8 matmuls (scaling.use_gpu=true); "
                          "use train.precision=bf16 on CPU")
    recipe.tracking.validate()
    recipe.registry.validate()
    return recipe


def _check_context_parallel(recipe: Recipe) -> None:
    cp = recipe.scaling.context_parallel
    if cp > 1 and recipe.train.loop != "fsdp2":
        raise RecipeError("scaling.context_parallel: offered by the FSDP2 loop only (train.loop='fsdp2')")
    if cp > 1 and recipe.data.seq_len % (2 * cp):
        raise RecipeError(f"data.seq_len: {recipe.data.seq_len} must be a multiple of 2 x "
                          f"scaling.context_parallel ({2 * cp}): each block is split into that many equal chunks")


def recipe_from_dict(d: dict[str, Any]) -> Recipe:
    """Rebuild a Recipe from `Recipe.to_dict()` (as shipped to Ray workers); unknown keys fail."""
    classes = _section_classes()
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key == "job":
            kwargs["job"] = value
            continue
        if key not in classes:
            raise RecipeError(f"{key}: unknown section (sections: {', '.join(classes)})")
        cls = classes[key]
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - names
        if unknown:
            raise RecipeError(f"{key}.{sorted(unknown)[0]}: unknown field of {key} (fields: {', '.join(sorted(names))})")
        hints = typing.get_type_hints(cls)
        fixed = {k: (tuple(v) if typing.get_origin(hints[k]) is tuple and isinstance(v, list) else v)
                 for k, v in value.items()}
        kwargs[key] = cls(**fixed)
    return Recipe(**kwargs)


def absolute_local_paths(recipe: Recipe) -> Recipe:
    """Every local path of the recipe made absolute, once, where the run is launched: Ray workers run in
    folders of their own, so a relative path resolved there names another place (a second, empty
    MLflow store, say). The storage path and a file-based tracking URI are always made absolute; the
    model, tokenizer, template and data paths when they exist here (hub ids such as Qwen/Qwen3-4B and
    hf:// or builtin: sources are left alone)."""
    def fix(value: str | None) -> str | None:
        if not value or "://" in value or value.startswith("builtin:"):
            return value
        path = os.path.expanduser(value)
        return os.path.abspath(path) if os.path.exists(path) else value

    recipe.model.name = fix(recipe.model.name)
    recipe.model.tokenizer = fix(recipe.model.tokenizer)
    recipe.model.chat_template = fix(recipe.model.chat_template)
    recipe.data.source = fix(recipe.data.source)
    for entry in [*recipe.data.sources, *(e for m in recipe.data.mixtures.values() for e in m)]:
        if isinstance(entry, dict) and isinstance(entry.get("source"), str):
            entry["source"] = fix(entry["source"])
    if recipe.train.sample_count() is None:
        recipe.train.sample_prompts = fix(recipe.train.sample_prompts)
    tr = recipe.tracking
    if tr.storage_path.strip() and "://" not in tr.storage_path:
        tr.storage_path = os.path.abspath(os.path.expanduser(tr.storage_path))
    tr.tracking_uri = _absolute_store_uri(tr.tracking_uri)
    return recipe


def _absolute_store_uri(uri: str | None) -> str | None:
    """sqlite:///rel/mlflow.db and file:rel with the path made absolute; other URIs unchanged."""
    if uri and uri.startswith("sqlite:///") and not uri[len("sqlite:///"):].startswith("/"):
        return "sqlite:///" + os.path.abspath(os.path.expanduser(uri[len("sqlite:///"):]))
    if uri and uri.startswith("file:") and not uri.startswith("file:/"):
        return "file:" + os.path.abspath(os.path.expanduser(uri[len("file:"):]))
    return uri


def on_local_cpu(r: Recipe, *, workers: int, rows: int, seq_len: int, run_name: str, registry_name: str) -> Recipe:
    """What every job's `--local` shares: a tiny model of the same family in fp32, generated chat data,
    `workers` CPU workers on gloo, runs under ./runs (or $RAYTUNE_LOCAL_STORAGE), the local registry."""
    r.model.local_tiny = True
    r.model.dtype = "float32"
    r.model.max_position_embeddings = None
    r.data.source = f"builtin:chat:{rows}"
    r.data.revision = None
    r.data.seq_len = seq_len
    r.data.pack_window = 64 if rows < 400 else 256
    r.train.compile = False
    r.train.precision = "bf16"     # float8 matmuls need a GPU
    r.scaling.num_workers = workers
    r.scaling.use_gpu = False
    r.scaling.cpus_per_worker = 1
    r.scaling.backend = "gloo"
    r.scaling.max_failures = 1
    r.tracking.storage_path = os.environ.get("RAYTUNE_LOCAL_STORAGE", "./runs")
    r.tracking.run_name = run_name
    r.registry.name = registry_name
    r.registry.timeout_s = 600
    return r
