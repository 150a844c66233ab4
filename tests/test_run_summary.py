"""The summary a run prints: its MLflow link opens the training runs' view of the installed MLflow UI."""
from __future__ import annotations

from pathlib import Path

import mlflow

from raytune_ft.run import RUNS_VIEW, RunSummary


def test_the_summary_links_the_experiments_runs_tab_of_the_installed_mlflow_ui():
    s = RunSummary(job="j", run_name="r", status="trained", tracking_uri="sqlite:///runs/r/mlflow.db",
                   mlflow_run_id="abc", mlflow_experiment_id="3")
    assert "  then open        http://127.0.0.1:5000/#/experiments/3/runs" in s.lines()
    # the route the link names is one of the UI's own (a hash router: the path after '#/')
    route = "/" + RUNS_VIEW.split("/#/", 1)[1].replace("{}", ":experimentId")
    js = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    assert any(f'"{route}"' in p.read_text(errors="ignore") for p in js.glob("main.*.js")), route
