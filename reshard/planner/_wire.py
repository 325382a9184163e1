"""Layouts on the wire: `encode_layout` gives plain JSON values, `decode_layout` checks them and rebuilds the layout.

The one encoding of a layout that crosses processes (a refit's metadata exchange, a DTensor side's description), so
each side can declare only its own layouts. Encoded values are dicts, lists, strings, ints and None only, so any
JSON channel carries them. `Layout` travels as its mesh and DTensor placements; `ExplicitLayout` as its
per-rank pieces. Decoding trusts nothing: every field is checked, and anything malformed is a `ValueError`.

Example (a `(4, 6)` bfloat16 tensor, `[S(0), R]` on a 2x2 mesh of ranks 0-3):
    >>> m = encode_layout(Layout((4, 6), Mesh([[0, 1], [2, 3]]), [Shard(0), Replicate()], torch.bfloat16))
    >>> m["kind"], m["shape"], m["dtype"], m["mesh_shape"], m["ranks"], m["placements"]
    ('mesh', [4, 6], 'bfloat16', [2, 2], [0, 1, 2, 3], ['S(0)', 'R'])
    >>> decode_layout(json.loads(json.dumps(m))) == decode_layout(m)
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement

from reshard.planner._box import Box
from reshard.planner._dtypes import dtype_from_name, dtype_name
from reshard.planner._explicit import ExplicitLayout
from reshard.planner._layout import BoundedCache, Layout, Piece, placement_str
from reshard.planner._mesh import Mesh
from reshard.planner._notation import parse_placements

MESH_CACHE_SIZE = 256
"""Distinct meshes `decode_layout` keeps built (a model's layouts use a few per pipeline stage and engine)."""

_MESHES = BoundedCache("decoded meshes", MESH_CACHE_SIZE)

_MESH_FIELDS = frozenset({"kind", "name", "shape", "dtype", "mesh_shape", "ranks", "axis_names", "placements"})
_EXPLICIT_FIELDS = frozenset({"kind", "name", "shape", "dtype", "per_rank"})


def encode_placements(placements: Sequence[Placement]) -> list[str]:
    """DTensor placements as their notation: `[Shard(0), Replicate()]` -> `["S(0)", "R"]`."""
    return [placement_str(p) for p in placements]


def decode_placements(obj: Any, *, what: str = "placements") -> list[Placement]:
    """`encode_placements`' output back to placements; `ValueError` for anything but a list of `R`, `S(d)`,
    `_S(d, k)` (and `P`, which `Layout` then refuses with its own message)."""
    items = _seq(obj, what)
    out: list[Placement] = []
    for i, tok in enumerate(items):
        if not isinstance(tok, str):
            raise ValueError(f"{what}[{i}]: expected a placement string such as 'S(0)', got {tok!r}")
        if tok == "P":
            out.append(Partial())
            continue
        parsed = parse_placements(tok)
        if len(parsed) != 1:
            raise ValueError(f"{what}[{i}]: expected one placement, got {tok!r}")
        out.append(parsed[0])
    return out


def encode_layout(layout: Layout | ExplicitLayout) -> dict[str, Any]:
    """`layout` as JSON values (dict, list, str, int, None) that `decode_layout` turns back into an equal layout."""
    if isinstance(layout, Layout):
        return {
            **_head("mesh", layout),
            "mesh_shape": list(layout.mesh.shape),
            "ranks": [int(r) for r in layout.mesh.ranks],
            "axis_names": None if layout.mesh.axis_names is None else list(layout.mesh.axis_names),
            "placements": encode_placements(layout.placements),
        }
    if isinstance(layout, ExplicitLayout):
        return {
            **_head("explicit", layout),
            "per_rank": [
                [r, list(layout.local_shape(r)),
                 [[list(p.global_box.offsets), list(p.global_box.shape), list(p.local_box.offsets), p.tensor]
                  for p in layout.pieces(r)]]
                for r in layout.ranks
            ],
        }
    raise TypeError(f"encode_layout: expected a Layout or ExplicitLayout, got {type(layout).__name__}")


def _head(kind: str, layout: Layout | ExplicitLayout) -> dict[str, Any]:
    """The fields both kinds share."""
    return {"kind": kind, "name": layout.name, "shape": list(layout.shape), "dtype": dtype_name(layout.dtype)}


def decode_layout(obj: Any) -> Layout | ExplicitLayout:
    """The layout `encode_layout` described.

    Raises:
        ValueError: `obj` is not exactly what `encode_layout` writes (missing or extra fields, wrong types, an
            unknown dtype or placement), or describes an invalid layout; the message names the field.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"layout metadata: expected a dict, got {type(obj).__name__}")
    kind = obj.get("kind")
    fields = {"mesh": _MESH_FIELDS, "explicit": _EXPLICIT_FIELDS}.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ValueError(f"layout metadata: kind must be 'mesh' or 'explicit', got {kind!r}")
    if set(obj) != fields:
        raise ValueError(f"layout metadata ({kind}): fields {sorted(obj)}, expected {sorted(fields)}")
    name = obj["name"]
    if name is not None and not isinstance(name, str):
        raise ValueError(f"layout metadata: name must be a string or None, got {name!r}")
    what = f"layout metadata of {name!r}"
    shape = _ints(obj["shape"], f"{what}: shape")
    dtype = dtype_from_name(obj["dtype"], what=f"{what}: dtype")
    try:
        if kind == "mesh":
            mesh_shape = _ints(obj["mesh_shape"], f"{what}: mesh_shape")
            ranks = _ints(obj["ranks"], f"{what}: ranks")
            axis_names = obj["axis_names"]
            if axis_names is not None:
                axis_names = _seq(axis_names, f"{what}: axis_names")
                if not all(isinstance(a, str) for a in axis_names):
                    raise ValueError(f"{what}: axis_names must be strings, got {axis_names!r}")
            size = 1
            for s in mesh_shape:
                size *= s
            if not mesh_shape or size != len(ranks):
                raise ValueError(f"{what}: mesh_shape {mesh_shape} does not hold the {len(ranks)} ranks {ranks}")
            key = (tuple(mesh_shape), tuple(ranks), None if axis_names is None else tuple(axis_names))
            mesh = _MESHES.get(key)
            if mesh is None:  # every weight of a stage or an engine repeats a few meshes: build (and check) each once
                mesh = _MESHES[key] = Mesh(torch.tensor(ranks, dtype=torch.int64).reshape(mesh_shape), axis_names)
            return Layout(shape, mesh, decode_placements(obj["placements"], what=f"{what}: placements"), dtype,
                          name=name)
        pieces: dict[int, list[Piece]] = {}
        local_shapes: dict[int, tuple[int, ...]] = {}
        for i, entry in enumerate(_seq(obj["per_rank"], f"{what}: per_rank")):
            entry = _seq(entry, f"{what}: per_rank[{i}]")
            if len(entry) != 3:
                raise ValueError(f"{what}: per_rank[{i}] must be [rank, local_shape, pieces], got {entry!r}")
            rank = _int(entry[0], f"{what}: per_rank[{i}] rank")
            if rank in local_shapes:
                raise ValueError(f"{what}: rank {rank} appears twice in per_rank")
            local_shapes[rank] = tuple(_ints(entry[1], f"{what}: rank {rank} local_shape"))
            rank_pieces = []
            for j, piece in enumerate(_seq(entry[2], f"{what}: rank {rank} pieces")):
                where = f"{what}: rank {rank} piece {j}"
                piece = _seq(piece, where)
                if len(piece) != 4:
                    raise ValueError(f"{where}: expected [global_offsets, shape, local_offsets, tensor], got {piece!r}")
                go, gs, lo = (_ints(v, where) for v in piece[:3])
                tensor = piece[3]
                if tensor is not None and not isinstance(tensor, str):
                    raise ValueError(f"{where}: tensor must be a string or None, got {tensor!r}")
                rank_pieces.append(Piece(Box(go, gs), Box(lo, gs), tensor=tensor))
            if rank_pieces:
                pieces[rank] = rank_pieces
        return ExplicitLayout(shape, dtype, pieces, local_shapes, name=name)
    except TypeError as e:  # a constructor refusing a value's type: still malformed metadata
        raise ValueError(f"{what}: {e}") from None


def _seq(obj: Any, what: str) -> list | tuple:
    if not isinstance(obj, (list, tuple)):
        raise ValueError(f"{what}: expected a list, got {obj!r}")
    return obj


def _int(obj: Any, what: str) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int):
        raise ValueError(f"{what}: expected an integer, got {obj!r}")
    return obj


def _ints(obj: Any, what: str) -> list[int]:
    seq = _seq(obj, what)
    if set(map(type, seq)) <= {int}:  # the common case, checked in one pass (a mesh's thousands of ranks)
        return list(seq)
    return [_int(v, what) for v in seq]
