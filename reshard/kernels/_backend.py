"""Which implementation a kernel call runs: Triton or the pure-torch reference. The one place this is decided."""

from __future__ import annotations

import importlib.util
import os

import torch

BACKEND_ENV = "RESHARD_KERNEL_BACKEND"
"""Environment variable that overrides `backend=None`: `triton` or `torch`. An explicit `backend=` wins over it."""

BACKENDS = ("triton", "torch")


def triton_available() -> bool:
    """Whether the triton package is installed (found without importing it)."""
    return importlib.util.find_spec("triton") is not None


def choose_backend(op: str, device: torch.device, backend: str | None) -> tuple[str, bool]:
    """`(backend, explicit)`: `backend` if given, else `$RESHARD_KERNEL_BACKEND`, else Triton for CUDA tensors (when
    triton is installed) and torch for CPU tensors. `explicit` is True only for an explicit argument, the one
    case where a caller may not fall back to torch.

    Raises:
        ValueError: an unknown backend, naming `op` and where the value came from.
        NotImplementedError: `"triton"` asked for without the triton package.
    """
    source = "backend"
    explicit = backend is not None
    if backend is None and os.environ.get(BACKEND_ENV):
        backend, source = os.environ[BACKEND_ENV], f"${BACKEND_ENV}"
    if backend is None:
        return ("triton" if device.type == "cuda" and triton_available() else "torch"), False
    if backend not in BACKENDS:
        raise ValueError(f"{op}: {source} must be one of {BACKENDS} (or None), got {backend!r}")
    if backend == "triton" and not triton_available():
        raise NotImplementedError(f"{op}: backend='triton' needs the triton package; use backend='torch'")
    return backend, explicit
