"""The summary a run prints: its MLflow link opens the training runs' view of the installed MLflow UI."""
from __future__ import annotations

from pathlib import Path

import mlflow

from raytune_ft.driver.run import RUNS_VIEW, RunSummary


def test_the_summary_links_the_experiments_runs_tab_of_the_installed_mlflow_ui():
    s = RunSummary(job="j", run_name="r", status="trained", tracking_uri="sqlite:///runs/r/mlflow.db",
                   mlflow_run_id="abc", mlflow_experiment_id="3")
    assert "  then open        http://127.0.0.1:5000/#/experiments/3/runs" in s.lines()
    # the route the link names is one of the UI's own (a hash router: the path after '#/')
    route = "/" + RUNS_VIEW.split("/#/", 1)[1].replace("{}", ":experimentId")
    js = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    assert any(f'"{route}"' in p.read_text(errors="ignore") for p in js.glob("main.*.js")), route


def test_the_data_row_gives_the_padding_share_of_the_trained_tokens():
    """Issue 50: a run that trained half padding said only "3 rows read, 0 skipped, 40 blocks"."""
    data = {"rows_read": 3, "rows_trained": 3, "conversations": 3, "blocks": 40, "real_tokens": 10240,
            "padding_tokens": 10240, "equalisation_padding_blocks": 20}
    row = next(line for line in RunSummary(job="j", run_name="r", status="trained", data=data).lines()
               if line.startswith("  data "))
    assert row.endswith("3 rows read: 3 trained (3 conversations), 0 held out, 0 skipped, 40 blocks, padding 50.0% "
                        "of the trained tokens (20 all-padding blocks evened the ranks out)"), row
    data |= {"real_tokens": 20000, "padding_tokens": 480, "equalisation_padding_blocks": 0}
    row = next(line for line in RunSummary(job="j", run_name="r", status="trained", data=data).lines()
               if line.startswith("  data "))
    assert row.endswith("40 blocks, padding 2.3% of the trained tokens"), row
