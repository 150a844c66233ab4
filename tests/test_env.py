"""The process environment read while other threads change it (env.py): a child's environment is one
consistent copy, never a KeyError or RuntimeError from a variable set or dropped meanwhile."""
from __future__ import annotations

import os
import sys
import threading

from raytune_ft.env import child_python_env, environ_snapshot


def test_child_python_env_survives_threads_that_set_and_drop_variables():
    stop = threading.Event()

    def churn(i: int) -> None:
        n = 0
        while not stop.is_set():        # as MLflow's telemetry thread does: a variable set, then dropped
            key = f"RAYTUNE_TEST_CHURN_{i}_{n % 50}"
            os.environ[key] = "x"
            os.environ.pop(key, None)
            n += 1

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)         # threads switch often, so a torn copy shows within a few calls
    threads = [threading.Thread(target=churn, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    errors: list[str] = []
    try:
        for _ in range(300):
            try:
                env = child_python_env()
            except (KeyError, RuntimeError) as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            assert os.path.isdir(os.path.join(env["PYTHONPATH"].split(os.pathsep)[0], "raytune_ft"))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        sys.setswitchinterval(old_interval)
    assert errors == [], f"{len(errors)} of 300 calls failed, e.g. {errors[0]}"


def test_child_python_env_puts_the_package_first_and_keeps_the_callers_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_python_env()
    first, *rest = env["PYTHONPATH"].split(os.pathsep)
    assert os.path.isdir(os.path.join(first, "raytune_ft")) and rest == ["/elsewhere"]
    assert {k: v for k, v in env.items() if k != "PYTHONPATH"} == \
        {k: v for k, v in environ_snapshot().items() if k != "PYTHONPATH"}


def test_ray_train_defaults_turn_the_preemption_watcher_off_for_cpu_runs_only_and_keep_a_users_value(monkeypatch):
    from raytune_ft import env
    monkeypatch.delenv(env.PREEMPTION_ENV, raising=False)
    monkeypatch.setitem(env._SET_HERE, "preemption", False)
    env.ray_train_defaults(watch_preemption=False)
    assert os.environ[env.PREEMPTION_ENV] == "0"
    env.ray_train_defaults(watch_preemption=True)       # a GPU run after a CPU one in the same process
    assert env.PREEMPTION_ENV not in os.environ
    monkeypatch.setenv(env.PREEMPTION_ENV, "1")         # the user's own value wins either way
    env.ray_train_defaults(watch_preemption=False)
    assert os.environ[env.PREEMPTION_ENV] == "1"
    monkeypatch.setenv(env.PREEMPTION_ENV, "0")
    env.ray_train_defaults(watch_preemption=True)
    assert os.environ[env.PREEMPTION_ENV] == "0"
