"""The device that tests run on, chosen once per process by the environment."""

from __future__ import annotations

import os

import torch

DEVICE_ENV = "RESHARD_TEST_DEVICE"
"""Environment variable naming the test device: `cpu` (default; Triton under its interpreter) or `cuda`."""


def device_under_test() -> torch.device:
    """`torch.device(os.environ["RESHARD_TEST_DEVICE"])`, `cpu` when unset.

    Raises:
        ValueError: the variable names a device that does not parse, or CUDA that this machine does not have.
    """
    text = os.environ.get(DEVICE_ENV, "cpu")
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise ValueError(f"{DEVICE_ENV}={text!r} is not a device; expected 'cpu' or 'cuda'") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{DEVICE_ENV}={text!r} but torch sees no CUDA device")
    return device
