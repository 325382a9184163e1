"""Box-set helpers for the planner: a query index over many boxes, and exact union volume."""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Sequence

from reshard.planner._box import Box, intersect


class BoxIndex:
    """Finds, among a fixed list of boxes, those that may intersect a query box.

    DTensor layouts cut every dim into disjoint intervals, so the index picks the dim with the most distinct
    intervals, checks that they are disjoint, and answers a query by bisecting them. Box sets that do not have this
    shape (custom layouts) fall back to a linear scan. Answers are always exact: callers intersect the candidates.

    Example:
        >>> idx = BoxIndex([Box((0, 0), (2, 4)), Box((2, 0), (2, 4))])
        >>> idx.query(Box((1, 0), (1, 4)))
        [0]
    """

    __slots__ = ("boxes", "_dim", "_starts", "_intervals", "_members")

    def __init__(self, boxes: Sequence[Box]) -> None:
        self.boxes = list(boxes)
        self._dim = -1
        if len(self.boxes) < 8 or not self.boxes[0].ndim:
            return
        ndim = self.boxes[0].ndim
        best_dim, best = -1, 1
        for d in range(ndim):
            n = len({(b.offsets[d], b.shape[d]) for b in self.boxes})
            if n > best:
                best_dim, best = d, n
        if best_dim < 0:
            return
        members: dict[tuple[int, int], list[int]] = {}
        for i, b in enumerate(self.boxes):
            members.setdefault((b.offsets[best_dim], b.offsets[best_dim] + b.shape[best_dim]), []).append(i)
        intervals = sorted(members)
        for (a0, a1), (b0, _) in zip(intervals, intervals[1:]):
            if a1 > b0:
                return  # overlapping intervals: linear scan
        self._dim = best_dim
        self._intervals = intervals
        self._starts = [a for a, _ in intervals]
        self._members = [members[iv] for iv in intervals]

    def query(self, q: Box) -> list[int]:
        """Indices (ascending) of boxes whose extent along the index dim overlaps `q`; all of them for a scan."""
        d = self._dim
        if d < 0:
            return list(range(len(self.boxes)))
        lo, hi = q.offsets[d], q.offsets[d] + q.shape[d]
        # first interval whose stop > lo: intervals are disjoint and sorted, so stops are sorted too
        i = bisect.bisect_right(self._starts, lo) - 1
        if i < 0 or self._intervals[i][1] <= lo:
            i += 1
        out: list[int] = []
        while i < len(self._intervals) and self._intervals[i][0] < hi:
            out.extend(self._members[i])
            i += 1
        if len(out) > 1:
            out.sort()
        return out


def _pairwise_disjoint(boxes: Sequence[Box]) -> bool:
    index = BoxIndex(boxes)
    for i, b in enumerate(boxes):
        for j in index.query(b):
            if j > i and intersect(b, boxes[j]) is not None:
                return False
    return True


def union_volume(boxes: Sequence[Box], *, disjoint: bool = False) -> int:
    """The number of elements in the union of `boxes` (exact).

    Identical boxes are counted once. A set of pairwise disjoint boxes (what DTensor layouts give) is summed
    directly; otherwise the union is counted on the grid of all box boundaries (coordinate compression).
    `disjoint=True` says the distinct boxes are known to be pairwise disjoint (pieces of a DTensor layout, whose
    ranks' pieces are identical or disjoint), which skips checking it.
    """
    if disjoint:
        return sum(math.prod(b.shape) for b in set(boxes))
    unique = sorted(set(boxes), key=lambda b: (b.offsets, b.shape))
    if not unique:
        return 0
    if _pairwise_disjoint(unique):
        return sum(b.numel for b in unique)
    ndim = unique[0].ndim
    cuts = [sorted({v for b in unique for v in (b.offsets[d], b.offsets[d] + b.shape[d])}) for d in range(ndim)]
    total = 0
    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        lo = tuple(cuts[d][cell[d]] for d in range(ndim))
        if any(b.contains(Box._make(lo, (1,) * ndim)) for b in unique):
            total += _cell_volume(cuts, cell)
    return total


def _cell_volume(cuts: list[list[int]], cell: tuple[int, ...]) -> int:
    v = 1
    for d, i in enumerate(cell):
        v *= cuts[d][i + 1] - cuts[d][i]
    return v


def intersection_volume(a: Sequence[Box], b: Sequence[Box], *, disjoint: bool = False) -> int:
    """Elements in `union(a) ∩ union(b)` (exact).

    When each side is a set of pairwise disjoint boxes (after removing duplicates), the pairwise intersections are
    disjoint too and are summed; otherwise inclusion-exclusion over exact unions: `|A| + |B| - |A ∪ B|`.
    `disjoint=True` says each side's distinct boxes are known to be pairwise disjoint (see `union_volume`).
    """
    ua = sorted(set(a), key=lambda x: (x.offsets, x.shape))
    ub = sorted(set(b), key=lambda x: (x.offsets, x.shape))
    if not ua or not ub:
        return 0
    if disjoint or (_pairwise_disjoint(ua) and _pairwise_disjoint(ub)):
        index = BoxIndex(ub)
        total = 0
        for x in ua:
            for j in index.query(x):
                inter = intersect(x, ub[j])
                if inter is not None:
                    total += inter.numel
        return total
    return union_volume(ua) + union_volume(ub) - union_volume(ua + ub)
