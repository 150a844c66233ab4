"""The trainer's torch backend without torch where it is not used (train/backend.py): the driver builds the
trainer without importing torch, the controller's copy of the backend starts importing Ray's torch
backend as it is unpickled, and the backend is Ray's torch one in what it does (every Ray Train test of
the loops runs through it: gloo process groups of 2 workers, on one node and on two)."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import pytest

from raytune_ft.train.backend import TorchBackend, TorchBackendConfig
from tests.conftest import REPO, env_with_path

DRIVER = textwrap.dedent("""
    import json, os, sys
    import ray
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    from raytune_ft.cli import _job_recipe
    from raytune_ft.driver.launch import build_trainer
    recipe = _job_recipe("qwen27b_b300", True, ["tracking.storage_path=" + sys.argv[1]])
    trainer = build_trainer(recipe)
    print(json.dumps({"torch": "torch" in sys.modules, "backend": type(trainer.backend_config).__name__,
                      "nccl_free": trainer.backend_config.backend,
                      "poll": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")}))
""")


@pytest.mark.timeout(300)
def test_the_driver_builds_the_trainer_without_importing_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "runs")], cwd=tmp_path,
                         env=env_with_path(REPO, drop=("RAY_ADDRESS", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Ray Train's controller polls the workers every 0.5 s, not its 2 s (a checkpoint report waits for a poll)
    assert got == {"torch": False, "backend": "TorchBackendConfig", "nccl_free": "gloo", "poll": "0.5"}


UNPICKLE = textwrap.dedent("""
    import pickle, sys, threading, time
    backend = pickle.loads(sys.stdin.buffer.read())
    started = "raytune-torch-backend" in [t.name for t in threading.enumerate()]
    deadline = time.time() + 120
    while "ray.train.torch.config" not in sys.modules and time.time() < deadline:
        time.sleep(0.05)
    print(started, "ray.train.torch.config" in sys.modules, backend.share_cuda_visible_devices)
""")


def test_unpickling_the_backend_starts_importing_ray_s_torch_backend():
    """What Ray Train's controller does with the trainer's callbacks: the import starts there, in a thread."""
    blob = pickle.dumps(TorchBackend())
    out = subprocess.run([sys.executable, "-c", UNPICKLE], input=blob, capture_output=True, timeout=200,
                         env=env_with_path(REPO))
    assert out.returncode == 0, out.stderr[-3000:].decode(errors="replace")
    assert out.stdout.decode().split() == ["True", "True", "True"]


def test_the_config_reads_as_ray_s_torch_config():
    from ray.train.torch.config import TorchConfig
    from ray.train.v2._internal.util import TrainingFramework

    ours, ray_s = TorchBackendConfig(backend="nccl", timeout_s=60), TorchConfig(backend="nccl", timeout_s=60)
    assert ours.to_dict() == ray_s.to_dict() and ours.framework is ray_s.framework is TrainingFramework.TORCH
    assert TorchBackend.share_cuda_visible_devices == ray_s.backend_cls.share_cuda_visible_devices is True
    assert TorchBackend.has_replica_groups == ray_s.backend_cls.has_replica_groups


ACTOR_DIED = """The actor died unexpectedly before finishing this task.
\tclass_name: RayTrainWorker
\tactor_id: 9a658a4fdfcb8171ac78975501000000
\tpid: 9379
\tnamespace: de1af085
\tip: 192.0.2.2
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker \
unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the process was killed"""


def test_a_dead_worker_is_said_in_a_few_words():
    """Issue 36: Ray logged the dead worker's ActorDiedError as a 30-line traceback at the backend's shutdown."""
    from raytune_ft.train.backend import _actor_said

    assert _actor_said(RuntimeError(ACTOR_DIED)) == "pid 9379, Worker unexpectedly exits with a connection error code 2"
    assert _actor_said(RuntimeError("no details")) == "RuntimeError"


def test_a_collective_that_lost_its_peer_is_raised_in_one_line():
    from raytune_ft.driver.launch import PeerLost, _peer_lost

    gloo = ("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:34698. This is "
            "typically caused by a remote worker crashing.\nmore")
    lost = _peer_lost(RuntimeError(gloo))
    assert isinstance(lost, PeerLost) and lost.__suppress_context__
    assert str(lost) == ("a collective lost its peer (another worker of this attempt died): Connection closed by peer "
                         "[127.0.0.1]:34698")
    assert _peer_lost(ValueError("other")) is None       # any other error is raised as it was


def test_a_report_cut_short_by_the_attempts_end_is_a_lost_peer_and_ray_does_not_print_its_traceback():
    """Rank 0 in ray.train.report's rank synchronisation when rank 1 died: Ray Train's controller killed the
    synchronisation actor, and the worker raised ActorDiedError (its text as Ray printed it in CI). The loop
    raises it as PeerLost, whose "Error in training function" record Ray's logger then drops in the worker
    (console.quiet_process); another error's record keeps its traceback, less the last newline that printed a
    blank prefixed line."""
    import logging

    from raytune_ft import compat
    from raytune_ft.console import quiet_process
    from raytune_ft.driver.launch import PeerLost, _peer_lost

    died = ("The actor died unexpectedly before finishing this task.\n\tclass_name: SynchronizationActor\n\t"
            "actor_id: a800a9084a806bc9db8b9e7301000000\n\tpid: 9749\nThe actor is dead because it was killed by "
            "`ray.kill`.")
    lost = _peer_lost(RuntimeError(died))
    assert isinstance(lost, PeerLost) and "Ray Train stopped the attempt" in str(lost)

    quiet_process()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger(compat.RAY_TRAIN_FN_ERROR_LOGGER)
    log.addHandler(handler)
    try:
        log.error("Error in training function:\nTraceback (most recent call last):\n  ...\n"
                  f"raytune_ft.driver.launch.PeerLost: {lost}\n")
        log.error("Error in training function:\nTraceback (most recent call last):\n  ...\nValueError: bad\n")
    finally:
        log.removeHandler(handler)
    assert seen == ["Error in training function:\nTraceback (most recent call last):\n  ...\nValueError: bad"]
