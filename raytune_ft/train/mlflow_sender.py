"""Rank 0's MLflow calls, made by a Python process of its own (`MlflowSender`).

Rank 0 logs to its run from the first seconds of an attempt (the GPU tag, the kernels in use, the
precision) to its end. Made in the worker, `import mlflow` and the store's set-up (a sqlite store checks its
schema) took 4-6 s of a GPU worker's start, on the way to the first step (bench/NOTES.md, start-up), and
every logged step waited for the store or the tracking server. In a process of its own the imports run
beside the model build, on another core, and the loop hands each call over a pipe and goes on.

The calls are made in the order given. `flush()` waits until every call so far has been made (or has
failed); `close()` flushes and ends the process. A call that fails is reported in the worker's log, in the
words the caller gave (tracking must never kill training), and the calls after it are still made. Where
the process cannot start, or dies, the calls are made in the worker as before.

Nothing secret travels on the command line: the tracking URI goes over the pipe; the credentials MLflow
reads (MLFLOW_TRACKING_TOKEN, DATABRICKS_TOKEN, ...) are the worker's environment, which the process inherits.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Callable

# how long close() waits for calls still queued before it gives up on them (a tracking server gone away)
CLOSE_TIMEOUT_S = 300.0


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
    `say` reports a failed call (or tracking switched off) in the worker's log; it may be called from the
    sender's reading thread."""

    def __init__(self, tracking_uri: str, run_id: str, say: Callable[[str], None]):
        self._say = say
        self._uri, self._run_id = tracking_uri, run_id
        self._sent = self._done = 0           # calls handed to the process, and answered by it
        self._cond = threading.Condition()
        self._dead = self._closing = False    # the process exited; close() ends it
        self._here: _Calls | None = None      # the calls made in this process (no sender, or it died)
        self._off = False                     # MLflow could not be reached from this process either
        self._proc = None
        from raytune_ft.env import child_python_env

        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from raytune_ft.train.mlflow_sender import main; main()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_python_env(), text=True, bufsize=1)
            self._proc.stdin.write(json.dumps({"tracking_uri": tracking_uri, "run_id": run_id}) + "\n")
        except OSError:
            self._proc = None
            self._in_worker()
            return
        self._reader = threading.Thread(target=self._read, args=(self._proc,), name="raytune-mlflow-sender",
                                        daemon=True)
        self._reader.start()

    def _in_worker(self) -> None:
        self._here = _open_calls(self._uri, self._run_id, self._say)
        self._off = self._here is None

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
            if not self._closing:
                self._say(f"MLflow sender exited (code {code}) with {self._sent - self._done} call(s) not made; "
                          "the next ones are made in the worker")
            self._dead = True
            self._cond.notify_all()

    def call(self, op: str, fail: str, **args) -> None:
        """Make MLflow call `op` (set_tag, log_param, log_batch, log_table) with `args`, in order; where it
        fails, `fail` (with "{error}" for the error's type) is said in the worker's log."""
        if self._off:
            return
        if self._proc is not None and not self._dead:
            with self._cond:
                self._sent += 1
                n = self._sent
            try:
                self._proc.stdin.write(json.dumps({"op": op, "args": args, "fail": fail, "n": n}) + "\n")
                return
            except (OSError, ValueError):        # the process is gone: the call is made here
                pass
        if self._here is None:
            self._in_worker()
            if self._here is None:
                return
        try:
            self._here.make(op, args)
        except Exception as e:  # noqa: BLE001 - tracking must never kill training
            self._say(_failure(fail, e))

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every call so far has been made or has failed; False where `timeout` passed first."""
        if self._proc is None:
            return True
        with self._cond:
            target = self._sent
            return self._cond.wait_for(lambda: self._done >= target or self._dead, timeout=timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Flush, then end the sender's process. Calls still not made after `timeout` are said to be lost."""
        if self._proc is None:
            return
        done = self.flush(timeout)
        with self._cond:
            self._closing = True
            lost = 0 if self._dead else self._sent - self._done
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        if not done and lost:
            self._say(f"MLflow: {lost} call(s) not made after {timeout:.0f} s; the sender is stopped")
            self._proc.kill()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._reader.join(timeout=5)
        self._proc = None
