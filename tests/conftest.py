"""Shared test fixtures: paths to ../shared/fixtures and a local Ray instance per module."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("RAYTUNE_FIXTURES", REPO.parent / "shared" / "fixtures"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def fixtures() -> Path:
    if not FIXTURES.is_dir():
        pytest.fail(f"fixtures not found at {FIXTURES}; set RAYTUNE_FIXTURES")
    return FIXTURES


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray with more logical CPUs than cores, so Ray Data inside a trainer does not starve."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=True,
             ignore_reinit_error=True)
    yield ray
    ray.shutdown()
