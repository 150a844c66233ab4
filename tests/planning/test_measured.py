"""Issue 58 item 5: the plan's and the projection's measured inputs live in one data file
(raytune_ft/planning/data/measured.json), each naming its bench record; every figure equals its record."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytune_ft.planning.measured import figures

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _record(where: dict) -> dict:
    rows = [json.loads(line) for line in (RESULTS / where["file"]).read_text().splitlines() if line.strip()]
    found = [r for r in rows if r.get("date") == where["date"] and r.get("bench") == where["bench"]
             and ("label" not in where or r.get("label") == where["label"])]
    assert len(found) == 1, f"{where}: {len(found)} records match"
    return found[0]


def _at(record: dict, path: str):
    for key in path.split("."):
        record = record[key]
    return record


@pytest.mark.parametrize("name", sorted(figures()))
def test_each_measured_figure_equals_its_bench_record(name):
    fig = figures()[name]
    assert fig["kind"] in ("measured", "calibrated") and fig["date"] and fig["what"]
    if fig["kind"] == "calibrated":       # named with the runs it was fitted on, each checked as a record
        assert fig["fitted_on"]
        for run in fig["fitted_on"] + fig.get("checked_on", []):
            rec = _record(run)
            assert all(_at(rec, k) == v for k, v in run["values"].items()), run
        for run in fig.get("checked_on", []):      # its setting, as the record names it
            rec = _record(run)          # a recipe run's settings, or the shape bench's own field
            assert rec.get("settings", rec).get("train.precision", rec.get("precision", "bf16")) == run.get(
                "precision", "bf16")
        # a run it is checked on is one it was not fitted on
        assert not {r["date"] for r in fig["fitted_on"]} & {r["date"] for r in fig.get("checked_on", [])}
        return
    if fig["record"] is None:             # a figure older than the records: its RESULTS.md row holds it
        row = fig["results_row"]
        text = (RESULTS.parent / "RESULTS.md").read_text()
        assert f"{next(iter(fig['values'].values())):,}" in row and row.split(": ")[-1] in text
        return
    rec = _record(fig["record"])
    for key, value in fig["values"].items():
        assert _at(rec, key) == value, (name, key, _at(rec, key), value)
    if fig.get("gpu"):
        assert fig["gpu"] in rec["hardware"]["gpus"][0]["name"]
    for package, version in fig.get("versions", {}).items():
        assert rec["versions"][package] == version


def test_the_projection_and_the_lora_plan_read_the_file():
    from raytune_ft.planning import lora, projection

    assert projection.MEASURED_64["s_per_step"] == figures()["shape_64"]["values"]["s_per_step"]
    assert projection.MEASURED_64["checkpoint"]["write_s"] == figures()["shape_64_checkpoint"]["values"][
        "checkpoint.write_s"]
    assert lora.LORA_ALLOWANCE == figures()["lora_allowance"]["values"]["fraction_of_frozen_base"]
