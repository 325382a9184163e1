"""Where a box lives in its local tensor: local regions, their one translation helper and their one view function.

A piece is a box of a global tensor that a rank holds (`Piece.global_box`); its *local region* says where those
elements lie in the rank's local tensor. A region is one of two kinds:

- a box of the local tensor (`Box`): the local tensor has the layout's local shape and the elements are
  `local[box.slices()]`, whatever the local tensor's strides;
- a flat run (`FlatRun`): the local tensor is 1-D (a ZeRO-3 partition, an FSDP1 flat parameter) and the piece's
  elements are its elements `[start, start + prod(run))`, row-major in the piece's shape `run`. A sub-box of the
  piece (`offsets`, `shape` inside `run`) is a strided view of that run, so the flat tensor is a piece with no copy.
  A run may start before the tensor (a row-aligned window around a partition: `FlatRangeLayout.flat_frame`) as
  long as the box itself lies inside.

Everything that turns a region into memory goes through here: `local_region` moves a sub-box of a piece's global box
to its region (the planner's `delta` / `shift` are the same map for box regions, in the form its inner loops use);
`region_strides` gives a region's first element and strides in a tensor of given strides (the kernels' descriptor
tables); `region_view` is the region as a view of the tensor (every slicing site of comm and refit). The module is
pure integer arithmetic except `region_view`, which only builds a view (it never copies or reads data).

Worked example (a `(5, 3)` tensor; a rank holds the flat range `[8, 15)` as a 1-D partition `part` of 7 elements):

    piece global Box[3:5, 0:3]   region FlatRun(start=1, run=(2, 3))   region_view(part, ...) = part[1:7].view(2, 3)
    sub-box Box[3:5, 1:2]        local_region -> FlatRun(1, (2, 3), offsets=(0, 1), shape=(2, 1))
                                 region_strides((1,), ...) = (2, (3, 1)): elements part[2], part[5]
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from reshard.planner._box import Box

Delta = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FlatRun:
    """A box of a piece laid out row-major at `start` of a 1-D local tensor.

    Attributes:
        start: the element of the flat local tensor where the run's first element (row-major) lies. Negative when
            the run begins before the tensor: a rank's row-aligned window around its partition (`FlatRangeLayout.
            flat_frame`), whose boxes that are read all lie inside the partition (`region_fits` checks that).
        run: the run's shape (a piece's shape, or a window's); its elements are `[start, start + prod(run))` of the
            flat tensor.
        offsets, shape: the box inside `run` this region is (the whole run when `offsets` is all zeros and
            `shape == run`); `offsets[d] + shape[d] <= run[d]`.

    Example: `FlatRun(4, (2, 3))` is elements `[4, 10)` viewed `(2, 3)`; `FlatRun(4, (2, 3), (0, 2), (2, 1))` its
    last column: elements 6 and 9.
    """

    start: int
    run: tuple[int, ...]
    offsets: tuple[int, ...] = ()
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        run = tuple(operator.index(v) for v in self.run)
        offsets = tuple(operator.index(v) for v in self.offsets) if self.offsets else (0,) * len(run)
        shape = tuple(operator.index(v) for v in self.shape) if self.shape or not run else run
        start = operator.index(self.start)
        if len(offsets) != len(run) or len(shape) != len(run) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, shape, run)):
            raise ValueError(f"FlatRun: box offsets {offsets} shape {shape} does not fit run {run} at start {start}")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "run", run)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "shape", shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        """One past the last element of the flat tensor the whole run covers."""
        return self.start + math.prod(self.run)

    def span(self) -> tuple[int, int]:
        """`[first, last + 1)`: the elements of the flat tensor the box itself touches (`(0, 0)` when empty)."""
        if any(s == 0 for s in self.shape):
            return 0, 0
        strides = _row_major(self.run)
        first = self.start + sum(map(operator.mul, self.offsets, strides))
        return first, first + 1 + sum((s - 1) * st for s, st in zip(self.shape, strides))

    def __repr__(self) -> str:
        inner = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.shape))
        return f"FlatRun[{self.start}:{self.stop} as {self.run}][{inner}]"


LocalRegion = Box | FlatRun
"""Where a piece (or a sub-box of one) lies in its local tensor: a box of it, or a run of a flat one."""


def delta(global_box: Box, local_box: Box) -> Delta:
    """The per-dim shift from a piece's global box to its local box (`local = global + delta`)."""
    return tuple(map(operator.sub, local_box.offsets, global_box.offsets))


def shift(box: Box, by: Delta) -> Box:
    """`box` moved by `by` (`delta`), unchecked: for the planner's inner loops, whose values are already checked."""
    return Box._make(tuple(map(operator.add, box.offsets, by)), box.shape)


def local_region(global_box: Box, piece_global: Box, piece_local: LocalRegion) -> LocalRegion:
    """The local region of `global_box`, a box inside a piece whose global box is `piece_global` and whose local
    region is `piece_local`: the one global-box-to-local translation.

    Example: in a piece `Box[4:8, 0:3]` held at local `Box[0:4, 0:3]`, `Box[5:7, 1:3]` is local `Box[1:3, 1:3]`;
    held as `FlatRun(0, (4, 3))`, it is `FlatRun(0, (4, 3), (1, 1), (2, 2))`.

    Raises:
        ValueError: `global_box` is not inside `piece_global`.
    """
    if not piece_global.contains(global_box) or global_box.ndim != piece_global.ndim:
        raise ValueError(f"local_region: {global_box!r} is not inside the piece {piece_global!r}")
    moved = tuple(map(operator.sub, global_box.offsets, piece_global.offsets))
    if isinstance(piece_local, FlatRun):
        return FlatRun(piece_local.start, piece_local.run, tuple(map(operator.add, piece_local.offsets, moved)),
                       global_box.shape)
    return Box._make(tuple(map(operator.add, piece_local.offsets, moved)), global_box.shape)


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    out = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        out[d] = out[d + 1] * max(shape[d + 1], 1)
    return tuple(out)


def region_strides(strides: tuple[int, ...], region: LocalRegion) -> tuple[int, tuple[int, ...]]:
    """`(first, strides)` of `region` in a tensor of `strides` (in elements): its first element lies `first`
    elements after the tensor's first (`data_ptr()`), and it steps `strides` per dim. A `FlatRun` needs a 1-D tensor.

    Example: `region_strides((6, 2), Box((1, 2), (2, 2)))` is `(10, (6, 2))`; `region_strides((1,), FlatRun(4, (2,
    3), (0, 2), (2, 1)))` is `(6, (3, 1))`.
    """
    if isinstance(region, FlatRun):
        if len(strides) != 1:
            raise ValueError(f"{region!r} is a run of a flat (1-D) local tensor, got one with strides {strides}")
        s0 = strides[0]
        run = tuple(s * s0 for s in _row_major(region.run))
        return (region.start * s0 + sum(map(operator.mul, region.offsets, run))), run
    return sum(map(operator.mul, region.offsets, strides)), tuple(strides)


def region_fits(shape: tuple[int, ...], region: LocalRegion) -> bool:
    """Whether `region` lies inside a local tensor of `shape` (a `FlatRun`: a 1-D tensor long enough)."""
    if isinstance(region, FlatRun):
        first, stop = region.span()
        return len(shape) == 1 and first >= 0 and stop <= shape[0]
    return len(region.shape) == len(shape) and all(o + s <= n for o, s, n in zip(region.offsets, region.shape,
                                                                                  shape))


def region_view(tensor: torch.Tensor, region: LocalRegion) -> torch.Tensor:
    """`region` of `tensor` as a view (never a copy): `tensor[box.slices()]` for a box; for a `FlatRun`, the run of
    the 1-D `tensor` shaped `run`, cut to the region's box. Shape `region.shape`, `tensor`'s dtype and storage."""
    if isinstance(region, FlatRun):
        first, strides = region_strides(tuple(tensor.stride()), region)
        return tensor.as_strided(region.shape, strides, tensor.storage_offset() + first)
    return tensor[region.slices()]


# Flat ranges: the boxes and the row-aligned window a contiguous range of a row-major tensor covers


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes of a row-major tensor of `shape` that its flattened elements `[start, stop)` cover, in order.

    Algorithm: split off dim 0 (rows of `inner = prod(shape[1:])` elements): the range is a partial first row
    (recursing into `shape[1:]`), whole rows (one box), and a partial last row (recursing). At most `2 N - 1` boxes
    for `N` dims; a range inside one row is that row's sub-range.

    Example: `flat_boxes((5, 3), 2, 10)` is `[Box[0:1, 2:3], Box[1:3, 0:3], Box[3:4, 0:1]]`.

    Raises:
        ValueError: `not 0 <= start <= stop <= prod(shape)`.
    """
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"flat_boxes: range [{start}, {stop}) is not within the {n} elements of shape {shape}")
    return _boxes(shape, start, stop)


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)

    def row(r: int, lo: int, hi: int) -> list[Box]:
        return [Box((r, *b.offsets), (1, *b.shape)) for b in _boxes(rest, lo, hi)]

    if r0 == r1:
        return row(r0, c0, c1)
    out: list[Box] = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(Box((r0,) + (0,) * len(rest), (r1 - r0, *rest)))
    if c1:
        out += row(r1, 0, c1)
    return out


def flat_window(shape: Sequence[int], start: int, stop: int) -> tuple[int, tuple[int, ...]]:
    """The local window of the range `[start, stop)`: `(first, window_shape)`, where `first` is the flat index of
    the window's first element (`(start // inner) * inner`, `inner = prod(shape[1:])`) and `window_shape` is
    `(rows, *shape[1:])` with `rows` the rows the range touches (0 for an empty range). A 0-d tensor's window is
    itself: `(0, ())`.

    Example: `flat_window((5, 3), 8, 15)` is `(6, (3, 3))`: rows 2-4, the range starting 2 elements in.
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        return 0, ()
    inner = math.prod(shape[1:])
    if start >= stop or inner == 0:
        return 0, (0, *shape[1:])
    r0 = start // inner
    r1 = -(-stop // inner)
    return r0 * inner, (r1 - r0, *shape[1:])


def flat_partition(numel: int, num_ranks: int) -> dict[int, tuple[int, int]]:
    """ZeRO-3's even flat partition: rank `r` of `num_ranks` holds `[r * ps, min((r + 1) * ps, numel))` with
    `ps = ceil(numel / num_ranks)`; the padding (`ps * num_ranks - numel` elements) is at the tail only, so the
    last ranks of a small tensor may hold only padding (an empty range here).

    Example: `flat_partition(4, 3)` is `{0: (0, 2), 1: (2, 4), 2: (4, 4)}`.
    """
    if num_ranks < 1:
        raise ValueError(f"flat_partition: num_ranks must be >= 1, got {num_ranks}")
    ps = -(-numel // num_ranks)
    return {r: (min(r * ps, numel), min((r + 1) * ps, numel)) for r in range(num_ranks)}


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (checked by its attributes, `to_local` and `placements`: no DTensor import)."""
    return hasattr(t, "to_local") and hasattr(t, "placements")


@runtime_checkable
class LayoutLike(Protocol):
    """What every layout gives the planner and the runtime (a `Layout`, an `ExplicitLayout`, a `FlatRangeLayout`):
    the global `shape` and `dtype`, and per rank its local shape and pieces."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def local_shape(self, rank: int) -> tuple[int, ...]: ...

    def pieces(self, rank: int) -> Any: ...
