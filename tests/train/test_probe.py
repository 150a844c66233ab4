"""The probes (held-out loss, samples) keep the weights gathered for their length where they fit: one
all-gather per FSDP2 module instead of one per forward, float8 weights dequantised once, the same outputs, and
training after a probe exactly as without it (its weights resharded, each module's setting back)."""
from __future__ import annotations

import pytest
import torch

from raytune_ft.train import fp8, probe
from tests.train.test_fp8 import _blocks, _small_config, _train, process_group  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(600)


def _fresh(recipe: str | None, steps: int = 1):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    init = AutoModelForCausalLM.from_config(_small_config(), dtype=torch.float32).state_dict()
    return _train(init, recipe, _blocks(1)[:steps], "none")[1]


def _step(model) -> float:
    from raytune_ft.train.batch import StepBatch
    from raytune_ft.train.fsdp_loop import forward_backward

    mb = StepBatch.from_blocks(_blocks(2)[1:], torch.device("cpu"))
    loss_sum, denom = forward_backward(model, [mb], 1, torch.device("cpu"))
    return float(loss_sum / denom)


def _decode_forwards(model, n: int) -> list[torch.Tensor]:
    """`n` greedy-decoding-like forwards of two short packed sequences inside one probe."""
    from raytune_ft.models.gated_delta import packed_forward_kwargs

    lens = [30, 20]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    kwargs = packed_forward_kwargs({"input_ids": torch.arange(sum(lens)) % 400 + 10,
                                    "position_ids": torch.cat([torch.arange(k) for k in lens]), "cu_seqlens": cu},
                                   device=torch.device("cpu"))
    with torch.no_grad(), probe.probe_uncompiled(model):
        return [model(None, logits_at=(cu[1:] - 1).long(), **kwargs) for _ in range(n)]


def _count_unshards(monkeypatch) -> list[int]:
    """Every FSDP2 parameter group's unshard that gathers (on one rank FSDP2 skips the collective, but the
    gathered parameters are still built and freed: a float8 weight cast and dequantised every time)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    calls, real = [], FSDPParamGroup.unshard

    def counted(self, *a, **k):
        if self._all_gather_result is None and not self.is_unsharded:
            calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
    return calls


def _settings(model) -> list:
    out = []
    for m in probe.fsdp_modules(model):
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        out.append((state._auto_reshard_after_forward, [g.post_forward_mesh_info is None for g in groups],
                    [g.is_sharded for g in groups]))
    return out


@pytest.mark.slow
def test_a_probe_gathers_each_module_once_and_training_after_it_is_unchanged(process_group, monkeypatch):
    model = _fresh(None)
    before = _settings(model)
    groups = len(probe.fsdp_modules(model))
    calls = _count_unshards(monkeypatch)
    kept = _decode_forwards(model, 3)
    assert len(calls) == groups
    assert _settings(model) == before and all(all(s[2]) for s in before)

    monkeypatch.setattr(probe, "free_bytes", lambda device: (1 << 30, 64 << 30))   # too little: per forward
    calls.clear()
    per_forward = _decode_forwards(model, 3)
    assert len(calls) == 1 + 3 * (groups - 1)    # the root module is not resharded after a forward
    assert all(torch.equal(a, b) for a, b in zip(kept, per_forward))
    assert [s[:2] for s in _settings(model)] == [s[:2] for s in before]   # (the root stays gathered, as before)

    # a training step after a probe gives the loss of the same step without one (both from the same weights)
    assert _step(model) == _step(_fresh(None))


@pytest.mark.slow
def test_a_probe_as_the_models_first_forward_leaves_the_settings_of_a_first_training_forward(process_group):
    """The base model's samples run before the first step: FSDP2 sets itself up in that forward (the root
    keeps its parameters after a forward); training afterwards has the settings it has without the probe."""
    probed, plain = _fresh(None, steps=0), _fresh(None, steps=0)
    _decode_forwards(probed, 2)
    assert _step(probed) == _step(plain)
    assert _settings(probed) == _settings(plain)
    root, *layers = _settings(probed)
    assert probe.fsdp_modules(probed)[0]._get_fsdp_state()._is_root
    assert root[1] == [True] and all(s[1] == [False] for s in layers)   # the root alone keeps its parameters


@pytest.mark.slow
def test_float8_weights_are_dequantised_once_per_probe(process_group, monkeypatch):
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    model = _fresh("tensorwise")
    n_fp8 = len(fp8.fp8_module_names(model))
    dequants, real = [], Float8TrainingTensor.to_original_precision
    monkeypatch.setattr(Float8TrainingTensor, "to_original_precision",
                        lambda self: dequants.append(1) or real(self))
    kept = _decode_forwards(model, 3)
    assert len(dequants) == n_fp8
    monkeypatch.setattr(probe, "free_bytes", lambda device: (1 << 30, 64 << 30))
    dequants.clear()
    per_forward = _decode_forwards(model, 3)
    assert len(dequants) == 3 * n_fp8
    assert all(torch.equal(a, b) for a, b in zip(kept, per_forward))


def test_the_gathered_size_of_a_plain_module_is_its_parameters_bytes():
    lin = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16, bias=False))
    assert probe.gathered_bytes(lin) == (64 * 32 + 32 + 32 * 16) * 4     # no FSDP2 module: no all-gather buffers
    assert probe.fits_gathered(lin)          # no process group: this rank decides alone


@pytest.mark.slow
def test_the_gathered_size_adds_the_largest_modules_all_gather_buffers(process_group):
    model = _fresh(None)
    params = sum(p.numel() * p.dtype.itemsize for p in model.parameters())
    root, *layers = probe.fsdp_modules(model)
    in_layers = {id(p) for m in layers for p in m.parameters()}
    own = {"root": sum(p.numel() * p.dtype.itemsize for p in root.parameters() if id(p) not in in_layers)}
    own |= {i: sum(p.numel() * p.dtype.itemsize for p in m.parameters()) for i, m in enumerate(layers)}
    assert probe.gathered_bytes(model) == params + 2 * max(own.values())
