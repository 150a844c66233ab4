"""Shared test fixtures: paths to tests/fixtures and one local Ray per session; the `slow` marker.

`pytest -m "not slow"` runs the unit-level tests; `make test` runs everything. A test is slow when it
starts Ray, a server, a training run or a fresh Python process: marked here from the fixtures that start those and from the
modules that are slow throughout, so a test file needs no marker of its own (one may still add
`@pytest.mark.slow`).
"""
from __future__ import annotations

import contextlib
import os
import pickle
from pathlib import Path

import pytest

# one S3 server (SeaweedFS on loopback) per session, shared by every module that asks for it
from tests.s3_server import s3_env, s3_server  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
# the repository's own copy (tests/fixtures, licences in its README); RAYTUNE_FIXTURES reads them elsewhere
FIXTURES = Path(os.environ.get("RAYTUNE_FIXTURES", REPO / "tests" / "fixtures"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# fixtures (here and in test modules) that start Ray, a server, a training run or a fresh Python (mlflow_run: its
# tests log through rank 0's WorkerLog, whose MLflow sender is a child Python importing MLflow)
SLOW_FIXTURES = {"ray_local", "local_job", "ray_registry", "server", "mlflow_server", "ray_head", "runs", "two_node_run",
                 "s3_server", "finished_run", "local_run", "job_with_secrets", "mlflow_run"}
# modules whose every test trains a model or starts Ray
SLOW_MODULES = {"test_fault_tolerance", "test_fsdp_loop", "test_job_submit", "test_local_job", "test_save_final",
                "test_trl_recipes"}
# tests that spawn a process group of their own (torch.multiprocessing)
SLOW_TESTS = {"test_fsdp2_sharded_load_matches_unsharded", "test_random_init_of_a_sharded_model_matches_transformers_init",
              "test_a_kernel_failing_on_one_rank_is_off_on_every_rank",
              "test_ranks_recall_kept_verdicts_only_when_every_rank_holds_one",
              # bench's CPU smokes: a recipe run, `ray start` and `ray job submit`, workers' imports in fresh processes
              "test_cpu_smoke_of_the_suite_writes_a_dated_record",
              "test_cpu_smoke_of_the_imports_bench_times_the_workers_import_stages",
              "test_cpu_smoke_of_the_resubmit_bench_submits_twice_to_its_own_head_and_stops_it",
              "test_cpu_smoke_of_speed_reports_the_steps_alone_and_end_to_end",
              "test_cpu_smoke_of_recovery_times_the_kill_to_the_next_attempts_first_step",
              # fresh Python processes importing torch, transformers or Ray (each a few seconds on 2 cores), a
              # real torch.compile twice, the real 27B shape built, a race churned for seconds: unit-level in
              # what they check, not in what they cost (make test runs them; test-fast stays within minutes)
              "test_the_breakdown_says_how_many_compiled_graphs_came_from_the_cache",
              "test_a_driver_loads_a_tokenizer_once_then_remembers_the_class_autotokenizer_chose",
              "test_redaction_survives_another_thread_changing_the_environment",
              "test_random_init_builds_the_real_shape_without_a_checkpoint",
              "test_remote_code_in_a_model_folder_runs_only_when_the_recipe_allows_it",
              "test_ops_that_need_the_package_init_get_it", "test_the_ops_import_without_the_package_init",
              "test_the_driver_opens_the_run_in_a_process_of_its_own_with_start_runs_answers",
              "test_a_two_node_cluster_with_a_file_tracking_store_stops_before_the_run_opens",
              "test_the_driver_builds_the_trainer_without_importing_torch",
              "test_the_checkpoint_meta_and_the_drivers_after_fit_path_import_no_torch",
              "test_a_bf16_workers_model_build_does_not_import_torchao",
              "test_the_torchao_check_answers_truly_again_after_the_block",
              "test_a_workers_mlflow_calls_are_made_in_order_by_a_process_of_their_own",
              "test_unpickling_the_backend_starts_importing_ray_s_torch_backend",
              "test_job_script_still_runs_as_python_jobs_x",
              "test_dry_run_prints_resolved_recipe_and_bad_recipe_exits_before_ray",
              "test_turned_on_the_monitor_logs_system_metrics_of_this_node",
              "test_rank_0_alone_reads_the_held_out_split_and_every_rank_gets_its_rows"}
# a parametrized test's value that starts a server when the test asks for it (tests/storage/test_storage.py's `where`)
SLOW_PARAMS = {"s3"}


def pytest_collection_modifyitems(config, items):
    RAY_LOCAL_MODULES.update(item.path.stem for item in items
                             if item.path and "ray_local" in getattr(item, "fixturenames", ()))
    # the modules sharing ray_local's Ray last, one after another, so it starts once (a stable sort)
    items.sort(key=lambda item: bool(item.path) and item.path.stem in RAY_LOCAL_MODULES)
    for item in items:
        module = item.path.stem if item.path else ""
        params = set(map(str, getattr(getattr(item, "callspec", None), "params", {}).values()))
        if (module in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))
                or getattr(item, "originalname", item.name) in SLOW_TESTS or SLOW_PARAMS & params):
            item.add_marker(pytest.mark.slow)


def env_with_path(*folders, drop: tuple = ()) -> dict[str, str]:
    """This process's environment for a child Python, `folders` first on its PYTHONPATH, `drop` left out."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, folders), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="session")
def fixtures() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"fixtures not found at {FIXTURES}; set RAYTUNE_FIXTURES")
    return FIXTURES


# Ray started by ray_local, shared by every module that asks for it; a module that does not ask gets a
# process without it (own_ray / shared_ray_down), and the modules that ask run one after another
_SHARED_RAY = {"up": False}
RAY_LOCAL_MODULES: set[str] = set()


def shared_ray_down() -> None:
    """Shut ray_local's Ray down if it is up (ray_local starts it again on its next use)."""
    if _SHARED_RAY["up"]:
        import ray

        ray.shutdown()
        _SHARED_RAY["up"] = False


def own_ray(**kwargs):
    """ray.init(**kwargs) for a module that needs a Ray of its own (other resources, environment, cluster):
    the shared one is shut down first."""
    import ray

    shared_ray_down()
    return ray.init(**kwargs)


@pytest.fixture(scope="session")
def _ray_session():
    yield
    shared_ray_down()


@pytest.fixture(scope="module")
def ray_local(_ray_session):
    """A real local Ray with more logical CPUs than cores, so Ray Data inside a trainer does not starve.
    One per session: started on first use, kept across the modules that use it (grouped together by
    pytest_collection_modifyitems), shut down before a module that does not."""
    import ray

    if ray.is_initialized() and not _SHARED_RAY["up"]:
        ray.shutdown()       # a Ray a test started in this process for itself, with its own CPU count
    if not ray.is_initialized():
        from tests.faults import RUNTIME_ENV

        # the tests' fault plans reach the workers through this Ray's runtime environment (tests/faults.py)
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=True, runtime_env=RUNTIME_ENV)
        _SHARED_RAY["up"] = True
    yield ray


@pytest.fixture(scope="module", autouse=True)
def _no_shared_ray_elsewhere(request):
    """A module that does not use ray_local starts in a process without the shared Ray (some start their
    own, some check that nothing started one)."""
    if request.module.__name__.rsplit(".", 1)[-1] not in RAY_LOCAL_MODULES:
        shared_ray_down()
    yield


def ray_session_dir() -> Path:
    """The session folder (its logs/ and the rest) of the Ray this process is connected to."""
    from ray._private.worker import _global_node

    return Path(_global_node.get_session_dir_path())


def actors_started_since(t0: float, session_dir: str | Path | None = None) -> list[str]:
    """The class names of the actors a Ray started since `t0` (epoch seconds), read from its session's worker
    logs (each actor's log names it: ":actor_name:<Class>"); the session: `session_dir`, default this
    process's Ray's."""
    import glob

    session_dir = session_dir or ray_session_dir()
    names = []
    for f in glob.glob(os.path.join(session_dir, "logs", "worker-*.out")):
        if os.path.getmtime(f) >= t0:
            with open(f, errors="replace") as fh:
                names += [line.split(":actor_name:", 1)[1].strip() for line in fh if ":actor_name:" in line]
    return names


def grep_files(values: dict[str, bytes], *roots: Path) -> tuple[list[str], int]:
    """Every regular file under `roots` read as bytes: (where each value (name -> bytes) was found, the number of
    files read). The secrets tests' scan of logs, stores and checkpoints."""
    hits, n = [], 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                p = Path(dirpath) / name
                if not p.is_file() or p.is_symlink():
                    continue
                try:
                    data = p.read_bytes()
                except OSError:      # a socket or a file removed while Ray shut down
                    continue
                n += 1
                hits += [f"{k} in {p}" for k, v in values.items() if v in data]
    return hits, n


SECRET_VARS = ("DATABRICKS_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MLFLOW_TRACKING_TOKEN",
               "MLFLOW_TRACKING_PASSWORD", "DATABRICKS_CLIENT_SECRET")


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked and untracked-but-not-ignored files copied to `dest`, `.venv` linked in (as
    `make setup` would have built it): a user's fresh clone."""
    import shutil
    import subprocess

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest


class _ByValue:
    """A spawned rank's queue that sends what it puts as plain pickled bytes. torch.multiprocessing's queue sends
    a CPU tensor as a file descriptor that the sending process must still be alive to hand over: a rank that
    exits right after its put loses that race (ConnectionResetError in the parent, seen on a GPU node)."""

    def __init__(self, q):
        self.q = q

    def put(self, item) -> None:
        self.q.put(pickle.dumps(item))

    def close(self) -> None:
        self.q.close()

    def join_thread(self) -> None:
        self.q.join_thread()


def _by_value(target, rank: int, world: int, port: int, q) -> None:
    target(rank, world, port, _ByValue(q))


def run_gloo_ranks(target, world: int = 2, timeout: float = 150) -> dict:
    """{rank: what it put on the queue} of `world` spawned processes running `target(rank, world, port, q)`, each
    inside `spawned_gloo_rank` and putting one (rank, result) pair on `q`; every process must exit 0."""
    import torch.multiprocessing as mp

    from tests.mlflow_server import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_by_value, args=(target, r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(pickle.loads(q.get(timeout=timeout)) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0] * world
    return got


@contextlib.contextmanager
def spawned_gloo_rank(rank: int, world: int, port: int):
    """The gloo process group of one rank a test spawned (torch.multiprocessing), on 127.0.0.1:`port`.

    Ended without the interpreter's teardown once the body returns: a rank sometimes aborted after its work
    was done, "terminate called without an active exception" (a native thread, gloo's or pyarrow's S3
    client's, still running when the process's static objects are destroyed): 2 in ~35 runs of
    test_random_init's sharded test. What a test checks is written (a file, a queue drained) inside the
    body; an exception still reaches torch.multiprocessing's spawn as the rank's error."""
    import sys

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def local_job_process(cwd, overrides: list[str], *, extra_env: dict | None = None, drop_env: tuple = (),
                      prefix: str = "rtjob", timeout: int = 900, root: Path | None = None, job: str = "qwen27b_b300"):
    """`python jobs/qwen27b_b300.py --local --set=...` run in `cwd` as a user runs it (a subprocess with its
    own local Ray: RAY_ADDRESS dropped) with Ray's files in a short RAY_TMPDIR of its own (AF_UNIX paths are
    <= 107 bytes), removed afterwards; `job`'s script in `root`'s jobs/ (default: this repository's). Yields
    (the finished process, the RAY_TMPDIR)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    ray_tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    env = {**os.environ, **(extra_env or {}), "RAY_TMPDIR": str(ray_tmp), "PYTHONUNBUFFERED": "1"}
    for k in ("RAY_ADDRESS", *drop_env):
        env.pop(k, None)
    cmd = [sys.executable, str((root or REPO) / "jobs" / f"{job}.py"), "--local",
           *[f"--set={o}" for o in overrides]]
    try:
        yield subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, timeout=timeout), ray_tmp
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def local_job(tmp_path_factory):
    """The 27B recipe's --local job, run once per session as a user runs it after a fresh clone (a
    subprocess in a fresh copy of the repository, its own local Ray, registration included, the default
    storage), with credentials planted in its environment.

    Shared by the end-to-end, plots and secrets tests: one run instead of three keeps the suite's time
    down. Ray's files go to their own RAY_TMPDIR (short: AF_UNIX paths are <= 107 bytes) so the secrets
    test can read every log it wrote.
    """
    import json
    import secrets

    work = fresh_copy(tmp_path_factory.mktemp("localjob"))     # test_readme runs the README's other commands here
    planted = {k: f"sk-{k.lower()}-{secrets.token_hex(16)}" for k in SECRET_VARS}
    # the recipe's own log_every (5): MLflow must still get every step. The job runs with the default
    # storage, relative (./runs in its folder, which is not the Ray workers' working folder); `overrides`
    # names the same folder absolute, for the tests that resolve the recipe from another folder
    overrides = [f"tracking.storage_path={work / 'runs'}"]
    with local_job_process(work, [], extra_env=planted, drop_env=("RAYTUNE_LOCAL_STORAGE",),
                           root=work) as (proc, ray_tmp):
        summary_path = work / "runs" / "qwen27b-local" / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        yield {"proc": proc, "planted": planted, "work": work, "ray_tmp": ray_tmp, "summary": summary,
               "overrides": overrides}


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real `mlflow server` per session (sqlite store, proxied artifacts), for the registry, multi-node
    and secrets tests. The registry-down tests stop it and start it again on the same port and store; each
    test names its own models and finds its own runs."""
    from tests.mlflow_server import MlflowServer

    with MlflowServer(tmp_path_factory.mktemp("mlflow_server")) as server:
        yield server


def local_job_recipe(overrides):
    """The resolved recipe the local_job fixture ran."""
    from raytune_ft.cli import _job_recipe

    return _job_recipe("qwen27b_b300", True, overrides)


def train_state(ckpt_dir, rank: int = 0) -> dict:
    """Rank `rank`'s train state in a checkpoint folder on the local filesystem."""
    import pyarrow.fs as pafs

    from raytune_ft.train.checkpoint import read_train_state

    return read_train_state(pafs.LocalFileSystem(), os.path.abspath(ckpt_dir), rank)


def run_with_fault(recipe, plan: dict[str, str]) -> Exception | None:
    """run(recipe, local=True) with the faults `plan` for this run only (tests/faults.py: they reach the
    workers of a Ray the tests started); the exception the run raised, None when it finished."""
    from raytune_ft.driver.run import run
    from tests.faults import fault_plan

    with fault_plan(**plan):
        try:
            run(recipe, local=True)
        except Exception as e:  # noqa: BLE001 - the run is meant to fail
            return e
    return None


@pytest.fixture(autouse=True)
def _isolated_mlflow_uris():
    """mlflow.set_tracking_uri / set_registry_uri are process-global and also export MLFLOW_*_URI to the
    environment (and so to subprocesses): put both back after every test so no test leaks its store."""
    from raytune_ft.env import scoped_env

    with scoped_env(keep=("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")):
        yield
        try:
            import mlflow.tracking._model_registry.utils as reg
            import mlflow.tracking._tracking_service.utils as trk
        except ImportError:
            return
        reg._registry_uri = None
        trk._tracking_uri = None


@pytest.fixture
def mlflow_run(tmp_path):
    """A default recipe whose MLflow store is a sqlite file under tmp_path, and a real run in it (rank 0's
    logging: tests/train/test_step_metrics.py, tests/tracking/test_mlflow_sender.py)."""
    from raytune_ft.tracking import mlflow_run as tracking
    from raytune_ft.recipe.recipe import Recipe

    r = Recipe()
    r.tracking.storage_path = str(tmp_path / "runs")
    r.tracking.run_name = "metrics"
    return r, tracking.start_run(r)
