"""`Layout`: which part of a global tensor each rank holds, with DTensor's exact semantics.

A layout is a global shape and dtype, a `Mesh`, and one placement per mesh axis: `Shard(d)`, `Replicate()` or
`_StridedShard(d, split_factor=k)`, the very classes of `torch.distributed.tensor`. Placements apply left to
right over the mesh axes, exactly as `distribute_tensor` applies them, so several axes sharding one dim nest.

A rank's local tensor is described as *pieces*: each piece is one box of the global tensor and the box of the
local tensor it occupies. `Shard` gives one piece per rank; `_StridedShard` gives several (its local tensor
concatenates strided chunks). Empty pieces are dropped, so a rank with an empty shard, or a rank outside the mesh,
has no pieces; `local_shape` still tells their local shape.
"""

from __future__ import annotations

import itertools
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard.planner._box import Box, _as_int
from reshard.planner._dtypes import dtype_name
from reshard.planner._mesh import Mesh, _rank_ranges
from reshard.planner._placements import parse_placements

Interval = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Piece:
    """One box of a global tensor held by a rank, and where it lies in that rank's local tensor.

    `local_box` is the piece's local region (`reshard.planner.LocalRegion`): a `Box` of the local tensor, or a
    `FlatRun` of a flat (1-D) local tensor (`FlatRangeLayout.flat_pieces`); `global_box.shape == local_box.shape`
    always. `tensor` names the global tensor when a local tensor is built from
    pieces of several global tensors (fused layouts); it is None for a plain layout.
    """

    global_box: Box
    local_box: Box
    tensor: str | None = None


def placement_str(p: Placement) -> str:
    """DTensor notation: `S(0)`, `R`, `_S(0, 2)`, `P`."""
    if isinstance(p, _StridedShard):
        return f"_S({p.dim}, {p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P"
    return repr(p)


def _chunk(length: int, num_chunks: int, index: int) -> Interval:
    """`torch.chunk` semantics: chunk `index` of `num_chunks` over `[0, length)`, empty trailing chunks included.

    Example: length 5 in 4 chunks gives [0,2) [2,4) [4,5) [5,5).
    """
    size = -(-length // num_chunks)
    return min(index * size, length), min((index + 1) * size, length)


def _select(intervals: list[Interval], start: int, stop: int) -> list[Interval]:
    """The global intervals that local positions `[start, stop)` of the concatenation of `intervals` cover."""
    out: list[Interval] = []
    pos = 0
    for a, b in intervals:
        n = b - a
        lo, hi = max(start - pos, 0), min(stop - pos, n)
        if lo < hi:
            out.append((a + lo, a + hi))
        pos += n
        if pos >= stop:
            break
    return out


def _apply_shard(
    intervals: list[Interval], placement: Shard | _StridedShard, num_chunks: int, coord: int
) -> list[Interval]:
    """Shard the local extent of one dim (a concatenation of global intervals) as DTensor does for one mesh axis."""
    length = sum(b - a for a, b in intervals)
    if isinstance(placement, _StridedShard):
        # torch 2.13: chunk into split_factor pieces, chunk each piece into num_chunks, and concatenate chunk
        # `coord` of every piece (a virtual right-to-left sharding, see `_StridedShard._split_tensor`).
        out: list[Interval] = []
        split_factor = int(placement.split_factor)
        for j in range(split_factor):
            p0, p1 = _chunk(length, split_factor, j)
            c0, c1 = _chunk(p1 - p0, num_chunks, coord)
            out.extend(_select(intervals, p0 + c0, p0 + c1))
        return out
    c0, c1 = _chunk(length, num_chunks, coord)
    return _select(intervals, c0, c1)


def _merge(intervals: list[Interval]) -> list[Interval]:
    """Join abutting intervals, so a local run that is contiguous in the global tensor is one piece, not several."""
    out: list[Interval] = []
    for a, b in intervals:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


class BoundedCache(OrderedDict):
    """A dict that keeps only its `maxsize` most recently used entries (least recently used evicted first).

    Every planner cache is one of these, so a process that plans many distinct shapes holds a bounded amount of
    memory; `clear_caches()` (called by `clear_plan_cache()`) empties them all.
    """

    def __init__(self, name: str, maxsize: int) -> None:
        super().__init__()
        self.name = name
        self.maxsize = maxsize
        _CACHES.append(self)

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


_CACHES: list[BoundedCache] = []


def clear_caches() -> None:
    """Empty every `BoundedCache` of the planner."""
    for cache in _CACHES:
        cache.clear()


GEOMETRY_CACHE_SIZE = 2048
"""Distinct layout geometries whose pieces are kept (a model has tens to hundreds)."""

_GEOMETRY = BoundedCache("layout geometries", GEOMETRY_CACHE_SIZE)
_GEOMETRY_IDS = itertools.count()


def _shared_cache(key: tuple) -> tuple[int, dict, dict]:
    """One id and one pair of per-rank caches (pieces, local shapes) per distinct layout geometry.

    A model has hundreds of tensors with the same shape, mesh and placements; their pieces are computed once.
    The id is a small int that the planner hashes instead of the long key. Ids are never reused: a geometry
    evicted from the bounded cache (or cleared) and seen again gets a new id, so equal ids always mean equal
    geometry (equal geometry then need not mean equal ids, which only costs sharing).
    """
    entry = _GEOMETRY.get(key)
    if entry is None:
        entry = (next(_GEOMETRY_IDS), {}, {})
        _GEOMETRY[key] = entry
    return entry


def _geometry_id(layout: Any) -> int:
    """The small int naming `layout`'s geometry (its `key`: shape, dtype, ranks, pieces; not its name), for any
    layout type: its own `geometry_id` when it has one."""
    gid = getattr(layout, "geometry_id", None)
    return gid if gid is not None else _shared_cache(layout.key)[0]


def _parse_placements(placements: Any, who: str) -> tuple[Any, ...]:
    """`placements` as a tuple, with strings in DTensor notation parsed (`"R,S(0)"`, or `["R", "S(0)"]`)."""
    if isinstance(placements, str):
        return tuple(parse_placements(placements))
    if not hasattr(placements, "__iter__"):
        raise TypeError(f"{who}: placements must be a sequence of placements, got {placements!r}")
    out: list[Any] = []
    for p in placements:
        if isinstance(p, str):
            parsed = parse_placements(p)
            if len(parsed) != 1:
                raise ValueError(f"{who}: placement string {p!r} in a list must name one placement, got "
                                 f"{len(parsed)} (write the whole list as one string, or one string per axis)")
            p = parsed[0]
        out.append(p)
    return tuple(out)


class Layout:
    """Global shape + dtype + mesh + placements: which part of the global tensor each rank holds.

    Args:
        shape: the global shape, `()` for a scalar: integers (`bool` is refused).
        mesh: the ranks holding the tensor.
        placements: one `Shard`, `Replicate` or `_StridedShard` per mesh axis. `Partial` is refused: reshard moves
            values, so reduce first. Each may also be written in DTensor notation as a string (`"S(0)"`, `"R"`,
            `"_S(0,2)"`), and the whole list as one string (`"R,S(0)"`); they are parsed as `parse_placements`
            does. torch's `_StridedShard` truncates a fractional `split_factor` (1.5 -> 1) when it is built, before
            reshard sees it; the notation refuses one.
        dtype: the element type.
        name: the tensor's name, used in error messages.

    Example (a `(4, 6)` tensor on a 2x2 mesh, `[S(0), S(1)]`):
        >>> lay = Layout((4, 6), Mesh([[0, 1], [2, 3]]), [Shard(0), Shard(1)])
        >>> [p.global_box for p in lay.pieces(3)], lay.local_shape(3)
        ([Box[2:4, 3:6]], (2, 3))
    """

    def __init__(
        self,
        shape: Sequence[int],
        mesh: Mesh,
        placements: Sequence[Placement],
        dtype: torch.dtype = torch.float32,
        *,
        name: str | None = None,
    ) -> None:
        who = f"tensor {name!r}" if name else "Layout"
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise TypeError(f"{who}: shape must be a sequence of integers, got {shape!r}")
        shape = tuple(_as_int(s, f"{who}: shape {tuple(shape)!r}: each size") for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"{who}: shape must have sizes >= 0, got {shape}")
        if not isinstance(mesh, Mesh):
            raise ValueError(f"{who}: mesh must be a reshard.Mesh, got {type(mesh).__name__}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{who}: dtype must be a torch.dtype, got {dtype!r}")
        placements = _parse_placements(placements, who)
        if len(placements) != mesh.ndim:
            raise ValueError(
                f"{who}: expected {mesh.ndim} placements, one per mesh axis of mesh shape {mesh.shape}, "
                f"got {len(placements)}: {[placement_str(p) for p in placements]}"
            )
        ndim = len(shape)
        normalized: list[Placement] = []
        for axis, p in enumerate(placements):
            if isinstance(p, Partial):
                raise ValueError(
                    f"{who}: Partial placement on mesh axis {axis} is not supported: reshard moves values, "
                    "reduce the tensor first (expected Shard, Replicate or _StridedShard)"
                )
            if isinstance(p, (Shard, _StridedShard)):
                _as_int(p.dim, f"{who}: {type(p).__name__} on mesh axis {axis}: dim")
                if not -ndim <= p.dim < ndim:
                    raise ValueError(
                        f"{who}: {placement_str(p)} on mesh axis {axis} shards dim {p.dim}, out of range for a "
                        f"{ndim}-D tensor of shape {shape} (expected -{ndim} <= dim < {ndim})"
                    )
                d = p.dim % ndim
                if isinstance(p, _StridedShard):
                    k = _as_int(p.split_factor, f"{who}: _StridedShard on mesh axis {axis}: split_factor")
                    if k < 1:
                        raise ValueError(f"{who}: {placement_str(p)} on mesh axis {axis} needs split_factor >= 1, "
                                         f"got {k}")
                    p = _StridedShard(d, split_factor=k)
                else:
                    p = Shard(d)
            elif not isinstance(p, Placement):
                raise TypeError(
                    f"{who}: placement {p!r} on mesh axis {axis} is a {type(p).__name__}, not a placement "
                    "(expected Shard(d), Replicate(), _StridedShard(d, split_factor=k), or the same in DTensor "
                    "notation as a string: 'S(0)', 'R', '_S(0,2)')"
                )
            elif not isinstance(p, Replicate):
                raise NotImplementedError(
                    f"{who}: placement {p!r} on mesh axis {axis} is not supported "
                    "(expected Shard, Replicate or _StridedShard)"
                )
            normalized.append(p)
        self.shape: tuple[int, ...] = shape
        self.mesh = mesh
        self.placements: tuple[Placement, ...] = tuple(normalized)
        self.dtype = dtype
        self.name = name
        # layouts of equal geometry (every layer of a model) share their pieces: see `_shared_cache`
        # DTensor layouts cut every dim into the same intervals on every rank, so any two ranks' pieces are
        # identical or disjoint; the planner relies on this to skip overlap checks
        self.regular = True
        self.key = (
            "layout",
            shape,
            str(dtype),
            mesh.shape,
            mesh.ranks,
            tuple(placement_str(p) for p in normalized),
        )
        self.geometry_id, self._pieces, self._local_shapes = _shared_cache(self.key)

    @classmethod
    def from_dtensor(cls, dt: Any, *, name: str | None = None) -> Layout:
        """The layout of a `torch.distributed.tensor.DTensor` (its global shape, dtype, mesh and placements)."""
        return cls(tuple(dt.shape), Mesh.from_device_mesh(dt.device_mesh), dt.placements, dt.dtype, name=name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks of the mesh, in mesh order."""
        return self.mesh.ranks

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def _dim_intervals(self, rank: int) -> list[list[Interval]] | None:
        coord = self.mesh.coordinate(rank)
        if coord is None:
            return None
        per_dim: list[list[Interval]] = [[(0, s)] for s in self.shape]
        for axis, p in enumerate(self.placements):
            if isinstance(p, (Shard, _StridedShard)):
                per_dim[p.dim] = _apply_shard(per_dim[p.dim], p, self.mesh.shape[axis], coord[axis])
        return per_dim

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of `rank`'s local tensor; `(0,)` for a rank outside the mesh, as DTensor gives."""
        shape = self._local_shapes.get(rank)
        if shape is None:
            self.pieces(rank)
            shape = self._local_shapes.get(rank, (0,))
        return shape

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The non-empty pieces `rank` holds, in local row-major order; `()` outside the mesh.

        Args:
            rank: a global rank (an int).

        Returns:
            Pieces whose `local_box`es tile the rank's local tensor of shape `local_shape(rank)`.
        """
        cached = self._pieces.get(rank)
        if cached is not None:
            return cached
        if isinstance(rank, bool) or not isinstance(rank, int):
            try:
                rank = operator.index(rank)
            except TypeError:
                raise ValueError(f"rank must be an integer, got {rank!r}") from None
        per_dim = self._dim_intervals(rank)
        if per_dim is None:  # not cached: the caches stay bounded by the mesh size, whatever ranks are asked
            return ()
        self._local_shapes[rank] = tuple(sum(b - a for a, b in iv) for iv in per_dim)
        # local position of each global interval, per dim
        runs: list[list[tuple[int, int, int]]] = []  # (global_start, local_start, length)
        for iv in per_dim:
            pos = 0
            dim_runs = []
            for a, b in _merge(iv):
                dim_runs.append((a, pos, b - a))
                pos += b - a
            runs.append(dim_runs)
        out = []
        for combo in itertools.product(*runs):
            shape = tuple(r[2] for r in combo)
            global_box = Box._make(tuple(r[0] for r in combo), shape)
            out.append(Piece(global_box, Box._make(tuple(r[1] for r in combo), shape)))
        pieces = tuple(out)
        self._pieces[rank] = pieces
        return pieces

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        pl = ", ".join(placement_str(p) for p in self.placements)
        dt = dtype_name(self.dtype)
        mesh = "x".join(str(s) for s in self.mesh.shape)
        nm = f"{self.name!r} " if self.name else ""
        return f"Layout({nm}{list(self.shape)} {dt} ranks={_rank_ranges(self.mesh.ranks)} mesh={mesh} [{pl}])"
