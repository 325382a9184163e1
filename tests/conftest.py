"""Shared fixtures and test tiers.

Tiers (markers, registered in pyproject.toml; `--strict-markers` refuses others):
    distributed: starts several processes (the rank pool, torchrun); `pytest -m "not distributed"` is the fast tier.
    slow: long even for its tier.
    gpu: needs a CUDA device (`RESHARD_TEST_DEVICE=cuda`); skipped without one.
    vllm: needs vLLM installed; skipped without it.

The device: the `device` fixture, from `RESHARD_TEST_DEVICE` (`cpu` unless set to `cuda`; see
`reshard.testing.device_under_test`). Modules that need it at import time call `device_under_test()` themselves.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from reshard.testing import device_under_test


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the tests run on (`RESHARD_TEST_DEVICE`, default `cpu`)."""
    return device_under_test()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    on_gpu = device_under_test().type == "cuda"
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU: set RESHARD_TEST_DEVICE=cuda on a CUDA machine"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM installed"))
