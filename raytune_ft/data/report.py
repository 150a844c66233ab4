"""What a run says about its data at the end: per-source lines of the summary, and MLflow params (the formats
read, where the held-out rows came from, each source's counts), which the run's lifecycle logs as it ends
the MLflow run (lifecycle.RunLifecycle.finish: bounded when the store does not answer). Every row read is
trained, held out or skipped (packing.DataCounters), and each line says the three."""
from __future__ import annotations

import json

SKIPPED_ROWS_FILE = "skipped_rows.jsonl"       # the first skipped rows of each source and reason
DATA_FILE = "data.json"                        # the pass's counts, in the run folder and in MLflow


def rows_line(c: dict) -> str:
    """"R rows read: T trained (C conversations), H held out, S skipped {reason: n}" of counts `c` (the
    whole data's or one source's)."""
    skipped = c.get("rows_skipped_by_reason") or {}
    trained = c.get("trained", c.get("rows_trained", 0))
    held = c.get("held_out", c.get("rows_held_out", 0))
    return (f"{c.get('rows_read', 0)} rows read: {trained} trained ({c.get('conversations', 0)} conversations), "
            f"{held} held out, {sum(skipped.values())} skipped{f' {dict(sorted(skipped.items()))}' if skipped else ''}")


def source_lines(data: dict) -> list[str]:
    """One summary line per source: its rows (trained, held out, skipped by reason), tokens, blocks."""
    return [f"    {name}: {rows_line(c)}; {c.get('tokens', 0):,} tokens in {c.get('blocks', 0)} blocks"
            for name, c in (data.get("by_source") or {}).items()]


def skipped_rows_text(data: dict) -> str:
    """The skipped-row samples (DataCounters.skipped_rows) as JSON lines, "" when no row was skipped."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data.get("skipped_rows") or [])


def data_params(notes: list[str], data: dict) -> dict[str, str]:
    """MLflow params: the pre-run notes (`data.format.<source>`, `data.held_out`, `data.template_kwargs_ignored`)
    and each source's counts (`data.sources.<i>.<count>`)."""
    from raytune_ft.data.precheck import TEMPLATE_KWARGS_IGNORED

    params: dict[str, str] = {}
    for i, line in enumerate(notes):
        body = line.removeprefix("data: ")
        if body.startswith("held-out set: "):
            params["data.held_out"] = body.removeprefix("held-out set: ")
        elif body.startswith(TEMPLATE_KWARGS_IGNORED):
            params["data.template_kwargs_ignored"] = body.removeprefix(TEMPLATE_KWARGS_IGNORED)
        else:
            params[f"data.format.{i}"] = body
    for i, (name, c) in enumerate((data.get("by_source") or {}).items()):
        params[f"data.sources.{i}.name"] = name
        for key in ("rows_read", "trained", "held_out", "conversations", "tokens", "blocks"):
            params[f"data.sources.{i}.{key}"] = str(c.get(key, 0))
        for reason, n in sorted((c.get("rows_skipped_by_reason") or {}).items()):
            params[f"data.sources.{i}.skipped.{reason}"] = str(n)
    return {k: v[:6000] for k, v in params.items()}
