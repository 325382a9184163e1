"""The route of one rank's bytes, and the host staging that serves a CUDA rank over gloo.

A rank's *route* is decided once per run, before the plan handshake, from its tensors' device and the data backends
its group made at rendezvous from the exchanged devices (`Group.devices`): the executor only follows it.

- `direct`: the group has a data backend for the tensors' device type (gloo for CPU tensors, NCCL for CUDA
  tensors): staging on that device, the wire reads and writes it.
- `host-staged`: the tensors are on CUDA and the group moves data only over gloo (a group with a CPU rank: a
  trainer on CPU processes, an engine on a GPU): chunks are packed on the device into the device slot, copied to a
  pinned host mirror of that slot and sent over gloo from there; received chunks land in the host mirror and go on
  to the device slot, chunk by chunk, before they are unpacked on the device. Zero-copy messages are off (gloo
  cannot read device memory), so every wire byte passes through the mirror.
- no route (a `ValueError` on every rank before any byte): a device type the group has no backend for and no
  staging serves (CPU tensors in a group whose data backend is NCCL only).

The fingerprint the ranks agree on folds in the route's wire device type (`Route.wire`), so a host-staged CUDA
rank agrees with its CPU peers, while CUDA tensors on NCCL facing CPU tensors on gloo are still refused.

Ordering on CUDA, per slot (the mirror is reused from chunk to chunk like the slots):

    pack stream: pack -> `packed[slot]`
    comm stream: waits `packed[slot]`, copies the send area to the host mirror, the host waits for that copy
                 (gloo reads host memory as soon as a send is posted), then gloo posts
    host:        gloo's wait; then the comm stream copies the host receive area to the device slot (non-blocking,
                 from pinned memory) and records `transferred[slot]` after it (comm -> unpack) and `to_device[slot]`
                 (host mirror -> the next receive into it: a later chunk's gloo receive must not overwrite the host
                 area before that copy has read it)
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["HostStaging", "Route", "choose_route"]


@dataclass(frozen=True)
class Route:
    """How one rank's bytes reach the wire in one run.

    Attributes:
        device: where the rank's tensors and its device staging slots live.
        wire: the device type of the buffers the data backend moves (`"cpu"` for gloo, `"cuda"` for NCCL).
        staged: whether chunks pass through a host mirror of the slots between `device` and the wire.
    """

    device: torch.device
    wire: str
    staged: bool = False

    def __str__(self) -> str:
        return f"{self.device} via host staging over {self.wire}" if self.staged else f"{self.device} direct"


def choose_route(device: torch.device, backends: Collection[str]) -> Route:
    """The route of a rank whose tensors are on `device`, in a group with data backends for `backends`
    (device types, e.g. `{"cpu"}` for a gloo-only group).

    Raises:
        ValueError: no backend and no staging serves `device`.

    Example: CUDA tensors in a group of CPU trainers and a GPU engine (gloo only) are host-staged:
        >>> choose_route(torch.device("cuda", 0), {"cpu"})
        Route(device=device(type='cuda', index=0), wire='cpu', staged=True)
    """
    if device.type in backends:
        return Route(device, device.type)
    if device.type == "cuda" and "cpu" in backends:
        return Route(device, "cpu", staged=True)
    raise ValueError(f"no backend for {device.type} tensors (the group has {sorted(backends)}) and no host staging "
                     f"serves them: use CPU tensors with gloo or CUDA tensors with NCCL, or CUDA tensors in a group "
                     "whose data moves over gloo (they are staged through pinned host memory)")


class HostStaging:
    """Pinned host mirror of a `Staging`'s slots (and checksum buffers), for a host-staged route.

    Same sizes as the device slots: `slots[i]` mirrors the device `slots[i]` byte for byte (a chunk's send area at
    its start, its receive area after it). Reserved once with the staging and reused by every chunk, like it;
    pinned when the device is CUDA (non-blocking copies), plain host memory otherwise (CPU tests flag a CPU staging
    as staged: the copies are then real copies between distinct buffers, synchronous).

    Attributes:
        slots, send_sums, recv_sums: host tensors, `uint8` slots of `slot_bytes` and `int64` checksum buffers.
        to_device: CUDA only, per slot: the event after the last copy from the host slot to the device.
    """

    def __init__(self, device: torch.device, slot_bytes: int, num_slots: int, send_boxes: int,
                 recv_boxes: int) -> None:
        pin = device.type == "cuda"
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(num_slots)]
        self.send_sums = [torch.zeros(send_boxes, dtype=torch.int64, pin_memory=pin) for _ in range(num_slots)]
        self.recv_sums = [torch.zeros(recv_boxes, dtype=torch.int64, pin_memory=pin) for _ in range(num_slots)]
        self.to_device: list[Any] | None = [torch.cuda.Event() for _ in range(num_slots)] if pin else None
        self.pending: list[bool] = [False] * num_slots  # a copy from the host slot to the device may still run

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def wire_areas(self, staging: Any, slot: int, send_bytes: int, recv_bytes: int, *, verify: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Before the chunk's messages are posted (on the comm stream, after the pack -> comm hand-off): copy the
        slot's packed send area (and send checksums) to the host mirror, wait until the host holds them, and until
        the previous copy out of this host slot to the device is done. Returns the host `(send area, receive area,
        send sums, receive sums)` that gloo sends from and receives into."""
        host = self.slots[slot]
        send, recv = host.narrow(0, 0, send_bytes), host.narrow(0, send_bytes, recv_bytes)
        if send_bytes:
            send.copy_(staging.slots[slot].narrow(0, 0, send_bytes), non_blocking=True)
        if verify:
            self.send_sums[slot].copy_(staging.send_sums[slot], non_blocking=True)
        if self.to_device is not None:
            torch.cuda.current_stream(staging.device).synchronize()  # gloo reads the host copy as soon as posted
            if self.pending[slot]:
                self.to_device[slot].synchronize()  # the last chunk's bytes in this host slot have reached the device
        self.pending[slot] = False
        return send, recv, self.send_sums[slot], self.recv_sums[slot]

    def land(self, staging: Any, slot: int, send_bytes: int, recv_bytes: int, *, verify: bool) -> None:
        """After the chunk's gloo receives completed (on the comm stream): copy the host receive area (and receive
        checksums) into the device slot, where the unpack reads it."""
        if recv_bytes:
            staging.slots[slot].narrow(0, send_bytes, recv_bytes).copy_(
                self.slots[slot].narrow(0, send_bytes, recv_bytes), non_blocking=True)
        if verify:
            staging.recv_sums[slot].copy_(self.recv_sums[slot], non_blocking=True)
        if self.to_device is not None:
            self.to_device[slot].record(torch.cuda.current_stream(staging.device))
            self.pending[slot] = True
