"""The 27B recipe's --local job across a real two-node Ray cluster on one machine, its runs on object storage.

`ray.cluster_utils.Cluster` starts two Ray nodes (separate raylets and object stores) with 4 CPUs
each and one unit of a custom resource `raytune_node` each. The job is changed by `--set` only:
scaling.placement_strategy=STRICT_SPREAD and resources_per_worker={"raytune_node": 1}, so the two
workers can only land on different nodes. storage_path is an s3:// folder on the SeaweedFS server on loopback
(tests/s3_server.py), which both nodes reach through their AWS_* variables, as a real cluster's nodes reach its
bucket; the MLflow store is the session's `mlflow server`. Once the first checkpoint is registered, the worker
on the second node is SIGKILLed from outside (its PID from Ray Train's state actor; no fault hook in the
worker), and not before rank 0 has logged the loss of a step after that checkpoint; Ray restarts the group on
both nodes, and it resumes from that checkpoint, read from S3, to the end, training that step again.
"""
from __future__ import annotations

import os

import pytest

from mlflow import MlflowClient

from raytune_ft.env import scoped_env
from tests.train.test_fault_tolerance import EVERY, STATE_TRACKING_ENV, STEPS, RankKiller, _job

RUN = "multinode"


def trained_past_the_checkpoint(client: MlflowClient, fs, run_dir: str, seen: dict):
    """The kill's condition: the run's MLflow history has a loss of a step after the newest checkpoint Ray
    registered, so the restart trains a step the killed attempt logged (what the two losses of one step are
    compared on). `seen` gets that checkpoint's step and the steps logged."""
    from raytune_ft.storage import fs as storage
    run_id: list[str] = []      # looked up once: the kill's poll then reads the history only

    def ready() -> bool:
        if not run_id:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                      filter_string=f"attributes.run_name = '{RUN}'")
            run_id.extend(r.info.run_id for r in runs[:1])
        reported = storage.reported_checkpoints(fs, run_dir)
        if reported is None or reported.latest is None or not run_id:
            return False
        registered = int(reported.metrics[reported.latest]["step"])
        logged = sorted({m.step for m in client.get_metric_history(run_id[0], "train/loss")})
        seen.update(registered=registered, logged=logged)
        return bool(logged) and logged[-1] > registered
    return ready


def worker_nodes(run_name: str) -> list[dict[int, str]]:
    """For each attempt of `run_name` (oldest first): {world rank: node id}."""
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    if actor is None:       # created with the first Train run of the cluster
        return []
    run_ids = [r.id for r in ray.get(actor.get_train_runs.remote()).values() if r.name == run_name]
    attempts = ray.get(actor.get_train_run_attempts.remote())
    found = sorted((a for rid in run_ids for a in attempts.get(rid, {}).values() if a.workers),
                   key=lambda a: a.start_time_ns)
    return [{w.world_rank: w.node_id for w in a.workers} for a in found]


@pytest.fixture(scope="module")
def two_node_run(mlflow_server, s3_server):
    import ray
    from ray.cluster_utils import Cluster

    # imported here, before the killer's thread reads Ray Train's state: a first import of ray.train.v2 in
    # two threads at once can deadlock on its module locks (_DeadlockError in the killer)
    import ray.train.v2._internal.state.state_actor  # noqa: F401
    import ray.train.v2.api  # noqa: F401

    from raytune_ft.cli import resolve
    from raytune_ft.driver.run import run

    fs, bucket = s3_server.filesystem(), s3_server.bucket()
    storage = f"s3://{bucket}/mn_runs"
    out: dict = {"fs": fs, "bucket": bucket}
    # the store every node reaches: with a sqlite file the ranks on the second node would have their own
    server = mlflow_server          # the session's server (tests/conftest.py)
    out["tracking"] = server.uri
    # Ray Train's state actor (where each rank runs); the nodes' processes reach S3 as a node does
    with scoped_env({STATE_TRACKING_ENV: "1", **s3_server.env()}):
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "resources": {"raytune_node": 1}, "include_dashboard": False})
        try:
            second = cluster.add_node(num_cpus=4, resources={"raytune_node": 1})
            cluster.wait_for_nodes()
            ray.init(address=cluster.address)
            out["nodes"] = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            out["second"] = second.node_id
            job = _job()
            recipe = resolve(job.recipe, job.local, local=True, overrides=[
                f"tracking.storage_path={storage}", f"tracking.run_name={RUN}", f"tracking.tracking_uri={server.uri}",
                "scaling.num_workers=2", "scaling.placement_strategy=STRICT_SPREAD",
                'scaling.resources_per_worker={"raytune_node": 1}', "scaling.max_failures=1",
                f"train.max_steps={STEPS}", f"train.checkpoint_every={EVERY}", "registry.enabled=false"])
            # kill whichever rank runs on the second node, once a step after the checkpoint is logged
            out["at_kill"] = {}
            killer = RankKiller(f"{bucket}/mn_runs/{RUN}", RUN, fs=fs, pick_rank=lambda: next(
                (r for r, n in (worker_nodes(RUN) or [{}])[-1].items() if n == second.node_id), None),
                when=trained_past_the_checkpoint(MlflowClient(server.uri), fs, f"{bucket}/mn_runs/{RUN}",
                                                 out["at_kill"]))
            killer.start()
            try:
                out["summary"] = run(recipe, local=False)
            finally:
                killer.stop.set()
                killer.join(timeout=30)
            out["killer"] = killer
            out["attempts"] = worker_nodes(RUN)
            client = MlflowClient(server.uri)
            out["losses"] = [(m.step, m.value) for m in client.get_metric_history(out["summary"].mlflow_run_id,
                                                                                 "train/loss")]
        finally:
            ray.shutdown()
            cluster.shutdown()
    return out


@pytest.mark.timeout(600)
def test_two_workers_on_two_nodes_train_checkpoint_and_resume(two_node_run):
    import psutil

    from raytune_ft.storage import fs as storage
    out = two_node_run
    fs = out["fs"]
    assert len(out["nodes"]) == 2
    killer, summary = out["killer"], out["summary"]
    assert killer.error is None, killer.error
    assert killer.killed_pid is not None and "RayTrainWorker" in killer.cmdline
    assert not psutil.pid_exists(killer.killed_pid) or psutil.Process(killer.killed_pid).status() == "zombie"
    # each attempt (the first, and the restart after the kill) spread its two ranks over both nodes
    assert len(out["attempts"]) == 2, out["attempts"]
    for placement in out["attempts"]:
        assert set(placement) == {0, 1}
        assert set(placement.values()) == out["nodes"], placement
    # trained to the end on S3; both ranks resumed from the checkpoint registered before the kill
    assert summary.steps == STEPS and summary.checkpoint.startswith(f"s3://{out['bucket']}/mn_runs/{RUN}/checkpoint_")
    ckpt = summary.checkpoint[len("s3://"):]
    at_kill = out["at_kill"]
    for rank in (0, 1):
        st = storage.read_json(fs, f"{ckpt}/train_state/rank{rank}.json")
        assert st["resumed_from"] == [at_kill["registered"]] and at_kill["registered"] in (4, 8), (st, at_kill)
        assert [h["step"] for h in st["history"]] == list(range(1, STEPS + 1))
    # the final checkpoint holds both nodes' shards in one folder on the shared storage
    shards = [i.path for i in storage.list_files(fs, f"{ckpt}/dcp") if i.path.endswith(".distcp")]
    assert len(shards) == 2, shards
    assert storage.exists(fs, f"{ckpt}/hf/config.json")
    # rank 0's metrics reached the run's one store, wherever rank 0 ran: every step, and the steps the killed
    # attempt logged after the checkpoint (at least one: the kill waited for it) and the restart trained
    # again give the same loss
    assert summary.tracking_uri == out["tracking"]
    by_step: dict[int, list[float]] = {}
    for step, value in out["losses"]:
        by_step.setdefault(step, []).append(value)
    assert sorted(by_step) == list(range(1, STEPS + 1)), by_step
    twice = [step for step, values in by_step.items() if len(values) > 1]
    after = [step for step in at_kill["logged"] if step > at_kill["registered"]]
    assert after and set(after) <= set(twice), (at_kill, by_step)
    assert min(twice) == at_kill["registered"] + 1, (at_kill, by_step)
    for step, values in by_step.items():
        assert values == pytest.approx([values[0]] * len(values), rel=1e-5), (step, values)


@pytest.mark.timeout(120)
def test_more_nodes_by_scaling_with_a_file_tracking_store_stop_before_ray_starts(tmp_path, monkeypatch):
    """16 GPU workers of 8 per node are two nodes: a sqlite file on the launching machine is no store for
    the ranks of the other node (each would open an empty database of its own next to it)."""
    import ray

    from raytune_ft.cli import resolve
    from raytune_ft.recipe.recipe import RecipeError, check_tracking_store, nodes_of
    from raytune_ft.driver.run import run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    job = _job()
    recipe = resolve(job.recipe, job.local, local=False,
                     overrides=["scaling.num_workers=16", f"tracking.storage_path={tmp_path}"])
    with pytest.raises(RecipeError, match=r"tracking\.tracking_uri.*2 nodes.*http://") as caught:
        run(recipe)
    assert "mlflow server" in str(caught.value)
    assert not ray.is_initialized() and not os.listdir(tmp_path)
    # a tracking server every node reaches is what the message asks for, and passes
    recipe.tracking.tracking_uri = "http://head-node:5000"
    check_tracking_store(recipe, nodes_of(recipe.scaling), "scaling")


@pytest.mark.timeout(300)
def test_a_two_node_cluster_with_a_file_tracking_store_stops_before_the_run_opens(tmp_path):
    """The --local job joins a real two-node cluster (ray.cluster_utils.Cluster) with the default sqlite
    store: it stops before an MLflow run is opened or anything trains, naming the fix."""
    import ray
    from ray.cluster_utils import Cluster

    from raytune_ft.cli import resolve
    from raytune_ft.recipe.recipe import RecipeError
    from raytune_ft.driver.run import run

    job = _job()
    recipe = resolve(job.recipe, job.local, local=True, overrides=[
        f"tracking.storage_path={tmp_path}", "train.max_steps=2", "registry.enabled=false"])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        with pytest.raises(RecipeError, match=r"tracking\.tracking_uri.*2 nodes"):
            run(recipe, local=False)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert not os.path.exists(os.path.join(recipe.run_dir, "mlflow.db"))


@pytest.mark.parametrize("override, field", [
    ('scaling.resources_per_worker={"GPU": 2}', "scaling.resources_per_worker.GPU"),
    ('scaling.resources_per_worker={"CPU": 4}', "scaling.resources_per_worker.CPU"),
    ("scaling.accelerator_type=B300", "scaling.accelerator_type"),   # the --local job has no GPU
    ("tracking.experiment= ", "tracking.experiment"),
])
def test_bad_scaling_fails_before_ray_naming_the_field(override, field):
    from raytune_ft.cli import resolve
    from raytune_ft.recipe.recipe import RecipeError

    job = _job()
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        resolve(job.recipe, job.local, local=True, overrides=[override])
