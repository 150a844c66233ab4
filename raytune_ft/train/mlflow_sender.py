"""Rank 0's MLflow calls, made by a Python process of their own (`MlflowSender`).

Rank 0 logs to its run from the first seconds of an attempt (the GPU tag, the kernels in use, the
precision) to its end. Made in the worker, `import mlflow` and the store's set-up (a sqlite store checks its
schema) would sit on the way to the first step, and every logged step would wait for the store or the
tracking server. In a process of its own the imports run beside the model build, on another core, and the
loop hands each call over and goes on.

The training thread never waits on MLflow: a call goes into a bounded queue, and a thread of the sender's
writes the queue to the process's pipe (a stalled store fills the pipe, which then blocks that thread only).
A call that finds the queue full is dropped, and said. The calls are made in the order given. `flush()`
waits, for a bounded time, until every call so far has been made (or has failed); where the time passes
first it says how many calls are missing and returns False. `close()` flushes and ends the process within
its own bound, saying how many calls were lost. A call that fails is reported in the worker's log, in the
words the caller gave (tracking must never kill training), and the calls after it are still made. Where
the process cannot start, or dies, the sender's thread makes the calls in the worker instead.

Nothing secret travels on the command line: the tracking URI goes over the pipe; the credentials MLflow
reads (MLFLOW_TRACKING_TOKEN, DATABRICKS_TOKEN, ...) are the worker's environment, which the process inherits.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Callable

# how long flush() waits (before a checkpoint is reported) for the calls so far to be made
FLUSH_TIMEOUT_S = 120.0
# how long close() holds the end of a run for calls still queued before it stops the sender (a tracking
# server gone away); the process then gets EXIT_GRACE_S more to exit
CLOSE_TIMEOUT_S = 60.0
EXIT_GRACE_S = 10.0
# calls waiting for the sender's process; beyond it a call is dropped (said) rather than wait
QUEUE_CALLS = 10_000


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
        elif op == "log_table":
            from raytune_ft.env import scoped_env

            # mlflow appends the rows to the table in the run, downloading it first: without its progress bar,
            # which a worker's console would forward as chatter
            with scoped_env({"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):
                self.client.log_table(self.run_id, args["data"], args["artifact_file"])
        else:
            raise ValueError(f"unknown MLflow call {op!r}")


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


def _serve(stdin, stdout) -> None:
    """The sender process: the run from the first line, then one call per line; answers on `stdout`."""
    def answer(**msg) -> None:
        stdout.write(json.dumps(msg) + "\n")
        stdout.flush()

    line = stdin.readline()
    if not line:          # the worker went before it said which run
        return
    first = json.loads(line)
    calls = _open_calls(first["tracking_uri"], first["run_id"], lambda text: answer(say=text))
    for line in stdin:
        msg = json.loads(line)
        if calls is not None and msg.get("op"):
            try:
                calls.make(msg["op"], msg.get("args", {}))
            except Exception as e:  # noqa: BLE001 - reported in the caller's words; the next calls are made
                answer(say=_failure(msg.get("fail", "MLflow call failed ({error})"), e))
        answer(done=msg["n"])


def main() -> None:
    # the answers keep the process's stdout to themselves: anything a library prints goes to stderr (the
    # worker's log)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(sys.stdin, answers)


class MlflowSender:
    """Rank 0's MLflow calls on run `run_id`, made in order by a child process (see the module's doc).
    `say` reports a failed call, calls missing after a flush or a close, or tracking switched off, in the
    worker's log; it may be called from the sender's threads."""

    def __init__(self, tracking_uri: str, run_id: str, say: Callable[[str], None]):
        self._say = say
        self._uri, self._run_id = tracking_uri, run_id
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_CALLS)
        self._cond = threading.Condition()
        # calls are numbered from 1 as they are queued; made, failed and lost ones all count as done
        self._queued = self._written = self._done = 0
        self._dropped = 0                     # calls refused because the queue was full
        self._dead = False                    # the process exited or never started: calls made here
        self._closing = self._stopped = False # close() began; close() gave up on the calls still queued
        self._here: _Calls | None = None      # the calls made in this process (no sender, or it died)
        self._off = False                     # MLflow could not be reached from this process either
        self._proc = self._reader = None
        from raytune_ft.env import child_python_env

        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from raytune_ft.train.mlflow_sender import main; main()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_python_env(), text=True, bufsize=1)
            # the first line of a fresh pipe: written at once
            self._proc.stdin.write(json.dumps({"tracking_uri": tracking_uri, "run_id": run_id}) + "\n")
        except OSError:
            self._proc, self._dead = None, True
        if self._proc is not None:
            self._reader = threading.Thread(target=self._read, args=(self._proc,), name="raytune-mlflow-answers",
                                            daemon=True)
            self._reader.start()
        self._writer = threading.Thread(target=self._write, name="raytune-mlflow-sender", daemon=True)
        self._writer.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "say" in msg:
                self._say(msg["say"])
            if "done" in msg:
                with self._cond:
                    self._done = max(self._done, msg["done"])
                    self._cond.notify_all()
        code = proc.wait()
        with self._cond:
            lost = self._written - self._done     # handed to the process, never answered
            self._dead = True
            self._done = max(self._done, self._written)
            self._cond.notify_all()
            closing = self._closing
        if not closing:
            self._say(f"MLflow sender exited (code {code}) with {max(lost, 0)} call(s) not made; "
                      "the next ones are made in the worker")

    def _write(self) -> None:
        """The sender's thread: each queued call to the process's pipe, or made here where there is none."""
        while True:
            item = self._queue.get()
            if item is None or self._stopped:
                break
            n, line, op, fail = item
            if not self._dead:
                try:
                    self._proc.stdin.write(line)      # blocks this thread only, when the pipe is full
                    self._proc.stdin.flush()
                except (OSError, ValueError):        # the process is gone: the call is made here
                    pass
                else:
                    with self._cond:
                        self._written = n
                        if self._dead:               # it went before answering: counted as lost
                            self._done = max(self._done, n)
                            self._cond.notify_all()
                    continue
            if self._stopped:
                break
            self._make_here(op, json.loads(line)["args"], fail)
            with self._cond:
                self._done = max(self._done, n)
                self._cond.notify_all()
        if self._proc is not None and not self._stopped:
            try:
                self._proc.stdin.close()             # the process ends after the calls before
            except (OSError, ValueError):
                pass

    def _make_here(self, op: str, args: dict, fail: str) -> None:
        if self._here is None and not self._off:
            self._here = _open_calls(self._uri, self._run_id, self._say)
            self._off = self._here is None
        if self._here is None:
            return
        try:
            self._here.make(op, args)
        except Exception as e:  # noqa: BLE001 - tracking must never kill training
            self._say(_failure(fail, e))

    def call(self, op: str, fail: str, **args) -> None:
        """Make MLflow call `op` (set_tag, log_param, log_batch, log_table) with `args`, in order; where it
        fails, `fail` (with "{error}" for the error's type) is said in the worker's log. Never waits: a
        call that finds QUEUE_CALLS calls still waiting is dropped and said."""
        if self._off or self._closing:
            return
        with self._cond:
            n = self._queued + 1
            line = json.dumps({"op": op, "args": args, "fail": fail, "n": n}) + "\n"
            try:
                self._queue.put_nowait((n, line, op, fail))
            except queue.Full:
                self._dropped += 1
                dropped = self._dropped
            else:
                self._queued = n
                return
        if dropped == 1 or dropped % 1000 == 0:
            self._say(f"MLflow: {dropped} call(s) dropped so far: {QUEUE_CALLS} calls wait for the sender "
                      "(the tracking store is slow or unreachable)")

    def _wait(self, timeout: float) -> int:
        """Wait up to `timeout` for the calls queued so far; how many are still not made."""
        with self._cond:
            target = self._queued
            self._cond.wait_for(lambda: self._done >= target, timeout=max(timeout, 0.0))
            return max(target - self._done, 0)

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every call so far has been made or has failed. Where `timeout` passes first, say how
        many are missing (the run's curves lack them at this point) and return False."""
        missing = self._wait(timeout)
        if missing:
            self._say(f"MLflow: {missing} call(s) still not made after {timeout:.0f} s (the tracking store is "
                      "slow or unreachable); the run's curves lack them at this point")
        return not missing

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Flush, then end the sender's process: within `timeout` (and EXIT_GRACE_S for the process to exit)
        whatever the store does; calls still not made then are said to be lost."""
        if self._closing:
            return
        deadline = time.monotonic() + timeout
        missing = self._wait(timeout)
        with self._cond:
            self._closing = True
        if missing:
            self._stopped = True
            self._say(f"MLflow: {missing} call(s) not made after {timeout:.0f} s; the sender is stopped")
            if self._proc is not None:
                self._proc.kill()                    # a write blocked on its pipe then fails
        try:
            self._queue.put_nowait(None)
        except queue.Full:                           # stopped: the writer leaves at its next call
            pass
        self._writer.join(timeout=max(deadline - time.monotonic(), 0.0) + EXIT_GRACE_S)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=max(deadline - time.monotonic(), 0.0) + EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._reader.join(timeout=EXIT_GRACE_S)
            try:
                self._proc.stdin.close()             # what a stopped sender left unwritten goes
            except (OSError, ValueError):
                pass
        if self._dropped:
            self._say(f"MLflow: {self._dropped} call(s) were dropped while the sender was behind")
