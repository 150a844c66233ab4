"""The GPU test suite (marker `gpu`): run on a machine with CUDA, skipped elsewhere with the reason.

    python -m pytest -m gpu tests/gpu -v        # on the GPU machine (bench/README.md: the packages it needs)

Every test here gets the `gpu` marker and, without a CUDA device, a skip that says why, so a CPU run of
the whole suite stays green and reports how many GPU tests it skipped.
"""
from __future__ import annotations

import pytest
import torch

NO_CUDA = "no CUDA device: the GPU suite runs on a GPU machine (python -m pytest -m gpu tests/gpu)"


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture
def cuda() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _kernels_back_on():
    """A test that switches a kernel off (or patches one) leaves the process as it found it."""
    from raytune_ft.models.attention import reset_disabled_kernels

    reset_disabled_kernels()
    yield
    reset_disabled_kernels()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


FAST_KERNELS = ("flash_attn", "torch_varlen", "causal_conv1d", "fla_chunk")


def use_only(*wanted: str) -> None:
    """Switch every fast kernel off except `wanted` (the reference paths stay available)."""
    from raytune_ft.models.attention import disable_kernel, reset_disabled_kernels

    reset_disabled_kernels()
    for name in FAST_KERNELS:
        if name not in wanted:
            disable_kernel(name)


def installed() -> dict[str, bool]:
    """Which fast kernels this machine has (importable), by the loop's own detection."""
    from raytune_ft.models import attention as att
    from raytune_ft.models import gated_delta as gd

    return {"flash_attn": att._flash_attn_varlen() is not None, "torch_varlen": att._torch_varlen()[0] is not None,
            "causal_conv1d": gd._causal_conv1d_fn() is not None,
            "fla_chunk": gd._fla_chunk_gated_delta_rule() is not None,
            "sdpa_blockdiag": True, "torch_segmented": True, "torch_per_segment": True}
