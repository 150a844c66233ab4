"""The one child-process channel (raytune_ft/channel.py) with real child processes: answers in order, a close
within its bound whatever the child does, a child's death said once, and the signals a terminal or `ray job
stop` sends to the whole process group left to the parent."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from raytune_ft.channel import KILL_GRACE_S, Channel


def echo(child) -> None:
    """A child that answers each message with itself."""
    for msg in child.messages():
        child.answer(**msg)


def _echo(**kwargs) -> tuple[Channel, list[dict]]:
    got: list[dict] = []
    return Channel("tests.test_channel", "echo", on_message=got.append, **kwargs), got


def _answering() -> tuple[Channel, list[dict], list[int]]:
    """An echo child that has answered once; its answers, and its exit codes as on_exit hears them."""
    exits: list[int] = []
    channel, got = _echo(on_exit=exits.append)
    assert channel.send({"n": 0}) and channel.wait(lambda: got, timeout=60)
    return channel, got, exits


@pytest.mark.slow          # child processes
@pytest.mark.timeout(120)
def test_a_child_answers_in_order_ignores_the_groups_signals_and_exits_when_closed():
    exits: list[int] = []
    channel, got = _echo(on_exit=exits.append)
    for n in range(3):
        assert channel.send({"n": n})
    assert channel.wait(lambda: len(got) == 3, timeout=60), got
    os.kill(channel.pid, signal.SIGINT)           # a terminal's Ctrl-C reaches the whole group
    os.kill(channel.pid, signal.SIGTERM)          # so does `ray job stop`
    assert channel.send({"n": 3}) and channel.wait(lambda: len(got) == 4, timeout=60)
    assert [m["n"] for m in got] == [0, 1, 2, 3] and channel.alive
    assert channel.close(timeout=30) == 0 and exits == [0]
    assert not channel.send({"n": 4})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_child_that_stops_answering_is_killed_within_the_close_bound_and_its_death_said_once():
    channel, got, exits = _answering()
    os.kill(channel.pid, signal.SIGSTOP)          # stops answering, as a child stuck on a hung store
    waiter = threading.Thread(target=channel.wait, args=(lambda: len(got) > 1, 600), daemon=True)
    waiter.start()
    for n in range(1, 50):                        # more than the pipe holds: the sends never wait
        channel.send({"n": n, "pad": "x" * 4000})
    t0 = time.monotonic()
    assert channel.close(timeout=1) == -signal.SIGKILL
    assert time.monotonic() - t0 < 1 + 2 * KILL_GRACE_S
    waiter.join(timeout=5)
    assert not waiter.is_alive()                  # a wait ends when the child is gone
    assert exits == [-signal.SIGKILL] and channel.unsent()    # what it was never sent is the owner's


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_child_that_dies_ends_the_waits_and_refuses_the_next_sends():
    channel, got, exits = _answering()
    os.kill(channel.pid, signal.SIGKILL)          # killed for memory
    assert channel.wait(lambda: False, timeout=60) is False
    assert exits == [-signal.SIGKILL] and not channel.alive and not channel.send({"n": 1})
    channel.close(timeout=1)
    assert exits == [-signal.SIGKILL]
