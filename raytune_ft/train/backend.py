"""Ray Train's torch backend (the workers' process group, their CUDA device), with torch imported where it
is used and not before.

`ray.train.torch.TorchTrainer` and `TorchConfig` live in a module that imports torch, so the driver that
builds the trainer and Ray Train's controller that unpickles it import torch before either does anything
else, one after the other on the way to the first step. `TorchBackendConfig` is Ray's `TorchConfig` (same fields, same meaning) in a
module without torch: its backend hands each call to Ray's own torch backend, imported in a thread of
the controller's as the controller unpickles it, while it places and starts the workers, which take a
while before the process group is asked of them; the train function's context (the CUDA device of
the worker's training thread) is Ray's too, imported in the worker. The trainer is Ray's
`DataParallelTrainer` with this config, which is all `TorchTrainer` adds (launch.py).
"""
from __future__ import annotations

import functools
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Optional

from ray.train.backend import Backend, BackendConfig

from raytune_ft import compat
def _import_ray_torch_backend() -> None:
    try:
        import ray.train.torch.config  # noqa: F401
    except Exception:  # noqa: BLE001 - the first call through the backend raises it, in its place
        pass


@functools.cache
def _start_importing() -> None:
    """Start importing Ray's torch backend (and torch) in a thread of this process, once (the controller
    unpickles two of these backends, the accelerator set-up's and the process group's)."""
    threading.Thread(target=_import_ray_torch_backend, daemon=True, name="raytune-torch-backend").start()


def _unpickled_backend() -> "TorchBackend":
    _start_importing()
    return TorchBackend()


# Ray's own limit for the process group's shutdown (TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, its default)
SHUTDOWN_TIMEOUT_S = float(os.environ.get("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", 30))
# what the workers left get once one is known dead
DEAD_PEER_GRACE_S = 2.0


def _actor_said(e: BaseException) -> str:
    """A dead actor's error in a few words: its class and process, and why it died (Ray's first sentence)."""
    text = str(e)
    pid = re.search(r"\bpid: (\d+)", text)
    why = re.search(r"Worker exit detail: ([^.]*)", text) or re.search(r"The actor is dead because ([^.]*)", text)
    return ", ".join(x for x in (f"pid {pid.group(1)}" if pid else "", why.group(1) if why else type(e).__name__)
                     if x)


class TorchBackend(Backend):
    """Ray's `_TorchBackend`, imported at its first call; unpickling one (in Ray Train's controller)
    starts that import in a thread."""

    # workers on one node see each other's GPUs (NCCL's peer-to-peer paths), as Ray's torch backend does
    share_cuda_visible_devices: bool = True

    def __init__(self):
        self._ray_backend = None

    def __reduce__(self):
        return _unpickled_backend, ()

    def _ray(self):
        if self._ray_backend is None:
            ray_torch_backend, _ = compat.RAY_TORCH_BACKEND.load()
            self._ray_backend = ray_torch_backend()
        return self._ray_backend

    def on_start(self, worker_group, backend_config):
        return self._ray().on_start(worker_group, backend_config)

    def on_training_start(self, worker_group, backend_config):
        return self._ray().on_training_start(worker_group, backend_config)

    def on_shutdown(self, worker_group, backend_config):
        """Ray's shutdown of the process group on every worker, except where a worker died: that one is
        said in one line (Ray logs the dead actor's error as a 30-line traceback), and the others get
        `DEAD_PEER_GRACE_S`, not Ray's 30 s: their process group lost a member, a collective may never
        return, and Ray kills them next either way."""
        import ray
        from ray.exceptions import RayActorError
        _, shutdown_torch = compat.RAY_TORCH_BACKEND.load()
        pending = list(worker_group.execute_async(shutdown_torch, destroy_process_group=len(worker_group) > 1))
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        dead = []
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            try:
                ray.get(ready[0])
            except RayActorError as e:
                if not dead:
                    deadline = min(deadline, time.monotonic() + DEAD_PEER_GRACE_S)
                dead.append(_actor_said(e))
        if dead:
            print(f"[raytune_ft] a training worker is gone ({dead[0]}); the attempt's other workers are stopped "
                  "and Ray Train starts the next attempt from the last checkpoint", flush=True)
        elif pending:
            print(f"[raytune_ft] the process group's shutdown took over {SHUTDOWN_TIMEOUT_S:.0f} s; the workers "
                  "are stopped", flush=True)


class TrainThreadDevice:
    """The train function's context on each worker: Ray's torch one (sets the training thread's CUDA device)."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self._inner = TorchConfigContextManager()
        return self._inner.__enter__()

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)


@dataclass
class TorchBackendConfig(BackendConfig):
    """`ray.train.torch.TorchConfig`'s fields: backend (None: nccl with GPUs, else gloo), init_method ("env"
    or "tcp"), timeout_s of the process group's operations."""

    backend: Optional[str] = None
    init_method: str = "env"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return TorchBackend

    @property
    def train_func_context(self):
        return TrainThreadDevice

    @property
    def framework(self):
        return compat.RAY_TRAINING_FRAMEWORK.load().TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}
