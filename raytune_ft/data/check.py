"""`raytune-ft data check JOB [--set ...]`: what a job's data would train on, read in this process (no Ray, no
GPU): per source its rows, format, skipped rows by reason, token lengths after the chat template, the
assistant-token share, conversations longer than `data.seq_len` and what `data.overlong` does with them, the
blocks, their packing efficiency and padding share, and the held-out set; a length histogram PNG.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import numpy as np

from raytune_ft.data.held_out import held_out_keys, split_plan
from raytune_ft.data.packing import DataCounters, pack_blocks
from raytune_ft.data.precheck import check_sources
from raytune_ft.data.reading import iter_raw_rows
from raytune_ft.data.rows import _unwrap, render_or_reason
from raytune_ft.data.specs import SourceSpec, source_specs
from raytune_ft.recipe.values import RecipeError

DEFAULT_ROWS = 5000


@dataclass
class SourceReport:
    """What one source's rows came to."""
    name: str
    format: str
    weight: float | None = None             # a mixture's: how often each row is used
    rows: int = 0
    held_out: int = 0
    formats: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    supervised: int = 0
    counters: DataCounters = field(default_factory=DataCounters)

    def lines(self, data, limit: int) -> list[str]:
        """The report's text, one fact a line."""
        lengths = np.asarray(self.lengths or [0])
        tokens = int(lengths.sum())
        c = self.counters
        total = c.real_tokens + c.padding_tokens
        over = int((lengths > data.seq_len).sum())
        policy = (f"split into {data.seq_len}-token pieces, each trained without the text before it"
                  if data.overlong == "split" else "dropped (counted as skipped: overlong)")
        skipped = sum(self.skipped.values())
        out = [f"source {self.name}" + (f" (weight {self.weight:g})" if self.weight is not None else ""),
               f"  rows             {self.rows}{' (the first ' + str(limit) + ')' if self.rows >= limit else ''}; "
               f"{self.held_out} held out, {self.rows - self.held_out - skipped} to train on",
               f"  format           {self.format} ({', '.join(f'{k}: {v}' for k, v in self.formats.items())})",
               f"  skipped          {skipped}" + (f" {dict(sorted(self.skipped.items()))}" if skipped else ""),
               "  tokens           " + ", ".join(f"p{q} {int(np.percentile(lengths, q)):,}" for q in (50, 90, 99))
               + f", max {int(lengths.max()):,} per conversation (after the chat template); {tokens:,} in all",
               f"  assistant share  {self.supervised / max(tokens, 1):.1%} of the tokens carry the loss",
               f"  over seq_len     {over} conversations longer than {data.seq_len} tokens: {policy}",
               f"  blocks           {c.blocks} of {data.seq_len} tokens; packing efficiency "
               f"{c.real_tokens / max(total, 1):.1%}, padding {c.padding_tokens / max(total, 1):.1%}"]
        return out


def _report(spec: SourceSpec, fmt: str, data, tokenizer, limit: int, keys: frozenset) -> SourceReport:
    from raytune_ft.data.pipeline import adapter_of

    adapter, rep = adapter_of(spec), SourceReport(spec.name, fmt, spec.weight if data.sources else None)
    kwargs = dict(data.template_kwargs)
    # the rows training leaves to the held-out set, and those with a held-out row's content (`keys`)
    carve = dataclasses.replace(split_plan(spec, data, "train")[1], held_out=keys)
    examples = []
    for raw in iter_raw_rows(spec, spec.split, seed=data.seed):
        if rep.rows >= limit:
            break
        rep.rows += 1
        row = _unwrap(raw)
        messages, reason = adapter(row)
        place = carve.place(messages, row)
        if place is None:
            rep.held_out += 1
            continue
        if place:
            messages, reason = None, place
        ids, mask, reason = render_or_reason(tokenizer, messages, reason, kwargs)
        if reason:
            rep.skipped[reason] = rep.skipped.get(reason, 0) + 1
            continue
        kind = adapter.detect(row if isinstance(row, dict) else json.loads(row)) if spec.schema == "auto" \
            else spec.schema
        rep.formats[kind] = rep.formats.get(kind, 0) + 1
        rep.lengths.append(len(ids))
        rep.supervised += int(sum(mask))
        examples.append((ids, mask))
    for _ in pack_blocks(examples, data.seq_len, window=data.pack_window, overlong=data.overlong,
                         counters=rep.counters):
        pass
    for reason, n in rep.counters.rows_skipped_by_reason.items():      # overlong rows dropped while packing
        rep.skipped[reason] = rep.skipped.get(reason, 0) + n
    return rep


def histogram(reports: list[SourceReport], seq_len: int, path: str, title: str) -> str:
    """A PNG of the conversations' token lengths per source, with seq_len marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    top = max([seq_len, *[max(r.lengths or [0]) for r in reports]])
    bins = np.linspace(0, top, 60)
    for r in reports:
        ax.hist(r.lengths, bins=bins, alpha=0.6, label=f"{r.name} ({len(r.lengths)} conversations)")
    ax.axvline(seq_len, color="black", linestyle="--", label=f"data.seq_len = {seq_len}")
    ax.set_xlabel("tokens per conversation (after the chat template)")
    ax.set_ylabel("conversations")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def data_check(recipe, *, limit: int = DEFAULT_ROWS, png: str | None = None) -> tuple[list[str], bool]:
    """The check's lines, and whether the data passes (its skipped share within data.max_skip_fraction)."""
    from raytune_ft.models.tokenizer import tokenizer_for

    data = recipe.data
    checks, held, _ = check_sources(data)
    try:
        tokenizer = tokenizer_for(recipe.model)
    except Exception as e:  # noqa: BLE001 - offline, a wrong name: said in one line
        raise RecipeError(f"model.tokenizer: the tokenizer of {recipe.model.tokenizer or recipe.model.name} cannot "
                          f"be loaded here ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                          "--set model.tokenizer=PATH names a local one, --local uses the tiny model's") from None
    keys = held_out_keys(data)
    reports = [_report(spec, c.format, data, tokenizer, limit, keys) for spec, c in zip(source_specs(data), checks)]
    lines = [line for r in reports for line in r.lines(data, limit)]
    lines.append(f"held-out set       {held if data.validation_fraction or data.validation_split or data.sources else 'none'}")
    rows = sum(r.rows - r.held_out for r in reports)
    skipped = {k: sum(r.skipped.get(k, 0) for r in reports) for r in reports for k in r.skipped}
    from raytune_ft.data.rows import too_many_skipped

    why = too_many_skipped(skipped, rows, data.max_skip_fraction)
    if why:
        lines.append(f"STOP               a run would stop: {why}")
    path = histogram(reports, data.seq_len, png or f"data_check_{recipe.job}.png",
                     f"{recipe.job}: token lengths by source")
    lines.append(f"histogram          {path}")
    return lines, not why


def add_parser(sub, job_help: str) -> None:
    """The `raytune-ft data check` subcommand's arguments."""
    p = sub.add_parser("data", help="check a job's data before any GPU is spent (raytune-ft data check JOB)",
                       description="Read a job's data sources here (no Ray, no GPU) and say per source: rows, "
                                   "format, skipped rows by reason, token lengths after the chat template, the "
                                   "assistant-token share, conversations over data.seq_len, blocks, packing "
                                   "efficiency and padding, and the held-out set; write a length histogram PNG.")
    p.add_argument("action", choices=["check"])
    p.add_argument("job", help=job_help)
    p.add_argument("--local", action="store_true", help="check the --local variant (its tiny model's tokenizer)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a recipe field (repeatable), e.g. --set data.source=my.jsonl")
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS, help=f"rows read per source (default {DEFAULT_ROWS})")
    p.add_argument("--png", default=None, help="where the histogram goes (default ./data_check_<job>.png)")


def main(args, recipe_of) -> int:
    """Run the check for the parsed `args`; `recipe_of()` resolves the job's recipe. Exit codes: 0 the data
    passes, 1 a run would stop for its skipped rows, 2 a bad recipe or source."""
    import sys

    from raytune_ft.env import redact

    try:
        lines, ok = data_check(recipe_of(), limit=args.rows, png=args.png)
    except RecipeError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    return 0 if ok else 1
