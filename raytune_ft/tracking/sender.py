"""Rank 0's MLflow calls, made by a Python process of their own (`MlflowSender`, over a channel.Channel).

Rank 0 logs to its run from the first seconds of an attempt (the GPU tag, the kernels in use, the
precision) to its end. Made in the worker, `import mlflow` and the store's set-up (a sqlite store checks its
schema) would sit on the way to the first step, and every logged step would wait for the store or the
tracking server. In a process of its own the imports run beside the model build, on another core, and the
loop hands each call over and goes on.

Training never waits on tracking. A call is queued and the loop goes on (a call that finds QUEUE_CALLS
calls waiting is dropped, and said). The calls are made in the order given. `flush()`, before a checkpoint
report, waits at most REPORT_WAIT_S for the calls so far: a store that hangs costs the first report after it
stopped that much, and the next ones nothing until it makes a call again; the calls are made later, once the
store answers. `close()` waits at most
CLOSE_TIMEOUT_S (and the channel's kill grace) and says how many calls were never made. A call that fails
is reported in the worker's log in the words the caller gave (tracking must never kill training) and the
calls after it are still made. A sender process that dies loses the calls it had been handed and not
answered (said, with their number); the next calls go to a new process, up to RESTARTS times.

Nothing secret travels on the command line: the tracking URI goes over the pipe; the credentials MLflow
reads (MLFLOW_TRACKING_TOKEN, DATABRICKS_TOKEN, ...) are the worker's environment, which the process inherits.
"""
from __future__ import annotations

import threading
from typing import Callable

# how long flush() (before a checkpoint report) waits for the calls so far: the most a hung store costs a report
REPORT_WAIT_S = 2.0
# how long close() holds the end of an attempt for calls still queued (a tracking server gone away)
CLOSE_TIMEOUT_S = 30.0
# calls waiting for the sender's process; beyond it a call is dropped (said) rather than wait
QUEUE_CALLS = 10_000
# new processes for a sender whose process died (killed for memory, ...), before tracking goes off
RESTARTS = 3


class _Calls:
    """The MLflow calls themselves, on one run: in the sender's process, or in the worker where it has none."""

    def __init__(self, tracking_uri: str, run_id: str):
        import mlflow

        mlflow.set_tracking_uri(tracking_uri)
        self.client = mlflow.MlflowClient(tracking_uri)
        self.run_id = run_id

    def make(self, op: str, args: dict) -> None:
        from mlflow.entities import Metric, Param

        if op == "set_tag":
            self.client.set_tag(self.run_id, args["key"], args["value"])
        elif op == "log_param":
            self.client.log_param(self.run_id, args["key"], args["value"])
        elif op == "log_batch":
            self.client.log_batch(self.run_id, metrics=[Metric(*m) for m in args.get("metrics", ())],
                                  params=[Param(*p) for p in args.get("params", ())])
        elif op == "backfill":
            self.backfill(args["metrics"])
        elif op == "log_table":
            from raytune_ft.env import scoped_env

            # mlflow appends the rows to the table in the run, downloading it first: without its progress bar,
            # which a worker's console would forward as chatter
            with scoped_env({"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):
                self.client.log_table(self.run_id, args["data"], args["artifact_file"])
        else:
            raise ValueError(f"unknown MLflow call {op!r}")


    def backfill(self, metrics: list) -> None:
        """Log the points of `metrics` ([name, value, timestamp, step]) the run does not hold yet: the steps a
        tracking outage kept from the store, from the checkpoint's history."""
        from mlflow.entities import Metric

        held = {name: {m.step for m in self.client.get_metric_history(self.run_id, name)}
                for name in {m[0] for m in metrics}}
        missing = [Metric(*m) for m in metrics if m[3] not in held[m[0]]]
        for i in range(0, len(missing), 1000):          # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=missing[i:i + 1000])


def _open_calls(tracking_uri: str, run_id: str, say: Callable[[str], None]) -> _Calls | None:
    """The run's calls, or None after saying why MLflow cannot be reached (the worker trains on, untracked)."""
    from raytune_ft.env import redact_exception

    try:
        return _Calls(tracking_uri, run_id)
    except Exception as e:  # noqa: BLE001 - tracking must never kill training
        say(f"MLflow logging off: {redact_exception(e)}")
        return None


def _failure(fail: str, e: BaseException) -> str:
    return fail.format(error=type(e).__name__)


def serve(child) -> None:
    """The sender process (channel.Channel's child): the tracking URI (and the run, where known) from the first
    message, then one call per message, each answered `done` once made or failed. Calls that come before the
    run's id (a `run_id` message, once the driver's run is open) wait here, in order, QUEUE_CALLS at most."""
    messages = child.messages()
    first = next(messages, None)
    if first is None:          # the worker went before it said which run
        return
    say = lambda text: child.answer(say=text)  # noqa: E731
    uri, calls, waiting = first["tracking_uri"], None, []
    known = first.get("run_id") is not None
    if known:
        calls = _open_calls(uri, first["run_id"], say)
    for msg in messages:
        if "op" not in msg:               # the run's id, handed over once the run is open
            calls, known = _open_calls(uri, msg["run_id"], say), True
            for held in waiting:
                _make(child, calls, held)
            waiting = []
        elif not known and len(waiting) < QUEUE_CALLS:
            waiting.append(msg)
        else:
            _make(child, calls, msg)


def _make(child, calls: "_Calls | None", msg: dict) -> None:
    if calls is not None:
        try:
            calls.make(msg["op"], msg.get("args", {}))
        except Exception as e:  # noqa: BLE001 - reported in the caller's words; the next calls are made
            child.answer(say=_failure(msg.get("fail", "MLflow call failed ({error})"), e))
    child.answer(done=msg["n"])


class MlflowSender:
    """Rank 0's MLflow calls on run `run_id`, made in order by a child process (see the module's doc).
    `say` reports a failed call, calls lost or dropped, or tracking switched off, in the worker's log; it
    may be called from the channel's threads. `run_id` None: the calls wait in the process until `give_run`
    hands the id over (the loop builds and steps meanwhile)."""

    def __init__(self, tracking_uri: str, run_id: str | None, say: Callable[[str], None]):
        self._say = say
        self.not_opened: BaseException | None = None    # the driver's run did not open (await_run)
        self._first = {"tracking_uri": tracking_uri, "run_id": run_id}
        self._cond = threading.Condition()
        # calls are numbered from 1 as they are queued; made, failed and lost ones all count as done
        self._queued = self._done = self._dropped = 0
        self._restarts = 0
        self._stuck_at: int | None = None     # calls done when a flush last ran out of time
        self._closing = False
        with self._cond:        # a process that dies at once is seen (_exited) only once this is set
            self._channel = self._start()

    def _start(self):
        from raytune_ft.channel import Channel

        channel = Channel("raytune_ft.tracking.sender", "serve", on_message=self._answered,
                          on_exit=self._exited, max_queued=QUEUE_CALLS, name="mlflow-sender")
        channel.send(self._first)
        return channel

    def await_run(self, run_key: str) -> None:
        """A thread that hands the run's id over (`give_run`) once the driver's run is open; where it did not
        open, `not_opened` holds the driver's words for the loop to raise."""
        def wait() -> None:
            from raytune_ft.tracking.opening import await_run_id

            try:
                self.give_run(await_run_id(run_key))
            except Exception as e:  # noqa: BLE001 - RunNotOpened: raised in the loop's thread
                self.not_opened = e

        threading.Thread(target=wait, name="raytune-run-id", daemon=True).start()

    def backfill(self, history) -> None:
        """The points of `history` (the checkpoint's per-step loss, lr, grad norm) the run lacks, logged: what a
        tracking outage kept from the store reaches it at the next contact (a resume, the end of the run)."""
        import time

        from raytune_ft.tracking.mlflow_run import mlflow_metric_name

        ts = int(time.time() * 1000)
        metrics = [[mlflow_metric_name(k), float(v), ts, int(s["step"])] for s in history for k, v in s.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v]
        if metrics:
            self.call("backfill", "MLflow: the steps missing from the run were not logged ({error})", metrics=metrics)

    def give_run(self, run_id: str) -> None:
        """The run's id, once the driver's run is open: the calls held for it are made, in order."""
        with self._cond:
            self._first["run_id"] = run_id       # a process started after this gets it first
            self._stuck_at = None                # the held calls are made now: a flush waits for them again
            self._channel.send({"run_id": run_id})

    @property
    def pid(self) -> int | None:
        """The sender process's id (None: it did not start)."""
        return self._channel.pid

    def _answered(self, msg: dict) -> None:
        if "say" in msg:
            self._say(msg["say"])
        if "done" in msg:
            with self._cond:
                self._done = max(self._done, msg["done"])
                self._cond.notify_all()

    def _exited(self, code: int) -> None:
        """The process is gone: the calls it was handed and did not answer are lost; the unsent ones go to a
        new process (not when closing, nor after RESTARTS)."""
        with self._cond:
            unsent = [m for m in self._channel.unsent() if "n" in m]
            handed = (unsent[0]["n"] - 1) if unsent else self._queued
            lost, self._done = max(handed - self._done, 0), max(self._done, handed)
            restart = not self._closing and self._restarts < RESTARTS
            if restart:
                self._restarts += 1
                self._channel = self._start()
                for m in unsent:
                    self._channel.send(m)
            else:
                self._done = self._queued
            self._cond.notify_all()
        if not self._closing:
            more = "the next ones go to a new process" if restart else "MLflow logging is off for this attempt"
            self._say(f"MLflow sender exited (code {code}) with {lost} call(s) not made; {more}")

    def call(self, op: str, fail: str, **args) -> None:
        """Make MLflow call `op` (set_tag, log_param, log_batch, log_table) with `args`, in order; where it
        fails, `fail` (with "{error}" for the error's type) is said in the worker's log. Never waits: a
        call that finds QUEUE_CALLS calls still waiting is dropped and said."""
        with self._cond:
            if self._closing:
                return
            n = self._queued + 1
            if self._channel.send({"op": op, "args": args, "fail": fail, "n": n}):
                self._queued = n
                return
            if not self._channel.alive and self._restarts >= RESTARTS:
                return                               # off: said once when it went
            self._dropped += 1
            dropped = self._dropped
        if dropped == 1 or dropped % 1000 == 0:
            self._say(f"MLflow: {dropped} call(s) dropped so far: {QUEUE_CALLS} calls wait for the sender "
                      "(the tracking store is slow or unreachable)")

    def _wait(self, timeout: float) -> int:
        """Wait up to `timeout` for the calls queued so far; how many are still not made."""
        with self._cond:
            target = self._queued
            self._cond.wait_for(lambda: self._done >= target, timeout=max(timeout, 0.0))
            return max(target - self._done, 0)

    def flush(self, timeout: float = REPORT_WAIT_S) -> bool:
        """Wait up to `timeout` until every call so far has been made or has failed; whether they all have.
        The calls left are made later: nothing is said, nothing lost. Where no call was made since the last
        flush ran out of time (the store still hangs), it does not wait again."""
        with self._cond:
            stuck = self._stuck_at == self._done
        missing = self._wait(0.0 if stuck else timeout)
        with self._cond:
            self._stuck_at = self._done if missing else None
        return not missing

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Wait up to `timeout` for the calls so far, then end the sender's process (killed where it still
        has calls then, within the channel's grace); the calls never made are said to be lost."""
        missing = self._wait(timeout)
        with self._cond:
            if self._closing:
                return
            self._closing = True
        self._channel.close(timeout=0.0 if missing else 10.0)
        if missing:
            self._say(f"MLflow: {missing} call(s) not made after {timeout:.0f} s; the sender is stopped")
        if self._dropped:
            self._say(f"MLflow: {self._dropped} call(s) were dropped while the sender was behind")
