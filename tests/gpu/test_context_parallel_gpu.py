"""Context parallelism on the GPU (issue 59): CP's CUDA kernels against the packed path on the same block, bf16,
one decoder layer of each kind of Qwen3.8-27B at its real widths (test_packed_equality's `build`).

The block (8,192 tokens) holds conversations that cross a chunk boundary for a group of one (chunks of 4,096)
and of two (chunks of 2,048), one that starts exactly at a chunk boundary, and one of a single token.
- A group of one still cuts the block into two chunks: the recurrence's state crosses from the first chunk to
  the second through the [B|M] scan on flash-linear-attention's chunk kernel (an initial state per piece,
  cu_seqlens, value columns widened by dk), the conv's halo through the segmented conv, and the queries of
  the second chunk attend on the varlen kernel with more keys than queries (causal aligned bottom-right).
- A group of two on the one GPU: NCCL refuses two ranks on one device, so two spawned gloo processes share it,
  and the all-gather of CUDA tensors goes through the host (gloo has no CUDA all-gather into one tensor):
  a stand-in for NCCL's transport only; every kernel under test runs on CUDA.
Compared: the mean token loss and every parameter's gradient (for two ranks, their sum over the group), with
test_packed_equality's bf16 tolerances.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu.conftest import installed, rel
from tests.gpu.test_packed_equality import TOL, VOCAB, build

T = 8192
# starts 0, 3000, 3001, 4101, 4104, 6144, 8147: 0-3000 crosses 2,048, 3001-4101 crosses 4,096, 6144 starts a chunk
LENS = [3000, 1, 1100, 3, 2040, 2003, 45]


def _block(seed: int = 1) -> dict:
    from raytune_ft.data.packing import block_from_segments

    rng = np.random.default_rng(seed)
    return block_from_segments([(rng.integers(10, VOCAB - 100, n), rng.random(n) < 0.7) for n in LENS], T)


def _whole(lm, block, dev) -> tuple[float, dict]:
    from raytune_ft.models.gated_delta import packed_forward_kwargs
    from raytune_ft.models.loss import chunked_cross_entropy

    lm.zero_grad(set_to_none=True)
    hidden = lm.model(**packed_forward_kwargs(block, device=dev)).last_hidden_state
    loss_sum, n = chunked_cross_entropy(hidden, lm.lm_head.weight, torch.as_tensor(block["labels"], device=dev)[None])
    (loss_sum / n).backward()
    return float(loss_sum.detach() / n), {k: p.grad.float() for k, p in lm.named_parameters() if p.grad is not None}


def _share(lm, block, dev, size: int, rank: int, group=None) -> tuple[float, int, dict]:
    """This rank's loss sum, supervised tokens and its share of the gradients (loss divided by the group's
    token count, as the loop divides)."""
    import torch.distributed as dist

    from raytune_ft.models import context_parallel as cp
    from raytune_ft.models.loss import chunked_cross_entropy

    lm.zero_grad(set_to_none=True)
    shard = cp.make_shard(block["cu_seqlens"], T, size, rank, group)
    local = cp.shard_block(block, shard)
    hidden = lm.model(**cp.cp_forward_kwargs(local, shard, dev)).last_hidden_state
    loss_sum, n = chunked_cross_entropy(hidden, lm.lm_head.weight, local["targets"][None].to(dev), shift=False)
    total = n.detach().float()
    if group is not None:
        dist.all_reduce(total, group=group)
    (loss_sum / total).backward()
    return float(loss_sum.detach()), int(n), {k: p.grad.float().cpu() for k, p in lm.named_parameters() if p.grad is not None}


def _compare(loss: float, grads: dict, want_loss: float, want: dict) -> dict:
    res = {"loss_rel": abs(loss - want_loss) / abs(want_loss),
           "grad_rel": {k: rel(grads[k].cuda(), g) for k, g in want.items() if g.norm() > 0}}
    print("RESULT", {"loss_rel": res["loss_rel"], "grad_rel_max": max(res["grad_rel"].values()),
                     "grad_worst": max(res["grad_rel"], key=res["grad_rel"].get)})
    return res


def _check(res: dict) -> None:
    assert res["loss_rel"] <= TOL["loss"], res["loss_rel"]
    bad = {k: v for k, v in res["grad_rel"].items() if v > TOL["grad"]}
    assert not bad, bad


def _need_fla():
    import importlib.util

    import triton

    if not installed()["fla_chunk"]:
        pytest.skip("flash-linear-attention is not installed: CP's CUDA recurrence is its chunk kernel")
    hopper = torch.cuda.get_device_capability() == (9, 0)
    old_triton = tuple(int(x) for x in triton.__version__.split(".")[:3] if x.isdigit()) < (3, 7, 1)
    if hopper and old_triton and importlib.util.find_spec("tilelang") is None:
        # flash-linear-attention 0.6.0 raises in the gated backward here (its issue 640): seen on an H200
        pytest.skip(f"Triton {triton.__version__} on Hopper needs tilelang for fla's gated backward: install "
                    "the wheelhouse's tilelang part too (bench/README.md)")


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_a_group_of_one_on_cuda_kernels_equals_the_packed_path(kind, cuda):
    _need_fla()
    lm, _ = build(kind, cuda)
    block = _block()
    want_loss, want = _whole(lm, block, cuda)
    loss_sum, n, grads = _share(lm, block, cuda, 1, 0)
    _check(_compare(loss_sum / n, grads, want_loss, want))


def _host_all_gather(out, x, group=None):
    """gloo's all-gather of a CUDA tensor through the host (module docstring)."""
    import torch.distributed as dist

    host = out.new_empty(out.shape, device="cpu")
    dist.all_gather_into_tensor(host, x.cpu(), group=group)
    out.copy_(host)


def _rank_main(rank, world, port, q):
    from raytune_ft.models.context_parallel import exchange
    from tests.conftest import spawned_gloo_rank

    torch.cuda.set_device(0)
    exchange._ALL_GATHER = _host_all_gather
    with spawned_gloo_rank(rank, world, port):
        import torch.distributed as dist

        out = {}
        for kind in ("linear_attention", "full_attention"):
            lm, _ = build(kind, torch.device("cuda", 0))
            out[kind] = _share(lm, _block(), torch.device("cuda", 0), 2, rank, dist.group.WORLD)
            del lm
            torch.cuda.empty_cache()
        q.put((rank, out))
        q.close()
        q.join_thread()


@pytest.mark.timeout(900)
def test_a_group_of_two_on_one_gpu_gives_the_loss_and_gradients_of_the_whole_block(cuda):
    _need_fla()
    from tests.conftest import run_gloo_ranks

    ranks = run_gloo_ranks(_rank_main, world=2, timeout=800)
    for kind in ("linear_attention", "full_attention"):
        lm, _ = build(kind, cuda)
        want_loss, want = _whole(lm, _block(), cuda)
        runs = [ranks[r][kind] for r in (0, 1)]
        loss = sum(r[0] for r in runs) / sum(r[1] for r in runs)
        grads = {k: runs[0][2][k] + runs[1][2][k] for k in runs[0][2]}
        print("CP 2,", kind)
        _check(_compare(loss, grads, want_loss, want))
        del lm
        torch.cuda.empty_cache()
