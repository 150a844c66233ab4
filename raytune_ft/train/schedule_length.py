"""How many optimizer steps a run's learning-rate schedule spans, used by both loops: `train.max_steps` when
set, else counted from the packed blocks as the loops' `StepFeed` will run them (one extra pass over the data
per epoch, no training), kept in the checkpoint with the settings it was counted under and counted again
when one of them changed; and the line a run says when it ends short of that length.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Iterable

import torch

from raytune_ft.data.packing import DataCounters
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.train.lending import steps_for


def count_steps(blocks: Iterable[dict], per_step: int, *, flag_device: torch.device | None = None,
                group: Any = None) -> int:
    """Optimizer steps a `StepFeed` will run over `blocks` (one pass of this rank's share): every rank's
    blocks over `world x per_step` (ranks lend blocks: `lending`). A collective; reading `blocks` costs a
    full pass (tokenize + pack, no training)."""
    return steps_for(sum(1 for _ in blocks), per_step, flag_device, group)


def count_run_steps(open_blocks: Callable[[int, DataCounters], Iterable[dict]], per_step: int, epochs: int, *,
                    flag_device: torch.device | None = None, group: Any = None) -> int:
    """Optimizer steps of `epochs` passes, each from the start (`count_steps` per pass: a collective and
    a full pass over the data each, tokenize + pack, no training). Both loops count their schedule so."""
    return sum(count_steps(open_blocks(e, DataCounters()), per_step, flag_device=flag_device, group=group)
               for e in range(epochs))


def short_of_steps(step: int, total: int, counters: DataCounters) -> str:
    """The log's line when a run ends at `step`, before the `total` steps its schedule was set for."""
    why = "every rank's data is spent"
    if counters.blocks_unsupervised:
        why += (f"; steps whose blocks held no supervised token on any rank were read past, not trained "
                f"({counters.blocks_unsupervised} of this rank's blocks), and a counted schedule counts them")
    return f"the run ends at step {step}, short of the {total} steps its schedule was set for: {why}"


# What a counted schedule length depends on besides the data's own settings (all of data.* but the
# CPU share of its operators): a resumed attempt counts again when one of them changed.
_COUNT_SETTINGS = ("train.epochs", "train.micro_batch_size", "train.grad_accum", "scaling.num_workers")


def schedule_settings(recipe: Recipe) -> dict[str, str]:
    """{setting: digest of its value} of every setting the counted schedule length depends on (digests:
    the data source may be a path or URI that has no place in a checkpoint)."""
    import dataclasses
    import json

    names = list(_COUNT_SETTINGS) + [f"data.{f.name}" for f in dataclasses.fields(recipe.data)
                                      if f.name != "num_cpus_per_op"]
    values = {name: _setting(recipe, name) for name in names}
    return {k: f"{zlib.crc32(json.dumps(v, sort_keys=True, default=str).encode()):08x}" for k, v in values.items()}


def needs_counting_pass(recipe: Recipe, state: dict) -> bool:
    """Whether the run's schedule length takes a counting pass over the data (`run_schedule_steps`): no
    `train.max_steps`, a schedule that must know its end, and no count in the checkpoint made under
    today's settings."""
    t = recipe.train
    if t.max_steps or t.schedule == "constant":
        return False
    return not _current_count(state, schedule_settings(recipe))


def _current_count(state: dict, settings: dict[str, str]) -> int:
    """The checkpoint's counted schedule length when it was counted under `settings`, else 0."""
    saved = int(state.get("counted_steps") or 0)
    return saved if saved and (state.get("counted_for") or {}) == settings else 0


def run_schedule_steps(recipe: Recipe, state: dict, count: Callable[[], int], log: Callable[[str], None]) -> int:
    """The counted schedule length of the run (both loops): the checkpoint's count (`state`'s
    `counted_steps`) when it was counted under today's settings (`counted_for`), else `count()` (a full
    pass per epoch), saying which setting changed. A re-submit with more epochs or other data runs the
    length it asks for; the LR schedule stretches (or shrinks) from the resumed step on."""
    settings = schedule_settings(recipe)
    if current := _current_count(state, settings):
        return current
    saved, saved_for = int(state.get("counted_steps") or 0), state.get("counted_for") or {}
    total = count()
    if saved:
        changed = [k for k in settings if saved_for.get(k) != settings[k]]
        now = ", ".join(f"{k}={_setting(recipe, k)!r}" for k in changed if k.startswith(("train.", "scaling.")))
        why = (f"{', '.join(changed)} changed since the checkpoint" + (f" (now {now})" if now else "")
               if saved_for else "the checkpoint does not say which settings it was counted for")
        log(f"schedule length: recounted {total} optimizer steps (the checkpoint's count was {saved}): {why}; "
            "the learning-rate schedule follows the new length from the resumed step on")
    else:
        log(f"schedule length: counted {total} optimizer steps for {recipe.train.epochs} epoch(s) (one extra "
            "pass over the data per epoch; set train.max_steps to skip it)")
    return total


def _setting(recipe: Recipe, name: str) -> Any:
    section, field_name = name.split(".", 1)
    return getattr(getattr(recipe, section), field_name)
