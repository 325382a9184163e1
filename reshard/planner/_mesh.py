"""`Mesh`: an n-D array of global ranks, with no process group behind it."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch


def _flatten(ranks: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Returns `(shape, flat_ranks)` of an n-D nested list, numpy array or integer tensor."""
    if isinstance(ranks, torch.Tensor):
        if ranks.dtype.is_floating_point or ranks.dtype.is_complex or ranks.dtype == torch.bool:
            raise ValueError(f"Mesh: ranks must be integers, got a tensor of dtype {ranks.dtype}")
        return tuple(ranks.shape), tuple(int(r) for r in ranks.flatten().tolist())
    if hasattr(ranks, "shape") and hasattr(ranks, "dtype") and hasattr(ranks, "tolist"):  # numpy, without importing it
        kind = getattr(ranks.dtype, "kind", "i")
        if kind not in "iu":
            raise ValueError(f"Mesh: ranks must be integers, got an array of dtype {ranks.dtype}")
        ranks = ranks.tolist()
    shape: list[int] = []
    level: Any = ranks
    while isinstance(level, (list, tuple)):
        shape.append(len(level))
        if not level:
            break
        level = level[0]
    flat: list[int] = []

    def walk(node: Any, depth: int) -> None:
        if depth == len(shape):
            if isinstance(node, bool) or isinstance(node, float):
                raise ValueError(f"Mesh: ranks must be integers, got {node!r}")
            try:
                flat.append(operator.index(node))
            except TypeError:
                raise ValueError(f"Mesh: ranks must be integers, got {node!r}") from None
            return
        if not isinstance(node, (list, tuple)) or len(node) != shape[depth]:
            raise ValueError(f"Mesh: ranks must be a rectangular n-D array, got ragged nesting {ranks!r}")
        for child in node:
            walk(child, depth + 1)

    walk(ranks, 0)
    return tuple(shape), tuple(flat)


class Mesh:
    """An n-D array of distinct global ranks, like `DeviceMesh.mesh`, with optional axis names.

    Args:
        ranks: an n-D nested list, numpy array or integer tensor of distinct global ranks (`>= 0`), at least one.
        axis_names: one name per mesh axis, or None.

    Example:
        >>> m = Mesh([[0, 1], [2, 3]], axis_names=("dp", "tp"))
        >>> m.shape, m.coordinate(2)
        ((2, 2), (1, 0))
    """

    __slots__ = ("shape", "ranks", "axis_names", "_coord", "_key")

    def __init__(self, ranks: Any, axis_names: Sequence[str] | None = None) -> None:
        shape, flat = _flatten(ranks)
        if len(shape) == 0:
            raise ValueError(f"Mesh: ranks must have at least one axis, got the scalar {ranks!r}")
        if not flat:
            raise ValueError(f"Mesh: ranks must name at least one rank, got an empty mesh of shape {shape}: {ranks!r}")
        if any(r < 0 for r in flat):
            raise ValueError(f"Mesh: ranks must be >= 0, got {sorted(r for r in flat if r < 0)}")
        if len(set(flat)) != len(flat):
            seen: set[int] = set()
            dups = sorted({r for r in flat if r in seen or seen.add(r)})  # type: ignore[func-returns-value]
            raise ValueError(f"Mesh: ranks must be distinct, got duplicate ranks {dups} in {list(flat)}")
        if axis_names is not None:
            axis_names = tuple(str(n) for n in axis_names)
            if len(axis_names) != len(shape):
                raise ValueError(f"Mesh: {len(axis_names)} axis_names {axis_names} for a {len(shape)}-D mesh")
        self.shape: tuple[int, ...] = shape
        self.ranks: tuple[int, ...] = flat
        self.axis_names: tuple[str, ...] | None = axis_names
        coord: dict[int, tuple[int, ...]] = {}
        for i, r in enumerate(flat):
            c = []
            rem = i
            for s in reversed(shape):
                c.append(rem % s)
                rem //= s
            coord[r] = tuple(reversed(c))
        self._coord = coord
        self._key = (shape, flat, axis_names)

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> Mesh:
        """The mesh of a `torch.distributed.device_mesh.DeviceMesh` (its global ranks and axis names)."""
        return cls(device_mesh.mesh, axis_names=device_mesh.mesh_dim_names)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """The rank's coordinate on the mesh, or None when it is not part of it."""
        return self._coord.get(rank)

    def __contains__(self, rank: object) -> bool:
        return rank in self._coord

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._key[:2] == other._key[:2]

    def __hash__(self) -> int:
        return hash(self._key[:2])

    def __repr__(self) -> str:
        return f"Mesh(shape={self.shape}, ranks={_rank_ranges(self.ranks)}, axis_names={self.axis_names})"


def flat_index(coord: Sequence[int], mesh_shape: Sequence[int]) -> int:
    """The row-major position of `coord` in a mesh of `mesh_shape` (`(1, 0)` in `(2, 2)` -> 2)."""
    flat = 0
    for c, s in zip(coord, mesh_shape):
        flat = flat * s + c
    return flat


def _rank_ranges(ranks: Sequence[int]) -> str:
    """`[0, 1, 2, 3, 8]` -> `"0-3,8"`: compact printing of rank lists."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)
