"""The gather-and-broadcast baseline: its bytes (one definition) and its modelled time.

The baseline users run today: the source ranks all-gather each full tensor (each receives what it lacks), then one
source rank broadcasts it to every destination rank that is not a source rank; each keeps its slice.

Its time is modelled per trainer pipeline stage as a ring all-gather of each weight over the ranks that hold its
distinct shards, then a pipelined chain (ring) broadcast of it from one stage rank to every destination rank
outside the stage. Weights go one after another within a stage; stages run concurrently.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.cost._hardware import Hardware
from reshard.planner import Box


def gather_broadcast_bytes(src: Any, dst: Any) -> dict[str, int]:
    """Bytes that gather-and-broadcast moves for one tensor from layout `src` to layout `dst`.

    Every source rank receives the part of the full tensor it does not hold (the all-gather), then every
    destination rank that is not a source rank receives the full tensor (the broadcast).

    Returns:
        `{"gather": ..., "broadcast": ..., "total": ...}` in bytes.

    Example: a `(4, 4)` float32 tensor (64 bytes) as `S(0)` on ranks `[0, 1]` to `R` on ranks `[1, 2, 3]`: ranks 0
    and 1 each receive 32 bytes, ranks 2 and 3 each 64 (rank 1 already has it): gather 64, broadcast 128.
    """
    full = math.prod(src.shape) * src.dtype.itemsize
    gather = sum(full - _held_bytes(src, r) for r in src.ranks)
    broadcast = full * len(_broadcast_ranks(src, dst))
    return {"gather": gather, "broadcast": broadcast, "total": gather + broadcast}


def _broadcast_ranks(src: Any, dst: Any) -> list[int]:
    """The destination ranks the broadcast reaches: those that did not take part in the all-gather."""
    src_ranks = set(src.ranks)
    return [r for r in dst.ranks if r not in src_ranks]


@dataclass(frozen=True)
class GatherBroadcast:
    """The modelled gather-and-broadcast baseline.

    Attributes:
        seconds: total time (stages concurrent, each stage's weights one after another).
        stage_seconds: per pipeline stage, gather plus broadcast time.
        gather_bytes: bytes received by all trainer ranks in all-gathers (every rank ends with every full weight
            of its stage, as a TP/EP all-gather gives).
        gather_network_bytes: the part of `gather_bytes` of weights whose ring spans several domains.
        broadcast_bytes: bytes received by inference GPUs (each receives every weight in full).
        network_bytes: broadcast bytes crossing the network: in a domain-ordered chain each weight enters each
            inference domain other than the root's once.
        gather_seconds, broadcast_seconds: per stage.
    """

    seconds: float
    stage_seconds: tuple[float, ...]
    gather_seconds: tuple[float, ...]
    broadcast_seconds: tuple[float, ...]
    gather_bytes: int
    broadcast_bytes: int
    network_bytes: int
    gather_network_bytes: int = 0


def _held_bytes(layout: Any, rank: int) -> int:
    """Bytes of the global tensor `rank` holds (a layout's pieces on one rank are disjoint)."""
    return sum(p.global_box.numel for p in layout.pieces(rank)) * layout.dtype.itemsize


def _ring(layout: Any) -> list[int]:
    """One rank per distinct holding (the first in mesh order): the smallest group that holds every element."""
    seen: dict[frozenset[Box], int] = {}
    for r in layout.ranks:
        boxes = frozenset(p.global_box for p in layout.pieces(r))
        if boxes and boxes not in seen:
            seen[boxes] = r
    return list(seen.values())


def ring_allgather_s(nbytes: int, ranks: Sequence[int], hw: Hardware, domain: Callable[[int], Hashable]) -> float:
    """Ring all-gather of a tensor of `nbytes` over `ranks` (one shard each): `n - 1` steps of `nbytes / n` each.

    The ring's slowest hop sets its bandwidth: NVLink when every rank shares one domain, the network otherwise.
    """
    n = len(ranks)
    if n <= 1:
        return 0.0
    link = "nvlink" if len({domain(r) for r in ranks}) == 1 else "network"
    return (n - 1) / n * nbytes / hw.bandwidth(link) + (n - 1) * hw.latency(link)


def chain_broadcast_s(
    nbytes: int, root: int, dsts: Sequence[int], hw: Hardware, domain: Callable[[int], Hashable]
) -> float:
    """Pipelined chain (ring) broadcast of `nbytes` from `root` through `dsts` ordered by domain.

    Every byte crosses every hop once and the hops work at once, so the time is `nbytes` over the slowest hop's
    bandwidth, plus one latency per hop for the pipeline to fill.
    """
    dsts = [d for d in dsts if d != root]
    if not dsts:
        return 0.0
    order = [root, *sorted(dsts, key=lambda r: (domain(r) != domain(root), repr(domain(r)), r))]
    hops = ["nvlink" if domain(a) == domain(b) else "network" for a, b in itertools.pairwise(order)]
    bw = min(hw.bandwidth(h) for h in hops)
    return nbytes / bw + sum(hw.latency(h) for h in hops)


def gather_broadcast(
    weights: Iterable[tuple[Any, Any, int]],
    hw: Hardware,
    domain: Callable[[int], Hashable],
) -> GatherBroadcast:
    """Model gather-and-broadcast for many weights.

    Args:
        weights: `(train_layout, gen_layout, stage)` per weight.
        hw: bandwidths and latencies.
        domain: rank -> NVLink domain id.

    Returns:
        A `GatherBroadcast`. Per stage, the root is the first rank of the stage's first ring.

    Closed forms (a weight of `B` bytes in `n` distinct shards, replicated `m` times on the trainer, `G` inference
    GPUs outside the trainer's ranks of the weight): gather bytes `m * (n - 1) * B`, broadcast bytes `G * B` (the
    bytes are `gather_broadcast_bytes`'s).
    """
    gather_s: dict[int, float] = defaultdict(float)
    bcast_s: dict[int, float] = defaultdict(float)
    gather_bytes = broadcast_bytes = network_bytes = gather_network = 0
    roots: dict[int, int] = {}
    for train, gen, stage in weights:
        full = math.prod(train.shape) * train.dtype.itemsize
        ring = _ring(train)
        nbytes = gather_broadcast_bytes(train, gen)
        gather_bytes += nbytes["gather"]
        if len({domain(r) for r in ring}) > 1:
            gather_network += nbytes["gather"]
        gather_s[stage] += ring_allgather_s(full, ring, hw, domain)
        root = roots.setdefault(stage, ring[0] if ring else train.ranks[0])
        dsts = _broadcast_ranks(train, gen)
        broadcast_bytes += nbytes["broadcast"]
        gen_domains = {domain(r) for r in dsts}
        network_bytes += full * len(gen_domains - {domain(root)})
        bcast_s[stage] += chain_broadcast_s(full, root, dsts, hw, domain)
    stages = sorted(set(gather_s) | set(bcast_s))
    per_stage = tuple(gather_s[s] + bcast_s[s] for s in stages)
    return GatherBroadcast(
        seconds=max(per_stage, default=0.0),
        stage_seconds=per_stage,
        gather_seconds=tuple(gather_s[s] for s in stages),
        broadcast_seconds=tuple(bcast_s[s] for s in stages),
        gather_bytes=gather_bytes,
        broadcast_bytes=broadcast_bytes,
        network_bytes=network_bytes,
        gather_network_bytes=gather_network,
    )
