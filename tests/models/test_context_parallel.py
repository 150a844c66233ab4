"""Context parallelism is exact (issue 59): a packed block split over 2 or 4 gloo ranks gives the loss and the
gradients of one rank holding the whole block, and nothing crosses a conversation boundary.

fp32 on CPU, the tiny Qwen3.5 hybrid (three gated-delta-net layers, one full-attention layer). Its decays are
set mild (a token keeps most of the state) so the state handed between ranks matters: at transformers' random
init the state decays to nothing within a token and a lost state would go unseen.

The mixed block (256 tokens) puts conversations where the layout can go wrong, for chunks of 32 (CP 4) and
64 (CP 2): one starts exactly at a chunk boundary (64), one a token after one (97, 129), one crosses several
ranks (130-230), conversations of one and two tokens (shorter than the conv's three preceding tokens), and
padding at the end. The whole block is one conversation of 256 tokens.
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

from raytune_ft.data.packing import IGNORE_INDEX, block_from_segments
from raytune_ft.models import context_parallel as cp
from raytune_ft.models.context_parallel import full_attention

T = 256
MIXED = [5, 27, 32, 1, 2, 30, 32, 1, 100, 20]          # starts 0 5 32 64 65 67 97 129 130 230; padding 250-256
PERTURBED = [(32, 64), (67, 97)]                        # end at a chunk boundary / cross one, then a conversation
RTOL = 1e-4


def _block(lens: list[int], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return block_from_segments([(rng.integers(0, 250, n), rng.random(n) < 0.7) for n in lens], T)


BLOCKS = {"mixed": _block(MIXED), "whole": _block([T])}


def _tiny_hybrid():
    import transformers

    from raytune_ft.models.gated_delta import enable_packing
    from raytune_ft.models.tiny import tiny_config

    torch.manual_seed(0)
    model = enable_packing(transformers.Qwen3_5ForCausalLM(tiny_config("qwen3_5", 256)))
    with torch.no_grad():              # decays of 0.8-0.98 a token (module docstring)
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.A_log.copy_(torch.empty_like(m.A_log).uniform_(0.02, 0.2).log())
                m.dt_bias.zero_()
    return model


@functools.lru_cache(maxsize=None)
def _one_rank(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    return _whole_block(_tiny_hybrid(), BLOCKS[name])


def _whole_block(model, block) -> tuple[float, dict[str, torch.Tensor]]:
    """The mean token loss and the gradients of one rank holding the whole block (the packed path)."""
    from raytune_ft.models.gated_delta import packed_forward_kwargs
    from raytune_ft.models.loss import chunked_cross_entropy

    model.zero_grad()
    hidden = model.model(**packed_forward_kwargs(block)).last_hidden_state
    loss_sum, n = chunked_cross_entropy(hidden, model.lm_head.weight, torch.as_tensor(block["labels"])[None])
    (loss_sum / n).backward()
    return float(loss_sum.detach() / n), {k: p.grad.clone() for k, p in model.named_parameters()}


def _shard_loss(model, block, shard: cp.CPShard) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's loss sum, its supervised tokens) of its share of `block`, in the model's graph."""
    from raytune_ft.models.loss import chunked_cross_entropy

    local = cp.shard_block(block, shard)
    hidden = model.model(**cp.cp_forward_kwargs(local, shard)).last_hidden_state
    return chunked_cross_entropy(hidden, model.lm_head.weight, local["targets"][None], shift=False)


def _assert_grads_close(got: dict, want: dict) -> None:
    for name, g in want.items():
        err = float((got[name] - g).norm() / g.norm())
        assert err <= RTOL, f"{name}: gradient off by {err:.2e} (relative)"


# ----------------------------------------------------------------- the layout

@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_zigzag_layout_covers_the_block_once_and_balances_causal_work(size):
    held = [cp.make_shard([0, T], T, size, r, group=object() if size > 1 else None).index for r in range(size)]
    assert sorted(torch.cat(held).tolist()) == list(range(T))
    n = T // (2 * size)
    assert held[size - 1][:n].tolist() == list(range((size - 1) * n, size * n))     # chunk C-1, then chunk C
    assert held[0][n:].tolist() == list(range(T - n, T))                           # rank 0 also holds the last
    causal_work = {int((idx + 1).sum()) for idx in held}          # keys each rank's queries see
    assert len(causal_work) == 1


def test_a_shard_takes_its_tokens_positions_and_the_labels_they_predict():
    block = BLOCKS["mixed"]
    shard = cp.make_shard(block["cu_seqlens"], T, 4, 2, group=object())
    local = cp.shard_block(block, shard)
    idx = shard.index.numpy()
    assert idx[:2].tolist() == [64, 65] and idx[32:34].tolist() == [160, 161]
    assert local["input_ids"].tolist() == block["input_ids"][idx].tolist()
    assert local["position_ids"].tolist() == block["position_ids"][idx].tolist()   # rotary: global positions
    # the loss is taken unshifted: a token's target is the next token's label, across chunk and rank ends
    following = np.r_[block["labels"][1:], IGNORE_INDEX]
    assert local["targets"].tolist() == following[idx].tolist()
    assert local["targets"][31] == following[95]                   # chunk 2's last token predicts chunk 3's first


def test_chunks_know_which_conversations_they_continue():
    shard = cp.make_shard(BLOCKS["mixed"]["cu_seqlens"], T, 4, 1, group=object())
    assert not shard.carries(2)                     # token 64 starts a conversation: its state starts from zero
    assert shard.carries(3) and not shard.whole(3)  # 96 continues 67-97; 97 starts one inside
    assert shard.carries(5) and shard.whole(5)      # 160-192 inside 130-230: its end state depends on its start
    assert [(p.start, p.end, p.global_start, p.conv_start) for p in shard.pieces(1)] == [
        (32, 64, 192, 130)]                         # rank 1 holds chunks 1 and 6


def test_a_block_that_does_not_split_evenly_is_refused_naming_the_settings():
    with pytest.raises(ValueError, match=r"data.seq_len \(250\).*2 x scaling.context_parallel \(4\)"):
        cp.make_shard([0, 250], 250, 2, 0, group=object())
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        cp.make_shard([0, 40, 30, 64], 64, 2, 0, group=object())
    with pytest.raises(ValueError, match="needs its process group"):
        cp.make_shard([0, 64], 64, 2, 0)


# ----------------------------------------------------------------- one rank, two chunks

@pytest.mark.parametrize("attention", ["dense_mask", "per_piece"])
@pytest.mark.parametrize("name", ["mixed", "whole"])
def test_one_rank_with_the_chunk_exchange_equals_the_packed_path(name, attention, monkeypatch):
    """A group of one still splits the block into two chunks: the state and conv inputs cross between them
    through the same scan, and the attention through both CPU paths."""
    if attention == "per_piece":
        monkeypatch.setattr(full_attention, "_DENSE_MASK_MAX", 0)
    model, block = _tiny_hybrid(), BLOCKS[name]
    want_loss, want = _whole_block(model, block)
    model.zero_grad()
    shard = cp.make_shard(block["cu_seqlens"], T, 1, 0)
    loss_sum, n = _shard_loss(model, block, shard)
    (loss_sum / n).backward()
    assert float(loss_sum.detach() / n) == pytest.approx(want_loss, rel=1e-6)
    _assert_grads_close({k: p.grad for k, p in model.named_parameters()}, want)


# ----------------------------------------------------------------- CP 2 and CP 4 over gloo ranks

def _cp_run(model, block, size: int, rank: int, group) -> dict:
    """This rank's share of the group's loss sum and token count, and its parameters' gradients (their sum
    over the group is the block's gradient, as FSDP's reduction over the mesh forms it)."""
    import torch.distributed as dist

    model.zero_grad()
    shard = cp.make_shard(block["cu_seqlens"], T, size, rank, group)
    loss_sum, n = _shard_loss(model, block, shard)
    total = n.float()
    dist.all_reduce(total, group=group)            # the group's supervised tokens
    (loss_sum / total).backward()
    return {"loss_sum": float(loss_sum), "n": int(n),
            "grads": {k: p.grad.numpy().copy() for k, p in model.named_parameters()}}


def _hidden(model, block, shard) -> np.ndarray:
    with torch.no_grad():
        local = cp.shard_block(block, shard)
        return model.model(**cp.cp_forward_kwargs(local, shard)).last_hidden_state[0].numpy().copy()


def _perturbed(block: dict) -> dict:
    out = dict(block, input_ids=block["input_ids"].copy())
    for s, e in PERTURBED:
        out["input_ids"][s:e] = (out["input_ids"][s:e] + 7) % 250
    return out


@contextlib.contextmanager
def _counting_exchanges():
    """What the model's exchanges move on this rank: each all-gather's whole gathered tensor (bytes) and the
    number of gathers and of their backwards (each a collective over the same gathered size)."""
    from raytune_ft.models.context_parallel import exchange

    traffic = {"gathers": 0, "gathered_bytes": 0, "backwards": 0}
    gather, backward = exchange._ALL_GATHER, exchange._GatherRanks.backward

    def counted_gather(out, x, group=None):
        traffic["gathers"] += 1
        traffic["gathered_bytes"] += out.numel() * out.element_size()
        return gather(out, x, group=group)

    def counted_backward(ctx, grad):
        traffic["backwards"] += 1
        return backward(ctx, grad)

    exchange._ALL_GATHER, exchange._GatherRanks.backward = counted_gather, staticmethod(counted_backward)
    try:
        yield traffic
    finally:
        exchange._ALL_GATHER, exchange._GatherRanks.backward = gather, staticmethod(backward)


def _rank_main(rank, world, port, q):
    import torch.distributed as dist

    from tests.conftest import spawned_gloo_rank

    with spawned_gloo_rank(rank, world, port):
        torch.set_num_threads(1)                   # four ranks on a small machine
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]    # every rank creates every group
        model = _tiny_hybrid()
        out = {}
        for name, block in BLOCKS.items():
            out["cp2", name] = _cp_run(model, block, 2, rank % 2, pairs[rank // 2])
            with _counting_exchanges() as traffic:
                out["cp4", name] = _cp_run(model, block, 4, rank, dist.group.WORLD)
            out["traffic", name] = traffic
        shard = cp.make_shard(BLOCKS["mixed"]["cu_seqlens"], T, 4, rank, dist.group.WORLD)
        out["index"] = shard.index.numpy()
        out["hidden"] = _hidden(model, BLOCKS["mixed"], shard)
        out["hidden_perturbed"] = _hidden(model, _perturbed(BLOCKS["mixed"]), shard)
        q.put((rank, out))
        q.close()
        q.join_thread()


@pytest.fixture(scope="module")
def four_ranks():
    """Four gloo ranks, run once: CP 2 twice (ranks 0-1 and 2-3) and CP 4 on both blocks, and the mixed
    block's outputs with conversations 32-64 and 67-97 changed."""
    from tests.conftest import run_gloo_ranks

    return run_gloo_ranks(_rank_main, world=4, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["mixed", "whole"])
@pytest.mark.parametrize("size", [2, 4])
def test_cp_gives_the_loss_and_gradients_of_one_rank(four_ranks, size, name):
    want_loss, want = _one_rank(name)
    groups = [[0, 1], [2, 3]] if size == 2 else [[0, 1, 2, 3]]
    for group in groups:
        runs = [four_ranks[r][f"cp{size}", name] for r in group]
        assert sum(r["n"] for r in runs) == int((BLOCKS[name]["labels"][1:] != IGNORE_INDEX).sum())
        assert sum(r["loss_sum"] for r in runs) / sum(r["n"] for r in runs) == pytest.approx(want_loss, rel=RTOL)
        _assert_grads_close({k: sum(torch.from_numpy(r["grads"][k]) for r in runs) for k in want}, want)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_no_state_conv_input_or_key_crosses_a_conversation_boundary(four_ranks):
    """Changing the tokens of two conversations (one ending at a chunk boundary, one crossing from rank 2 to
    rank 3 with the next conversation starting a token later) changes no other token's output on any rank."""
    hidden, moved = np.zeros((T, 64)), np.zeros((T, 64))
    for r in range(4):
        hidden[four_ranks[r]["index"]] = four_ranks[r]["hidden"]
        moved[four_ranks[r]["index"]] = four_ranks[r]["hidden_perturbed"]
    inside = np.zeros(T, dtype=bool)
    for s, e in PERTURBED:
        inside[s:e] = True
    diff = np.abs(hidden - moved).max(axis=1)
    assert diff[inside].min() > 1e-3                       # the change is there
    leaked = np.flatnonzero(~inside & (diff > 1e-6))
    assert leaked.size == 0, f"tokens {leaked.tolist()} changed with conversations they are not part of"


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["mixed", "whole"])
def test_the_plans_cp_traffic_is_what_the_exchanges_move(four_ranks, name):
    """Issue 59: the communication `raytune-ft plan` states under CP (planning/cp_comms.py) against what the
    model's exchanges moved on each rank of CP 4 (one micro-batch, no recompute, fp32): the same number of
    collectives, and each one's whole gathered tensor x (C-1)/C through the rank's link."""
    from raytune_ft.models.tiny import tiny_config
    from raytune_ft.planning.cp_comms import CpStep, cp_exchange
    from raytune_ft.planning.shapes import ModelShape
    from raytune_ft.recipe.checkpointing import NONE

    est = cp_exchange(ModelShape.from_config(tiny_config("qwen3_5", 256)), CpStep(cp=4, tokens=T, compute_b=4),
                      NONE)
    per_micro_batch = 4                                   # the estimate is a step's: the group's 4 blocks
    for r in range(4):
        moved = four_ranks[r]["traffic", name]
        assert moved["gathers"] == moved["backwards"] > 0
        assert est.collectives / per_micro_batch == moved["gathers"] + moved["backwards"]
        assert est.bytes / per_micro_batch == pytest.approx(2 * moved["gathered_bytes"] * 3 / 4, rel=1e-9)
