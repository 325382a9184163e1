"""The cost model: time from per-rank link loads, and lower bounds.

Every GPU has four links that work at once: NVLink out, NVLink in, network out, network in (each at its own
per-direction bandwidth), plus local copies at device copy bandwidth. A plan's chunks are pipelined, so its
stages (network hop, NVLink forward, local copies) overlap and the busiest link sets the time:

    time = max over (rank, link, direction) of  bytes / bandwidth + messages * latency   (+ pipeline fill)

The gather-and-broadcast baseline is modelled in `_baseline.py`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field

from reshard.cost._hardware import Hardware
from reshard.planner import PIPELINE_DEPTH, Plan

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
    chunk = plan.staging_bytes // PIPELINE_DEPTH  # the planner keeps a chunk within this share of the budget
    busiest = max((rb.nvlink_send for rb in plan.stats.per_rank.values()), default=0)
    return chunk_lag * min(chunk, busiest) / hw.nvlink_bytes_per_s


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
