"""`raytune-ft runs`: the runs found in storage folders, newest first, and their table: each run folder's
summary.json, or its MLflow store where the job ended before writing one."""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys

from raytune_ft.env import redact

DEFAULT_STORAGE = ("~/raytune_runs", "./runs")   # TrackingConfig's default, the --local jobs' default


def find_runs(storages: list[str]) -> list[dict]:
    """One dict per run folder under each storage path (a folder or s3://bucket/prefix): from its summary.json,
    else from its MLflow store, else from the lease of a job that holds it."""
    import pyarrow.fs as pafs

    from raytune_ft.storage import fs as st_mod
    rows: list[dict] = []
    for where in storages:
        try:
            st = st_mod.resolve(where)
            entries = st.fs.get_file_info(pafs.FileSelector(st.root, allow_not_found=True))
        except (OSError, ValueError) as e:   # an unreachable bucket must not hide the other storages' runs
            print(f"(could not list {where}: {redact(str(e)).splitlines()[0][:200]})", file=sys.stderr)
            continue
        for info in entries:
            if info.type == pafs.FileType.Directory:
                row = _run_row(st, info.path, info.base_name)
                if row is not None:
                    rows.append(row)
    rows.sort(key=lambda r: r.get("time", 0), reverse=True)
    return rows


def _run_row(st, run_path: str, name: str) -> dict | None:
    """The row of one folder of a storage, None when it is not a run's."""
    import tempfile

    import pyarrow.fs as pafs

    from raytune_ft.storage import fs as st_mod
    uri = st.uri(run_path)
    files = {f: st.fs.get_file_info(f"{run_path}/{f}") for f in (st_mod.SUMMARY_FILE, "mlflow.db")}
    found = {f: i for f, i in files.items() if i.type == pafs.FileType.File}
    if st_mod.SUMMARY_FILE in found:
        when = found[st_mod.SUMMARY_FILE].mtime.timestamp()
        try:
            s = json.loads(st_mod.read_bytes(st.fs, f"{run_path}/{st_mod.SUMMARY_FILE}"))
        except (OSError, ValueError) as e:
            return {"run_name": name, "status": f"unreadable summary.json ({type(e).__name__})", "path": uri,
                    "time": when}
        s.update(path=uri, time=when)
        return s
    if "mlflow.db" in found:
        when = found["mlflow.db"].mtime.timestamp()
        if not st.remote:
            return _run_from_mlflow(f"{run_path}/mlflow.db", name, uri, when)
        with tempfile.TemporaryDirectory(prefix="raytune_runs_") as tmp:   # sqlite reads a local file only
            st_mod.download(st.fs, f"{run_path}/mlflow.db", tmp)
            return _run_from_mlflow(os.path.join(tmp, "mlflow.db"), name, uri, when)
    from raytune_ft.storage import lease
    held = lease.read(st.fs, run_path)        # a run on object storage keeps its MLflow store elsewhere
    if held is not None:
        age = max(0.0, _dt.datetime.now().timestamp() - held.heartbeat)
        return {"run_name": name, "path": uri, "time": held.heartbeat,
                "status": f"running: {held.owner()}, heartbeat {age:.0f} s ago"}
    return None


def _run_from_mlflow(db_path: str, name: str, uri: str, when: float) -> dict:
    """A run without summary.json (still running, failed, or killed): what its MLflow store says."""
    row = {"run_name": name, "path": uri, "time": when, "status": "no summary"}
    try:
        import mlflow

        from raytune_ft.tracking.mlflow_run import mlflow_metric_name

        loss_key = mlflow_metric_name("loss")
        client = mlflow.MlflowClient("sqlite:///" + os.path.abspath(db_path))
        found = []
        for exp in client.search_experiments():
            found += client.search_runs([exp.experiment_id], filter_string=f"tags.`raytune.run_name` = '{name}'",
                                        max_results=1, order_by=["attributes.start_time DESC"])
        if found:
            r = found[0]
            status = r.data.tags.get("raytune.status") or r.info.status.lower()
            row.update(status="running" if r.info.status == "RUNNING" else status,
                       job=r.data.tags.get("raytune.job"), final_loss=r.data.metrics.get(loss_key),
                       steps=int(r.data.metrics.get("step", 0)) or None, mlflow_run_id=r.info.run_id)
            hist = client.get_metric_history(r.info.run_id, loss_key)
            if hist:
                last = max(hist, key=lambda m: m.step)
                row.update(final_loss=last.value, steps=last.step)
    except Exception as e:  # a broken store still lists the folder
        row["status"] = f"no summary; MLflow store unreadable ({type(e).__name__})"
    return row


def format_runs(rows: list[dict]) -> str:
    """A table of runs, newest first."""
    if not rows:
        return "no runs found"
    table = [("FINISHED", "RUN", "JOB", "STATUS", "STEPS", "FINAL LOSS", "REGISTERED")]
    for r in rows:
        when = _dt.datetime.fromtimestamp(r["time"]).strftime("%Y-%m-%d %H:%M") if r.get("time") else ""
        loss = r.get("final_loss")
        reg = ""
        if r.get("registered_version"):
            reg = f"{r.get('registered_name')} v{r['registered_version']}"
        elif r.get("registration_error"):
            reg = "failed (see summary.json for the retry command)"
        table.append((when, str(r.get("run_name", "")), str(r.get("job") or ""), str(r.get("status", "")),
                      "" if r.get("steps") is None else str(r["steps"]),
                      f"{loss:.4f}" if isinstance(loss, (int, float)) else "", reg))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)
