"""Launch a recipe's training loop on Ray Train: one trainer with the torch backend (Ray's TorchTrainer in
all but the class: train/backend.py), N workers, the recipe's scaling.

Ray's FailureConfig retries every worker error up to `scaling.max_failures` times, each retry training
again from the last checkpoint. Some errors come back on every retry (storage full, a bad recipe, data
that no longer lays out the same blocks, a strict kernel check that failed): `RaiseUnfixable` ends the
run at once on those, with their message, and leaves the rest to Ray's own policy.
"""
from __future__ import annotations

import os

from raytune_ft import compat
from raytune_ft.env import ray_train_defaults
from raytune_ft.storage.lease import RunFolderInUse
from raytune_ft.recipe.recipe import Recipe, absolute_local_paths, recipe_from_dict
from raytune_ft.train.startup_clock import JobStart
from raytune_ft.train.job_attempts import note_workers_asked, workers_asked_key

WorkerGroupCallback = compat.RAY_WORKER_GROUP_CALLBACK.load()
FailureDecision, FailurePolicy, create_failure_policy = compat.RAY_FAILURE_POLICY.load()


def _worker_env() -> dict[str, str]:
    # the JIT caches too: a folder the user set for one wins over the run's fingerprinted one (jit_cache.py)
    keep = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "RAYTUNE_HF_ROOT", "HF_HOME",
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
            "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLA_CACHE_RESULTS",
            "RAYTUNE_COMPILE_KEYS")
    from raytune_ft.console import QUIET_ENV, PLAIN_ENV
    from raytune_ft.env import ALLOC_CONF_DEFAULT, ALLOC_CONF_ENV, BYTECODE_ENV

    # the driver set them (cli.job_main): workers on other nodes too
    keep += (*QUIET_ENV, *PLAIN_ENV, *BYTECODE_ENV)
    return {k: os.environ[k] for k in keep if k in os.environ} | {
        ALLOC_CONF_ENV: os.environ.get(ALLOC_CONF_ENV, ALLOC_CONF_DEFAULT)}


def unfixable_error(exc: BaseException | None) -> BaseException | None:
    """The error in `exc` (a worker's, however Ray wrapped it) that a retry cannot fix, or None."""
    from raytune_ft.models.kernel_check import KernelCheckError
    from raytune_ft.storage.fs import FileTooLargeError, StorageFullError
    from raytune_ft.train.batch import DataOrderChanged
    from raytune_ft.recipe.values import RecipeError

    unfixable = (StorageFullError, FileTooLargeError, RecipeError, DataOrderChanged, KernelCheckError,
                 RunFolderInUse)
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, unfixable):
            return e
        # Ray's wrappings: a worker's error (UserExceptionWithTraceback), a task's, the worker group's, the
        # controller's
        todo += [e.__cause__, e.__context__, compat.ray_wrapped_error(e), getattr(e, "cause", None),
                 getattr(e, "controller_failure", None)]
        todo += list((getattr(e, "worker_failures", None) or {}).values())
    return None


class RaiseUnfixable(FailurePolicy):
    """Ray Train's default failure policy, except that an error no retry can fix ends the run at once.

    Runs in Ray Train's controller; a worker's exception reaches it pickled (its own class, without the
    `__cause__` chain pickling drops), so the loops raise the unfixable error itself, not one wrapping it.
    """

    def __init__(self, failure_config):
        super().__init__(failure_config)
        self._default = create_failure_policy(failure_config)

    def make_decision(self, training_failed_error):
        if unfixable_error(training_failed_error) is not None:
            return FailureDecision.RAISE
        return self._default.make_decision(training_failed_error)


class NoteWorkersAsked(WorkerGroupCallback):
    """Notes in Ray's key-value store when Ray Train's controller asks for an attempt's workers
    (job_attempts.workers_asked_key). Ray may hand a new worker an idle process it started before a restart;
    the workers' start-up breakdown counts their set-up from this moment at the earliest, not from that start."""

    def __init__(self, key: str):
        self.key = key

    def before_worker_group_start(self, worker_group_context) -> None:
        note_workers_asked(self.key)


def _trainer_class():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    class Trainer(DataParallelTrainer):
        """Ray Train's data-parallel trainer with the torch backend (train/backend.py: what TorchTrainer is,
        without torch in this process) and RaiseUnfixable as its failure policy (Ray builds the default one
        in `fit`, from the FailureConfig alone, and hands it to the controller it starts here). On a Ray
        without a dashboard, no placement-group cleaner (`without_blind_callbacks`)."""

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            controller_init_kwargs["failure_policy"] = RaiseUnfixable(self.run_config.failure_config)
            if "callbacks" in controller_init_kwargs:
                controller_init_kwargs["callbacks"] = without_blind_callbacks(controller_init_kwargs["callbacks"])
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    return compat.check_ray_trainer_internals(Trainer)


def without_blind_callbacks(callbacks: list) -> list:
    """Ray Train's callbacks less its placement-group cleaner where this Ray has no dashboard (a job's own
    local Ray: start_ahead.ensure_ray). The cleaner is a detached actor that asks Ray's state API, served by
    the dashboard, whether the controller is alive, to remove the workers' placement group if it died; with no
    dashboard every ask fails (a warning in its log every few seconds: "State API may be temporarily
    unavailable") and it never removes anything: one Ray process per attempt (a Python start-up importing Ray,
    CPU seconds on the way to the first step) that cannot do its job. The controller removes the placement group
    itself when the attempt ends.
    A cluster's Ray (`ray start --head`, `ray job submit`) has a dashboard and keeps it."""
    if compat.RAY_DASHBOARD_URL.load()():
        return callbacks
    return [c for c in callbacks if type(c).__name__ != "PlacementGroupCleanerCallback"]


def run_fsdp_loop(config: dict) -> None:
    """The FSDP2 loop's Ray Train entry point. The loop's module (torch's distributed code, the model code,
    transformers) is imported here, in the worker: the driver, which pickles this function by reference,
    never imports it, and its start-up threads do not wait on those imports."""
    from raytune_ft.train.fsdp_loop import train_fsdp

    try:
        train_fsdp(config)
    except Exception as e:
        raise _peer_lost(e) or e


def run_trl_loop(config: dict) -> None:
    """The TRL loop's Ray Train entry point, imported in the worker as `run_fsdp_loop`'s."""
    from raytune_ft.train.trl.loop import train_trl

    try:
        train_trl(config)
    except Exception as e:
        raise _peer_lost(e) or e


class PeerLost(RuntimeError):
    """Another worker of the attempt died: this one's collective lost its peer (Ray Train restarts the attempt)."""


# what torch's process groups say when a member went away mid-collective (gloo's TCP pairs, NCCL's watchdog)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted",
              "Broken pipe", "remote process exited or there was a network error")


# what a worker's ray.train.report says when the attempt is torn down under it: Ray Train's controller, told
# a worker died, kills the actor the ranks synchronise each report through
_SYNC_GONE = "class_name: SynchronizationActor"


def _peer_lost(e: BaseException) -> "PeerLost | None":
    """`e` said in one line as `PeerLost` where a collective failed because another worker died, or the report
    this worker was in was cut short by the attempt's end (the dead worker is the error to read; Ray prints
    each worker's traceback whole), else None."""
    text = str(e)
    if _SYNC_GONE in text:
        lost = PeerLost("a report was cut short: Ray Train stopped the attempt (another worker of it died)")
        lost.__suppress_context__ = True
        return lost
    for said in _PEER_GONE:
        if said in text:
            where = text[text.index(said):].split(". ")[0].splitlines()[0][:200]
            lost = PeerLost(f"a collective lost its peer (another worker of this attempt died): {where}")
            lost.__suppress_context__ = True
            return lost
    return None


def loop_function(recipe: Recipe):
    """The Ray Train worker entry point of the recipe's loop."""
    return run_fsdp_loop if recipe.train.loop == "fsdp2" else run_trl_loop


def build_trainer(recipe: Recipe, *, mlflow_run_key: str | None = None, blocks_by_rank: dict | None = None,
                  lease_token: str | None = None, job: JobStart = JobStart(), prebuilt: tuple | None = None):
    """The Ray Train trainer for `recipe`; re-running with the same run name resumes from its last checkpoint.

    The MLflow run rank 0 logs to: `mlflow_run_key`, where it finds the run id in Ray's key-value store
    (run_opening.RunIdHandoff, or run_opening.put_run_id for a caller that has the id): the one way a run id
    reaches the workers; None: no tracking. `lease_token`: the run folder's lease this job holds
    (lease.py); each attempt's workers check it is still theirs before they clear the checkpoints dead attempts
    left. `job`: when the job started and the driver's start-up marks, where the workers' start-up breakdown
    counts from (train/startup_clock.StartupClock). `prebuilt`: `build_datasets(recipe)`'s answer, where the caller
    built them already (run.py, while the MLflow run opens)."""
    import ray.train

    from raytune_ft.train.backend import TorchBackendConfig

    # the controller's poll interval, its preemption watcher (GPU runs): Ray passes the driver's values on
    ray_train_defaults(watch_preemption=recipe.scaling.use_gpu)
    s = recipe.scaling
    loop = loop_function(recipe)
    backend = s.backend if s.backend != "auto" else ("nccl" if s.use_gpu else "gloo")
    resources = {"CPU": s.cpus_per_worker, **s.resources_per_worker}
    if s.use_gpu:
        resources.setdefault("GPU", 1)
    scaling = ray.train.ScalingConfig(
        num_workers=s.num_workers, use_gpu=s.use_gpu, resources_per_worker=resources,
        placement_strategy=s.placement_strategy, accelerator_type=s.accelerator_type)
    from raytune_ft.storage import fs as storage

    # one filesystem object for Ray and the loops: S3's endpoint travels with it, its keys do not
    st = storage.for_recipe(recipe, create=True)
    run_config = ray.train.RunConfig(
        name=recipe.tracking.run_name, storage_path=st.root, storage_filesystem=st.fs,
        failure_config=ray.train.FailureConfig(max_failures=s.max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=recipe.train.keep_checkpoints),
        # the same for every run of this driver (the lease token goes in the loop's config): the processes rank 0's
        # held-out read starts can serve the next run's too
        worker_runtime_env={"env_vars": _worker_env()},
        # Ray Train's own progress lines ("Requesting resources", "Checkpoint successfully created at ...")
        # stay in its log files; its warnings and errors still reach the console
        logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        # Ray Train adds callbacks of its own kinds from here to the controller's
        callbacks=[NoteWorkersAsked(workers_asked_key(recipe.tracking.run_name, job.at))] if job.at else [],
    )
    # workers get every local path absolute and the MLflow store named: they resolve nothing against
    # their own working folder or home (a second, empty store there would take their metrics)
    shipped = absolute_local_paths(recipe_from_dict(recipe.to_dict()))
    shipped.tracking.tracking_uri = shipped.tracking_uri
    config = {"recipe": shipped.to_dict(), "mlflow_run_key": mlflow_run_key, "job_start": job.at,
              "lease_token": lease_token}
    if blocks_by_rank is not None:
        config["blocks_by_rank"] = blocks_by_rank
        datasets, dataset_config = None, None
    else:
        datasets, dataset_config = prebuilt or build_datasets(recipe)
    if job.marks is not None:
        config["startup_marks"] = dict(job.marks)
    return _trainer_class()(loop, train_loop_config=config, scaling_config=scaling, run_config=run_config,
                            backend_config=TorchBackendConfig(backend=backend), datasets=datasets,
                            dataset_config=dataset_config)


def tokenize_processes(recipe: Recipe) -> int:
    """`data.tokenize_workers`, or one per training worker and at least 2: one tokenizing process keeps up
    with several times what a GPU trains on, and each one more imports transformers beside the workers' start."""
    return recipe.data.tokenize_workers or max(2, recipe.scaling.num_workers)


def start_tokenizing(recipe: Recipe) -> None:
    """Start the processes `build_datasets`' tokenizing tasks will run in, with the same tokenizer settings,
    number and CPUs (data/pipeline.start_tokenizing_processes)."""
    from raytune_ft.data.pipeline import start_tokenizing_processes
    from raytune_ft.models.tokenizer import TokenizerOf

    ray_train_defaults(watch_preemption=recipe.scaling.use_gpu)   # the controller's environment, as build_trainer's
    start_tokenizing_processes(TokenizerOf.of(recipe.model), tokenize_processes(recipe), recipe.data.num_cpus_per_op)


def build_datasets(recipe: Recipe):
    """The train (and validation) Ray Datasets: read, tokenize and mask lazily; split without dropping rows."""
    from raytune_ft.data.pipeline import build_dataset, train_data_config
    from raytune_ft.models.tokenizer import TokenizerOf

    # the model's tokenizer settings, not the object: every process the datasets pass through unpickles
    # them, and only the tokenizing tasks need the tokenizer (models/tokenizer.py)
    tok = TokenizerOf.of(recipe.model)
    n = tokenize_processes(recipe)
    datasets = {"train": build_dataset(recipe.data, tok, split="train", processes=n)}
    # built only when read: a recipe without evaluation or held-out sample prompts skips its driver-side set-up
    if ((recipe.data.validation_fraction or 0) > 0 or recipe.data.validation_split) and recipe.train.reads_held_out():
        datasets["validation"] = build_dataset(recipe.data, tok, split="validation", processes=n)
    return datasets, train_data_config(("train",))
