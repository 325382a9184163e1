"""dtype <-> name, the one place: names are torch's own without the `torch.` prefix (`bfloat16`, `float8_e4m3fn`)."""

from __future__ import annotations

import torch

DTYPE_NAMES: tuple[str, ...] = tuple(sorted(
    n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype) and str(getattr(torch, n)) == f"torch.{n}"
))
"""The canonical dtype names (`dtype_from_name` also takes torch's aliases, such as `half`, and `SHORT_NAMES`)."""

SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
"""Common short names, for command lines."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype_name: expected a torch.dtype, got {type(dtype).__name__}")
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, *, what: str = "dtype") -> torch.dtype:
    """`"bfloat16"` (or `"torch.bfloat16"`, `"bf16"`, any case) -> `torch.bfloat16`.

    Raises:
        ValueError: `name` is not a string naming a torch dtype; the message names `what` and the valid names.
    """
    if not isinstance(name, str):
        raise ValueError(f"{what}: expected a dtype name (a string such as 'bfloat16'), got {name!r}")
    key = name.strip().lower().removeprefix("torch.")
    key = SHORT_NAMES.get(key, key)
    dt = getattr(torch, key, None) if key.isidentifier() and not key.startswith("_") else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"{what}: unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return dt
