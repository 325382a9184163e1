"""The plan's value types: `Transfer`, `Message`, `BoxList`, `RankChunk`, `RankPlan`, `PlanStats`, and the
pipeline depth the plan is built for (`PIPELINE_DEPTH`).

All are frozen dataclasses of tuples, so a plan can be shared, hashed and cached. `RankPlan` is one rank's whole
program: the executor runs it as it is and decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal, NamedTuple

import torch

from reshard.planner._box import Box

PIPELINE_DEPTH = 2
"""Chunks in flight per rank, the contract between planner and executor: the executor keeps this many staging slots
(chunk i is in flight while chunk i+1 is packed and chunk i-1 unpacked), the planner keeps one chunk's send plus
receive bytes within `staging_bytes // PIPELINE_DEPTH`, and a relay forwards a box at least this many chunks after
the box arrives, so packing the next chunk never waits for the arrival still being unpacked."""

Link = Literal["local", "nvlink", "network"]
LINKS: tuple[Link, ...] = ("local", "nvlink", "network")


class Transfer(NamedTuple):
    """One box moving from a source rank to a destination rank: the plan's one transfer record (a `Plan`'s, a
    `LocalPlan`'s, and a rank part's `LocalTransfer`s before they are scheduled into chunks).

    Attributes:
        src_rank, dst_rank: global ranks (equal for a local copy).
        src_box: the box in the sender's local tensor. At stage 0 that is the sender's *source-layout* tensor
            `src_tensor`; at stage >= 1 it is the sender's *destination-layout* tensor `src_tensor` (a relay forwards
            bytes it received at a lower stage).
        dst_box: the box in the receiver's destination-layout tensor `dst_tensor`.
        global_box: the same box in global-tensor coordinates of item `item`.
        nbytes: bytes on the wire (`global_box.numel * itemsize`).
        link: `"local"`, `"nvlink"` or `"network"`.
        stage: 0 reads the source layout; >= 1 forwards (NVLink relay).
        chunk: the chunk this transfer is sent in; equal on sender and receiver in a `Plan` (in a `LocalPlan`, each
            end's own chunk).
        item: index of the (source, destination) layout pair in the plan.
        src_tensor, dst_tensor: indices of the local tensors on sender and receiver (several items may share one
            destination tensor, as fused tensors do).
    """

    src_rank: int
    dst_rank: int
    src_box: Box
    dst_box: Box
    global_box: Box
    nbytes: int
    link: Link
    stage: int = 0
    chunk: int = 0
    item: int = 0
    src_tensor: int = 0
    dst_tensor: int = 0

    @property
    def src(self) -> int:
        """`src_rank` (the name a rank part's transfers use)."""
        return self.src_rank

    @property
    def dst(self) -> int:
        """`dst_rank`."""
        return self.dst_rank

    def __repr__(self) -> str:
        relay = f" stage={self.stage}" if self.stage else ""
        return (
            f"Transfer({self.src_rank}->{self.dst_rank} {self.link}{relay} chunk={self.chunk} item={self.item} "
            f"global={self.global_box} src={self.src_box} dst={self.dst_box} {self.nbytes}B)"
        )


@dataclass(frozen=True, slots=True)
class Message:
    """Boxes one rank sends to (or receives from) one peer in one chunk, packed back to back, as one or more wire
    sends.

    Per peer and chunk the boxes form at most one packed message, followed by one message per box that is large
    enough (`reshard.planner._messages.DIRECT_SPLIT_BYTES`) and contiguous in its local tensor on at least one end:
    that end sends it from (receives it into) the tensor itself. Sender and receiver list the same messages in the
    same order, and the wire carries them in that order (first in, first out per peer).

    Attributes:
        peer: the other rank.
        transfers: in buffer order; transfer `i` occupies `[offsets[i], offsets[i] + transfers[i].nbytes)` of the
            message.
        offsets: byte offset of each transfer inside the message.
        buffer_offset: where the message starts in the rank's send (or receive) staging buffer for the chunk.
        nbytes: total bytes.
        first_box: index of the message's first transfer in the chunk's `pack` (or `unpack`) box list; its
            transfers are entries `first_box .. first_box + len(transfers) - 1` there (and of the checksums).
        direct: the zero-copy path: the message is one box that is contiguous in this rank's local tensor (of the
            layout's local shape, row-major), so it is sent from that tensor's view (or received into it) without
            staging; its area in the staging buffer is left unused. False: packed into (unpacked from) staging.
            The wire bytes are the same either way.
        cuts: byte offsets inside the message where it is cut into separate wire sends (empty: one send). Only a
            message of one box that is strided on at least one end is cut, at boundaries of the box's outermost
            dimension of extent > 1 (so each part is a sub-box, contiguous in the message), into parts of about
            `reshard.planner._messages.PART_BYTES`: the sender packs part k+1 while part k is on the wire, the receiver
            gets every part at its offset (in staging or in the tensor).
    """

    peer: int
    transfers: tuple[Transfer, ...]
    offsets: tuple[int, ...]
    buffer_offset: int
    nbytes: int
    first_box: int = 0
    direct: bool = False
    cuts: tuple[int, ...] = ()

    @property
    def parts(self) -> tuple[tuple[int, int], ...]:
        """`(offset, nbytes)` of each wire send inside the message, in order (one part when not cut)."""
        bounds = (0, *self.cuts, self.nbytes)
        return tuple((a, b - a) for a, b in pairwise(bounds))


@dataclass(frozen=True, slots=True)
class BoxList:
    """The boxes of one `pack` (or `unpack`) call of a chunk, in staging-buffer order: the chunk's messages back to
    back, by peer.

    Attributes:
        transfers: the transfer of each box.
        from_dst: box `i` is read from (or written to) the destination local tensor `tensors[i]`; False: the source
            local tensor (stage-0 sends). A relay forward reads the destination tensor, where its box landed.
        tensors: local tensor index of each box.
        boxes: each box in its local tensor.
        offsets: byte offset of each box in the chunk's send (or receive) area of a staging slot.
        wire: the dtype box `i` is cast to while packing (a stage-0 box of a `precision="cast"` item), or None for a
            raw copy (always None when unpacking: the wire carries the destination dtype).
        groups: `(wire dtype, box indices)` per distinct `wire` value, in first-seen order: one pack call each.
        direct: box `i` is its message's one box on the zero-copy path (`Message.direct`): the executor leaves it
            out of the pack (unpack) call.
    """

    transfers: tuple[Transfer, ...] = ()
    from_dst: tuple[bool, ...] = ()
    tensors: tuple[int, ...] = ()
    boxes: tuple[Box, ...] = ()
    offsets: tuple[int, ...] = ()
    wire: tuple[torch.dtype | None, ...] = ()
    groups: tuple[tuple[torch.dtype | None, tuple[int, ...]], ...] = ()
    direct: tuple[bool, ...] = ()


@dataclass(frozen=True, slots=True)
class RankChunk:
    """One rank's work in one chunk: messages to send, messages to receive, and local copies.

    Attributes:
        index: the chunk index, equal on every rank that takes part in the chunk (in a `Plan`; a `LocalPlan`
            numbers each rank's chunks on its own, and messages match by their order per peer).
        sends, recvs: the messages, by peer (none of zero bytes: every one is posted); a peer may have several
            (see `Message`).
        local: local copies (never a message); a stage >= 1 copy reads the destination tensor.
        send_bytes, recv_bytes: the chunk's send area (packed sends) and receive area (right after it) in a slot.
        unpack_before_pack: the latest earlier chunk whose received bytes this chunk forwards (relay), or -1: the
            executor must finish unpacking that chunk before packing this one.
        pack, unpack: the boxes of the chunk's pack call (all of `sends`) and unpack call (all of `recvs`).
    """

    index: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    local: tuple[Transfer, ...]
    send_bytes: int
    recv_bytes: int
    unpack_before_pack: int = -1
    pack: BoxList = field(default_factory=BoxList)
    unpack: BoxList = field(default_factory=BoxList)


@dataclass(frozen=True, slots=True)
class RankPlan:
    """What one rank does, in executable order: chunks in increasing index. This is the executor's whole program.

    Attributes:
        rank: the global rank.
        chunks: only the chunks in which this rank has work.
        max_send_bytes, max_recv_bytes: the largest chunk's send and receive bytes.
        peers: every rank this one exchanges messages with.
        max_chunk_bytes: the largest chunk's send + receive bytes: the size of each of the `PIPELINE_DEPTH` staging
            slots.
        max_send_boxes, max_recv_boxes: the most boxes one chunk packs (unpacks): the size of each slot's checksum
            buffers.
        local_bytes: bytes of all local copies.
    """

    rank: int
    chunks: tuple[RankChunk, ...]
    max_send_bytes: int
    max_recv_bytes: int
    peers: tuple[int, ...]
    max_chunk_bytes: int = 0
    max_send_boxes: int = 0
    max_recv_boxes: int = 0
    local_bytes: int = 0

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        out: list[Transfer] = []
        for c in self.chunks:
            out.extend(c.local)
            for m in c.sends:
                out.extend(m.transfers)
            for m in c.recvs:
                out.extend(m.transfers)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class RankBytes:
    """Bytes one rank sends and receives, per link kind (local copies count once, as `local`)."""

    network_send: int = 0
    network_recv: int = 0
    nvlink_send: int = 0
    nvlink_recv: int = 0
    local: int = 0
    network_messages_sent: int = 0
    network_messages_received: int = 0
    nvlink_messages_sent: int = 0
    nvlink_messages_received: int = 0

    @property
    def messages_sent(self) -> int:
        return self.network_messages_sent + self.nvlink_messages_sent

    @property
    def messages_received(self) -> int:
        return self.network_messages_received + self.nvlink_messages_received

    @property
    def send(self) -> int:
        return self.network_send + self.nvlink_send

    @property
    def recv(self) -> int:
        return self.network_recv + self.nvlink_recv


@dataclass(frozen=True, slots=True)
class PlanStats:
    """Byte accounting of a plan, next to its lower bounds.

    Attributes:
        total_bytes: all bytes the plan moves, local copies included (`network + nvlink + local`).
        network_bytes, nvlink_bytes, local_bytes: per link kind.
        needed_bytes: the bytes the destination ranks hold when done (sum of their pieces).
        network_lower_bound: per destination domain, the union of what its ranks need minus what its ranks already
            hold, summed over domains. With relays, `network_bytes == network_lower_bound`.
        messages: number of (chunk, sender, receiver) messages, local copies excluded.
        num_transfers: number of transfers.
        num_forwards: how many of them are relay forwards (stage 1).
        num_chunks: number of chunks.
        max_rank_send_bytes, max_rank_recv_bytes: the busiest rank's send and receive bytes (network + NVLink).
        mean_rank_send_bytes, mean_rank_recv_bytes: the mean over ranks that send (receive) anything.
        send_imbalance, recv_imbalance: max over mean (1.0 is perfect balance; 0.0 when nothing moves).
        per_rank: rank -> `RankBytes`, for every rank that takes part.
    """

    total_bytes: int
    network_bytes: int
    nvlink_bytes: int
    local_bytes: int
    needed_bytes: int
    network_lower_bound: int
    messages: int
    num_transfers: int
    num_forwards: int
    num_chunks: int
    max_rank_send_bytes: int
    max_rank_recv_bytes: int
    mean_rank_send_bytes: float
    mean_rank_recv_bytes: float
    send_imbalance: float
    recv_imbalance: float
    per_rank: dict[int, RankBytes] = field(default_factory=dict, compare=False, repr=False)
