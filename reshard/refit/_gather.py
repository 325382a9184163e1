"""Gather-and-broadcast for one weight, when the refit's policy picks it: the method most RL frameworks use today.

The weight is gathered whole on one source rank (the lowest rank of its trainer layout), sent whole to every
destination rank (a flat broadcast from that root), and each destination keeps its slice. It needs a full-size
buffer on the root and on every destination, and moves about `(num_destinations + 1) x` the weight's size; the
refit's cost model picks it only when it is the faster way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate

from reshard.comm import execute
from reshard.planner import Layout, Mesh, PlanItem, plan, region_view


class GatherBroadcastWeight:
    """The two plans (gather to the root, root to every destination) and the slicing of one weight."""

    def __init__(self, item: PlanItem) -> None:
        self.item = item
        src, dst = item.src, item.dst
        self.root = min(src.ranks)
        whole = lambda ranks: Layout(src.shape, Mesh(list(ranks)), [Replicate()], src.dtype, name=item.name)  # noqa: E731
        self.gather = plan(src, whole([self.root]), relay=False)
        # the root already holds the full tensor: it broadcasts to the other destination ranks only (a tensor is
        # never passed to `execute` as both a source and a destination)
        receivers = sorted(set(dst.ranks) - {self.root})
        self.broadcast = plan(whole([self.root]), whole(receivers), relay=False) if receivers else None
        self.nbytes = self.gather.stats.total_bytes + (self.broadcast.stats.total_bytes if self.broadcast else 0)

    def run(self, refit: Any, src_tensors: list, dst_tensors: list) -> None:
        """Every rank of the group calls this, in the same order for every weight."""
        rank = refit.rank
        item = self.item
        full = None
        device = _device(src_tensors, dst_tensors)
        if rank == self.root or rank in item.dst.ranks:
            full = torch.empty(item.src.shape, dtype=item.src.dtype, device=device)
        src = [src_tensors[item.src_tensor] if rank in item.src.ranks else None]
        execute(self.gather, rank, src, [full if rank == self.root else None], refit.group, timeout=refit.timeout)
        if self.broadcast is not None:
            outs = [full if rank in self.broadcast.items[0].dst.ranks else None]
            execute(self.broadcast, rank, [full if rank == self.root else None], outs, refit.group,
                    timeout=refit.timeout)
        if rank in item.dst.ranks:
            out = dst_tensors[item.dst_tensor]
            assert full is not None and out is not None
            for p in item.dst.pieces(rank):
                region_view(out, p.local_box).copy_(full[p.global_box.slices()])


def _device(*lists: list) -> torch.device:
    for lst in lists:
        for t in lst:
            if t is not None:
                return t.device
    return torch.device("cpu")


