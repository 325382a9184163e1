"""A per-tensor exact-overlap planner: the simplest honest baseline for `reshard.plan`'s planning time.

For one tensor at a time: every destination piece is intersected with every source box that overlaps it (found by
a sort along dim 0), a box the destination rank already holds is a local copy, and the replicas of a source box take
turns as its sender. No relays, no staging budget, no chunks: what a per-tensor transfer (such as NeMo RL's
`xferdtensor` fallback) plans before it sends contiguous views. Used by `perf/bench_plan.py` only.
"""

from __future__ import annotations

import bisect
from typing import Any

from reshard.planner import Box, Transfer, intersect


def _moved(box: Box, global_box: Box, local_box: Box) -> Box:
    """`box` (inside `global_box`) in the coordinates of `local_box`, where `global_box` lies in a local tensor."""
    return Box(tuple(o + lo - go for o, lo, go in zip(box.offsets, local_box.offsets, global_box.offsets)), box.shape)


def exact_overlap_plan(src: Any, dst: Any) -> list[Transfer]:
    """The exact intersections of `src`'s and `dst`'s shard boxes, one transfer each.

    Args:
        src, dst: layouts of one global shape and dtype (anything with `ranks`, `pieces(rank)`, `dtype`).

    Returns:
        `Transfer`s (link `"local"` from the destination itself, else `"network"`; stage, chunk, item 0) by
        destination rank, then piece, then source box (by offsets): every destination element once.

    Algorithm: group the source pieces by global box (the holders of each box, ascending); sort the boxes by their
    dim-0 start; for each destination piece, the boxes that can meet it start in `[lo - longest + 1, hi)` along dim
    0 (bisect), and each non-empty intersection is one transfer, from the destination itself when it holds the box,
    else from holder `k % len(holders)` for the k-th destination that needs the box.

    Example (worked by hand): `(4, 4)` on ranks `[0, 1]` as `S(0)` to ranks `[2, 3]` as `R`: rank 2 gets rows 0:2
    from rank 0 and rows 2:4 from rank 1, rank 3 the same: 4 transfers of 32 B (float32).
    """
    itemsize = dst.dtype.itemsize
    holders: dict[Box, list[tuple[int, Box, Box]]] = {}
    for r in sorted(src.ranks):
        for p in src.pieces(r):
            holders.setdefault(p.global_box, []).append((r, p.global_box, p.local_box))
    boxes = sorted(holders, key=lambda b: (b.offsets, b.shape))
    scalar = bool(boxes) and not boxes[0].shape
    starts = [b.offsets[0] if not scalar else 0 for b in boxes]
    longest = max((b.shape[0] for b in boxes), default=0) if not scalar else 1
    turns: dict[Box, int] = {}
    out: list[Transfer] = []
    for r in sorted(dst.ranks):
        for piece in dst.pieces(r):
            g = piece.global_box
            lo, hi = (g.offsets[0], g.offsets[0] + g.shape[0]) if not scalar else (0, 1)
            for k in range(bisect.bisect_left(starts, lo - longest + 1), bisect.bisect_left(starts, hi)):
                x = intersect(boxes[k], g)
                if x is None:
                    continue
                hs = holders[boxes[k]]
                own = [h for h in hs if h[0] == r]
                if own:
                    h = own[0]
                else:
                    turn = turns.get(boxes[k], 0)
                    turns[boxes[k]] = turn + 1
                    h = hs[turn % len(hs)]
                out.append(Transfer(h[0], r, _moved(x, h[1], h[2]), _moved(x, g, piece.local_box), x,
                                    x.numel * itemsize, "local" if h[0] == r else "network"))
    return out
