"""Causal LM cross-entropy without materialising the full logits.

At 32,768 tokens x 248,320 vocab the fp32 logits alone are 30 GiB, more than a training step can spare. `chunked_cross_entropy` walks the tokens in chunks of `chunk_size`: per chunk it computes the
logits, the loss, and, when a backward will follow, the gradients for the hidden states and the lm_head
weight right away (so backward only scales them and no chunk's logits are ever recomputed or kept).
Peak extra memory: one chunk of fp32 logits (4096 x 248,320 x 4 B = 4 GiB) plus an fp32 accumulator
for the lm_head gradient (V x D).

Under FSDP2 the lm_head weight is only gathered while the root module runs its forward, so the loss must
be computed inside that forward: the FSDP2 loop's `PackedCausalLM` wraps the model for that.
"""
from __future__ import annotations

import functools

import torch

IGNORE_INDEX = -100


@functools.lru_cache(maxsize=None)
def _fused_add_product(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch adds a `dtype` matmul into an fp32 tensor on `device` in place (torch < 2.9 has no
    `out_dtype`), checked once on a small product against the two-step sum."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(64, 32, device=device, generator=gen).to(dtype) for _ in range(2))
    acc = torch.ones(32, 32, device=device)
    want = acc + (a.t() @ b).float()
    try:
        torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.allclose(acc, want, rtol=1e-2, atol=1e-1))


def _add_product(acc_VD: torch.Tensor, g_CV: torch.Tensor, h_CD: torch.Tensor) -> None:
    """acc_VD += g_CV.t() @ h_CD, accumulated in fp32. On CUDA one matmul adds into the fp32 accumulator
    (`addmm` with `out_dtype`): no (V, D) product in the compute dtype, 2.4 GiB at the 27B's vocabulary, at the
    forward's end when every layer's checkpoint input is live. Elsewhere (CPU has no such kernel) the product is
    made, then added."""
    if acc_VD.is_cuda and acc_VD.dtype != g_CV.dtype and _fused_add_product(acc_VD.device, g_CV.dtype):
        torch.addmm(acc_VD, g_CV.t(), h_CD, out_dtype=acc_VD.dtype, out=acc_VD)
    else:
        acc_VD.add_(g_CV.t() @ h_CD)


class _ChunkedCE(torch.autograd.Function):
    """Sum of token cross-entropies over rows of (hidden (N, D), weight (V, D), targets (N,))."""

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, chunk_size: int, need_grad: bool):
        n = hidden_ND.shape[0]
        valid_N = targets_N != IGNORE_INDEX
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden_ND.device)
        grad_h = torch.zeros_like(hidden_ND) if need_grad and hidden_ND.requires_grad else None
        grad_w = (torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
                  if need_grad and weight_VD.requires_grad else None)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            h = hidden_ND[s:e]
            tgt = targets_N[s:e]
            ok = valid_N[s:e]
            logits = (h @ weight_VD.t()).float()                  # (c, V) fp32, one chunk only
            lse = torch.logsumexp(logits, dim=-1)
            safe_tgt = tgt.clamp(min=0)
            picked = logits.gather(1, safe_tgt[:, None]).squeeze(1)
            loss_sum += ((lse - picked) * ok).sum()
            if grad_h is None and grad_w is None:
                continue
            # d(lse - logit_t)/dlogits = softmax - onehot(t), zero on unsupervised rows; reuse `logits`.
            grad_logits = logits.sub_(lse[:, None]).exp_()
            grad_logits[torch.arange(e - s, device=h.device), safe_tgt] -= 1.0
            grad_logits.mul_(ok[:, None].to(grad_logits.dtype))
            g = grad_logits.to(h.dtype)
            if grad_h is not None:
                grad_h[s:e] = g @ weight_VD
            if grad_w is not None:
                _add_product(grad_w, g, h)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight_VD.dtype
        n_tokens = valid_N.sum()
        ctx.mark_non_differentiable(n_tokens)
        return loss_sum, n_tokens

    @staticmethod
    def backward(ctx, grad_loss, _grad_count):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is None and grad_w is None and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            raise RuntimeError("chunked_cross_entropy: backward through a loss computed without gradients "
                               "(it ran under no_grad or inference_mode)")
        # scaled in place (autograd refuses a second backward through them: their version moved on)
        gh = grad_h.mul_(grad_loss.to(grad_h.dtype)) if grad_h is not None else None
        # in place: a second fp32 (V, D) tensor would be 4.7 GiB at the 27B's vocabulary, at the backward's start
        gw = grad_w.mul_(grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None


def chunked_cross_entropy(hidden_BTD: torch.Tensor, lm_head_weight: torch.Tensor, labels_BT: torch.Tensor,
                          *, chunk_size: int = 4096, reduction: str = "sum", shift: bool = True
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted causal-LM cross-entropy from final hidden states, in chunks of tokens.

    hidden_BTD: the decoder's normed output (B, T, D); lm_head_weight: (V, D); labels_BT: (B, T) with
    -100 where no loss is taken. Position t predicts labels[t + 1] within each row (shift=False: labels
    are already aligned with hidden). Returns (loss_sum fp32, n_tokens): the sum of per-token losses (or
    their mean with reduction="mean") and the number of supervised tokens after shifting."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: {reduction!r} is not 'sum' or 'mean'")
    if shift:
        hidden_BTD, labels_BT = hidden_BTD[:, :-1], labels_BT[:, 1:]
    d = hidden_BTD.shape[-1]
    hidden_ND = hidden_BTD.reshape(-1, d)
    targets_N = labels_BT.reshape(-1).to(hidden_ND.device)
    need_grad = torch.is_grad_enabled() and (hidden_ND.requires_grad or lm_head_weight.requires_grad)
    loss_sum, n_tokens = _ChunkedCE.apply(hidden_ND, lm_head_weight, targets_N, int(chunk_size), need_grad)
    if reduction == "mean":
        return loss_sum / n_tokens.clamp(min=1), n_tokens
    return loss_sum, n_tokens
