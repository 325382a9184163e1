"""The cost model: time from per-rank link loads, gather-and-broadcast as ring collectives, and lower bounds.

Every GPU has four links that work at once: NVLink out, NVLink in, network out, network in (each at its own
per-direction bandwidth), plus local copies at device copy bandwidth. A plan's chunks are pipelined, so its
stages (network hop, NVLink forward, local copies) overlap and the busiest link sets the time:

    time = max over (rank, link, direction) of  bytes / bandwidth + messages * latency   (+ pipeline fill)

Gather-and-broadcast, the baseline, is modelled per trainer pipeline stage as a ring all-gather of each weight
over the ranks that hold its distinct shards, then a pipelined chain (ring) broadcast of it from one stage rank to
every inference GPU. Weights go one after another within a stage; stages run concurrently.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reshard.planner import Box, Plan
from reshard.sim._hardware import Hardware

DIRECTIONS = ("send", "recv")


@dataclass(frozen=True)
class LinkKey:
    """One direction of one link of one rank."""

    rank: int
    link: str  # "nvlink", "network" or "local"
    direction: str  # "send" or "recv"


class LinkLoads:
    """Bytes and messages per (rank, link, direction).

    Example (a single 1 GB network message from rank 0 to rank 1):
        >>> loads = LinkLoads()
        >>> loads.add_transfer(0, 1, "network", 10**9)
        >>> loads.bytes[LinkKey(0, "network", "send")], loads.messages[LinkKey(1, "network", "recv")]
        (1000000000, 1)
    """

    def __init__(self) -> None:
        self.bytes: dict[LinkKey, int] = defaultdict(int)
        self.messages: dict[LinkKey, int] = defaultdict(int)

    def add(self, rank: int, link: str, direction: str, nbytes: int, messages: int = 1) -> None:
        key = LinkKey(rank, link, direction)
        self.bytes[key] += nbytes
        self.messages[key] += messages

    def add_transfer(self, src: int, dst: int, link: str, nbytes: int, messages: int = 1) -> None:
        """`nbytes` from `src` to `dst` in `messages` messages; a local copy loads only the rank's copy engine."""
        if link == "local" or src == dst:
            self.add(dst, "local", "recv", nbytes, 0)
            return
        self.add(src, link, "send", nbytes, messages)
        self.add(dst, link, "recv", nbytes, messages)

    def total_bytes(self, link: str) -> int:
        """Bytes carried over `link`, each counted once (at the receiver)."""
        return sum(b for k, b in self.bytes.items() if k.link == link and k.direction == "recv")


@dataclass(frozen=True)
class Timing:
    """The modelled time of a set of link loads.

    Attributes:
        seconds: the total.
        bottleneck: the busiest link, or None when nothing moves.
        bottleneck_bytes, bottleneck_messages: its load.
        per_link_s: for each link kind, its busiest instance's time (s).
        fill_s: pipeline fill added to the busiest link's time.
    """

    seconds: float
    bottleneck: LinkKey | None
    bottleneck_bytes: int
    bottleneck_messages: int
    per_link_s: dict[str, float] = field(default_factory=dict)
    fill_s: float = 0.0


def link_time(loads: LinkLoads, hw: Hardware, *, fill_s: float = 0.0) -> Timing:
    """The time of `loads` on `hw`: the busiest link's `bytes / bandwidth + messages * latency`, plus `fill_s`.

    Args:
        loads: bytes and messages per (rank, link, direction).
        hw: bandwidths and latencies.
        fill_s: pipeline fill (the time before the last stage of a pipelined plan starts), added once.

    Returns:
        A `Timing`.

    Example (a relay fan-out on 2 H100 nodes: 1 GB crosses the network to rank 8, which forwards it over NVLink
    to ranks 9 and 10): the NIC takes 1e9 / 50e9 = 20 ms, rank 8's NVLink out 2e9 / 450e9 = 4.4 ms, so 20 ms
    plus one message latency.
    """
    best = -1.0
    best_key: LinkKey | None = None
    per_link: dict[str, float] = {}
    for key, nbytes in loads.bytes.items():
        msgs = loads.messages.get(key, 0)
        t = nbytes / hw.bandwidth(key.link) + msgs * hw.latency(key.link)
        per_link[key.link] = max(per_link.get(key.link, 0.0), t)
        if t > best or (t == best and best_key is not None and _order(key) < _order(best_key)):
            best, best_key = t, key
    if best_key is None:
        return Timing(fill_s, None, 0, 0, {}, fill_s)
    return Timing(best + fill_s, best_key, loads.bytes[best_key], loads.messages.get(best_key, 0), per_link, fill_s)


def _order(key: LinkKey) -> tuple:
    return (key.rank, key.link, key.direction)


def plan_loads(plan: Plan) -> LinkLoads:
    """Per-rank link loads of a plan. A message is one (chunk, sender, receiver) triple, as the executor sends."""
    loads = LinkLoads()
    for r, b in plan.stats.per_rank.items():
        for link, direction, nbytes, messages in (
            ("network", "send", b.network_send, b.network_messages_sent),
            ("network", "recv", b.network_recv, b.network_messages_received),
            ("nvlink", "send", b.nvlink_send, b.nvlink_messages_sent),
            ("nvlink", "recv", b.nvlink_recv, b.nvlink_messages_received),
            ("local", "recv", b.local, 0),
        ):
            if nbytes or messages:
                loads.add(r, link, direction, nbytes, messages)
    return loads


def relay_fill_s(plan: Plan, hw: Hardware, *, chunk_lag: int) -> float:
    """Pipeline fill of a relay plan. A forward goes `chunk_lag` chunks after its bytes arrive, so after the last
    network arrival up to `chunk_lag` chunks of NVLink forwards remain; the rest of the forwarding overlaps the
    network transfers and is already in the NVLink links' load. Zero without forwards."""
    if not plan.stats.num_forwards:
        return 0.0
    chunk = plan.staging_bytes // 2
    busiest = max((rb.nvlink_send for rb in plan.stats.per_rank.values()), default=0)
    return chunk_lag * min(chunk, busiest) / hw.nvlink_bytes_per_s


# ---- gather and broadcast ----------------------------------------------------------------------------------------


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
    """Bytes of the global tensor `rank` holds (its pieces are disjoint)."""
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
    GPUs outside the trainer): gather bytes `m * (n - 1) * B`, broadcast bytes `G * B`.
    """
    gather_s: dict[int, float] = defaultdict(float)
    bcast_s: dict[int, float] = defaultdict(float)
    gather_bytes = broadcast_bytes = network_bytes = gather_network = 0
    roots: dict[int, int] = {}
    for train, gen, stage in weights:
        full = math.prod(train.shape) * train.dtype.itemsize
        ring = _ring(train)
        gathered = sum(full - _held_bytes(train, r) for r in train.ranks)
        gather_bytes += gathered
        if len({domain(r) for r in ring}) > 1:
            gather_network += gathered
        gather_s[stage] += ring_allgather_s(full, ring, hw, domain)
        root = roots.setdefault(stage, ring[0] if ring else train.ranks[0])
        dsts = [r for r in gen.ranks if r != root]
        broadcast_bytes += full * len(dsts)
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


# ---- lower bound -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LowerBound:
    """Time no schedule can beat on the modelled links, from bandwidth alone.

    Attributes:
        seconds: the largest of the terms below.
        domain_import_s: per destination domain, the bytes that must enter it (the plan's network lower bound)
            over the network bandwidth of its destination GPUs together; the largest.
        rank_ingress_s: per destination rank, the bytes it needs but does not hold (what it receives: a relay
            receives only boxes it needs itself) over its NVLink plus network bandwidth; the largest.
        source_egress_s: all bytes that must cross the network over the network bandwidth of every source GPU.
    """

    seconds: float
    domain_import_s: float
    rank_ingress_s: float
    source_egress_s: float


def lower_bound(relay_plan: Plan, hw: Hardware) -> LowerBound:
    """The bandwidth lower bound of moving `relay_plan`'s items, read from a relay plan (whose network bytes per
    destination domain equal the per-domain minimum)."""
    topo = relay_plan.topology
    per_rank = relay_plan.stats.per_rank
    dst_ranks = {r for it in relay_plan.items for r in it.dst.ranks}
    src_ranks = {r for it in relay_plan.items for r in it.src.ranks}
    imports: dict[Hashable, int] = defaultdict(int)
    members: dict[Hashable, set[int]] = defaultdict(set)
    for r in dst_ranks:
        members[topo.domain(r)].add(r)
    for r, rb in per_rank.items():
        imports[topo.domain(r)] += rb.network_recv if r in dst_ranks else 0
    domain_s = max((imports[d] / (len(members[d]) * hw.network_bytes_per_s) for d in members), default=0.0)
    ingress_s = max(
        (
            (rb.network_recv + rb.nvlink_recv) / (hw.network_bytes_per_s + hw.nvlink_bytes_per_s)
            for r, rb in per_rank.items()
            if r in dst_ranks
        ),
        default=0.0,
    )
    egress_s = relay_plan.stats.network_lower_bound / (max(len(src_ranks), 1) * hw.network_bytes_per_s)
    return LowerBound(max(domain_s, ingress_s, egress_s), domain_s, ingress_s, egress_s)
