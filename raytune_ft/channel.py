"""One child Python process spoken to in JSON lines: the run opener (run_opening.py), rank 0's MLflow sender
(train/mlflow_sender.py) and each node's system-metrics monitor (train/system_metrics.py) are all one.

The parent: `Channel(module, function)` starts `function(child)` of `module` in a new Python process; `send`
queues a message and never waits (a thread of the channel writes the queue to the child's stdin, so a child
that stops reading blocks that thread only); every answer goes to `on_message` (from the channel's reader
thread); `wait(predicate, timeout)` waits a bounded time for the answers to make `predicate` true; `close`
ends the child within its bound. The child: `child.messages()` yields the parent's messages until the parent
closes the pipe (or dies), `child.answer(**msg)` answers.

When the child dies, or is killed by `close` because it stopped answering, `on_exit(code)` is called once,
waits end at once, and the messages it was never sent are `unsent()`: the owner decides what they become.
The child ignores SIGINT and SIGTERM (Ctrl-C and `ray job stop` reach the whole process group): the parent
alone ends it, by closing its pipe (the child finishes what it was sent, then exits) or by killing it. Its
stdout and stderr are the parent's; answers travel on a pipe of their own. Nothing secret goes on its
command line: the credentials a child needs are the parent's environment, which it inherits.

`call_within` is the same bounded wait for a call made in this process (a read of the tracking store).
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator

# how long `close` waits for a child's exit after the bound it was given, once killed
KILL_GRACE_S = 5.0


class Channel:
    """A child process running `function(child)` of `module` (see the module's doc)."""

    def __init__(self, module: str, function: str, *, on_message: Callable[[dict], None] | None = None,
                 on_exit: Callable[[int], None] | None = None, max_queued: int = 10_000, name: str = "channel"):
        from raytune_ft.env import child_python_env

        self._on_message, self._on_exit = on_message, on_exit
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._max_queued = max_queued
        self._closing = False
        self.exit_code: int | None = None
        read_fd, write_fd = os.pipe()
        code = f"from raytune_ft.channel import _child; _child({module!r}, {function!r}, {write_fd})"
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-c", code], stdin=subprocess.PIPE, env=child_python_env(), pass_fds=(write_fd,))
        except OSError:
            self._proc = None
        os.close(write_fd)
        self._answers = os.fdopen(read_fd, "r")
        self._threads = [threading.Thread(target=t, name=f"raytune-{name}-{t.__name__.strip('_')}", daemon=True)
                         for t in (self._write, self._read)]
        for t in self._threads:
            t.start()

    @property
    def alive(self) -> bool:
        """Whether the child runs (started and not yet exited)."""
        return self._proc is not None and self.exit_code is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def send(self, msg: dict) -> bool:
        """Queue `msg` for the child; never waits. False when the child is gone, closing or `max_queued`
        messages wait already (the message is not sent)."""
        with self._cond:
            if self._closing or not self.alive or len(self._queue) >= self._max_queued:
                return False
            self._queue.append(json.dumps(msg) + "\n")
            self._cond.notify_all()
            return True

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait up to `timeout` s until `predicate()` (checked at each answer) holds, or the child is gone;
        whether it holds."""
        with self._cond:
            self._cond.wait_for(lambda: predicate() or not self.alive, timeout=max(timeout, 0.0))
            return predicate()

    def unsent(self) -> list[dict]:
        """The messages queued but never written to the child (taken: a second call returns none)."""
        with self._cond:
            out, self._queue = [json.loads(m) for m in self._queue], collections.deque()
            return out

    def close(self, timeout: float = 10.0) -> int | None:
        """Let the child finish what it was sent and exit, within `timeout` s; then kill it. Its exit code."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._threads[0].join(timeout=max(deadline - time.monotonic(), 0.0))
        if self._proc is not None:
            try:
                self._proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                self._proc.kill()       # a write blocked on its full pipe then fails too
                self._proc.wait(timeout=KILL_GRACE_S)
        for t in self._threads:
            t.join(timeout=KILL_GRACE_S)
        return self.exit_code

    def kill(self) -> None:
        """End the child now, whatever it is doing."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self.alive:
            self._proc.kill()

    def _write(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing or not self.alive)
                if not self.alive or not self._queue:
                    break
                line = self._queue.popleft()
            try:
                self._proc.stdin.write(line.encode())   # blocks this thread only, while the pipe is full
                self._proc.stdin.flush()
            except (OSError, ValueError):
                break
        if self._proc is not None:
            try:
                self._proc.stdin.close()                 # the child's messages() ends
            except (OSError, ValueError):
                pass

    def _read(self) -> None:
        for line in self._answers:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if self._on_message is not None:
                self._on_message(msg)
            with self._cond:
                self._cond.notify_all()
        self._answers.close()
        code = self._proc.wait() if self._proc is not None else -1
        with self._cond:
            self.exit_code = code
            self._cond.notify_all()
        if self._on_exit is not None:
            self._on_exit(code)


class Child:
    """The child's side: the parent's messages in, answers out."""

    def __init__(self, answer_fd: int):
        self._out = os.fdopen(answer_fd, "w", buffering=1)
        self._lock = threading.Lock()

    def messages(self) -> Iterator[dict]:
        """The parent's messages, in order, until it closes the pipe or dies."""
        for line in sys.stdin:
            if line.strip():
                yield json.loads(line)

    def answer(self, **msg) -> None:
        """One answer to the parent (from any thread)."""
        with self._lock:
            self._out.write(json.dumps(msg) + "\n")
            self._out.flush()


def _child(module: str, function: str, answer_fd: int) -> None:
    import importlib
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):   # the parent ends this process: see the module's doc
        signal.signal(sig, signal.SIG_IGN)
    getattr(importlib.import_module(module), function)(Child(answer_fd))
    sys.stdout.flush()
    sys.stderr.flush()
    # MLflow's background threads (telemetry, async logging) have nothing left to do for this process
    os._exit(0)


class NoAnswer(TimeoutError):
    """A call given to `call_within` did not return within its bound."""


class Deadline:
    """One bound shared by the parts of a sequence (a run's ending): each part waits for what is left of it,
    so their sum cannot pass the bound however slowly each part answers."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self, at_most: float | None = None) -> float:
        """Seconds left (never negative), capped at `at_most` (a part's own limit)."""
        left = max(0.0, self.end - time.monotonic())
        return left if at_most is None else min(left, at_most)

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self.end


# set once a call_within gave up on a call: its thread may still wait in a library (pyarrow's S3 client, an HTTP
# request) whose exit handlers wait for it too
_ABANDONED = threading.Event()


def exit_if_abandoned(code: int) -> None:
    """Exit now with `code`, skipping the interpreter's exit handlers, where a call was given up on: pyarrow's S3
    finalizer waits for a request to a store that stopped answering, which would hold the exit past the
    ending's bound. Otherwise return (the caller exits as usual)."""
    if _ABANDONED.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def call_within(seconds: float, what: str, fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)` in a daemon thread, waited for `seconds` at most: its result, its exception
    raised here, or NoAnswer naming `what` (the thread is left behind, and the process does not wait for it
    to exit: a store that never answers holds nothing up)."""
    out: dict = {}

    def call() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            out["error"] = e

    worker = threading.Thread(target=call, name=f"raytune-{what.split()[0]}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        _ABANDONED.set()
        raise NoAnswer(f"{what}: no answer within {seconds:g} s")
    if "error" in out:
        raise out["error"]
    return out["result"]
