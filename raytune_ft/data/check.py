"""`raytune-ft data check JOB [--set ...]`: what a job's data would train on, read in this process (no Ray, no
GPU): per source its rows (read, held out, skipped by reason with the first skipped rows, to train on), format,
token lengths after the chat template, the assistant-token share, conversations longer than `data.seq_len` and
what `data.overlong` does with them, the conversations, pieces, tokens and blocks trained; for the pass, its
blocks, steps, packing efficiency and padding on the run's ranks; the held-out set; a length histogram PNG.

The counts come from `local_pass`: the run's own row functions, packing and counting over the same ranks'
shares, so they are the run's for the same recipe and world size (of the first `--rows` rows of each source).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from raytune_ft.data.local_pass import SourceRows, local_pass, pass_steps, stream_bundles
from raytune_ft.data.packing import DataCounters
from raytune_ft.data.precheck import check_sources
from raytune_ft.data.rows import skipped_lines, too_many_skipped
from raytune_ft.data.specs import source_specs
from raytune_ft.recipe.values import RecipeError

DEFAULT_ROWS = 5000


@dataclass
class SourceReport:
    """What one source's rows came to: its counts in the pass (DataCounters.by_source) and its rows' shape."""
    name: str
    format: str
    weight: float | None = None             # a mixture's: how often each row is used
    counts: dict = field(default_factory=dict)
    rows: SourceRows = field(default_factory=SourceRows)
    skipped_rows: list[dict] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        return self.rows.lengths

    def lines(self, data, limit: int) -> list[str]:
        """The report's text, one fact a line."""
        c, lengths = self.counts, np.asarray(self.rows.lengths or [0])
        skipped = c.get("rows_skipped_by_reason") or {}
        over = int((lengths > data.seq_len).sum())
        policy = (f"split into {data.seq_len}-token pieces, each trained without the text before it"
                  if data.overlong == "split" else "dropped (counted as skipped: overlong)")
        formats = ", ".join(f"{k}: {v}" for k, v in self.rows.formats.items())
        out = [f"source {self.name}" + (f" (weight {self.weight:g})" if self.weight is not None else ""),
               f"  rows             {c.get('rows_read', 0)}{f' (the first {limit})' if self.rows.limited else ''}: "
               f"{c.get('trained', 0)} to train on, {c.get('held_out', 0)} held out, {sum(skipped.values())} skipped",
               f"  format           {self.format} ({formats})",
               f"  skipped          {sum(skipped.values())}" + (f" {dict(sorted(skipped.items()))}" if skipped else "")]
        if self.skipped_rows:
            out += ["    first skipped rows:", *skipped_lines(self.skipped_rows, indent="      ")]
        out += ["  tokens           " + ", ".join(f"p{q} {int(np.percentile(lengths, q)):,}" for q in (50, 90, 99))
                + f", max {int(lengths.max()):,} per conversation (after the chat template); "
                f"{c.get('tokens', 0):,} trained",
                f"  assistant share  {self.rows.supervised / max(int(lengths.sum()), 1):.1%} of the tokens carry "
                "the loss",
                f"  over seq_len     {over} conversations longer than {data.seq_len} tokens: {policy}",
                f"  trained          {c.get('conversations', 0)} conversations, {c.get('pieces', 0)} pieces packed, "
                f"in {c.get('blocks', 0)} blocks"]
        if over:
            out.insert(-1, overlong_line(self.rows, over, data.overlong))
        return out


def overlong_line(rows: SourceRows, over: int, chosen: str) -> str:
    """What each data.overlong choice trains and drops of the conversations longer than a block: split trains
    their pieces that hold an assistant token (packing.overlong_pieces), drop none of them."""
    def this(choice: str) -> str:
        return f"{choice} (this run)" if choice == chosen else choice

    return (f"  overlong         {this('split')} trains {rows.pieces_trained} of their {rows.pieces} pieces and drops "
            f"{rows.pieces - rows.pieces_trained} with no assistant token; {this('drop')} trains none of them, "
            f"skipping the {over} rows")


def pass_line(c: DataCounters, data, world: int, per_step: int) -> str:
    """The whole pass on the run's ranks: blocks, steps, packing efficiency and padding."""
    total = c.real_tokens + c.padding_tokens
    return (f"pass               {c.blocks} blocks of {data.seq_len} tokens ({c.equalisation_padding_blocks} of them "
            f"all-padding, evening out {world} rank(s) x {per_step} block(s) a step): "
            f"{pass_steps(c.blocks, world, per_step)} steps; packing efficiency {c.real_tokens / max(total, 1):.1%}, "
            f"padding {c.padding_tokens / max(total, 1):.1%}")


def template_line(data, template: str | None) -> str | None:
    """What the chat template does with data.template_kwargs: those it reads are applied; those it never reads
    are taken out, as a run takes them out (precheck.settle_template_kwargs). None when none is given."""
    from raytune_ft.data.precheck import settle_template_kwargs

    given = dict(data.template_kwargs)
    if not given:
        return None
    settle_template_kwargs(data, template)
    applied = ", ".join(f"{k}={v!r}" for k, v in data.template_kwargs.items()) or "none"
    ignored = ", ".join(f"{k}={v!r}" for k, v in given.items() if k not in data.template_kwargs)
    return f"template kwargs    applied: {applied}" + (
        f"; ignored, the chat template never reads them: {ignored}" if ignored else "")


def data_pass(recipe, tokenizer, limit: int | None) -> tuple[DataCounters, dict[str, SourceRows]]:
    """The counters of the run's first pass over (the first `limit` rows of each of) its sources, for its
    world size, and each source's rows."""
    bundles, seen = stream_bundles(recipe.data, tokenizer, limit=limit)
    return local_pass(bundles, recipe.data, world=recipe.scaling.num_workers,
                      per_step=recipe.train.grad_accum * recipe.train.micro_batch_size), seen


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
    template = template_line(data, tokenizer.chat_template)      # before the pass: it renders as a run would
    c, seen = data_pass(recipe, tokenizer, limit)
    reports = [SourceReport(spec.name, check.format, spec.weight if data.sources else None,
                            c.by_source.get(spec.name, {}), seen[spec.name],
                            [r for r in c.skipped_rows if r["source"] == spec.name])
               for spec, check in zip(source_specs(data), checks)]
    lines = [line for r in reports for line in r.lines(data, limit)]
    lines.append(pass_line(c, data, recipe.scaling.num_workers,
                           recipe.train.grad_accum * recipe.train.micro_batch_size))
    carved = data.validation_fraction or data.validation_split or data.sources
    lines.append(f"held-out set       {held if carved else 'none'}")
    if template:
        lines.append(template)
    why = too_many_skipped(c.rows_skipped_by_reason, c.rows_read - c.rows_held_out, data.max_skip_fraction,
                           c.skipped_rows)
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
