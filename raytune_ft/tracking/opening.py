"""The driver's MLflow run opened beside the start-up and ended by the same process however the job ends
(RunOpening: a channel.Channel's child), and its id handed to rank 0 through Ray's key-value store
(RunIdHandoff, read by `await_run_id` in the worker): the one way a run id reaches the workers."""
from __future__ import annotations

import base64
import json
import pickle

from raytune_ft import compat
from raytune_ft.env import redact
from raytune_ft.recipe.recipe import Recipe, RecipeError
from raytune_ft.tracking.mlflow_run import RunEnd, end_run, start_run

# how long RunOpening.end waits for its process to end the run (the store's answer included) before it kills it
END_WAIT_S = 10.0
# the most anything waits for the run to open (the handoff's thread, a caller giving no bound)
OPEN_WAIT_S = 600.0


class RunOpening:
    """`start_run(recipe)` in a Python process of its own, started at once; `result()` waits for the run id
    or raises start_run's error (FinishedRunError, the store's), `exception()` waits and returns it.

    The driver opens the run while its threads import torch, Ray Train and the tokenizer: in a thread the
    run's imports and store calls would share the GIL with them. Its own process imports nothing but MLflow
    and the recipe. It stays until `close()`: `end(status, tags)` has it end the run it opened (or is still
    opening: the end waits for the open, so a run created or reopened to RUNNING is never left so), within
    a bound, whatever the store does."""

    def __init__(self, recipe: Recipe):
        from raytune_ft.channel import Channel

        self._answer: dict | None = None
        self._ended: dict | None = None
        self._closed = False
        self._channel = Channel("raytune_ft.tracking.opening", "serve", on_message=self._answered, name="run-opener")
        self._channel.send({"recipe": json.loads(json.dumps(recipe.to_dict(), default=str))})

    def _answered(self, msg: dict) -> None:
        if "ended" in msg:
            self._ended = msg
        else:
            self._answer = msg

    def done(self) -> bool:
        """Whether the run is open (or failed to open, or never will), without waiting."""
        return self._answer is not None or not self._channel.alive

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the run to open (or fail to); whether it is done."""
        self._channel.wait(lambda: self._answer is not None, timeout)
        return self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """start_run's error, waiting for it (up to `timeout` s: None, however long the store takes)."""
        timeout = OPEN_WAIT_S if timeout is None else timeout
        self._channel.wait(lambda: self._answer is not None, timeout)
        if self._answer is None:
            if self._closed:
                return RuntimeError("opening the MLflow run was abandoned: the run ended first")
            if self._channel.alive:
                return TimeoutError(f"the MLflow run did not open within {timeout:.0f} s")
            return RuntimeError(f"opening the MLflow run failed: its process exited with code "
                                f"{self._channel.exit_code} and no answer")
        if "error" in self._answer:
            return pickle.loads(base64.b64decode(self._answer["error"]))
        return None

    def result(self, timeout: float | None = None) -> str:
        """The run id, waiting for it (up to `timeout` s); start_run's error raised."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._answer["run_id"]

    def end(self, status: str, tags: dict, timeout: float = END_WAIT_S, **more) -> dict:
        """Have the process end the run with `status` and `tags` (and tracking.end_run's `metrics`,
        `json_artifacts`) once it is open, within `timeout` s. Its answer: `ended` (the run's id; None where
        the run did not open, was not RUNNING, or the store failed), `experiment_id`, `step` (the last step of
        the loss curve); {} where the store did not answer in time."""
        self._ended = None           # a second end is answered by its own outcome, never by the first's
        if not self._channel.send({"end": {"status": status, "tags": tags, **more}}):
            return {}
        self._channel.wait(lambda: self._ended is not None, timeout)
        return self._ended or {}

    def close(self, timeout: float = 2.0) -> None:
        """End the process: it exits once done with what it was sent, or is killed after `timeout` s; a second
        close does nothing."""
        if self._closed:
            return
        self._closed = True
        self._channel.close(timeout)

    def __enter__(self) -> "RunOpening":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RunNotOpened(RecipeError):
    """The driver's MLflow run did not open: the worker that waited for it stops the attempt (no retry)."""


class RunIdHandoffError(RuntimeError):
    """The driver could not write to Ray's key-value store, where rank 0 waits for the MLflow run's id."""


# Ray's key-value store: the namespace the run ids travel in
RUN_KEY_NAMESPACE = "raytune_ft"


def put_run_id(key: str, value: dict) -> None:
    """`value` ({"run_id": ...}, {"error": ...} or {"pending": True}) under `key` in Ray's key-value store, where
    rank 0 waits for it (`await_run_id`); RunIdHandoffError, in one line, when the store cannot be written."""
    _internal_kv_put = compat.RAY_INTERNAL_KV.load()[1]

    try:
        _internal_kv_put(key, json.dumps(value), overwrite=True, namespace=RUN_KEY_NAMESPACE)
    except Exception as e:  # noqa: BLE001 - said in one line: rank 0 would otherwise wait for nothing
        raise RunIdHandoffError("could not hand the MLflow run id to the workers through Ray's key-value "
                                f"store: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from e


class RunIdHandoff:
    """The one way the MLflow run's id reaches rank 0: Ray's key-value store, under `key`, once `opened` (a
    RunOpening) has it, so that the trainer need not wait for the run to open. An opening that failed hands
    over its words, and the worker waiting for the id (`await_run_id`) stops the attempt.

    The first write is made here, on the caller's thread: a store that cannot be written fails the run at
    once (RunIdHandoffError), not the worker after its wait. A context manager: the key is deleted at the end
    (the opening closed first ends the thread's wait at once)."""

    def __init__(self, opened: RunOpening, token: str):
        import threading

        self.key = f"mlflow_run/{token}"
        self._opened = opened
        self._thread = None
        self._closed = False
        if opened.done():
            put_run_id(self.key, self._value())
            return
        put_run_id(self.key, {"pending": True})
        self._thread = threading.Thread(target=self._hand_over, name="raytune-run-handoff", daemon=True)
        self._thread.start()

    def _value(self) -> dict:
        from raytune_ft.env import redact_exception

        error = self._opened.exception()
        return {"error": redact_exception(error)[:2000]} if error is not None else {"run_id": self._opened.result()}

    def _hand_over(self) -> None:
        try:
            put_run_id(self.key, self._value())
        except RunIdHandoffError as e:   # the store went away since the first write: the job's Ray with it
            print(f"[raytune_ft] {e}")

    def __enter__(self) -> "RunIdHandoff":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout: float = 4.0) -> None:
        """Delete the key, within `timeout` s in all (the hand-over's thread given half); a second close does
        nothing."""
        import contextlib
        import threading
        import time

        if self._closed:
            return
        self._closed = True
        end = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout=timeout / 2)

        def delete() -> None:
            with contextlib.suppress(Exception):  # the job's Ray may be gone already
                _internal_kv_del = compat.RAY_INTERNAL_KV.load()[2]

                _internal_kv_del(self.key, namespace=RUN_KEY_NAMESPACE)

        # a Ray whose processes a Ctrl-C ended with the driver's would hold the deletion for its reconnect time
        deleting = threading.Thread(target=delete, name="raytune-run-key", daemon=True)
        deleting.start()
        deleting.join(timeout=max(0.0, end - time.monotonic()))


def await_run_id(key: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> str:
    """In a worker: the run id `RunIdHandoff` hands over under `key`, waiting for it up to `timeout_s`; raises
    RunNotOpened with the driver's words when the run did not open."""
    import time

    _internal_kv_get = compat.RAY_INTERNAL_KV.load()[0]

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


def _pickled(e: BaseException) -> str:
    try:
        raw = pickle.dumps(e)
    except Exception:  # noqa: BLE001 - an error that does not pickle goes as its type and words
        raw = pickle.dumps(RuntimeError(f"{type(e).__name__}: {redact(str(e))}"))
    return base64.b64encode(raw).decode()


def serve(child) -> None:
    """RunOpening's process (channel.Channel's child): the recipe from the first message, the run id (or the
    error, pickled) answered; then an `end` message ends that run, answered `ended` with its id."""
    from raytune_ft.recipe.recipe import recipe_from_dict

    messages = child.messages()
    first = next(messages, None)
    if first is None:
        return
    recipe, run_id = recipe_from_dict(first["recipe"]), None
    try:
        run_id = start_run(recipe)
        child.answer(run_id=run_id)
    except Exception as e:  # noqa: BLE001 - raised again in the driver
        child.answer(error=_pickled(e))
    for msg in messages:
        if "end" in msg:
            child.answer(**_end(recipe, run_id, msg["end"]))


def _end(recipe: Recipe, run_id: str | None, how: dict) -> dict:
    """End run `run_id` as `how` says (status, tags, metrics, json_artifacts), where it is RUNNING or is
    finishing: a finished run re-submitted is left as it was."""
    out: dict = {"ended": None}
    if run_id is None:
        return out
    try:
        import mlflow

        from raytune_ft.tracking.mlflow_run import mlflow_metric_name

        client = mlflow.MlflowClient(recipe.tracking_uri)
        history = client.get_metric_history(run_id, mlflow_metric_name("loss"))
        out["step"] = max(m.step for m in history) if history else None
        if how["status"] == "FINISHED" or client.get_run(run_id).info.status == "RUNNING":
            out["experiment_id"] = end_run(recipe, run_id, RunEnd(**how))
            out["ended"] = run_id
    except Exception as e:  # noqa: BLE001 - the driver says the run may stay RUNNING
        print(f"[raytune_ft] could not end the MLflow run {run_id}: {type(e).__name__}", flush=True)
    return out
