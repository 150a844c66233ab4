"""What a run says about its data at the end: per-source lines of the summary, and MLflow params (the formats
read, where the held-out rows came from, each source's counts), which the run's lifecycle logs as it ends
the MLflow run (lifecycle.RunLifecycle.finish: bounded when the store does not answer)."""
from __future__ import annotations


def source_lines(data: dict) -> list[str]:
    """One summary line per source of a mixture: rows read, skipped by reason, tokens, blocks."""
    out = []
    for name, c in (data.get("by_source") or {}).items():
        skipped = c.get("rows_skipped_by_reason") or {}
        out.append(f"    {name}: {c.get('rows_read', 0)} rows read, {sum(skipped.values())} skipped"
                   f"{f' {dict(skipped)}' if skipped else ''}, {c.get('tokens', 0):,} tokens, "
                   f"in {c.get('blocks', 0)} blocks")
    return out


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
        for key in ("rows_read", "tokens", "blocks"):
            params[f"data.sources.{i}.{key}"] = str(c.get(key, 0))
        for reason, n in sorted((c.get("rows_skipped_by_reason") or {}).items()):
            params[f"data.sources.{i}.skipped.{reason}"] = str(n)
    return {k: v[:6000] for k, v in params.items()}

