"""Layout metadata as plain picklable values, so each side can declare only its own layouts and exchange them.

A layout travels as a tuple of builtins (no torch objects but the dtype name), and is rebuilt identically on every
rank. `Layout` keeps its mesh and DTensor placements; `ExplicitLayout` keeps its per-rank pieces.
"""

from __future__ import annotations

from typing import Any

import torch

from reshard.planner import Box, ExplicitLayout, Layout, Mesh, Piece, placement_str
from reshard.planner._notation import parse_placements

LayoutLike = Layout | ExplicitLayout


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in layout metadata")
    return dt


def encode_layout(layout: LayoutLike) -> tuple:
    """A picklable description of `layout` that `decode_layout` turns back into an equal layout."""
    if isinstance(layout, Layout):
        return (
            "layout",
            layout.name,
            layout.shape,
            dtype_name(layout.dtype),
            layout.mesh.shape,
            layout.mesh.ranks,
            layout.mesh.axis_names,
            tuple(placement_str(p) for p in layout.placements),
        )
    if isinstance(layout, ExplicitLayout):
        return (
            "explicit",
            layout.name,
            layout.shape,
            dtype_name(layout.dtype),
            tuple(
                (r, layout.local_shape(r),
                 tuple((p.global_box.offsets, p.global_box.shape, p.local_box.offsets) for p in layout.pieces(r)))
                for r in layout.ranks
            ),
        )
    raise ValueError(f"cannot describe layout of type {type(layout).__name__}; expected Layout or ExplicitLayout")


def decode_layout(spec: tuple) -> LayoutLike:
    kind = spec[0]
    if kind == "layout":
        _, name, shape, dt, mesh_shape, ranks, axis_names, placements = spec
        mesh = Mesh(torch.tensor(ranks, dtype=torch.int64).reshape(mesh_shape) if ranks else [], axis_names)
        return Layout(shape, mesh, parse_placements(",".join(placements)), dtype_from_name(dt), name=name)
    if kind == "explicit":
        _, name, shape, dt, per_rank = spec
        pieces = {
            r: [Piece(Box(go, gs), Box(lo, gs), tensor=name) for go, gs, lo in ps] for r, ls, ps in per_rank
        }
        shapes = {r: ls for r, ls, _ in per_rank}
        return ExplicitLayout(shape, dtype_from_name(dt), pieces, shapes, name=name)
    raise ValueError(f"unknown layout metadata kind {kind!r}")


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
