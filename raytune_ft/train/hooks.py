"""Named points in the training loops where a test attaches behaviour (a worker dying mid-checkpoint, a
storage that reports itself full), so the loops hold no test code and branch on no test setting.

The loops call `fire(point, **info)` where something may happen, and `value(point, default, **info)`
where a figure may be replaced; with nothing attached (every run but a test's) both go over an empty
list. A test attaches its handlers itself, in its own process or, through the runtime environment of a Ray
it started, in the workers' (tests/faults.py): nothing here loads them or reads a setting for them.

Points (`info` in brackets):
    checkpoint.written   [step, rank]  the FSDP2 loop's checkpoint files are complete in the local folder
    checkpoint.uploaded  [step, rank]  ...and this rank's part is on the run's storage, not yet reported
    trl.step_end         [step, rank, output_dir, resumed]  the TRL loop ended an optimizer step
    trl.saved            [step, rank, output_dir, resumed]  the TRL loop reported its checkpoint of `step`
    storage.free_bytes   value [step]  the free bytes the checkpoint guard reads (None: cannot say)
"""
from __future__ import annotations

from typing import Any, Callable

_handlers: dict[str, list[Callable[..., Any]]] = {}


def attach(point: str, handler: Callable[..., Any]) -> None:
    """Call `handler(**info)` at `point` (for a value point: `handler(value, **info)`, returning the value)."""
    _handlers.setdefault(point, []).append(handler)


def clear() -> None:
    _handlers.clear()


def fire(point: str, **info: Any) -> None:
    for handler in _handlers.get(point, ()):
        handler(**info)


def value(point: str, default: Any, **info: Any) -> Any:
    for handler in _handlers.get(point, ()):
        default = handler(default, **info)
    return default
