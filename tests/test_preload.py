"""The loop's imports begun with a Ray Train worker's process (train/preload.py): which modules, where the
set-up hook goes, and that only an actor's process imports them (a task inheriting the runtime
environment does not). The local job's test (test_local_job.py) checks the hook runs in its workers."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from raytune_ft.cli import _job_recipe
from raytune_ft.console import WORKER_SETUP_HOOK
from raytune_ft.train import preload

JOBS = ("qwen27b_b300", "qwen3_4b_full", "qwen2_05b_lora")
GPU_ONLY = ("fla", "liger_kernel")        # the [gpu] extra's, absent on a CPU machine


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("local", [True, False])
def test_every_module_the_preload_names_exists(job, local):
    """A module renamed or moved would stop being preloaded without a word (the thread skips what fails
    to import): each name the recipes list must be found here, the GPU extra's aside."""
    recipe = _job_recipe(job, local, [])
    names = preload.modules_for(recipe)
    assert names[0] == "torch"
    loop = "raytune_ft.train.fsdp_loop" if recipe.train.loop == "fsdp2" else "raytune_ft.train.trl.loop"
    assert loop in names and f"transformers.models.{recipe.model.family}.modeling_{recipe.model.family}" in names
    for name in names:
        if name.split(".")[0] in GPU_ONLY:
            assert recipe.scaling.use_gpu, (job, local, name)   # never on a CPU worker: they break it there
            continue
        assert importlib.util.find_spec(name) is not None, name


def test_the_27b_recipe_preloads_the_gated_delta_kernels_on_gpu_only():
    gpu, cpu = _job_recipe("qwen27b_b300", False, []), _job_recipe("qwen27b_b300", True, [])
    assert "fla.ops.gated_delta_rule" in preload.modules_for(gpu)
    assert not [n for n in preload.modules_for(cpu) if n.split(".")[0] in GPU_ONLY]
    lora = _job_recipe("qwen2_05b_lora", False, [])
    assert ("liger_kernel.transformers" in preload.modules_for(lora)) == lora.train.use_liger


def test_the_hook_takes_the_console_hook_s_place_and_leaves_a_user_s_own():
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR as hook_env

    recipe = _job_recipe("qwen27b_b300", True, [])
    for job_hook in (None, WORKER_SETUP_HOOK):     # none, or the console's (preload.begin runs it first)
        env = preload.runtime_env_vars(recipe, job_hook)
        assert env[hook_env] == "raytune_ft.train.preload.begin"
        assert env[preload.PRELOAD_ENV].split(",") == preload.modules_for(recipe)
    assert preload.runtime_env_vars(recipe, "mypkg.setup.hook") == {}


@pytest.mark.timeout(180)
def test_only_an_actor_s_process_imports_the_modules(ray_local):
    """Real Ray: the hook in the runtime environment of an actor and of a plain task; the module list is
    one module of the standard library no Ray worker imports otherwise (`tomllib`)."""
    from ray._private.ray_constants import WORKER_PROCESS_SETUP_HOOK_ENV_VAR as hook_env

    ray = ray_local
    env = {"env_vars": {hook_env: "raytune_ft.train.preload.begin", preload.PRELOAD_ENV: "tomllib"}}

    def seen() -> tuple[bool, dict]:
        from raytune_ft.train import preload as p

        done = p.wait()
        return "tomllib" in sys.modules, done

    @ray.remote
    class Actor:
        def check(self):
            return seen()

    @ray.remote
    def task():
        import time

        time.sleep(2.0)       # past the thread's wait for an actor's creation
        return seen()

    in_actor, done = ray.get(Actor.options(runtime_env=env).remote().check.remote(), timeout=120)
    assert in_actor and done["imported"] == ["tomllib"] and done["failed"] == [], done
    in_task, done = ray.get(task.options(runtime_env=env).remote(), timeout=120)
    assert not in_task and done == {}
