"""The activation checkpointing a recipe asks for (`train.activation_checkpointing`, the FSDP2 loop): what the
backward recomputes instead of keeping. One grammar, read by the recipe check, the memory plan and the model build:

  auto          the memory plan picks the least recompute that fits the GPU (planning/checkpointing.py)
  none          nothing recomputed: every layer keeps what its backward needs
  full          every decoder layer recomputed whole (each keeps its input only)
  selective     every other decoder layer recomputed whole (the same as every:2)
  every:N       decoder layers 0, N, 2N, ... recomputed whole, the others keep everything
  keep:K        every decoder layer recomputed whole but the first K, which keep everything: the finest step
                between full and none (what a GPU with room for a few layers' activations takes)
  KIND[+KIND]   one part of every layer recomputed: `attention` (the full-attention layers' attention),
                `gated_delta` (the gated-delta-net layers' mixer, Qwen3.5), `mlp` (every layer's MLP);
                e.g. gated_delta+mlp
"""
from __future__ import annotations

from dataclasses import dataclass

from raytune_ft.recipe.values import RecipeError

AUTO = "auto"
# the parts a per-kind choice recomputes, in the order a label names them
KINDS = ("attention", "gated_delta", "mlp")
FIELD = "train.activation_checkpointing"
ALLOWED = (f"auto, none, full, selective, every:N (N >= 1), keep:K (K >= 1), or parts joined by '+' from "
           f"{', '.join(KINDS)}")


@dataclass(frozen=True)
class Checkpointing:
    """A concrete choice: whole decoder layers (`every`: layer i when i % every == 0, from layer `keep` on; 0:
    none), or parts of every layer (`kinds`); never both."""

    every: int = 0
    kinds: frozenset[str] = frozenset()
    keep: int = 0            # the first `keep` decoder layers keep everything (keep:K)

    @property
    def label(self) -> str:
        if self.kinds:
            return "+".join(k for k in KINDS if k in self.kinds)
        if self.keep:
            return f"keep:{self.keep}"
        return {0: "none", 1: "full"}.get(self.every, f"every:{self.every}")

    def whole(self, layer_index: int) -> bool:
        """Whether decoder layer `layer_index` is recomputed whole."""
        return self.every > 0 and layer_index >= self.keep and layer_index % self.every == 0


NONE = Checkpointing()
FULL = Checkpointing(every=1)


def parse_checkpointing(text: str, field: str = FIELD) -> Checkpointing | None:
    """The choice `text` names; None for `auto`. A RecipeError naming `field` for anything else."""
    t = str(text).strip().lower()
    if t == AUTO:
        return None
    if t in ("none", "full", "selective"):
        return {"none": NONE, "full": FULL, "selective": Checkpointing(every=2)}[t]
    if t.startswith("keep:"):
        k = t.removeprefix("keep:")
        if not k.isdigit() or int(k) < 1:
            raise RecipeError(f"{field}: {text!r}: keep:K needs a whole number K >= 1 (allowed: {ALLOWED})")
        return Checkpointing(every=1, keep=int(k))
    if t.startswith("every:"):
        n = t.removeprefix("every:")
        if not n.isdigit() or int(n) < 1:
            raise RecipeError(f"{field}: {text!r}: every:N needs a whole number N >= 1 (allowed: {ALLOWED})")
        return Checkpointing(every=int(n))
    parts = [p.strip() for p in t.split("+")]
    unknown = [p for p in parts if p not in KINDS]
    if unknown or not parts:
        raise RecipeError(f"{field}: {text!r} is not a choice (allowed: {ALLOWED})")
    return Checkpointing(kinds=frozenset(parts))


def check_checkpointing(text: str, family: str) -> None:
    """The recipe check: a choice the grammar knows, and a gated-delta-net part only on a model that has one."""
    choice = parse_checkpointing(text)
    if choice is not None and "gated_delta" in choice.kinds and family != "qwen3_5":
        raise RecipeError(f"{FIELD}: {text!r} recomputes gated-delta-net layers, which a {family} model does not "
                          "have (model.family qwen3_5 has them)")
