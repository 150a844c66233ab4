"""The data checked in the driver before Ray starts: each source's splits exist, its first rows are in a format
the adapters read, and the held-out set is settled (data/held_out.py: each source that evaluates holds out at
least one row and at most its share of `validation_max_rows`; a small local source is read whole to settle its
carve, and a single one's skipped share checked). Every failure is a RecipeError (exit 2).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from raytune_ft.data.held_out import evaluating, named_split, source_fraction
from raytune_ft.data.reading import check_readable, head_rows, hf_repo, iter_source_rows, source_files
from raytune_ft.data.rows import IN_HELD_OUT, _split_bucket, too_many_skipped
from raytune_ft.data.sources import describe_formats
from raytune_ft.data.specs import SourceSpec, source_specs
from raytune_ft.recipe.values import RecipeError

HEAD_ROWS = 64
READ_WHOLE_BYTES = 64 << 20      # a local source up to this size is read whole for the held-out carve
_NOT_A_FORMAT = ("invalid_json", "unknown_schema", "missing_messages")


@dataclass
class SourceCheck:
    """What the first rows of a source said: the format picked and how many rows were looked at."""
    name: str
    format: str
    rows_seen: int


def _fields(row) -> str:
    if isinstance(row, (str, bytes)):
        try:
            row = json.loads(row)
        except ValueError:
            return "not JSON"
    return ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__


def check_format(spec: SourceSpec, rows: list, where: str) -> SourceCheck:
    """The format of a source's first rows; RecipeError when none of them is in one (row, fields, formats)."""
    from raytune_ft.data.pipeline import adapter_of
    from raytune_ft.data.rows import _unwrap

    adapter = adapter_of(spec)
    picked: dict[str, int] = {}
    first_bad = None
    for n, row in enumerate(rows, 1):
        raw = _unwrap(row)
        messages, reason = adapter(raw)
        if reason in _NOT_A_FORMAT:
            first_bad = first_bad or (n, raw, reason)
            continue
        parsed = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        fmt = spec.schema if spec.schema != "auto" else adapter.detect(parsed)
        picked[fmt] = picked.get(fmt, 0) + 1
    if not picked:
        if not rows:
            raise RecipeError(f"{where}: {spec.source} has no rows")
        n, raw, reason = first_bad
        mapped = f" (mapped: {spec.fields})" if spec.fields else ""
        asked = f"data.schema={spec.schema}: " if spec.schema != "auto" else ""
        raise RecipeError(
            f"{where}: {spec.source} row {n} is in no known format ({asked}{reason}); its fields: {_fields(raw)}"
            f"{mapped}. Formats accepted: {describe_formats()}. Map other names with --set data.fields.FIELD=NAME "
            "(e.g. data.fields.messages=dialog) and --set data.roles.ROLE=[names]")
    return SourceCheck(spec.name, max(picked, key=picked.get), len(rows))


def _check_splits(spec: SourceSpec, where: str) -> None:
    """The named splits of a hub or object-store source exist (local ones: the recipe's validation)."""
    if spec.kind == "hf":
        from raytune_ft.data.reading import hf_splits

        have = hf_splits(hf_repo(spec.source), spec.revision)
        for what, name in (("split", spec.split), ("validation_split", spec.validation_split)):
            if name is not None and name not in have:
                raise RecipeError(f"{where}.{what}: {name!r} does not exist in {spec.source} "
                                  f"(splits: {', '.join(have) or 'none'})")
    elif spec.kind == "remote" and spec.validation_split is not None:
        source_files(spec, spec.validation_split, held_out=True)


def _local_bytes(spec: SourceSpec) -> int | None:
    if spec.kind != "local":
        return None
    files, _ = source_files(spec, spec.split)
    return sum(os.path.getsize(f) for f in files)


def _where(data, i: int) -> str:
    return f"data.sources[{i}]" if data.sources else "data"


def settle_carve(data, i: int, spec: SourceSpec, share: int | None) -> tuple[str, int | None]:
    """For a source read whole here: move its carve's fraction (a threshold on the rows' content hash; a
    mixture source's own, `data.sources[i].validation_fraction`) so that at least one row and at most `share`
    are held out, and stop on too many skipped rows (a single source's). Returns the held-out description and
    its row count (None: not counted here)."""
    from raytune_ft.data.pipeline import adapter_of

    f = source_fraction(spec, data)
    size = _local_bytes(spec)
    if size is None or size > READ_WHOLE_BYTES:
        return (f"{f:.1%} of {spec.name}'s rows by content hash (seed {data.seed}), never trained on; "
                f"evaluated: {'all' if share is None else f'at most {share} of them'}", None)
    adapter, buckets, reasons, n, sample = adapter_of(spec), [], {}, 0, []
    for file, number, raw in iter_source_rows(spec, spec.split, seed=data.seed):
        if spec.max_rows is not None and n >= spec.max_rows:
            break
        messages, reason = adapter(raw)
        n += 1
        if reason:
            reasons[reason] = reasons.get(reason, 0) + 1
            sample += [{"source": spec.name, "file": file, "row": number, "reason": str(reason),
                        "detail": getattr(reason, "detail", "")}][:5 - len(sample)]
        else:                   # a row that cannot be trained is skipped, never carved (held_out_row)
            buckets.append(_split_bucket(messages, data.seed))
    # a mixture's skipped share is the whole pass's: `data check` and the run say it
    why = None if data.sources else too_many_skipped(reasons, n, data.max_skip_fraction, sample)
    if why:
        raise RecipeError(f"data.max_skip_fraction: {spec.source}: {why}")
    if len(buckets) < 2:
        raise RecipeError(f"{_where(data, i)}: {spec.source} has {len(buckets)} usable row(s) of {n}: too few to "
                          "hold any out and train on the rest; set data.validation_fraction=0 and train.eval_every=0")
    buckets.sort()
    want = sum(b < f for b in buckets)
    cap = min(share or len(buckets) - 1, len(buckets) - 1)
    held = min(max(want, 1), cap)
    if held != want:            # a repeated conversation is on one side of a threshold: the counts one can hold out
        cuts = [k for k in range(1, cap + 1) if buckets[k - 1] < buckets[k]]
        if not cuts:
            raise RecipeError(f"{_where(data, i)}: {spec.source} has {len(buckets)} usable row(s) of {n}, "
                              f"{len(set(buckets))} distinct conversation(s): too few to hold out at least one and "
                              f"at most {cap} and train on the rest; set data.validation_fraction=0 and "
                              "train.eval_every=0")
        held = max((k for k in cuts if k <= held), default=cuts[0])
    moved = f
    if held != want:            # the threshold between the held-th and the next smallest hash
        moved = (buckets[held - 1] + buckets[held]) / 2
        if data.sources:
            data.sources[i]["validation_fraction"] = moved
        else:
            data.validation_fraction = moved
    return (f"{held} of {n} rows of {spec.name} by content hash (seed {data.seed}; validation_fraction "
            f"{f:g}{f' -> {moved:.6f}' if held != want else ''}), never trained on", held)


def named_split_note(data, i: int, spec: SourceSpec, share: int | None) -> tuple[str, int]:
    """A named held-out split's description and the rows evaluated; RecipeError when it has none."""
    where = f"{_where(data, i)}.validation_split"
    try:
        split = named_split(spec, share, data.seed)
    except (OSError, ValueError) as e:      # a hub or store split that cannot be listed or read
        raise RecipeError(f"{where}: {spec.validation_split!r} of {spec.source} cannot be read "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})") from None
    if not split.rows:
        raise RecipeError(f"{where}: {spec.validation_split!r} of {spec.source} has no rows to evaluate on")
    rows = f"the first {split.rows} rows" if split.more else f"{split.rows} row{'s' * (split.rows != 1)}"
    if not split.usable:            # the run would evaluate skipped rows alone: no block to evaluate on
        raise RecipeError(f"{where}: {spec.validation_split!r} of {spec.source}: {rows}, the rows a run evaluates, "
                          f"hold no conversation to evaluate on (first: {split.first_skip}); fix them"
                          + (" or raise data.validation_max_rows" if split.more else ""))
    return (f"split {spec.validation_split} of {spec.name}, {rows}; training rows with the same content are "
            f"skipped ({IN_HELD_OUT})", split.rows)


def held_out_plan(data, specs: list[SourceSpec]) -> tuple[str, int | None]:
    """Where the held-out rows come from, and how many are evaluated (None: not known before they are read):
    each source that evaluates its share of `data.validation_max_rows`, taken after its carve."""
    sources = evaluating(data, specs)
    cap = data.validation_max_rows
    if cap is not None and cap < len(sources):
        raise RecipeError(f"data.validation_max_rows: {cap} held-out row(s) cannot give each of the {len(sources)} "
                          f"sources that evaluate ({', '.join(s.name for _, s, _ in sources)}) one; set it to at "
                          f"least {len(sources)}")
    parts, count = [], 0
    for i, spec, share in sources:
        text, rows = (named_split_note if spec.validation_split else settle_carve)(data, i, spec, share)
        parts.append(text)
        count = None if count is None or rows is None else count + rows
    return "; ".join(parts) or "none", (count if sources else None)


def check_sources(data, *, head: int = HEAD_ROWS) -> tuple[list[SourceCheck], str, int | None]:
    """Every source's splits and first rows (module docstring); the held-out plan settled."""
    specs = source_specs(data)
    checks = []
    for i, spec in enumerate(specs):
        where = f"data.sources[{i}]" if data.sources else "data"
        _check_splits(spec, where)
        try:
            check_readable(spec, spec.split, where)
            rows = head_rows(spec, spec.split, head, seed=data.seed)
        except OSError as e:
            raise RecipeError(f"{where}.source: {spec.source} cannot be read "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})") from None
        checks.append(check_format(spec, rows, where))
    held, count = held_out_plan(data, specs)
    return checks, held, count


def format_note(check: SourceCheck, spec: SourceSpec) -> str:
    """One line: the format a source is read in, and whether it was picked by its fields."""
    how = "picked by its fields" if spec.schema == "auto" else "data.schema"
    return f"data: {check.name}: format {check.format} ({how}, {check.rows_seen} first rows read)"


# the note of the data.template_kwargs the chat template never reads (data/report.data_params logs it)
TEMPLATE_KWARGS_IGNORED = "template_kwargs ignored: "


def settle_template_kwargs(data, template: str | None) -> str | None:
    """Take the `data.template_kwargs` the chat template never reads out of the recipe, so the settings a run
    logs are those it renders with, and say so in one line (the run logs it as `data.template_kwargs_ignored`);
    None when every one is read, none is given, or the template is not here to read (`chat_template_text`)."""
    from raytune_ft.data.sft import unread_template_kwargs

    unread = unread_template_kwargs(template, data.template_kwargs) if template and data.template_kwargs else None
    if not unread:
        return None
    ignored = ", ".join(f"{k}={data.template_kwargs.pop(k)!r}" for k in unread)
    return (f"data: {TEMPLATE_KWARGS_IGNORED}{ignored} (the chat template never reads them: not passed to it; "
            f"applied: {', '.join(data.template_kwargs) or 'none'})")
