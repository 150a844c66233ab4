"""What the LoRA and export-layout tests share: the loop's model built in-process on a one-rank gloo group,
trained a few steps on packed blocks exactly as `fsdp_loop` trains it, and its logits."""
from __future__ import annotations

import torch

from raytune_ft.recipe.recipe import Recipe, validate
from tests.train.test_train_state import one_rank_group  # noqa: F401 - the one-rank gloo group these tests run in


def recipe(storage, *, name: str | None = None, **train) -> Recipe:
    """The FSDP2 loop's recipe on the tiny qwen3_5 model (or the base folder `name`), CPU, float32."""
    r = Recipe(job="lora_test")
    if name is None:
        r.model.local_tiny = True
    else:
        r.model.name = name
    r.model.family = "qwen3_5"
    r.model.dtype = "float32"
    r.model.max_position_embeddings = 4096
    r.data.source = "builtin:chat:200"
    r.data.seq_len = 256
    r.train.lr = 5e-3
    r.train.activation_checkpointing = "none"
    r.train.kernels = "off"
    for k, v in train.items():
        setattr(r.train, k, v)
    r.scaling.num_workers, r.scaling.use_gpu, r.scaling.backend = 1, False, "gloo"
    r.tracking.storage_path = str(storage)
    r.registry.enabled = False
    return validate(r)


def build(r: Recipe):
    """(model, lm, tokenizer, optimizer) as `train_fsdp` builds them."""
    from raytune_ft.train.common import WorkerLog
    from raytune_ft.train.fsdp_model import build_fsdp_model

    model, lm, tok = build_fsdp_model(r, torch.device("cpu"), WorkerLog(0, r))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=r.train.lr, betas=tuple(r.train.betas), weight_decay=r.train.weight_decay)
    return model, lm, tok, opt


def blocks(n: int, seq_len: int = 256) -> list[dict]:
    """`n` packed blocks of the built-in chat data (several conversations each)."""
    from raytune_ft.data.builtin import builtin_chat
    from raytune_ft.data.packing import pack_blocks
    from raytune_ft.data.sft import render_sft
    from raytune_ft.models.tiny import local_tokenizer

    tok = local_tokenizer()
    examples = [render_sft(tok, row["messages"]) for row in builtin_chat(120, seed=3)]
    out = list(pack_blocks(examples, seq_len, window=64))[:n]
    assert len(out) == n and all(len(b["cu_seqlens"]) > 2 for b in out)   # packed: several conversations
    return out


def train_step(model, opt, block: dict) -> float:
    """One optimizer step of the loop on one block; the step's mean token loss."""
    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.fsdp_loop import forward_backward

    mb = StepBatch.from_blocks([block], torch.device("cpu"))
    loss_sum, denom = forward_backward(model, [mb], 1, torch.device("cpu"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss_sum / denom)


def ids(n: int = 40) -> torch.Tensor:
    """One conversation's first `n` token ids, (1, n)."""
    from raytune_ft.data.builtin import builtin_chat
    from raytune_ft.data.sft import render_sft
    from raytune_ft.models.tiny import local_tokenizer

    tokens, _ = render_sft(local_tokenizer(), builtin_chat(4, seed=5)[0]["messages"])
    return torch.tensor([tokens[:n]])


def loop_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The loop's model's fp32 logits at every position of one unpacked sequence, (n, vocab)."""
    from raytune_ft.models.gated_delta import packed_forward_kwargs

    n = input_ids.shape[1]
    kwargs = packed_forward_kwargs({"input_ids": input_ids[0], "position_ids": torch.arange(n),
                                    "cu_seqlens": torch.tensor([0, n], dtype=torch.int32)}, device="cpu")
    with torch.no_grad():
        return model(None, logits_at=torch.arange(n), **kwargs)
