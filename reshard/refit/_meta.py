"""The layouts a refit registers, and the check of a registered local tensor against its layout.

Layouts travel between ranks as `reshard.planner._wire` encodes them.
"""

from __future__ import annotations

from typing import Any

import torch

from reshard.planner import ExplicitLayout, Layout

LayoutLike = Layout | ExplicitLayout


def check_local(name: str, tensor: Any, layout: LayoutLike, rank: int) -> str | None:
    """Why `tensor` cannot be `rank`'s local tensor of `layout`, or None when it can."""
    if not isinstance(tensor, torch.Tensor):
        return f"tensor {name!r} on rank {rank}: expected a torch.Tensor, got {type(tensor).__name__}"
    expected = tuple(layout.local_shape(rank))
    if tuple(tensor.shape) != expected:
        return (f"tensor {name!r} on rank {rank}: local shape {tuple(tensor.shape)} does not match its layout, "
                f"expected {expected}")
    if tensor.dtype != layout.dtype:
        return f"tensor {name!r} on rank {rank}: dtype {tensor.dtype}, its layout says {layout.dtype}"
    return None
