"""Launch a recipe's training loop on Ray Train: one trainer with the torch backend (Ray's TorchTrainer in
all but the class: train/backend.py), N workers, the recipe's scaling.

Ray's FailureConfig retries every worker error up to `scaling.max_failures` times, each retry training
again from the last checkpoint. Some errors come back on every retry (storage full, a bad recipe, data
that no longer lays out the same blocks, a strict kernel check that failed): `RaiseUnfixable` ends the
run at once on those, with their message, and leaves the rest to Ray's own policy.
"""
from __future__ import annotations

import os

from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy, create_failure_policy

from raytune_ft.lease import TOKEN_ENV, RunFolderInUse
from raytune_ft.recipe import Recipe, absolute_local_paths, recipe_from_dict


def _worker_env() -> dict[str, str]:
    # the JIT caches too: a folder the user set for one wins over the run's fingerprinted one (jit_cache.py)
    keep = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "RAYTUNE_HF_ROOT", "HF_HOME",
            "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
            "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "FLA_CACHE_RESULTS",
            "RAYTUNE_FAULT_AFTER_UPLOAD", "RAYTUNE_FAULT_AT_STEP", "RAYTUNE_FAULT_FREE_BYTES",
            "RAYTUNE_COMPILE_KEYS")
    from raytune_ft.console import QUIET_ENV, PLAIN_ENV
    from raytune_ft.env import BYTECODE_ENV

    # the driver set them (cli.job_main): workers on other nodes too
    keep += (*QUIET_ENV, *PLAIN_ENV, *BYTECODE_ENV)
    return {k: os.environ[k] for k in keep if k in os.environ}


def unfixable_error(exc: BaseException | None) -> BaseException | None:
    """The error in `exc` (a worker's, however Ray wrapped it) that a retry cannot fix, or None."""
    from raytune_ft.models.kernel_check import KernelCheckError
    from raytune_ft.storage import FileTooLargeError, StorageFullError
    from raytune_ft.train.batch import DataOrderChanged
    from raytune_ft.typed_values import RecipeError

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
        todo += [e.__cause__, e.__context__, getattr(e, "_base_exc", None), getattr(e, "cause", None),
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


def _trainer_class():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    class Trainer(DataParallelTrainer):
        """Ray Train's data-parallel trainer with the torch backend (train/backend.py: what TorchTrainer is,
        without torch in this process) and RaiseUnfixable as its failure policy (Ray builds the default one
        in `fit`, from the FailureConfig alone, and hands it to the controller it starts here)."""

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            controller_init_kwargs["failure_policy"] = RaiseUnfixable(self.run_config.failure_config)
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    return Trainer


def run_fsdp_loop(config: dict) -> None:
    """The FSDP2 loop's Ray Train entry point. The loop's module (torch's distributed code, the model code,
    transformers) is imported here, in the worker: the driver, which pickles this function by reference,
    never imports it, and its start-up threads do not wait on those imports (bench/NOTES.md, start-up)."""
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


def _peer_lost(e: BaseException) -> "PeerLost | None":
    """`e` said in one line as `PeerLost` where a collective failed because another worker died (the dead worker
    is the error to read; Ray prints each worker's traceback whole), else None."""
    text = str(e)
    for said in _PEER_GONE:
        if said in text:
            where = text[text.index(said):].split(". ")[0].splitlines()[0][:200]
            lost = PeerLost(f"a collective lost its peer (another worker of this attempt died): {where}")
            lost.__suppress_context__ = True
            return lost
    return None
