"""Counting a group's control rounds from the messages on its control backend, not from what the code says it did.

`counted_group(group)` gives a `Group` with the same rank, size and data backends whose control backend records
every operation this rank posts on it. Every all-rank control round of reshard is one of two kinds:

- an agreement (`reshard.comm.agree`: the plan handshake, the completion round, `Refit`'s live check) runs over a
  binomial tree rooted at the lowest rank: in a round where every rank agrees, each other rank sends exactly one
  message to a lower rank (its header, to its parent) and none else to a lower rank;
- a collective (`all_gather_json`, `broadcast_bytes`, ...) is one `allgather` or `broadcast` call.

So on any rank but the lowest, `ControlCounter.rounds()` (sends to lower ranks plus collectives) counts the
rounds of a run that every rank passed. Example, 2 ranks, one clean `agree`: rank 1 sends its header to rank 0
and receives the verdict: `rounds() == 1`.
"""

from __future__ import annotations

from typing import Any

import torch

from reshard.comm import Group

_COLLECTIVES = ("allgather", "allgather_coalesced", "allreduce", "broadcast", "barrier", "reduce", "gather",
                "scatter", "alltoall", "alltoall_base", "reduce_scatter", "allgather_into_tensor_coalesced")


class ControlCounter:
    """A control backend (a `torch.distributed` process group) that records what this rank posts on it, then
    posts it on the backend it wraps; any other attribute is the wrapped backend's.

    Attributes:
        rank: this process's rank in the group.
        sends, recvs: `(peer, nbytes)` per point-to-point operation, in posting order.
        collectives: the name of each collective call (`"allgather"`, `"broadcast"`, ...), in order.
    """

    def __init__(self, inner: Any, rank: int) -> None:
        self.inner, self.rank = inner, rank
        self.sends: list[tuple[int, int]] = []
        self.recvs: list[tuple[int, int]] = []
        self.collectives: list[str] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        self.sends.append((dst, sum(t.numel() * t.element_size() for t in tensors)))
        return self.inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        self.recvs.append((src, sum(t.numel() * t.element_size() for t in tensors)))
        return self.inner.recv(tensors, src, tag)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in _COLLECTIVES:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.collectives.append(name)
                return attr(*args, **kwargs)
            return counted
        return attr

    def rounds(self) -> int:
        """All-rank control rounds seen on this rank since the last `clear()`: sends to lower ranks plus collectives
        (exact on any rank but the lowest, for rounds every rank passed; see the module docstring)."""
        return sum(1 for peer, _ in self.sends if peer < self.rank) + len(self.collectives)

    def clear(self) -> None:
        self.sends.clear()
        self.recvs.clear()
        self.collectives.clear()


def counted_group(group: Group) -> tuple[Group, ControlCounter]:
    """A `Group` of `group`'s rank, size, timeout, devices and data backends whose control messages `ControlCounter`
    records (the returned counter). It has no store: a fault is reported on the rank that sees it only. Use it in
    `group`'s place on every rank; it closes nothing (close `group`)."""
    counter = ControlCounter(group.control, group.rank)
    data = {kind: group.data_backend(torch.device(kind)) for kind in group.data_types}
    counted = Group(rank=group.rank, size=group.size, control=counter, data=data, name=f"counted({group.name})",
                    timeout=group.timeout)
    counted.devices = group.devices
    return counted, counter
