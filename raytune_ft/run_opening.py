"""The driver's MLflow run opened beside the start-up (RunOpening: a process of its own) and its id handed to
rank 0 through Ray's key-value store (RunIdHandoff, read by `await_run_id` in the worker)."""
from __future__ import annotations

import contextlib
import os
import subprocess

from raytune_ft.env import redact
from raytune_ft.recipe import Recipe, RecipeError
from raytune_ft.tracking import start_run


class RunOpening:
    """`start_run(recipe)` in a Python process of its own, started at once; `result()` waits for the run id
    or raises start_run's error (FinishedRunError, the store's), `exception()` waits and returns it.

    The driver opens the run while its threads import torch, Ray Train and the tokenizer: in a thread the
    run's imports and store calls would share the GIL with them. Its own process imports nothing but MLflow
    and the recipe. Where no process can be started, a thread does it. `close()` (or the end of a `with`)
    ends a process still running and removes its answer file, however the run ended."""

    def __init__(self, recipe: Recipe):
        import json
        import sys
        import tempfile
        import threading

        self._result: str | None = None
        self._error: BaseException | None = None
        self._thread = None
        self._path: str | None = None
        self._lock = threading.Lock()      # the driver's main thread and RunIdHandoff's may both wait
        from raytune_ft.env import child_python_env

        env = child_python_env()
        fd, self._path = tempfile.mkstemp(prefix="raytune_run_", suffix=".pickle")
        os.close(fd)
        code = f"from raytune_ft.run_opening import _open_run_here; _open_run_here({self._path!r})"
        self._proc = None
        try:   # the child's output (the re-submit's notes) goes where the driver's goes
            self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=env)
            self._proc.stdin.write(json.dumps(recipe.to_dict(), default=str).encode())
            self._proc.stdin.close()
        except OSError:
            self.close()
            self._thread = threading.Thread(target=self._in_thread, args=(recipe,), daemon=True)
            self._thread.start()

    def _in_thread(self, recipe: Recipe) -> None:
        try:
            self._result = start_run(recipe)
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e

    def done(self) -> bool:
        """Whether the run is open (or failed to open), without waiting."""
        if self._thread is not None:
            return not self._thread.is_alive()
        proc = self._proc
        return proc is None or proc.poll() is not None

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the run to open (or fail to); whether it is done."""
        import time

        deadline = time.monotonic() + timeout
        while not self.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.done()

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            return
        with self._lock:
            self._wait_for_process()

    def _wait_for_process(self) -> None:
        if self._proc is None:
            return
        import pickle

        code, self._proc = self._proc.wait(), None
        try:
            with open(self._path, "rb") as f:
                outcome = pickle.load(f)
        except Exception as e:  # noqa: BLE001 - the child died before writing (killed, out of memory)
            outcome = {"error": RuntimeError(f"opening the MLflow run failed: its process exited with code {code} "
                                             f"and no answer ({type(e).__name__})")}
        self._remove_file()
        self._result, self._error = outcome.get("run_id"), outcome.get("error")

    def _remove_file(self) -> None:
        path, self._path = self._path, None
        if path:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        """End the opening's process if it still runs (the run it was opening is not used) and remove its file."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and self._result is None and self._error is None:
            self._error = RuntimeError("opening the MLflow run was abandoned: the run ended first")
        self._remove_file()

    def __enter__(self) -> "RunOpening":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def exception(self) -> BaseException | None:
        self._wait()
        return self._error

    def result(self) -> str:
        self._wait()
        if self._error is not None:
            raise self._error
        return self._result


class RunNotOpened(RecipeError):
    """The driver's MLflow run did not open: the worker that waited for it stops the attempt (no retry)."""


class RunIdHandoffError(RuntimeError):
    """The driver could not write to Ray's key-value store, where rank 0 waits for the MLflow run's id."""


# Ray's key-value store: the namespace the run ids travel in
RUN_KEY_NAMESPACE = "raytune_ft"


class RunIdHandoff:
    """The one way the MLflow run's id reaches rank 0 in a run: Ray's key-value store, under `key`, once
    `opened` (a RunOpening) has it, so that the trainer need not wait for the run to open. An opening that
    failed hands over its words, and the worker waiting for the id (`await_run_id`) stops the attempt.

    The first write is made here, on the caller's thread: a store that cannot be written fails the run at
    once (RunIdHandoffError), not the worker after its wait. A context manager: the key is deleted at the end."""

    def __init__(self, opened: RunOpening, token: str):
        import threading

        self.key = f"mlflow_run/{token}"
        self._opened = opened
        self.error: BaseException | None = None
        self._thread = None
        if opened.done():
            self._put(self._value())
            return
        self._put({"pending": True})
        self._thread = threading.Thread(target=self._hand_over, name="raytune-run-handoff", daemon=True)
        self._thread.start()

    def _value(self) -> dict:
        from raytune_ft.env import redact_exception

        try:
            return {"run_id": self._opened.result()}
        except BaseException as e:  # noqa: BLE001 - handed to the worker in words; the driver raises it itself
            return {"error": redact_exception(e)[:2000]}

    def _put(self, value: dict) -> None:
        import json

        from ray.experimental.internal_kv import _internal_kv_put

        try:
            _internal_kv_put(self.key, json.dumps(value), overwrite=True, namespace=RUN_KEY_NAMESPACE)
        except Exception as e:  # noqa: BLE001 - said in one line: rank 0 would otherwise wait for nothing
            raise RunIdHandoffError("could not hand the MLflow run id to the workers through Ray's key-value "
                                    f"store: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from e

    def _hand_over(self) -> None:
        value = self._value()
        try:
            self._put(value)
        except RunIdHandoffError as e:
            self.error = e      # the store went away since the first write: the job's Ray with it
            print(f"[raytune_ft] {e}")

    def __enter__(self) -> "RunIdHandoff":
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._thread.join(timeout=60)
        with contextlib.suppress(Exception):  # the job's Ray may be gone already
            from ray.experimental.internal_kv import _internal_kv_del

            _internal_kv_del(self.key, namespace=RUN_KEY_NAMESPACE)


def await_run_id(key: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> str:
    """In a worker: the run id `RunIdHandoff` hands over under `key`, waiting for it up to `timeout_s`; raises
    RunNotOpened with the driver's words when the run did not open."""
    import json
    import time

    from ray.experimental.internal_kv import _internal_kv_get

    deadline = time.time() + timeout_s
    while True:
        raw = _internal_kv_get(key, namespace=RUN_KEY_NAMESPACE)
        value = json.loads(raw) if raw is not None else {"pending": True}
        if "run_id" in value:
            return value["run_id"]
        if "error" in value:
            raise RunNotOpened(f"the MLflow run did not open: {value.get('error')}")
        if time.time() > deadline:
            raise RunNotOpened(f"the MLflow run did not open within {timeout_s:.0f} s of the trainer's start")
        time.sleep(poll_s)


def _open_run_here(result_path: str) -> None:
    """The child of RunOpening: the recipe (JSON) from stdin, the run id or the error (pickled) to a file."""
    import json
    import pickle
    import sys

    from raytune_ft.recipe import recipe_from_dict

    try:
        outcome = {"run_id": start_run(recipe_from_dict(json.loads(sys.stdin.read())))}
    except Exception as e:  # noqa: BLE001 - raised again in the driver
        try:
            pickle.dumps(e)
            outcome = {"error": e}
        except Exception:  # noqa: BLE001 - an error that does not pickle goes as its type and words
            outcome = {"error": RuntimeError(f"{type(e).__name__}: {redact(str(e))}")}
    with open(result_path, "wb") as f:
        pickle.dump(outcome, f)
    sys.stdout.flush()
    # MLflow's background threads (telemetry, async logging) have nothing left to do for this process
    os._exit(0)
