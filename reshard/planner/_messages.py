"""Messages and box lists: how one rank's side of one chunk is cut into messages, and the boxes of its pack and
unpack calls.

Pure geometry of the plan (`Plan.for_rank` calls these), so the sender and the receiver of a message list the same
messages, boxes and byte offsets without talking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Sequence

import torch

from reshard.planner._box import Box
from reshard.planner._item import PlanItem
from reshard.planner._types import BoxList, Message, Transfer

DIRECT_SPLIT_BYTES = 256 << 10
"""A box of at least this many bytes that is contiguous in its local tensor at one end (sender or receiver) or both
is a message of its own, sent from (received into) the tensor at that end, instead of being packed with the
peer's other boxes of the chunk: above this size one more message on the wire costs less than packing and
unpacking the box (gloo on CPU)."""

PART_BYTES = 8 << 20
"""A one-box message that is strided at one end is cut into wire sends of about this many bytes, so packing part
k+1 (or unpacking part k) overlaps the transfer of the other parts."""


def _contiguous_in(box: Box, shape: Sequence[int]) -> bool:
    """Whether `box` is one contiguous range of a row-major tensor of `shape`: after its first dim of extent > 1,
    every dim is whole."""
    dims = len(shape)
    k = 0
    while k < dims and box.shape[k] == 1:
        k += 1
    return all(box.offsets[d] == 0 and box.shape[d] == shape[d] for d in range(k + 1, dims))


def _cuts(t: Transfer) -> tuple[int, ...]:
    """Byte offsets cutting a one-box message of `t` into parts of about `PART_BYTES`, at boundaries of the box's
    outermost dimension of extent > 1 (each part a sub-box); empty when the box fits one part or cannot be cut."""
    if t.nbytes <= PART_BYTES:
        return ()
    shape = t.src_box.shape
    d = next((k for k, n in enumerate(shape) if n > 1), None)
    if d is None:
        return ()
    rows = shape[d]
    row_bytes = t.nbytes // rows
    per = max(1, -(-rows // -(-t.nbytes // PART_BYTES)))
    return tuple(k * row_bytes for k in range(per, rows, per))


def _messages(by_peer: dict[int, list[Transfer]],
              direct: Callable[[Transfer], bool] = lambda t: False,
              contiguous_at: Callable[[Transfer, bool], bool] | None = None) -> tuple[Message, ...]:
    """The messages of one rank's side of one chunk, by peer, back to back in the staging area.

    Per peer: the boxes that are small (< `DIRECT_SPLIT_BYTES`) or strided at both ends go into one packed
    message, in plan order; each other box is a message of its own after it. A message of one box for which
    `direct` (this rank's end) holds takes the zero-copy path (`Message.direct`); a one-box message that is strided
    at one end or both is cut into parts (`Message.cuts`, see `_cuts`). The split and the cuts depend only on the
    transfers and on `contiguous_at(t, sending)` (both ends' geometry, from the plan), so sender and receiver list
    the same messages. Without `contiguous_at`, one message per peer, never cut.
    """
    out = []
    buf = boxes = 0
    for peer in sorted(by_peer):
        ts = by_peer[peer]
        groups: list[list[Transfer]] = []
        ends: list[tuple[bool, bool]] = []
        packed: list[Transfer] = []
        for t in ts:
            at = (contiguous_at(t, True), contiguous_at(t, False)) if contiguous_at else (False, False)
            if t.nbytes >= DIRECT_SPLIT_BYTES and any(at):
                groups.append([t])
                ends.append(at)
            else:
                packed.append(t)
        if packed:
            groups.insert(0, packed)
            ends.insert(0, (contiguous_at(packed[0], True), contiguous_at(packed[0], False))
                        if contiguous_at and len(packed) == 1 else (False, False))
        for group, at in zip(groups, ends):
            offsets = []
            pos = 0
            for t in group:
                offsets.append(pos)
                pos += t.nbytes
            if not pos:
                continue
            one = len(group) == 1
            cuts = _cuts(group[0]) if one and contiguous_at and not all(at) else ()
            out.append(Message(peer, tuple(group), tuple(offsets), buf, pos, boxes, one and direct(group[0]), cuts))
            buf += pos
            boxes += len(group)
    return tuple(out)


def _box_list(items: Sequence[PlanItem], messages: Sequence[Message], *, sending: bool) -> BoxList:
    """The boxes of one chunk's pack (`sending`) or unpack call: `messages`' transfers in buffer order."""
    transfers = tuple(t for m in messages for t in m.transfers)
    offsets = tuple(m.buffer_offset + o for m in messages for o in m.offsets)
    wire: tuple[torch.dtype | None, ...]
    if sending:
        from_dst = tuple(t.stage > 0 for t in transfers)  # a forward reads the box where it landed
        tensors = tuple(t.src_tensor for t in transfers)
        boxes = tuple(t.src_box for t in transfers)
        # a stage-0 box of a casting item is packed as its destination dtype
        wire = tuple(items[t.item].dst.dtype if t.stage == 0 and items[t.item].casts else None for t in transfers)
    else:
        from_dst = (True,) * len(transfers)
        tensors = tuple(t.dst_tensor for t in transfers)
        boxes = tuple(t.dst_box for t in transfers)
        wire = (None,) * len(transfers)  # the wire already carries the destination dtype
    groups: dict[torch.dtype | None, list[int]] = {}
    for i, w in enumerate(wire):
        groups.setdefault(w, []).append(i)
    return BoxList(transfers, from_dst, tensors, boxes, offsets, wire,
                   tuple((w, tuple(ix)) for w, ix in groups.items()),
                   tuple(m.direct for m in messages for _ in m.transfers))
