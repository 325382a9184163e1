"""A flat partition's window: the local tensor a `FlatRangeLayout` rank registers, read from the partition itself.

A rank holding the flattened elements `[start, stop)` of a tensor of `shape` keeps them as a 1-D tensor `part`
(`part[0:stop - start]`; anything after is padding). Its `FlatRangeLayout` local tensor is the window of whole rows
the range touches (`reshard.planner.flat_window`), `(rows, *shape[1:])`, whose element `start - first` is
`part[0]`. Where `part`'s storage reaches `lead = start % row` elements before `part` and the window's tail after
it (a partition inside one flat buffer of several parameters, as DeepSpeed's after `deepspeed.initialize`), the
window is a `torch.as_strided` view of that storage: no copy, and an optimizer step in place is seen by the next
send. Otherwise it is a copy of the window's shape, refreshed from `part` before every send (`refresh`); only the
range is copied, the rest of the window is never read.

Example: `(5, 3)`, rank 1 holding `[8, 15)` of a flat buffer where `part` starts at storage offset 8: the window is
rows 2-4, `as_strided(part, (3, 3), (3, 1), 6)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from reshard.planner import flat_window


class Window(NamedTuple):
    """A registered window and where its range lies in it.

    Attributes:
        tensor: the window, `(rows, *shape[1:])` (a view of the partition's storage, or a copy).
        lead: elements of the window before the range (`start - first`).
        count: elements of the range (`stop - start`).
        view: whether `tensor` is a view of the partition (False: a copy to `refresh`).
    """

    tensor: torch.Tensor
    lead: int
    count: int
    view: bool


def window_of(part: torch.Tensor, shape: Sequence[int], start: int, stop: int) -> Window:
    """The window of the range `[start, stop)` of a tensor of `shape`, held as `part[0:stop - start]`: a view of
    `part`'s storage where it reaches far enough on both sides (see the module docstring), else a filled copy."""
    first, wshape = flat_window(shape, start, stop)
    lead, count = start - first, stop - start
    size = math.prod(wshape)
    if part.dim() != 1 or (count and part.stride(0) != 1):
        raise ValueError(f"flat partition of shape {tuple(part.shape)} and strides {tuple(part.stride())}: expected a "
                         "contiguous 1-D tensor")
    offset = part.storage_offset() - lead
    stored = part.untyped_storage().nbytes() // part.element_size()
    stride = tuple(math.prod(wshape[d + 1:]) for d in range(len(wshape)))
    if offset >= 0 and offset + size <= stored:
        return Window(torch.as_strided(part, wshape, stride, offset), lead, count, True)
    out = Window(torch.empty(wshape, dtype=part.dtype, device=part.device), lead, count, False)
    refresh(out, part)
    return out


def refresh(window: Window, part: torch.Tensor) -> None:
    """Copy the range from `part` into a copied window (a view needs nothing)."""
    if not window.view and window.count:
        window.tensor.view(-1)[window.lead:window.lead + window.count].copy_(part[:window.count])
