"""The start-up kernel check on the GPU: the real kernels at the recipes' real shapes, and deliberately
wrong kernels (patched backends) caught and switched off, the model then running on the path used instead.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.conftest import installed

# The check must cost seconds, not minutes: once the kernels are compiled (Triton / tilelang JIT caches),
# and with the first run's compile included.
WARM_S, COLD_S = 20.0, 240.0


@pytest.mark.parametrize("model, liger", [("qwen3.8-27b", False), ("qwen3-4b", True)])
def test_check_at_real_shape(cuda, model, liger):
    from raytune_ft.models import fast_paths as fp
    from raytune_ft.models import kernel_check as kc
    from raytune_ft.models.attention import reset_disabled_kernels
    from raytune_ft.models.tiny import real_config

    cfg = real_config(model)
    have = installed()
    runs = []
    for _ in range(2):                      # the first pays the JIT compiles, the second is the warm cost
        reset_disabled_kernels()
        lines: list[str] = []
        runs.append((kc.check_kernels(kc.KernelUse(cfg, cuda, liger=liger), log_line=lines.append), lines))
    report, lines = runs[-1]
    print("RESULT " + json.dumps({"kernel_check": model, "seconds": [round(r.seconds, 2) for r, _ in runs],
                                  "in_use": report.in_use, "errors": report.errors,
                                  "off": [f.line("") for f in report.failures]}))
    assert report.checked
    expected = {"attention"} | ({"gdn_conv", "gdn_recurrence"} if fp.has_gated_delta_net(cfg) else set())
    assert set(report.in_use) == expected | ({"fused_ce"} if liger else set())
    # every installed fast kernel of those paths was tried
    tried = {k.split("/")[1] for k in report.errors}
    for name in ("flash_attn", "torch_varlen") + (("causal_conv1d", "fla_chunk") if "gdn_conv" in expected else ()):
        assert (name in tried) == have[name], (name, tried)
    # verdicts are consistent: a kernel that failed is off and not in use, one that passed met its tolerance
    failed = {f.kernel for f in report.failures}
    for key, err in report.errors.items():
        path, name = key.split("/")
        if name in failed:
            assert report.in_use[path] != name
        else:
            assert err <= fp.TOLERANCE[path][torch.bfloat16], (key, err)
    assert len([x for x in lines if "switched off" in x]) == len(report.failures)
    assert runs[0][0].seconds < COLD_S and report.seconds < WARM_S, [r.seconds for r, _ in runs]


def test_check_of_the_context_parallel_forms_at_real_shape(cuda):
    """Issue 59 item 5: with context parallelism the check also runs each installed kernel the way
    models/context_parallel calls it (a carried state into flash-linear-attention's chunked rule, a conv
    reading the chunk before it, varlen attention with more keys than queries), at the 27B's real widths."""
    from raytune_ft.models import fast_paths as fp
    from raytune_ft.models import kernel_check as kc
    from raytune_ft.models.attention import reset_disabled_kernels
    from raytune_ft.models.tiny import real_config

    reset_disabled_kernels()
    lines: list[str] = []
    report = kc.check_kernels(kc.KernelUse(real_config("qwen3.8-27b"), cuda, context_parallel=True),
                              log_line=lines.append)
    print("RESULT " + json.dumps({"kernel_check": "qwen3.8-27b, context-parallel forms", "in_use": report.in_use,
                                  "errors": report.errors, "off": [f.line("") for f in report.failures]}))
    assert {"cp_attention", "cp_gdn_conv", "cp_gdn_recurrence"} <= set(report.in_use)
    tried = {k for k in report.errors if k.startswith("cp_")}
    have = installed()
    assert ("cp_gdn_recurrence/fla_chunk" in tried) == have["fla_chunk"]
    for key, err in report.errors.items():
        if key.split("/")[1] not in {f.kernel for f in report.failures}:
            assert err <= fp.TOLERANCE[key.split("/")[0]][torch.bfloat16], (key, err)
    assert report.failures == [], lines


def _noncausal_varlen(monkeypatch):
    """torch's varlen_attn called without window_size=(-1, 0): per conversation, but not causal."""
    from raytune_ft.models import attention as att

    fn, params = att._torch_varlen()
    if fn is None:
        pytest.skip("torch.nn.attention.varlen is not in this torch")

    def wrong(*args, **kw):
        kw.pop("window_size", None)
        return fn(*args, **kw)

    monkeypatch.setattr(att, "_torch_varlen", lambda: (wrong, params))
    return "torch_varlen", "wrong values"


def _fla_ignoring_boundaries(monkeypatch):
    """fla's chunk rule handed no cu_seqlens: the whole block as one sequence (a leak)."""
    from raytune_ft.models import gated_delta as gd

    fla = gd._fla_chunk_gated_delta_rule()
    if fla is None:
        pytest.skip("flash-linear-attention is not installed")

    def leaky(*args, cu_seqlens=None, **kw):
        return fla(*args, cu_seqlens=None, **kw)

    monkeypatch.setattr(gd, "_fla_chunk_gated_delta_rule", lambda: leaky)
    return "fla_chunk", None        # a leak shows as such or as wrong values, depending on the values


def _conv_off_by_half(monkeypatch):
    """A conv kernel whose outputs are off by about 0.5 (causal-conv1d built for sm_103 with CUDA 13 did
    that on B300s): the project's own conv plus 0.5."""
    from raytune_ft.models import gated_delta as gd

    def wrong(x, w, bias, seq_idx=None, activation=None):
        cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=x.device),
                        torch.nonzero(torch.diff(seq_idx[0])).flatten() + 1,
                        torch.tensor([x.shape[2]], device=x.device)])
        return gd.segment_causal_conv1d(x, w, bias, cu, activation=activation, backend="torch_segmented") + 0.5

    monkeypatch.setattr(gd, "_causal_conv1d_fn", lambda: wrong)
    return "causal_conv1d", "wrong values"


@pytest.mark.parametrize("patch", [_noncausal_varlen, _fla_ignoring_boundaries, _conv_off_by_half])
def test_a_wrong_kernel_is_caught_and_switched_off(cuda, monkeypatch, patch):
    from raytune_ft.models import kernel_check as kc
    from raytune_ft.models.attention import DISABLED_KERNELS, select_attention_backend
    from raytune_ft.models.gated_delta import gated_delta_backends
    from raytune_ft.models.tiny import real_config

    name, what = patch(monkeypatch)
    cfg = real_config("qwen3.8-27b")
    lines: list[str] = []
    tags: dict[str, str] = {}
    report = kc.check_kernels(kc.KernelUse(cfg, cuda), log_line=lines.append, tag=tags.__setitem__)
    print("RESULT " + json.dumps({"patched": name, "lines": lines}))
    bad = [f for f in report.failures if f.kernel == name]
    assert len(bad) == 1, report.failures
    if what is not None:
        assert bad[0].what == what
    else:
        assert bad[0].what in ("leaks across a boundary", "wrong values")
    assert name in DISABLED_KERNELS
    in_use = {"attention": select_attention_backend("cuda"), **{f"gdn_{k}": v for k, v in gated_delta_backends("cuda").items()}}
    assert name not in in_use.values() and in_use == report.in_use
    line = [x for x in lines if x.startswith(f"kernel check: {name} ")]
    assert len(line) == 1 and "torch " in line[0] and f"using {bad[0].instead} instead" in line[0]
    assert f"{name}:" in tags[kc.TAG_OFF] and name not in tags[kc.TAG_IN_USE]

    # strict: the same patched kernel stops the run
    from raytune_ft.models.attention import reset_disabled_kernels

    reset_disabled_kernels()
    with pytest.raises(kc.KernelCheckError, match=name):
        kc.check_kernels(kc.KernelUse(cfg, cuda), mode="strict", log_line=lambda _: None)


def test_model_trains_on_the_path_used_instead(cuda, monkeypatch):
    """After the check switched the non-causal varlen off, a packed forward + backward of a real-width
    attention layer takes the path used instead and matches the conversations run alone."""
    from raytune_ft.models import kernel_check as kc
    from raytune_ft.models.attention import select_attention_backend
    from raytune_ft.models.tiny import real_config
    from tests.gpu import test_packed_equality as eq

    _noncausal_varlen(monkeypatch)
    report = kc.check_kernels(kc.KernelUse(real_config("qwen3.8-27b"), cuda), log_line=lambda _: None)
    assert report.in_use["attention"] != "torch_varlen"
    assert select_attention_backend("cuda") == report.in_use["attention"]
    lm, mixer = eq.build("full_attention", cuda)
    ids, lens = eq.block(cuda)
    packed = eq.run(lm, mixer, eq.packed_kwargs(ids, lens, cuda), ids, lens)
    eq.use_only()                                   # the reference: SDPA, each conversation alone
    sep = eq.separate(lm, mixer, ids, lens, cuda, "reference")
    eq.check(eq.compare(packed, sep, lens))
