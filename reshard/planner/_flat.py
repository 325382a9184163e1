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

from reshard.planner._box import _as_int
from reshard.planner._explicit import ExplicitLayout, _sizes
from reshard.planner._layout import Piece
from reshard.planner._region import (FlatRun, _boxes, _row_major, flat_boxes, flat_partition, flat_window,
                                     shift)

__all__ = ["FlatRangeLayout", "flat_boxes", "flat_partition", "flat_window"]


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
            by = (-row0,) + (0,) * (len(shape) - 1) if shape else ()
            pieces[r] = [Piece(b, shift(b, by), tensor=name) for b in _boxes(shape, start, stop)]
            local_shapes[r] = window
        super().__init__(shape, dtype, pieces, local_shapes, name=name)
        self.ranges: dict[int, tuple[int, int]] = checked

    def window_start(self, rank: int) -> int:
        """The flat index of the first element of `rank`'s window (its range starts `start - window_start` in)."""
        start, stop = self.ranges.get(rank, (0, 0))
        return flat_window(self.shape, start, stop)[0]

    def flat_frame(self, rank: int) -> FlatRun:
        """`rank`'s window (its local shape) as a run of its 1-D partition (element 0 the range's first element):
        it starts `start - window_start` elements before the partition, and every box of the window that a plan
        reads (the range's) lies inside it. `local_region(box, Box((0,) * n, window), frame)` is a window box's
        place in the partition: how the executor reads a partition given in place of the window.

        Example (`(5, 3)`, rank 1 holding `[8, 15)`): `FlatRun(-2, (3, 3))`.
        """
        start, _ = self.ranges.get(rank, (0, 0))
        return FlatRun(self.window_start(rank) - start, self.local_shape(rank))

    def flat_pieces(self, rank: int) -> list[Piece]:
        """`rank`'s pieces with flat-run local regions: each piece's elements as the run of the rank's 1-D
        partition (element 0 is the range's first element) it occupies, so the partition itself is the local tensor,
        with no window and no copy (`reshard.planner.region_view(part, piece.local_box)`).

        Example (`(5, 3)`, rank 1 holding `[8, 15)`): `[Piece(Box[2:3, 2:3], FlatRun[0:1 as (1, 1)]), Piece(Box[3:5,
        0:3], FlatRun[1:7 as (2, 3)])]`.
        """
        start, _ = self.ranges.get(rank, (0, 0))
        out = []
        for p in self.pieces(rank):
            first = sum(o * s for o, s in zip(p.global_box.offsets, _row_major(self.shape)))
            out.append(Piece(p.global_box, FlatRun(first - start, p.global_box.shape), tensor=p.tensor))
        return out

    def __repr__(self) -> str:
        return "Flat" + super().__repr__().replace("ExplicitLayout", "RangeLayout", 1)
