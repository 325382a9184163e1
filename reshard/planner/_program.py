"""A rank's program (`RankPlan`) from its transfers, chunk by chunk: the messages of each chunk, the box lists of
its pack and unpack calls, and the staging sizes. Shared by the whole plan (`Plan.for_rank`) and the rank-local one
(`LocalPlan.for_rank`): pure geometry, so the two ends of a message list the same messages without talking."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from reshard.planner._box import Box
from reshard.planner._item import PlanItem
from reshard.planner._messages import _box_list, _contiguous_in, _messages
from reshard.planner._types import RankChunk, RankPlan, Transfer

ChunkWork = tuple[int, list[Transfer], dict[int, list[Transfer]], dict[int, list[Transfer]], int]
"""One chunk of a rank: `(index, local copies, sends by peer, receives by peer, unpack_before_pack)`; each peer's
transfers in the order both ends agree on."""


def rank_program(items: Sequence[PlanItem], rank: int, chunks: Iterable[ChunkWork]) -> RankPlan:
    """`rank`'s program from its chunks (given in increasing index): per chunk its messages (`_messages`: by peer,
    boxes in the given order), its local copies and the box lists of its pack and unpack calls."""
    shapes: dict[tuple[bool, int, int], tuple[int, ...]] = {}
    known: dict[tuple[tuple[int, ...], Box], bool] = {}  # (local shape, box) -> contiguous: items repeat both

    def contiguous_at(t: Transfer, sending: bool) -> bool:
        """Whether the box is read from (written to) the local tensor of its sender (receiver) as it is:
        contiguous there, no cast while packing. Pure geometry of the plan, so both ends compute the same."""
        item = items[t.item]
        if sending and t.stage == 0 and item.casts:
            return False
        on_dst = not sending or t.stage > 0
        end = t.src_rank if sending else t.dst_rank
        key = (on_dst, t.item, end)
        shape = shapes.get(key)
        if shape is None:
            shape = shapes[key] = tuple((item.dst if on_dst else item.src).local_shape(end))
        box = t.src_box if sending else t.dst_box
        out = known.get((shape, box))
        if out is None:
            out = known[(shape, box)] = _contiguous_in(box, shape)
        return out

    out = []
    peers: set[int] = set()
    for index, local, sends, recvs, dep in chunks:
        send_msgs = _messages(sends, lambda t: contiguous_at(t, True), contiguous_at)
        recv_msgs = _messages(recvs, lambda t: contiguous_at(t, False), contiguous_at)
        peers.update(sends)
        peers.update(recvs)
        out.append(RankChunk(index, send_msgs, recv_msgs, tuple(local), sum(m.nbytes for m in send_msgs),
                             sum(m.nbytes for m in recv_msgs), dep, _box_list(items, send_msgs, sending=True),
                             _box_list(items, recv_msgs, sending=False)))
    return RankPlan(
        rank,
        tuple(out),
        max((c.send_bytes for c in out), default=0),
        max((c.recv_bytes for c in out), default=0),
        tuple(sorted(peers)),
        max_chunk_bytes=max((c.send_bytes + c.recv_bytes for c in out), default=0),
        max_send_boxes=max((len(c.pack.boxes) for c in out), default=0),
        max_recv_boxes=max((len(c.unpack.boxes) for c in out), default=0),
        local_bytes=sum(t.nbytes for c in out for t in c.local),
    )
