"""Each node's health in the MLflow run: GPU utilisation, memory and power (pynvml), CPU, memory, disk and
network, as MLflow's own system metrics (`system/<node>/...`), sampled every 10 s.

`tracking.system_metrics`: "auto" (on where the recipe asks for GPUs and the worker has one), "on", "off". On each node the worker of
local rank 0 starts a process of its own that runs MLflow's `SystemMetricsMonitor` on the run: MLflow's
imports and the store's calls stay out of the training process, and the node's GPUs are all visible to it
(pynvml counts the node's devices, whatever CUDA_VISIBLE_DEVICES says). The process ends when the worker
closes its pipe or dies (its stdin reaches the end), and MLflow's monitor stops by itself once the run is no
longer RUNNING. A restarted attempt's monitor continues the steps where the last one stopped. The process is
a channel.Channel's child: one that dies takes the node's samples with it (said in the worker's log).
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Callable

SAMPLE_EVERY_S = 10.0


def wanted(mode: str, use_gpu: bool) -> bool:
    """Whether `tracking.system_metrics` asks for the monitor on this run."""
    return mode == "on" or (mode == "auto" and use_gpu)


def _sees_gpu() -> bool:
    """Whether this worker has a GPU (a GPU recipe's loop run on a CPU, as the tests do, has none)."""
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def node_id(node_rank: int) -> str:
    return f"node_{node_rank}"


class NodeMonitor:
    """The node's monitor process on the run (a collective of nothing: one per node, started by local rank 0).
    `run_id` may come later (`give_run`), where the run was still opening when the worker started."""

    def __init__(self, tracking_uri: str, node: str, say: Callable[[str], None], *,
                 sample_every_s: float = SAMPLE_EVERY_S, gpus: bool = False):
        from raytune_ft.channel import Channel

        self._first = {"tracking_uri": tracking_uri, "node_id": node, "sample_every_s": sample_every_s,
                       "gpus": gpus}
        self._say, self._closed = say, False
        self._channel: Channel | None = Channel("raytune_ft.train.system_metrics", "serve", on_exit=self._exited,
                                                name="system-metrics")

    def _exited(self, code: int) -> None:
        if not self._closed and code != 0:
            self._say(f"system metrics off: the monitor's process exited (code {code})")

    def give_run(self, run_id: str | None) -> None:
        """Start sampling into `run_id` (None: the run never came; the process ends)."""
        if self._channel is not None and not (run_id and self._channel.send({**self._first, "run_id": run_id})):
            self.close()

    def close(self, timeout: float = 30.0) -> None:
        """The last samples logged, the process ended (killed after `timeout` s)."""
        channel, self._channel, self._closed = self._channel, None, True
        if channel is not None:
            channel.close(timeout)


def start_for_node(recipe, rank: int, run_id: str | None, run_key: str | None,
                   say: Callable[[str], None]) -> NodeMonitor | None:
    """This node's monitor, where this worker is the node's local rank 0 and the recipe asks for one; the run
    id is `run_id`, or awaited in a thread through Ray's key-value store (`run_key`). None elsewhere."""
    if not wanted(recipe.tracking.system_metrics, recipe.scaling.use_gpu and _sees_gpu()) or not (run_id or run_key):
        return None
    try:
        import ray.train

        ctx = ray.train.get_context()
        local_rank, node_rank = ctx.get_local_rank(), ctx.get_node_rank()
    except Exception:  # noqa: BLE001 - outside Ray Train (tests, benchmarks): the process is its node
        local_rank, node_rank = 0, 0
    if local_rank != 0:
        return None
    monitor = NodeMonitor(recipe.tracking_uri, node_id(node_rank), say, gpus=recipe.scaling.use_gpu)
    if run_id:
        monitor.give_run(run_id)
    else:
        def wait() -> None:
            from raytune_ft.tracking.opening import await_run_id

            try:
                monitor.give_run(await_run_id(run_key))
            except Exception:  # noqa: BLE001 - no run: nothing to sample into
                monitor.give_run(None)
        threading.Thread(target=wait, name="raytune-system-metrics", daemon=True).start()
    if rank == 0:
        say(f"system metrics: each node's GPUs, CPU, memory, disk and network every {SAMPLE_EVERY_S:.0f} s "
            "(MLflow system/node_<n>/...; tracking.system_metrics=off turns them off)")
    return monitor


def serve(child) -> None:
    """The monitor's process (channel.Channel's child): the run from the first message, then samples until
    the worker closes the pipe or dies."""
    import logging

    os.dup2(2, 1)           # anything a library prints goes to the worker's log
    messages = child.messages()
    cfg = next(messages, None)
    if cfg is None:
        return
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(cfg["run_id"], sampling_interval=cfg["sample_every_s"], resume_logging=True,
                                   node_id=cfg["node_id"], tracking_uri=cfg["tracking_uri"])
    if cfg.get("gpus") and not any("GPU" in type(m).__name__ for m in monitor.monitors):
        print("[raytune_ft] system metrics without the GPUs' figures: pynvml is missing (pip install nvidia-ml-py)",
              file=sys.stderr, flush=True)
    monitor.start()
    for _ in messages:      # until the worker closes the pipe or dies
        pass
    monitor.finish()
