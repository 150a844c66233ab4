"""Packed == separate on the GPU, for each layer kind of Qwen3.8-27B at its real widths and head dims, bf16.

One decoder layer of each kind (full attention: 24 query / 4 KV heads of 256; gated-delta-net: 16 key /
48 value heads of 128, conv kernel 4), real hidden (5120) and MLP (17408) widths, random weights; the
vocabulary cut to 32,000 (embedding and head are not what is under test). A packed block of conversations
with awkward lengths (1 and 3 tokens, 64 and 65 around fla's chunk) runs through the packed path with the
backend under test; each conversation then runs alone through the reference kernels (SDPA, the torch conv,
transformers' torch delta rule). Compared, with tolerances stated here:
- the layer's mixer output (attention / gated-delta-net), per conversation, rel <= TOL["mixer"];
- the per-token loss, max rel over tokens <= TOL["loss"];
- the gradient of every parameter (sum of token losses), rel per tensor <= TOL["grad"].
A negative control runs the block as one sequence: its mixer output must miss the separate one by at
least TOL["control"] x TOL["mixer"], or the comparison could not see a leak.
One more test compares the packed reference path with transformers' own unpacked forward per conversation
(the project's layer code against the library's). Backends this machine lacks are skipped, with the reason.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.gpu.conftest import installed, rel, use_only

LENS = [700, 3, 64, 65, 1, 300, 411]
VOCAB = 32_000
# bf16: 2^-8 = 3.9e-3 unit roundoff; the ops measured 3e-3 to 6e-3 against fp32 on the H200 (bench/RESULTS.md)
TOL = {"mixer": 1e-2, "loss": 1e-2, "grad": 2e-2, "control": 10.0}


def build(kind: str, dev: torch.device):
    from transformers import AutoModelForCausalLM

    from raytune_ft.models.gated_delta import enable_packing
    from raytune_ft.models.tiny import real_config

    cfg = real_config("qwen3.8-27b", num_hidden_layers=1, layer_types=[kind], vocab_size=VOCAB)
    torch.manual_seed(0)
    with torch.device(dev):
        lm = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    enable_packing(lm)
    lm.train()
    layer = lm.model.layers[0]
    mixer = layer.linear_attn if kind == "linear_attention" else layer.self_attn
    return lm, mixer


def block(dev, lens=LENS, seed=1):
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(10, VOCAB - 100, size=sum(lens))).to(dev)
    return ids, lens


def packed_kwargs(ids, lens, dev):
    from raytune_ft.models.gated_delta import packed_forward_kwargs

    pos = torch.cat([torch.arange(n) for n in lens])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return packed_forward_kwargs({"input_ids": ids.cpu(), "position_ids": pos, "cu_seqlens": cu}, device=dev)


def run(lm, mixer, kwargs, ids, lens):
    """Forward + backward of the sum of token losses. Returns (mixer output (T, D) fp32, per-token
    losses, {name: fp32 grad})."""
    seen = {}
    hook = mixer.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out[0] if isinstance(out, tuple) else out))
    lm.zero_grad(set_to_none=True)
    try:
        hidden = lm.model(**kwargs).last_hidden_state.reshape(-1, lm.config.hidden_size)
    finally:
        hook.remove()
    w = lm.lm_head.weight
    losses, s = [], 0
    for n in lens:
        logits = hidden[s:s + n - 1].float() @ w.float().t()
        losses.append(F.cross_entropy(logits, ids[s + 1:s + n], reduction="none"))
        s += n
    tok = torch.cat(losses)
    tok.sum().backward()
    grads = {k: p.grad.float() for k, p in lm.named_parameters() if p.grad is not None}
    return seen["out"].detach().reshape(-1, seen["out"].shape[-1]).float(), tok.detach(), grads


def separate(lm, mixer, ids, lens, dev, how: str):
    """Each conversation alone: through the packed path on the reference kernels ("reference"), or
    through transformers' own unpacked forward ("transformers"). Gradients summed in fp32. The torch
    conv runs eagerly here (compiled, every conversation length would be a new graph)."""
    from raytune_ft.models import gated_delta as gd

    compiled, gd._compiled_shifted = gd._compiled_shifted, gd._shifted_conv_silu
    try:
        return _separate(lm, mixer, ids, lens, dev, how)
    finally:
        gd._compiled_shifted = compiled


def _separate(lm, mixer, ids, lens, dev, how):
    outs, toks, grads, s = [], [], {}, 0
    for n in lens:
        one = ids[s:s + n]
        if how == "reference":
            kw = packed_kwargs(one, [n], dev)
        else:
            kw = {"input_ids": one[None], "position_ids": torch.arange(n, device=dev)[None], "use_cache": False}
        o, t, g = run(lm, mixer, kw, one, [n])
        outs.append(o)
        toks.append(t)
        for k, v in g.items():
            grads[k] = grads[k] + v if k in grads else v.clone()
        s += n
    return torch.cat(outs), torch.cat(toks), grads


def compare(packed, sep, lens) -> dict:
    (po, pt, pg), (so, st, sg) = packed, sep
    bounds = np.concatenate([[0], np.cumsum(lens)])
    mixer = [rel(po[a:b], so[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    loss = float(((pt - st).abs() / st.abs().clamp(min=1e-6)).max())
    grad = {k: rel(pg[k], sg[k]) for k in sg if sg[k].norm() > 0}
    return {"mixer_rel_max": max(mixer), "mixer_rel": [round(x, 5) for x in mixer], "loss_rel_max": loss,
            "grad_rel_max": max(grad.values()), "grad_worst": max(grad, key=grad.get), "n_grads": len(grad)}


def control(lm, mixer, ids, lens, sep_out, dev) -> float:
    """Mixer output of the block as ONE sequence vs each conversation alone, worst over conversations 2..N."""
    with torch.no_grad():
        seen = {}
        h = mixer.register_forward_hook(lambda m, a, out: seen.__setitem__("o", out[0] if isinstance(out, tuple) else out))
        try:
            lm.model(**packed_kwargs(ids, [sum(lens)], dev))
        finally:
            h.remove()
    one = seen["o"].reshape(-1, seen["o"].shape[-1]).float()
    bounds = np.concatenate([[0], np.cumsum(lens)])
    return max(rel(one[a:b], sep_out[a:b]) for a, b in list(zip(bounds[:-1], bounds[1:]))[1:])


def check(res: dict, ctrl: float | None = None) -> None:
    print("RESULT", res, "control", ctrl)
    assert res["mixer_rel_max"] <= TOL["mixer"], res
    assert res["loss_rel_max"] <= TOL["loss"], res
    assert res["grad_rel_max"] <= TOL["grad"], res
    assert res["n_grads"] >= 8, res
    if ctrl is not None:
        assert ctrl >= TOL["control"] * TOL["mixer"], f"the one-sequence control moved only {ctrl:.3g}"


def need(*names: str) -> None:
    have = installed()
    missing = [n for n in names if not have[n]]
    if missing:
        pytest.skip(f"not on this machine: {', '.join(missing)}")


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "sdpa_blockdiag"])
def test_full_attention_packed_equals_separate(cuda, backend):
    from raytune_ft.models.attention import select_attention_backend

    need(backend)
    lm, mixer = build("full_attention", cuda)
    ids, lens = block(cuda)
    use_only()
    sep = separate(lm, mixer, ids, lens, cuda, "reference")
    use_only(backend)
    assert select_attention_backend("cuda") == backend
    packed = run(lm, mixer, packed_kwargs(ids, lens, cuda), ids, lens)
    check(compare(packed, sep, lens), control(lm, mixer, ids, lens, sep[0], cuda))


@pytest.mark.parametrize("conv, recurrence", [("torch_segmented", "fla_chunk"), ("causal_conv1d", "fla_chunk"),
                                              ("torch_segmented", "torch_per_segment"),
                                              ("causal_conv1d", "torch_per_segment")])
def test_gated_delta_net_packed_equals_separate(cuda, conv, recurrence):
    from raytune_ft.models.gated_delta import gated_delta_backends

    need(conv, recurrence)
    lm, mixer = build("linear_attention", cuda)
    ids, lens = block(cuda)
    use_only()
    sep = separate(lm, mixer, ids, lens, cuda, "reference")
    use_only(conv, recurrence)
    assert gated_delta_backends("cuda") == {"conv": conv, "recurrence": recurrence}
    packed = run(lm, mixer, packed_kwargs(ids, lens, cuda), ids, lens)
    check(compare(packed, sep, lens), control(lm, mixer, ids, lens, sep[0], cuda))


@pytest.mark.parametrize("kind", ["full_attention", "linear_attention"])
def test_packed_reference_path_equals_transformers_unpacked(cuda, kind):
    """The project's packed layer (reference kernels) against transformers' own forward per conversation
    (whatever kernels transformers picks on this machine)."""
    lm, mixer = build(kind, cuda)
    ids, lens = block(cuda)
    use_only()
    packed = run(lm, mixer, packed_kwargs(ids, lens, cuda), ids, lens)
    sep = separate(lm, mixer, ids, lens, cuda, "transformers")
    check(compare(packed, sep, lens))
