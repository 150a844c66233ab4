"""GPU peaks, MFU basis and model FLOPs (raytune_ft/planning/hardware.py)."""
from __future__ import annotations

import pytest
import torch

from raytune_ft.planning import hardware
from raytune_ft.models.tiny import real_config


def test_flops_follow_the_seed_method():
    cfg = real_config("qwen3-4b")
    n_mm = hardware.matmul_params(cfg)
    assert abs(n_mm / 1e9 - 4.02) < 0.01                  # tied: the embedding counts once, as lm_head
    c27 = real_config("qwen3.8-27b", num_hidden_layers=8)
    n27 = hardware.matmul_params(c27)
    emb = 248320 * 5120
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m27 = AutoModelForCausalLM.from_config(c27)
    assert n27 == sum(p.numel() for p in m27.parameters()) - emb   # untied: input embedding excluded
    assert hardware.matmul_params(m27) == n27                      # a model counts as its config does
    lens = [1000, 3000, 96]
    got = hardware.flops_per_block(c27, lens)
    want = 6 * n27 * sum(lens) + 6 * 2 * (24 * 256) * sum(n * n for n in lens)
    assert got == pytest.approx(want, rel=1e-12)
    extra = hardware.flops_per_block(c27, lens, include_linear_attention=True) - got
    assert 0 < extra < 0.02 * got
    # the plan's per-token figure is the same formula at one conversation length
    assert hardware.flops_per_token(n27, hardware.attention_width(c27), 1000) == pytest.approx(
        hardware.flops_per_block(c27, [1000]) / 1000, rel=1e-12)


def test_peaks_are_the_datasheet_dense_bf16_figures():
    assert hardware.gpu_peak_tflops("NVIDIA H200") == 989.0
    assert hardware.gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert hardware.gpu_peak_tflops("NVIDIA B300 SXM6 AC") == 2250.0
    assert hardware.gpu_peak_tflops("NVIDIA B200") == 2250.0
    assert hardware.gpu_peak_tflops("a mystery chip") == 0.0
    assert hardware.gpu_peak_tflops(None) == 0.0
    assert hardware.gpu_spec("NVIDIA H200").measured_matmul_tflops == 790.0
    assert hardware.gpu_spec("NVIDIA H100 80GB HBM3").measured_matmul_tflops is None   # never measured


def test_mfu_metrics_name_their_basis():
    m = hardware.mfu_metrics(8 * 0.5 * 989e12, "NVIDIA H200", n_gpus=8)
    assert m["mfu"] == pytest.approx(0.5) and m["mfu_peak_tflops"] == 989.0
    assert m["mfu_measured_matmul"] == pytest.approx(0.5 * 989 / 790)
    assert all(isinstance(v, float) for v in m.values())           # MLflow metrics
    assert "datasheet dense bf16 H200 (989 TFLOP/s)" in hardware.mfu_basis("NVIDIA H200")
    assert "790" in hardware.mfu_basis("NVIDIA H200")
    b300 = hardware.mfu_metrics(1125e12, "NVIDIA B300 SXM6 AC")
    assert b300 == {"mfu": pytest.approx(0.5), "mfu_peak_tflops": 2250.0}  # no measured figure: none given
    assert hardware.mfu_metrics(1e12, "cpu") == {"mfu": 0.0, "mfu_peak_tflops": 0.0}
    assert hardware.mfu_basis("cpu").startswith("none")
