"""A Hugging Face CausalLM whose forward computes the loss with `chunked_cross_entropy`: a test's way to
check the chunked loss inside a model's forward against the full logits."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from raytune_ft.models.loss import chunked_cross_entropy


@dataclass
class ChunkedLossOutput(CausalLMOutputWithPast):
    """`loss` is the mean over supervised tokens; `loss_sum` and `n_tokens` let a loop normalise by the
    global token count across micro-batches and ranks."""
    loss_sum: torch.Tensor | None = None
    n_tokens: torch.Tensor | None = None


def _chunked_loss_forward(self, input_ids=None, labels=None, **kwargs):
    if labels is None:
        return self._raytune_forward_with_logits(input_ids=input_ids, **kwargs)
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("num_items_in_batch", None)
    out = self.model(input_ids=input_ids, **kwargs)
    loss_sum, n_tokens = chunked_cross_entropy(out.last_hidden_state, self.lm_head.weight, labels,
                                               chunk_size=self._raytune_loss_chunk)
    return ChunkedLossOutput(loss=loss_sum / n_tokens.clamp(min=1), loss_sum=loss_sum, n_tokens=n_tokens)


@functools.lru_cache(maxsize=None)
def _chunked_loss_class(cls: type) -> type:
    return type(f"ChunkedLoss{cls.__name__}", (cls,), {
        "forward": _chunked_loss_forward,
        "_raytune_forward_with_logits": cls.forward,
        "_raytune_chunked_loss": True,
    })


def enable_chunked_loss(model: torch.nn.Module, chunk_size: int = 4096) -> torch.nn.Module:
    """Make `model(..., labels=labels)` compute the shifted loss in chunks inside the model's forward
    (safe under FSDP2) and return ChunkedLossOutput(loss, loss_sum, n_tokens) with no logits.
    Without labels the model behaves as before. Idempotent; call before FSDP wrapping."""
    if not getattr(model, "_raytune_chunked_loss", False):
        model.__class__ = _chunked_loss_class(type(model))
    model._raytune_loss_chunk = int(chunk_size)
    return model
