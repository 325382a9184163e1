"""Layout metadata as plain JSON values, so each side can declare only its own layouts and exchange them.

A layout travels as nested lists of strings and integers (no tuples, no torch objects: the dtype goes by name), and
is rebuilt identically on every rank. `Layout` keeps its mesh and DTensor placements; `ExplicitLayout` keeps its
per-rank pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def plain(value: Any) -> Any:
    """`value` with every tuple turned into a list, recursively: the form JSON gives back, so values compare equal
    whether they travelled as JSON or not."""
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def encode_layout(layout: LayoutLike) -> list:
    """A JSON description of `layout` (lists, strings, integers) that `decode_layout` turns back into an equal
    layout."""
    if isinstance(layout, Layout):
        return plain((
            "layout",
            layout.name,
            layout.shape,
            dtype_name(layout.dtype),
            layout.mesh.shape,
            layout.mesh.ranks,
            layout.mesh.axis_names,
            tuple(placement_str(p) for p in layout.placements),
        ))
    if isinstance(layout, ExplicitLayout):
        return plain((
            "explicit",
            layout.name,
            layout.shape,
            dtype_name(layout.dtype),
            tuple(
                (r, layout.local_shape(r),
                 tuple((p.global_box.offsets, p.global_box.shape, p.local_box.offsets) for p in layout.pieces(r)))
                for r in layout.ranks
            ),
        ))
    raise ValueError(f"cannot describe layout of type {type(layout).__name__}; expected Layout or ExplicitLayout")


def decode_layout(spec: list | tuple, *, ranks_map: Mapping[int, int] | None = None) -> LayoutLike:
    """The layout `spec` describes (see `encode_layout`); with `ranks_map`, a `Layout`'s mesh ranks are replaced by
    `ranks_map[rank]` (a DTensor's own numbering -> group ranks)."""
    kind = spec[0]
    if kind == "layout":
        _, name, shape, dt, mesh_shape, ranks, axis_names, placements = spec
        if ranks_map is not None:
            ranks = [ranks_map[r] for r in ranks]
        mesh = Mesh(torch.tensor(ranks, dtype=torch.int64).reshape(tuple(mesh_shape)) if ranks else [],
                    None if axis_names is None else tuple(axis_names))
        return Layout(tuple(shape), mesh, parse_placements(",".join(placements)), dtype_from_name(dt), name=name)
    if kind == "explicit":
        _, name, shape, dt, per_rank = spec
        pieces = {
            r: [Piece(Box(tuple(go), tuple(gs)), Box(tuple(lo), tuple(gs)), tensor=name) for go, gs, lo in ps]
            for r, ls, ps in per_rank
        }
        shapes = {r: tuple(ls) for r, ls, _ in per_rank}
        return ExplicitLayout(tuple(shape), dtype_from_name(dt), pieces, shapes, name=name)
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
