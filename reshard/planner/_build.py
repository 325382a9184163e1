"""Building a plan: the per-geometry recipes of `plan_many` and the choices that turn them into transfer units.

Phase one (`_recipe`) is pure geometry: per item, its local copies and, for every other needed box, who needs it,
who holds it and how it is split. Phase two (`_emit_recipe`) chooses senders and relay receivers against the
running loads of a `_Builder` and emits the transfer units. `_network_lower_bound` is the bytes that must cross
into each destination domain, what relays meet exactly. The entry points that drive them are in `_plan`.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from reshard.planner._box import Box, intersect, split_box, split_to_fit, subtract
from reshard.planner._chunks import Member, Members, Unit, _new_unit, _Transfers
from reshard.planner._index import BoxIndex, intersection_volume, union_volume
from reshard.planner._item import PlanItem
from reshard.planner._layout import _geometry_id
from reshard.planner._region import delta as _delta, shift as _translate
from reshard.planner._topology import Topology

SPREAD_FACTOR = 1
"""A box is split over several relay receivers only when it exceeds 1/SPREAD_FACTOR of a receiver's fair share of
its domain's network bytes: boxes up to one fair share balance by assignment alone (least-loaded receiver), so a box
is not cut, and its transfers multiplied, where whole boxes already spread evenly (TP8 -> TP4 replicas: one box per
receiver)."""

SENDER_SPREAD_FACTOR = 8
"""A box is split over several senders (its replicas) only while a part exceeds 1/SENDER_SPREAD_FACTOR of a
receiver's fair share."""


class _Builder:
    """Mutable state of one planning run: loads per rank and the raw transfers emitted so far."""

    def __init__(self, topology: Topology, relay: bool, chunk_cap: int, min_split_bytes: int) -> None:
        self.topology = topology
        self.relay = relay
        self.chunk_cap = chunk_cap
        self.min_split_bytes = min_split_bytes
        self.net_send: dict[int, int] = defaultdict(int)
        self.net_recv: dict[int, int] = defaultdict(int)
        self.nvl_send: dict[int, int] = defaultdict(int)
        self.transfers = _Transfers()
        self.raw = self.transfers.rows  # the units emitted one at a time, see `_Transfers`
        self.fair_recv: dict[Any, float] = {}  # per destination domain: network bytes per destination rank
        self._domain_cache: dict[int, Any] = {}

    def domain(self, rank: int) -> Any:
        d = self._domain_cache.get(rank)
        if d is None:
            d = self.topology.domain(rank)
            self._domain_cache[rank] = d
        return d

    def emit(
        self,
        src: int,
        dst: int,
        src_delta: tuple[int, ...],
        dst_delta: tuple[int, ...],
        gbox: Box,
        itemsize: int,
        link: str,
        stage: int,
        members: Members,
        dep: int = -1,
    ) -> int:
        shape = gbox.shape
        nbytes = itemsize
        for s in shape:
            nbytes *= s
        src_box = _translate(gbox, src_delta)
        dst_box = _translate(gbox, dst_delta)
        self.raw.append(_new_unit(Unit, (src, dst, src_box, dst_box, gbox, nbytes, link, stage, members, dep)))
        nbytes *= len(members)
        if link == "network":
            self.net_send[src] += nbytes
            self.net_recv[dst] += nbytes
        elif link == "nvlink":
            self.nvl_send[src] += nbytes
        return len(self.raw) - 1

    def parts(self, box: Box, num_candidates: int, itemsize: int, fair_share: float = 0.0,
              num_senders: int = 1) -> list[Box]:
        """Split `box` for spreading over `num_candidates` receivers (or senders) and `num_senders` senders, then
        to fit a chunk; row-major order.

        A box is spread over receivers only when it is large next to `fair_share` (the bytes each receiver would
        carry if the whole plan were spread evenly; see `SPREAD_FACTOR`): boxes smaller than that balance by
        assignment alone, without multiplying transfers. Spreading over senders (replicas that would otherwise sit
        idle) stops at `SENDER_SPREAD_FACTOR` times that. No part is smaller than `min_split_bytes` unless the box
        is.
        """
        numel = 1
        for s in box.shape:
            numel *= s
        nbytes = numel * itemsize
        want, senders = num_candidates, num_senders
        if fair_share > 0:
            want = min(want, max(1, math.ceil(SPREAD_FACTOR * nbytes / fair_share)))
            senders = min(senders, max(1, math.ceil(SENDER_SPREAD_FACTOR * nbytes / fair_share)))
        want = min(max(want, senders), max(1, nbytes // self.min_split_bytes))
        cap_numel = max(1, self.chunk_cap // itemsize)
        if (want <= 1 or numel <= 1) and numel <= cap_numel:  # the common case: the box as it is
            return [box]
        out: list[Box] = []
        for part in split_box(box, want):
            out.extend(split_to_fit(part, cap_numel))
        return out



@dataclass(slots=True)
class _Part:
    """One box to move, with its place in every candidate's local tensor (computed once per geometry)."""

    box: Box
    nbytes: int
    dst_boxes: tuple[Box, ...]  # per needer
    src_boxes: tuple[Box, ...]  # per holder


class _LocalCopy(NamedTuple):
    """A box a destination rank already holds in its source tensor."""

    rank: int
    src_box: Box
    dst_box: Box
    global_box: Box


class _NvlNeed(NamedTuple):
    """A part a destination rank receives over NVLink from one of the holders in its domain."""

    dst: int
    holders: list[int]  # ascending
    part: _Part


class _NetNeed(NamedTuple):
    """A box some ranks of one destination domain need from holders outside it, and how it is split."""

    domain: Any
    group: int  # index of the unique source box it is cut from
    box: Box
    needers: list[int]  # ascending
    needer_deltas: list[tuple[int, ...]]  # per needer: local minus global offsets
    holders: list[int]  # ascending
    holder_deltas: list[tuple[int, ...]]  # per holder
    parts: list[_Part]
    spread: int  # how many senders the box was split for (before fitting chunks); receivers: `needers`


@dataclass(slots=True)
class _Recipe:
    """The geometry of an item's plan, independent of load: what each destination needs and who can send it.

    Every layer of a model repeats a few geometries; the recipe is computed once per geometry and each item then
    only makes its choices (which replica sends, which relay receives) against the plan's running loads.
    """

    itemsize: int
    local: list[_LocalCopy]
    nvl: list[_NvlNeed]
    net: list[_NetNeed]
    check_arrivals: bool
    max_part_bytes: int  # the largest box that takes staging (0 when there is none)



def _part(box: Box, itemsize: int, dst_deltas: Sequence[tuple[int, ...]],
          src_deltas: Sequence[tuple[int, ...]], src_one: tuple[int, ...] | None = None) -> _Part:
    """`box` and its place in each needer's and each holder's local tensor; `src_one`: the one delta every holder
    shares, when they do (replicas usually sit at the same place in their local tensors)."""
    offsets, shape = box.offsets, box.shape
    nbytes = itemsize
    for s in shape:
        nbytes *= s
    make = Box._make
    add = operator.add
    moved: dict[tuple[int, ...], Box] = {}  # translate once per distinct delta
    if src_one is not None:
        sbox = moved[src_one] = make(tuple(map(add, offsets, src_one)), shape)
        srcs = (sbox,) * len(src_deltas)
    else:
        for d in src_deltas:
            if d not in moved:
                moved[d] = make(tuple(map(add, offsets, d)), shape)
        srcs = tuple(map(moved.__getitem__, src_deltas))
    for d in dst_deltas:
        if d not in moved:
            moved[d] = make(tuple(map(add, offsets, d)), shape)
    return _Part(box, nbytes, tuple(map(moved.__getitem__, dst_deltas)), srcs)


def _one_delta(deltas: Sequence[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The delta all of `deltas` share, or None."""
    first = deltas[0]
    return first if deltas.count(first) == len(deltas) else None


def _recipe(b: _Builder, item: PlanItem) -> _Recipe:
    """Phase one of planning an item (see `plan_many`): local copies, and for every other needed box its needers,
    its holders and how it is split. Pure geometry."""
    src, dst = item.src, item.dst
    itemsize = dst.dtype.itemsize
    domain = b.domain

    # unique source boxes and their holders (replicas), in a fixed order
    holders_of: dict[Box, list[tuple[int, tuple[int, ...]]]] = {}
    for r in sorted(src.ranks):
        for p in src.pieces(r):
            holders_of.setdefault(p.global_box, []).append((r, _delta(p.global_box, p.local_box)))
    group_boxes = sorted(holders_of, key=lambda x: (x.offsets, x.shape))
    group_holders = [holders_of[g] for g in group_boxes]
    group_near: list[dict[Any, list[tuple[int, tuple[int, ...]]]]] = []
    for hs in group_holders:
        by_dom: dict[Any, list[tuple[int, tuple[int, ...]]]] = {}
        for h in hs:
            by_dom.setdefault(domain(h[0]), []).append(h)
        group_near.append(by_dom)
    index = BoxIndex(group_boxes)
    src_ranks = set(src.ranks)

    # per destination piece: local copies, and what must come from elsewhere
    local: list[_LocalCopy] = []
    nvl_needs: list[tuple[Box, int, tuple[int, ...], list[tuple[int, tuple[int, ...]]]]] = []
    net_needs: dict[Any, dict[tuple[int, Box], list[tuple[int, tuple[int, ...]]]]] = {}
    query = index.query
    cuts: dict[Box, list[tuple[int, Box]]] = {}  # a needed box: the (group, intersection) pairs it is cut into
    for r in sorted(dst.ranks):
        dom = domain(r)
        own = src.pieces(r) if r in src_ranks else ()
        dom_needs = net_needs.get(dom)
        for piece in dst.pieces(r):
            gbox = piece.global_box
            d_delta = _delta(gbox, piece.local_box)
            remaining = [gbox]
            for sp in own:
                x = intersect(sp.global_box, gbox)
                if x is None:
                    continue
                local.append(_LocalCopy(r, _translate(x, _delta(sp.global_box, sp.local_box)), _translate(x, d_delta),
                                        x))
                remaining = [y for rem in remaining for y in subtract(rem, x)]
            for rem in remaining:
                hits = cuts.get(rem)
                if hits is None:  # replicas of a destination shard need the same boxes: cut them once
                    hits = cuts[rem] = [(gid, x) for gid in query(rem)
                                        if (x := intersect(rem, group_boxes[gid])) is not None]
                for gid, x in hits:
                    near = group_near[gid].get(dom)
                    if near:
                        nvl_needs.append((x, r, d_delta, near))
                        continue
                    if dom_needs is None:
                        dom_needs = net_needs[dom] = {}
                    key = (gid, x)
                    lst = dom_needs.get(key)
                    if lst is None:
                        dom_needs[key] = [(r, d_delta)]
                    else:
                        lst.append((r, d_delta))

    # NVLink: largest boxes first; a box is split over several in-domain replicas only as far as other needs do
    # not already keep them busy
    nvl_needs.sort(key=lambda n: (-n[0].numel, n[1], n[0].offsets))
    nvl_demand: dict[int, int] = defaultdict(int)
    for x, r, d_delta, near in nvl_needs:
        nvl_demand[id(near)] += 1
    nvl: list[_NvlNeed] = []
    for x, r, d_delta, near in nvl_needs:
        ranks = [h[0] for h in near]
        deltas = [h[1] for h in near]
        for box in b.parts(x, -(-len(near) // nvl_demand[id(near)]), itemsize):
            nvl.append(_NvlNeed(r, ranks, _part(box, itemsize, [d_delta], deltas)))

    # network: per destination domain, each needed box crosses once (relay) or once per needer (no relay)
    net_demand: dict[int, int] = defaultdict(int)
    for needs in net_needs.values():
        for gid, _ in needs:
            net_demand[gid] += 1
    net: list[_NetNeed] = []
    split = b.parts
    relay = b.relay
    # per group: holder ranks, their deltas, the one delta they share or None (read only)
    holder_cols: dict[int, tuple[list[int], list[tuple[int, ...]], tuple[int, ...] | None]] = {}
    for dom in sorted(net_needs, key=repr):
        needs = net_needs[dom]
        fair = b.fair_recv.get(dom, 0.0)
        order = sorted([(-math.prod(x.shape), gid, x.offsets, k, x) for k, (gid, x) in enumerate(needs)])
        keys = list(needs)
        for *_, k, x in order:
            key = keys[k]
            gid = key[0]
            needers = needs[key]
            hc = holder_cols.get(gid)
            if hc is None:
                holders = group_holders[gid]
                h_deltas = [h[1] for h in holders]
                hc = holder_cols[gid] = ([h[0] for h in holders], h_deltas, _one_delta(h_deltas))
            h_ranks, h_deltas, h_one = hc
            if relay:
                k = -(-len(h_ranks) // net_demand[gid])  # senders per part, so that no replica sits idle
                boxes = split(x, len(needers), itemsize, fair, num_senders=k)
            else:
                k = -(-len(h_ranks) // (net_demand[gid] * len(needers)))
                boxes = split(x, k, itemsize)
            n_deltas = [n[1] for n in needers]
            net.append(_NetNeed(dom, gid, x, [n[0] for n in needers], n_deltas, h_ranks, h_deltas,
                                [_part(box, itemsize, n_deltas, h_deltas, h_one) for box in boxes], k))
    check = not (getattr(src, "regular", False) and getattr(dst, "regular", False))
    largest = max([n.part.nbytes for n in nvl] + [p.nbytes for n in net for p in n.parts], default=0)
    return _Recipe(itemsize, local, nvl, net, check, largest)


def _least(ranks: list[int], load: dict[int, int]) -> int:
    """Index of the least-loaded rank; among equals the first, which is the lowest rank (`ranks` is ascending)."""
    loads = list(map(load.__getitem__, ranks))
    return loads.index(min(loads))


def _emit_recipe(b: _Builder, rc: _Recipe, members: Members) -> None:
    """Phase two: choose senders and relay receivers against the running loads, and emit the transfers.

    `members`: the items (all of this recipe's geometry) that move together: one choice for all, each box once
    per member, in one transfer unit."""
    raw = b.raw
    k = len(members)
    relayed = tuple(Member(i, dt, dt) for i, _, dt in members)  # a forward reads the relay's destination tensor
    for r, sbox, dbox, x in rc.local:
        raw.append(_new_unit(Unit, (r, r, sbox, dbox, x, x.numel * rc.itemsize, "local", 0, members, -1)))
    nvl_send = b.nvl_send
    for r, ranks, part in rc.nvl:
        h = _least(ranks, nvl_send)
        raw.append(_new_unit(Unit, (ranks[h], r, part.src_boxes[h], part.dst_boxes[0], part.box, part.nbytes,
                                    "nvlink", 0, members, -1)))
        nvl_send[ranks[h]] += part.nbytes * k
    net_send, net_recv = b.net_send, b.net_recv
    arrivals: dict[tuple[Any, int], list[tuple[Box, int, tuple[int, ...], int]]] = defaultdict(list)
    for dom, gid, x, needers, n_deltas, holders, h_deltas, parts, spread in rc.net:
        if not b.relay:
            for n, r in enumerate(needers):
                for part in parts:
                    h = _least(holders, net_send)
                    raw.append(_new_unit(Unit, (holders[h], r, part.src_boxes[h], part.dst_boxes[n], part.box,
                                                part.nbytes, "network", 0, members, -1)))
                    net_send[holders[h]] += part.nbytes * k
                    net_recv[r] += part.nbytes * k
            continue
        if rc.check_arrivals:  # needs overlap partially only in custom layouts: forward what already arrived
            remaining = [x]
            for a_box, a_rank, a_delta, a_idx in arrivals[(dom, gid)]:
                covered = intersect(a_box, x)
                if covered is None:
                    continue
                remaining = [y for rem in remaining for y in subtract(rem, covered)]
                for r, d_delta in zip(needers, n_deltas):
                    if r == a_rank and d_delta == a_delta:
                        continue
                    b.emit(a_rank, r, a_delta, d_delta, covered, rc.itemsize, "local" if r == a_rank else "nvlink",
                           1, relayed, a_idx)
            if remaining != [x]:
                parts = [_part(box, rc.itemsize, n_deltas, h_deltas) for rem in remaining
                         for box in b.parts(rem, len(needers), rc.itemsize, b.fair_recv.get(dom, 0.0),
                                            num_senders=spread)]
        forward = len(needers) > 1 and b.transfers.add_forwards
        for part in parts:
            loads = list(map(net_recv.__getitem__, needers))
            n = loads.index(min(loads))  # the least-loaded needer receives; the lowest rank among equals
            if len(holders) > 1:
                loads = list(map(net_send.__getitem__, holders))
                h = loads.index(min(loads))
            else:
                h = 0
            recv, dst_boxes, nbytes = needers[n], part.dst_boxes, part.nbytes
            sender = holders[h]
            a_idx = len(raw)
            raw.append(_new_unit(Unit, (sender, recv, part.src_boxes[h], dst_boxes[n], part.box, nbytes,
                                        "network", 0, members, -1)))
            net_send[sender] += nbytes * k
            net_recv[recv] += nbytes * k
            if rc.check_arrivals:
                arrivals[(dom, gid)].append((part.box, recv, n_deltas[n], a_idx))
            if forward:
                nvl_send[recv] += forward(recv, dst_boxes[n], needers, dst_boxes, n, part.box, nbytes, relayed, a_idx)


def _network_lower_bound(items: Sequence[PlanItem], topology: Topology) -> dict[Any, int]:
    """Per destination domain: |union of what its ranks need| - |the part of it its ranks already hold|, in bytes
    summed over items."""
    out: dict[Any, int] = defaultdict(int)
    seen: dict[tuple[int, int], dict[Any, int]] = {}
    for item in items:
        gkey = (_geometry_id(item.src), _geometry_id(item.dst))
        if gkey in seen:  # the same geometry (another layer): the same bytes per domain
            for d, v in seen[gkey].items():
                out[d] += v
            continue
        this = seen[gkey] = {}
        need: dict[Any, list[Box]] = defaultdict(list)
        held: dict[Any, list[Box]] = defaultdict(list)
        for r in item.dst.ranks:
            need[topology.domain(r)].extend(p.global_box for p in item.dst.pieces(r))
        for r in item.src.ranks:
            d = topology.domain(r)
            if d in need:
                held[d].extend(p.global_box for p in item.src.pieces(r))
        # DTensor layouts: any two ranks' pieces are identical or disjoint, so the distinct boxes of each side are
        regular = getattr(item.src, "regular", False) and getattr(item.dst, "regular", False)
        for d, boxes in need.items():
            this[d] = (union_volume(boxes, disjoint=regular)
                       - intersection_volume(boxes, held.get(d, []), disjoint=regular)) * item.dst.dtype.itemsize
            out[d] += this[d]
    return out
