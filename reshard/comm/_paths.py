"""Which bytes of one chunk go on the wire straight from (into) the local tensors and which through staging, and
the CPU send program that packs part k+1 while part k is on the wire: the geometry of `reshard.comm._executor`'s
full runs, for one set of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from reshard.kernels import PreparedCopy, prepare_pack
from reshard.planner import Box, BoxList, LocalRegion, Message, RankChunk, local_region, region_view


class Paths:
    """How the messages of one chunk go on the wire, for one set of tensors: the plan's `Message.direct` where the
    box's view of the actual tensor is contiguous (a strided tensor takes the staged path instead), and each
    message's parts (`Message.parts`).

    Attributes:
        sends, recvs: per message, the `uint8` view of the tensor it is sent from (received into), or None:
            staged.
        pack_groups: the chunk's pack groups (`BoxList.groups`) without the direct boxes (one copy per chunk).
        unpack_boxes: indices of the unpack boxes that are staged.
        direct_bytes: bytes of the direct messages.
    """

    def __init__(self, step: RankChunk, send_tensors: list[torch.Tensor], recv_tensors: list[torch.Tensor],
                 zero_copy: bool) -> None:
        self.direct_bytes = 0
        self.sends = self._views(step.sends, step.pack, send_tensors, zero_copy)
        self.recvs = self._views(step.recvs, step.unpack, recv_tensors, zero_copy)
        skip = {m.first_box for m, v in zip(step.sends, self.sends) if v is not None}
        self.pack_groups = [(w, ix) for w, ix in ((w, [i for i in ix if i not in skip]) for w, ix in step.pack.groups)
                            if ix]
        skip = {m.first_box for m, v in zip(step.recvs, self.recvs) if v is not None}
        self.unpack_boxes = [i for i in range(len(step.unpack.boxes)) if i not in skip]

    def _views(self, messages: Sequence[Any], boxes: BoxList, tensors: list[torch.Tensor],
               zero_copy: bool) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for m in messages:
            view = None
            if zero_copy and m.direct:
                k = m.first_box
                view = region_view(tensors[k], boxes.boxes[k])
                if view.is_contiguous():
                    view = view.reshape(-1).view(torch.uint8)
                    self.direct_bytes += m.nbytes
                else:
                    view = None
            out.append(view)
        return out

    @staticmethod
    def wire(messages: Sequence[Message], views: list[torch.Tensor | None],
             area: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """`(peer, tensor)` per wire send (or receive) of `messages`, in wire order: each message's parts, cut from
        its view (direct) or from its range of the slot's staging `area`."""
        out = []
        for m, v in zip(messages, views):
            whole = area.narrow(0, m.buffer_offset, m.nbytes) if v is None else v
            out.extend((m.peer, whole.narrow(0, off, n)) for off, n in m.parts) if m.cuts else out.append((m.peer,
                                                                                                         whole))
        return out


def part_boxes(m: Message, box: LocalRegion) -> list[tuple[int, LocalRegion]]:
    """`(byte offset in the message, sub-box)` of each part of a one-box message `m` whose box (in the local
    tensor) is `box`: the parts cut `box` along its outermost dim of extent > 1 (see `Message.cuts`)."""
    if not m.cuts:
        return [(0, box)]
    d = next(k for k, n in enumerate(box.shape) if n > 1)
    whole = Box((0,) * box.ndim, box.shape)  # the parts in the box's own coordinates, then where they live
    row_bytes = m.nbytes // box.shape[d]
    out = []
    for off, n in m.parts:
        r0, rows = off // row_bytes, n // row_bytes
        part = Box(tuple(r0 if k == d else 0 for k in range(box.ndim)), tuple(rows if k == d else s for k, s in
                                                                          enumerate(box.shape)))
        out.append((off, local_region(part, whole, box)))
    return out


class SendUnits:
    """The CPU send program of one chunk from one slot: per wire send, the pack copies that fill it (none when
    direct) and the send itself, so part k+1 is packed while part k is on the wire (gloo sends on its own threads).

    Attributes:
        units: `(copies, peer, tensor)` per wire send, in wire order.
    """

    def __init__(self, step: RankChunk, paths: Paths, tensors: list[torch.Tensor], area: torch.Tensor) -> None:
        self.units: list[tuple[list[PreparedCopy], int, torch.Tensor]] = []
        pk = step.pack
        for m, view in zip(step.sends, paths.sends):
            whole = area.narrow(0, m.buffer_offset, m.nbytes) if view is None else view
            ks = range(m.first_box, m.first_box + len(m.transfers))
            if view is not None:
                for off, n in m.parts:
                    self.units.append(([], m.peer, whole.narrow(0, off, n)))
                continue
            if m.cuts:  # one box, packed part by part
                (k,) = ks
                for (off, box), (_, n) in zip(part_boxes(m, pk.boxes[k]), m.parts):
                    copy = prepare_pack([tensors[k]], [box], area, [pk.offsets[k] + off], dtype=pk.wire[k])
                    self.units.append(([copy], m.peer, whole.narrow(0, off, n)))
                continue
            by_wire: dict[Any, list[int]] = {}
            for k in ks:
                by_wire.setdefault(pk.wire[k], []).append(k)
            copies = [prepare_pack([tensors[k] for k in ix], [pk.boxes[k] for k in ix], area,
                                   [pk.offsets[k] for k in ix], dtype=w) for w, ix in by_wire.items()]
            self.units.append((copies, m.peer, whole))
