"""Named points in the training loops where a test attaches behaviour (a worker dying mid-checkpoint, a
storage that reports itself full), so the loops hold no test code and branch on no test setting.

The loops call `fire(point, **info)` where something may happen, and `value(point, default, **info)`
where a figure may be replaced; with nothing attached (every run but a test's) both go over an empty
list. A test attaches handlers inside the workers by naming a plugin in RAYTUNE_TEST_FAULTS,
"module:argument" (forwarded to the workers by train/launch.py, with RAYTUNE_TEST_FAULTS_PATH, the folder
the module is imported from when the worker's own path lacks it): `load_plugin()`, called once as a
worker's loop starts, imports the module and calls its `install(argument)`, which calls `attach`.

Points (`info` in brackets):
    checkpoint.written   [step, rank]  the FSDP2 loop's checkpoint files are complete in the local folder
    checkpoint.uploaded  [step, rank]  ...and this rank's part is on the run's storage, not yet reported
    trl.step_end         [step, rank, output_dir, resumed]  the TRL loop ended an optimizer step
    trl.saved            [step, rank, output_dir, resumed]  the TRL loop reported its checkpoint of `step`
    storage.free_bytes   value [step]  the free bytes the checkpoint guard reads (None: cannot say)
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

PLUGIN_ENV = "RAYTUNE_TEST_FAULTS"
PLUGIN_PATH_ENV = "RAYTUNE_TEST_FAULTS_PATH"

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


def load_plugin() -> None:
    """Install the plugin RAYTUNE_TEST_FAULTS names ("module:argument"), once per process."""
    spec = os.environ.get(PLUGIN_ENV, "")
    if spec and spec not in _loaded:
        module, _, argument = spec.partition(":")
        folder = os.environ.get(PLUGIN_PATH_ENV)
        if folder and folder not in sys.path:
            sys.path.insert(0, folder)
        importlib.import_module(module).install(argument)
        _loaded.add(spec)


_loaded: set[str] = set()
