"""Flat-range layouts: each rank holds one contiguous range of a row-major tensor's flattened elements.

Trainers that shard by flattening (DeepSpeed ZeRO-3's `ds_tensor`, FSDP1's flat parameters, Megatron's
distributed-optimizer buffers) give each rank the elements `[start, stop)` of `tensor.reshape(-1)`. The planner
moves boxes, so a range becomes the boxes it covers (`flat_boxes`): in 2-D at most three (a partial first row,
whole rows, a partial last row), in N-D at most `2 N - 1`.

The local tensor of such a rank is its *window* (`flat_window`): the whole rows (along dim 0) the range touches,
`(rows, *shape[1:])`, of which the range's boxes are the only part ever read or written. A flat partition whose
storage extends far enough on both sides is that window with no copy (`torch.as_strided` of the partition's
storage, starting `start % row` elements before the range); otherwise a small copy of the window is refreshed.

Worked example (`(5, 3)`, ranks 0 and 1 holding `[0, 8)` and `[8, 15)`, ZeRO-3's rule for 2 ranks):

    rank 0: rows 0-1 whole, row 2 columns 0-1   boxes [0:2, 0:3], [2:3, 0:2]   window rows 0-2: (3, 3), first 0
    rank 1: row 2 column 2, rows 3-4 whole      boxes [2:3, 2:3], [3:5, 0:3]   window rows 2-4: (3, 3), first 6
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from reshard.planner._box import Box, _as_int
from reshard.planner._explicit import ExplicitLayout, _sizes
from reshard.planner._layout import Piece


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


class FlatRangeLayout(ExplicitLayout):
    """A layout in which each rank holds one contiguous range of the row-major flattened tensor.

    Args:
        shape: the global shape.
        dtype: element type.
        ranges: rank -> `(start, stop)`, flat element indices of the range it holds (ranges may overlap across
            ranks: replicas). A rank with an empty range holds nothing and has an empty window.
        name: the global tensor's name.

    Each rank's local tensor is its window (`flat_window`: the whole rows its range touches); its pieces are the
    range's boxes (`flat_boxes`), shifted into the window. Elements of the window outside the range (the rows'
    parts other ranks hold) are never read or written.

    Example (`(5, 3)` over 2 ranks by ZeRO-3's rule):
        >>> lay = FlatRangeLayout((5, 3), torch.float32, flat_partition(15, 2))
        >>> lay.local_shape(1), [p.global_box for p in lay.pieces(1)], lay.window_start(1)
        ((3, 3), [Box[2:3, 2:3], Box[3:5, 0:3]], 6)
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, ranges: Mapping[int, tuple[int, int]], *,
                 name: str | None = None) -> None:
        who = f"tensor {name!r}" if name else "FlatRangeLayout"
        shape = _sizes(shape, f"{who}: shape")
        n = math.prod(shape)
        checked: dict[int, tuple[int, int]] = {}
        for r, rng in ranges.items():
            rank = _as_int(r, f"{who}: ranges: rank")
            if not isinstance(rng, (tuple, list)) or len(rng) != 2:
                raise ValueError(f"{who}: rank {rank}: a range must be (start, stop), got {rng!r}")
            start, stop = (_as_int(v, f"{who}: rank {rank} range") for v in rng)
            if not 0 <= start <= stop <= n:
                raise ValueError(f"{who}: rank {rank} range [{start}, {stop}) is not within the {n} elements of "
                                 f"shape {shape}")
            checked[rank] = (start, stop)
        pieces: dict[int, list[Piece]] = {}
        local_shapes: dict[int, tuple[int, ...]] = {}
        for r, (start, stop) in checked.items():
            first, window = flat_window(shape, start, stop)
            row0 = first // math.prod(shape[1:]) if shape and math.prod(shape[1:]) else 0
            shift = (-row0,) + (0,) * (len(shape) - 1) if shape else ()
            pieces[r] = [Piece(b, b.translate(shift), tensor=name) for b in _boxes(shape, start, stop)]
            local_shapes[r] = window
        super().__init__(shape, dtype, pieces, local_shapes, name=name)
        self.ranges: dict[int, tuple[int, int]] = checked

    def window_start(self, rank: int) -> int:
        """The flat index of the first element of `rank`'s window (its range starts `start - window_start` in)."""
        start, stop = self.ranges.get(rank, (0, 0))
        return flat_window(self.shape, start, stop)[0]

    def __repr__(self) -> str:
        return "Flat" + super().__repr__().replace("ExplicitLayout", "RangeLayout", 1)
