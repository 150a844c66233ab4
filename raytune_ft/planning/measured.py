"""The plan's and the projection's measured inputs, read from one dated data file (data/measured.json) in which
each figure names the bench record it comes from; tests/planning/test_measured.py holds every figure to its record."""
from __future__ import annotations

import functools
import json
from pathlib import Path

MEASURED_FILE = Path(__file__).with_name("data") / "measured.json"


@functools.lru_cache(maxsize=1)
def figures() -> dict:
    """Every figure of the file by name: kind, what, gpu, date, command, record, values."""
    return json.loads(MEASURED_FILE.read_text())["figures"]


def figure(name: str) -> dict:
    return figures()[name]


def measured_64() -> dict:
    """The 64-layer shape measurement in the projection's terms: its setting, its values, its checkpoint."""
    shape, ckpt = figure("shape_64"), figure("shape_64_checkpoint")
    return {"gpu": shape["gpu"], **shape["setting"], **shape["values"], "date": shape["date"],
            "command": shape["command"],
            "checkpoint": {k.removeprefix("checkpoint."): v for k, v in ckpt["values"].items()}}


def measured_64_cp() -> dict:
    """The same shape as one rank of a context-parallel group, in measured_64's terms: its setting (with `cp`),
    step, throughput and peak; the build, compile and checkpoint are measured_64's (CP changes none of them)."""
    cp = figure("shape_64_cp8")
    return {**measured_64(), **cp["setting"], **cp["values"], "date": cp["date"], "command": cp["command"]}
