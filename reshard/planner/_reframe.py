"""A rank's program reading flat partitions in place of their windows (`on_flat_sources`).

A `FlatRangeLayout` rank's local tensor is its row-aligned window, and a plan's boxes are in the window's
coordinates. A rank may instead hold just its partition, the 1-D run of the range (a ZeRO-3 `ds_tensor`, padding
and all). The window is then a `FlatRun` of that partition (`FlatRangeLayout.flat_frame`, starting `start -
window_start` elements before it), and every box the program reads from that source is moved to its place in the
partition by the one translation (`local_region`). Only source reads (stage 0, this rank's own) change; messages,
byte offsets and chunks stay as planned, so the wire carries the same bytes. Pure: no tensor is touched.

Example: `(5, 3)`, rank 1 holding `[8, 15)` as a 7-element partition: the window box `Box[1:3, 0:3]` (rows 3-4)
becomes `FlatRun(-2, (3, 3), (1, 0), (2, 3))`, partition elements 1-6.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from reshard.planner._box import Box
from reshard.planner._region import FlatRun, LocalRegion, local_region
from reshard.planner._types import BoxList, Message, RankChunk, RankPlan, Transfer


def on_flat_sources(prog: RankPlan, frames: Mapping[int, FlatRun]) -> RankPlan:
    """`prog` with every box it reads from source tensor `k` of `frames` as a region of that flat partition.

    Args:
        prog: a rank's program (`Plan.for_rank`, `LocalPlan.for_rank`).
        frames: source tensor index -> the window as a run of the partition (`FlatRangeLayout.flat_frame`).

    Returns:
        The same program (`prog` itself when `frames` is empty) but for those boxes.
    """
    if not frames:
        return prog
    wholes = {k: Box((0,) * len(f.run), f.run) for k, f in frames.items()}

    def moved(k: int, box: LocalRegion) -> LocalRegion:
        return local_region(box, wholes[k], frames[k]) if k in frames and isinstance(box, Box) else box

    def own_read(t: Transfer) -> Transfer:
        if t.stage or t.src_rank != prog.rank or t.src_tensor not in frames:
            return t
        return t._replace(src_box=moved(t.src_tensor, t.src_box))

    def pack(b: BoxList) -> BoxList:
        boxes = tuple(box if d else moved(k, box) for d, k, box in zip(b.from_dst, b.tensors, b.boxes))
        return replace(b, boxes=boxes, transfers=tuple(map(own_read, b.transfers)))

    def sends(ms: tuple[Message, ...]) -> tuple[Message, ...]:
        return tuple(replace(m, transfers=tuple(map(own_read, m.transfers))) for m in ms)

    chunks: list[RankChunk] = [replace(c, local=tuple(map(own_read, c.local)), pack=pack(c.pack),
                                       sends=sends(c.sends)) for c in prog.chunks]
    return replace(prog, chunks=tuple(chunks))
