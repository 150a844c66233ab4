"""What a checkpoint of the FSDP2 loop holds, as typed parts that each save and load themselves.

One class per part, each with `state_dict()` (what goes into the checkpoint) and `load_state_dict()`
(take it back), as torchtitan's Stateful parts; `TrainState` is the one place that lists them:

    model, optimizer    DCP shards (train/dcp_io.py): `ModelPart`, `OptimizerPart`
    schedule            the optimizer step and the schedule's length, counted or set
    data                where this rank stands in its data (batch.EpochFeeds' position)
    progress            the run's per-step history, tokens and seconds, the steps it resumed from
    evaluation          held-out losses, the last samples and the base model's completions

The last four share this rank's train_state/rank{R}.json as one flat object, each part owning its keys:
the layout the checkpoints of this version have (the TRL loop's checkpoints, the plots and the run
summary read the same keys), so a checkpoint written before the parts existed loads into them as it is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class JsonPart:
    """A dataclass part whose fields are its keys in the train-state file (None fields are left out)."""

    def state_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this part's keys from `state`; a key it lacks (an older checkpoint) keeps its fresh value."""
        fresh = type(self)()
        for f in dataclasses.fields(self):
            setattr(self, f.name, _plain(state[f.name]) if f.name in state else getattr(fresh, f.name))

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def _plain(value: Any) -> Any:
    """A copy made of JSON's types: a part never shares a list with the file it was saved to or loaded from."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclass
class Schedule(JsonPart):
    """The optimizer step reached and the schedule's length (`total_steps`, 0: none needed); a counted
    length with the digests of the settings it was counted under (schedule_length.run_schedule_steps)."""

    step: int = 0
    total_steps: int | None = None
    counted_steps: int | None = None
    counted_for: dict | None = None


@dataclass
class DataPosition(JsonPart):
    """Where this rank stands in its data: what `batch.EpochFeeds` takes on resume and gives back
    (`position()`): the current pass, the blocks consumed in it and their fingerprint, each pass's counters."""

    epoch: int | None = None
    blocks_consumed: int = 0
    data_fingerprint: int | None = None
    steps_in_epoch: int | None = None
    epoch_steps: list | None = None
    epoch_fingerprints: list | None = None
    epoch_counters: list | None = None
    counters: dict = field(default_factory=dict)


@dataclass
class Progress(JsonPart):
    """The run so far: every optimizer step's loss, LR and gradient norm (all-reduced, the same on every
    rank), tokens and training seconds of every attempt, and the step each restart resumed from."""

    history: list = field(default_factory=list)
    tokens_total: int | None = None
    run_train_seconds: float | None = None
    resumed_from: list | None = None

    def resumed(self, step: int) -> None:
        self.resumed_from = [*(self.resumed_from or []), step]


@dataclass
class EvaluationState(JsonPart):
    """What the loop measured besides training: the held-out losses by step, the last round of samples,
    and the base model's completions (shown beside each later round, a resumed run's too)."""

    eval_history: list | None = None
    samples: list | None = None
    sample_base: list | None = None

    def evaluated_at(self, step: int) -> bool:
        return bool(self.eval_history) and self.eval_history[-1].get("step") == step

    def sampled_at(self, step: int) -> bool:
        return bool(self.samples) and self.samples[0].get("step") == step

    def add_eval(self, step: int, loss: float) -> None:
        self.eval_history = [*(self.eval_history or []), {"step": step, "eval_loss": loss}]


class ModelPart:
    """The model's weights as DCP sees them (sharded DTensors where FSDP2 sharded them). `trainable_only`
    (LoRA): the parameters that train, nothing of the frozen base, which the run rebuilds from its source."""

    def __init__(self, model, trainable_only: bool = False):
        self.model, self.trainable_only = model, trainable_only

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(ignore_frozen_params=self.trainable_only))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.trainable_only:
            missing = sorted(set(self.state_dict()) - set(state))
            if missing:
                raise KeyError(f"checkpoint lacks {len(missing)} trained tensors, e.g. {missing[:3]}")
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=not self.trainable_only))


class OptimizerPart:
    """The optimizer's moments and step counts, keyed by the model's parameter names."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


class TrainState:
    """Every part of the FSDP2 loop's checkpoint. `sharded`: the DCP parts by their key in the shards
    (loaded in this order: the optimizer's names come from the model); `json_parts`: the train-state
    file's parts by name. `trainable_only`: the model part holds only what trains (LoRA's adapters)."""

    def __init__(self, model=None, optimizer=None, *, trainable_only: bool = False):
        self.schedule, self.data = Schedule(), DataPosition()
        self.progress, self.evaluation = Progress(), EvaluationState()
        self.sharded = {} if model is None else {"model": ModelPart(model, trainable_only),
                                                 "optim": OptimizerPart(model, optimizer)}

    @property
    def json_parts(self) -> dict[str, JsonPart]:
        return {"schedule": self.schedule, "data": self.data, "progress": self.progress,
                "evaluation": self.evaluation}

    @property
    def step(self) -> int:
        return self.schedule.step

    def state_dict(self) -> dict[str, Any]:
        """The train-state file's object: every part's keys side by side."""
        out: dict[str, Any] = {}
        for part in self.json_parts.values():
            out |= part.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.json_parts.values():
            part.load_state_dict(state)


def _check_keys_disjoint() -> None:
    seen: dict[str, str] = {}
    for cls in (Schedule, DataPosition, Progress, EvaluationState):
        for k in cls.keys():
            if k in seen:
                raise TypeError(f"train-state key {k!r} is owned by both {seen[k]} and {cls.__name__}")
            seen[k] = cls.__name__


_check_keys_disjoint()
