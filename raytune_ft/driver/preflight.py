"""Checks a run makes before Ray starts (or, on a cluster it joins, before anything of the run is placed on
it), each failing with a one-line RecipeError: what would otherwise fail minutes later as a traceback
(an unreachable hub after its retries), or never fail at all (a job waiting for CPUs no node has, behind
Ray's "The job may hang forever" warning). `check_before_ray` makes them all, in order, in one call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from raytune_ft.recipe.recipe import (Recipe, RecipeError, absolute_local_paths, check_tracking_store, nodes_of,
                                      validate)

# Ray's folder of the packages it unpacks for a job (`--working-dir`): deleted with the Ray session
_RAY_PACKAGES = "runtime_resources"


def _truthy(name: str) -> bool:
    return (os.environ.get(name) or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def in_ray_package(path: str) -> bool:
    """Whether a local path lies in Ray's unpacked copy of a job's working directory."""
    return _RAY_PACKAGES in os.path.realpath(os.path.expanduser(path)).split(os.sep)


def check_durable_paths(recipe: Recipe) -> None:
    """Refuse a run folder (or sqlite store) in Ray's temporary copy of the working directory: under
    `ray job submit --working-dir .` a relative tracking.storage_path resolves there and is lost."""
    t = recipe.tracking
    where = {"tracking.storage_path": t.storage_path}
    if (t.tracking_uri or "").startswith("sqlite:///"):
        where["tracking.tracking_uri"] = t.tracking_uri[len("sqlite:///"):]
    for name, path in where.items():
        if "://" not in path and in_ray_package(path):
            raise RecipeError(
                f"{name}: {path} lies in Ray's temporary copy of the job's working directory, deleted when "
                f"the Ray session ends: under `ray job submit --working-dir` give an absolute path "
                f"(e.g. --set {name}=$HOME/raytune_runs, expanded by the submitting shell) or s3://...")


def check_data_source(recipe: Recipe) -> list[str]:
    """Every data source must be reachable and readable now (data/precheck.py): an hf:// source offline or on a
    hub that does not answer, an object store that refuses the credentials, a file in no known format, a split
    that does not exist fail in one line instead of inside Ray. Settles the held-out set; returns the lines
    that say what each source is read as, where the held-out rows come from and which data.template_kwargs the
    chat template ignores (also printed)."""
    from raytune_ft.data.precheck import check_sources, format_note, settle_template_kwargs
    from raytune_ft.data.specs import source_specs
    from raytune_ft.models.tokenizer import chat_template_text

    specs = source_specs(recipe.data)
    for src, revision in dict.fromkeys((s.source, s.revision) for s in specs if s.kind == "hf"):
        _check_hub(src, revision)
    for i, spec in enumerate(specs):
        if spec.kind == "remote":
            probe_remote(spec, f"data.sources[{i}]" if recipe.data.sources else "data")
    checks, held, _ = check_sources(recipe.data)
    lines = [format_note(c, s) for c, s in zip(checks, specs)]
    if recipe.train.reads_held_out():
        lines.append(f"data: held-out set: {held}")
    if ignored := settle_template_kwargs(recipe.data, chat_template_text(recipe.model)):
        lines.append(ignored)
    for line in lines:
        print(f"[raytune_ft] {line}", flush=True)
    return lines


def probe_remote(spec, where: str) -> None:
    """An object-store source answers, with this environment's credentials, within the storage check's
    deadline and timeouts: listed once, a failure said as the checkpoint storage's is (storage_check)."""
    import pyarrow.fs as pafs

    from raytune_ft.storage import fs as storage

    from raytune_ft.storage import check as storage_check
    from raytune_ft.channel import NoAnswer, call_within
    from raytune_ft.env import public_uri

    st = storage.resolve(spec.source)
    fs = storage_check._quick(st.fs)

    def attempt() -> None:
        info = fs.get_file_info(st.root)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"{public_uri(spec.source)} does not exist")
        if info.type == pafs.FileType.Directory:
            fs.get_file_info(pafs.FileSelector(st.root, recursive=False))

    try:
        call_within(storage_check.DEADLINE_S, "data probe", attempt)
    except Exception as e:  # noqa: BLE001 - said in the recipe's words
        if isinstance(e, NoAnswer):
            e = TimeoutError(f"no answer within {storage_check.DEADLINE_S:g} s (timed out)")
        raise RecipeError(storage_check.unusable(f"{where}.source: {public_uri(spec.source)} cannot be read",
                                                 f"listing {public_uri(spec.source)}", e, st.fs)) from None


def _check_hub(src: str, revision: str | None) -> None:
    if os.environ.get("RAYTUNE_HF_ROOT"):
        return   # the hub's offline stand-in
    from raytune_ft.data.reading import hf_repo

    repo = hf_repo(src)
    if _truthy("HF_HUB_OFFLINE"):
        raise RecipeError(f"data.source: {src} needs the Hugging Face hub, and HF_HUB_OFFLINE is set: "
                          "unset it, or give a local file or folder")
    try:
        from huggingface_hub import HfApi

        HfApi().dataset_info(repo, revision=revision, timeout=15)
    except Exception as e:  # noqa: BLE001 - any failure to reach it is said in one line
        from raytune_ft.driver.endings import one_line

        raise RecipeError(f"data.source: {src} cannot be read from the Hugging Face hub ({one_line(e, 300)})") from None


def tokenize_processes(recipe: Recipe) -> int:
    """As train/launch.tokenize_processes (which imports Ray Train: too slow to import before Ray starts)."""
    return recipe.data.tokenize_workers or max(2, recipe.scaling.num_workers)


def cpus_needed(recipe: Recipe) -> float:
    """Logical CPUs the run holds at once: its workers, the tokenizing processes and one Ray Data read."""
    return (recipe.scaling.num_workers * recipe.scaling.cpus_per_worker
            + (tokenize_processes(recipe) + 1) * recipe.data.num_cpus_per_op)


def local_gpus() -> int:
    """GPUs Ray would find on this machine (CUDA_VISIBLE_DEVICES respected)."""
    from raytune_ft import compat
    manager = compat.RAY_ACCELERATORS.load()("GPU")
    visible = manager.get_current_process_visible_accelerator_ids()
    return len(visible) if visible is not None else manager.get_current_node_num_accelerators()


def cluster_nodes() -> int:
    """Alive nodes of the Ray cluster this process is connected to."""
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def check_resources(recipe: Recipe, resources: dict, where: str) -> None:
    """The cluster (`resources`: Ray's totals, or what a local Ray will have) holds what the run needs at
    once: a GPU per worker on GPU recipes, and the CPUs of `cpus_needed`."""
    s = recipe.scaling
    gpus = float(resources.get("GPU", 0))
    if s.use_gpu and gpus < s.num_workers:
        raise RecipeError(f"scaling.use_gpu: the recipe asks for {s.num_workers} GPU workers and {where} has "
                          f"{gpus:g} GPUs: run it where they are, or run the CPU form (--local)")
    cpus, need = float(resources.get("CPU", 0)), cpus_needed(recipe)
    if cpus + 1e-9 < need:
        raise RecipeError(
            f"scaling.cpus_per_worker: the run needs {need:g} CPUs at once ({s.num_workers} workers x "
            f"{s.cpus_per_worker:g}, {tokenize_processes(recipe) + 1} data tasks x {recipe.data.num_cpus_per_op:g}) "
            f"and {where} has {cpus:g}: lower scaling.cpus_per_worker or data.num_cpus_per_op, or give Ray more "
            "CPUs (ray start --head --num-cpus N)")


def finished_run_summary(recipe: Recipe, st, run_path: str, register: bool) -> dict | None:
    """The summary a finished run left in its folder, when a re-submit of it has nothing to do: the store
    holds the run as finished with its final checkpoint, with the same training settings (else
    FinishedRunError), and registered under this recipe's name when registering. None: the run goes on."""
    from raytune_ft.storage import fs as storage
    summary = storage.read_json(st.fs, f"{run_path.rstrip('/')}/{storage.SUMMARY_FILE}")
    if not summary or summary.get("status") not in ("registered", "trained"):
        return None
    if register and (summary["status"] != "registered" or summary.get("registered_name") != recipe.registry.name):
        return None     # the run registers (again, or under another name): that needs Ray
    from raytune_ft.tracking.mlflow_run import finished_run_id

    run_id = finished_run_id(recipe)
    if run_id is None or summary.get("mlflow_run_id") not in (None, run_id):
        return None
    return summary


@dataclass(frozen=True)
class Checked:
    """What the checks before Ray found: the run's storage and folder; the summary a finished run left, when a
    re-submit of it has nothing to do (None: the run goes on); the lines that say how the data is read."""
    storage: object                 # storage.fs.Storage
    run_path: str
    finished: dict | None = None
    data_notes: list[str] = field(default_factory=list)


def check_before_ray(recipe: Recipe, *, local: bool, joins: bool, register: bool) -> Checked:
    """Every check that can refuse the run, in the order they cost, before anything is held: the recipe with
    every local path made absolute (once, here: Ray workers resolve nothing against their own folders), a
    tracking store every node reaches, paths that would be lost with Ray's session, object storage, a finished run
    (nothing further to check then), the data sources, and the resources of a Ray this job starts (a cluster
    joined is checked when joined: RunLifecycle.start_ray)."""
    from raytune_ft.driver.start_ahead import local_cpus
    from raytune_ft.storage import fs as storage
    from raytune_ft.storage.check import check_storage

    validate(absolute_local_paths(recipe))
    check_tracking_store(recipe, nodes_of(recipe.scaling), f"scaling.num_workers={recipe.scaling.num_workers} "
                         f"with {recipe.scaling.gpus_per_node} GPUs per node")
    check_durable_paths(recipe)
    check_storage(recipe)       # object storage that cannot be used fails here, in words
    st, run_path = storage.run_storage(recipe)
    finished = finished_run_summary(recipe, st, run_path, register)
    if finished is not None:
        return Checked(st, run_path, finished)
    notes = check_data_source(recipe)
    if not joins:
        check_resources(recipe, {"CPU": local_cpus(local) or os.cpu_count() or 1,
                                 "GPU": local_gpus() if recipe.scaling.use_gpu else 0}, "this machine")
    return Checked(st, run_path, None, notes)
