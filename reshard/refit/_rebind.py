"""`Refit.update_source`'s check of a new binding, the same for DTensor and plain sources.

A source is registered either as a DTensor (its layout read from it, its mesh coordinate kept) or as a plain local
tensor with a global layout. `update_source(name, tensor)` must keep that kind and layout:

- a DTensor source takes a DTensor of the same layout at the same mesh coordinate;
- a plain source takes a plain `torch.Tensor` of its local shape `layout.local_shape(rank)` and dtype (and, after
  the first run, the planned device). A DTensor is refused even when its shape fits: the executor's copies cannot
  mix DTensors with plain tensors, and a DTensor's shape is global, not this rank's piece.

A refused rebinding binds nothing and stays refused: every later `run()` raises it on every rank, before any data
moves, until `update_source` binds a tensor that fits for that name (so a retry never sends one step's tensors with
another step's).
"""

from __future__ import annotations

from typing import Any

from reshard.planner import Layout, is_dtensor
from reshard.refit._meta import Geometry, LayoutLike, changed, check_local, geometry


def rebind_error(name: str, tensor: Any, layout: LayoutLike, coord: list[int] | None, rank: int,
                 planned: Geometry | None) -> str | None:
    """Why `tensor` cannot replace source `name`'s binding on `rank`, or None when it can.

    Args:
        layout: the source's registered global layout (for a DTensor source, in its own mesh ranks).
        coord: the DTensor source's mesh coordinate on this process; None for a plain source.
        planned: the plain local tensor's (shape, dtype, device) the plan was built for; None before the first run.
    """
    if coord is not None:
        if not is_dtensor(tensor):
            return f"source {name!r} is a DTensor, got a plain {type(tensor).__name__}"
        now = tensor.device_mesh.get_coordinate()
        new = Layout.from_dtensor(tensor, name=name)
        if new != layout or now is None or [int(c) for c in now] != coord:
            return (f"source {name!r} has another layout now: {layout!r} at mesh coordinate {coord} -> {new!r} at "
                    f"{None if now is None else list(now)}; a refit's tensors keep their layout (build a new Refit "
                    "for the new one)")
        return None
    if is_dtensor(tensor):
        return (f"source {name!r} was registered as a plain local tensor with a layout, got a DTensor "
                f"({type(tensor).__name__} of global shape {tuple(tensor.shape)}); bind this rank's piece "
                "(`tensor.to_local()`), or register DTensor sources in a new Refit")
    e = check_local(name, tensor, layout, rank)
    if e:
        return f"source {e}"
    if planned is not None:
        return changed("source", name, rank, planned, geometry(tensor))
    return None
