"""The planner: turn source layouts into destination layouts with a minimal, balanced list of transfers.

`plan(src, dst)` plans one tensor; `plan_many(items)` plans many tensors into one `Plan` whose chunks coalesce
every box bound for the same peer. Planning is pure Python on plain values: no device, no process group.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import math
import operator
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import torch

from reshard.planner import _checks
from reshard.planner._box import Box, intersect, split_box, split_to_fit, subtract
from reshard.planner._chunks import (
    _LOCAL,
    RELAY_CHUNK_LAG,
    Member,
    Members,
    TransferColumns,
    Unit,
    _assign_chunks,
    _Columns,
    _new_unit,
    _Transfers,
    _unique_triples,
    transfer_columns,
)
from reshard.planner._format import describe_plan, format_bytes, format_stats
from reshard.planner._index import BoxIndex, intersection_volume, union_volume
from reshard.planner._layout import _geometry_id
from reshard.planner._topology import Topology
from reshard.planner._types import (
    LINKS,
    PIPELINE_DEPTH,
    BoxList,
    Message,
    PlanStats,
    RankBytes,
    RankChunk,
    RankPlan,
    Transfer,
)

__all__ = ["DEFAULT_MIN_SPLIT_BYTES", "DEFAULT_STAGING_BYTES", "PLAN_VERSION", "RELAY_CHUNK_LAG", "Plan", "PlanData",
           "PlanItem", "clear_plan_cache", "format_bytes", "format_stats", "plan",
           "plan_many"]

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 << 20
"""Staging memory per rank. The executor keeps `PIPELINE_DEPTH` chunks in flight, so one chunk's send plus receive
bytes on a rank are at most `staging_bytes // PIPELINE_DEPTH`."""

DEFAULT_MIN_SPLIT_BYTES = 1 << 20
"""A box is split across several senders (or relay receivers) only into parts of at least this many bytes."""

SPREAD_FACTOR = 1
"""A box is split over several relay receivers only when it exceeds 1/SPREAD_FACTOR of a receiver's fair share of
its domain's network bytes: boxes up to one fair share balance by assignment alone (least-loaded receiver), so a box
is not cut, and its transfers multiplied, where whole boxes already spread evenly (TP8 -> TP4 replicas: one box per
receiver)."""

SENDER_SPREAD_FACTOR = 8
"""A box is split over several senders (its replicas) only while a part exceeds 1/SENDER_SPREAD_FACTOR of a
receiver's fair share."""

UNIT_SHARE = 16
"""Items of equal geometry move together in units of at most 1/UNIT_SHARE of a destination rank's mean bytes, so
that choosing one sender and relay for a whole unit still spreads the load, and at most half a chunk, so that a
rank can still send one unit and receive another in the same chunk."""

PLAN_VERSION = 3
"""Part of every fingerprint: bumped when the same inputs plan differently (2: first-fit chunk placement over bit
sets, relay forwards after all stage-0 transfers in plan order, items of equal geometry in units; 3: a box is split
over relay receivers only beyond one fair share, `SPREAD_FACTOR = 1`; large boxes contiguous at one end travel as
messages of their own, strided one-box messages are cut into parts)."""

DIRECT_SPLIT_BYTES = 256 << 10
"""A box of at least this many bytes that is contiguous in its local tensor at one end (sender or receiver) or both
is a message of its own, sent from (received into) the tensor at that end, instead of being packed with the
peer's other boxes of the chunk: above this size one more message on the wire costs less than packing and
unpacking the box (gloo on CPU)."""

PART_BYTES = 8 << 20
"""A one-box message that is strided at one end is cut into wire sends of about this many bytes, so packing part
k+1 (or unpacking part k) overlaps the transfer of the other parts."""


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One global tensor to move: its source and destination layouts and the local tensors they live in.

    Attributes:
        src, dst: layouts of the same global shape (anything with `shape`, `dtype`, `ranks`, `pieces(rank)`,
            `local_shape(rank)` and `key`, such as `Layout`).
        src_tensor, dst_tensor: index of the local tensor the pieces live in, on the source and destination side.
        name: the tensor's name for messages.
        precision: `"same"` (source and destination dtypes must match) or `"cast"` (values are cast to the
            destination dtype while packing, bit-exact to torch's `.to()`; the wire carries the destination dtype).
    """

    src: Any
    dst: Any
    src_tensor: int = 0
    dst_tensor: int = 0
    name: str | None = None
    precision: str = "same"

    def __post_init__(self) -> None:
        _checks.check_item_fields(self)

    @property
    def label(self) -> str:
        return self.name or getattr(self.dst, "name", None) or getattr(self.src, "name", None) or "tensor"

    @property
    def key(self) -> tuple:
        return (self.src.key, self.dst.key, self.src_tensor, self.dst_tensor, self.name, self.precision)

    @property
    def casts(self) -> bool:
        """Whether stage-0 boxes are cast from the source dtype to the destination dtype while packing."""
        return self.src.dtype != self.dst.dtype


def _check_item(item: PlanItem, index: int) -> None:
    src, dst = item.src, item.dst
    who = f"tensor {item.label!r} (item {index})"
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"{who}: global shapes differ: source {tuple(src.shape)}, destination {tuple(dst.shape)} (expected equal)"
        )
    if item.precision not in ("same", "cast"):
        raise ValueError(f"{who}: precision must be 'same' or 'cast', got {item.precision!r}")
    if src.dtype != dst.dtype and item.precision != "cast":
        raise ValueError(f"{who}: dtypes differ: source {src.dtype}, destination {dst.dtype} (expected equal, or "
                         "precision='cast' to cast while packing)")
    if item.precision == "cast" and not (src.dtype.is_floating_point and dst.dtype.is_floating_point):
        raise ValueError(f"{who}: precision='cast' needs floating-point dtypes, got {src.dtype} -> {dst.dtype}")


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
        src_box = Box._make(tuple(map(operator.add, gbox.offsets, src_delta)), shape)
        dst_box = Box._make(tuple(map(operator.add, gbox.offsets, dst_delta)), shape)
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


def _delta(global_box: Box, local_box: Box) -> tuple[int, ...]:
    return tuple(map(operator.sub, local_box.offsets, global_box.offsets))


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


def _translate(box: Box, delta: tuple[int, ...]) -> Box:
    return Box._make(tuple(map(operator.add, box.offsets, delta)), box.shape)


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
            d_delta = tuple(map(operator.sub, piece.local_box.offsets, gbox.offsets))
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


_KEY_DIGESTS = _checks.bounded_cache("layout digests", 4096)


def _layout_digest(layout: Any) -> bytes:
    """A digest of `layout.key` (shape, dtype, ranks, pieces), computed once per geometry: the key of an explicit
    layout lists every piece, and a model repeats each geometry in every layer."""
    gid = _geometry_id(layout)
    d = _KEY_DIGESTS.get(gid)
    if d is None:
        d = _KEY_DIGESTS[gid] = hashlib.sha256(repr(layout.key).encode()).digest()
    return d


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


def _unit_transfers(u: Unit, chunk: int) -> list[Transfer]:
    """The transfers of unit `u` in `chunk`: one per member tensor, same ranks and boxes."""
    return [Transfer(u.src, u.dst, u.src_box, u.dst_box, u.global_box, u.nbytes, u.link, u.stage, chunk, item,
                     src_t, dst_t) for item, src_t, dst_t in u.members]


_GBOX, _SRC_BOX, _DST_BOX, _DST = (operator.itemgetter(Unit._fields.index(f)) for f in
                                   ("global_box", "src_box", "dst_box", "dst"))
_SHAPE, _OFFSETS = operator.attrgetter("shape"), operator.attrgetter("offsets")
_UNBOUNDED = 1 << 62


def _repeat_each(values: Sequence[Any], counts: Sequence[int]) -> Iterable[Any]:
    """Each of `values` `counts[i]` times, in order."""
    return itertools.chain.from_iterable(map(itertools.repeat, values, counts))


def _expected_elements(layout: Any, rank: int) -> int:
    """Elements of `layout`'s pieces on `rank` (what the plan must write there)."""
    return sum(math.prod(piece.global_box.shape) for piece in layout.pieces(rank))


_RANK_FIELDS = {f: i for i, f in enumerate(RankBytes.__dataclass_fields__)}  # `RankBytes` fields in order

_PLAN_CACHE: OrderedDict[tuple, Plan] = OrderedDict()
_PLAN_CACHE_SIZE = 128


def clear_plan_cache() -> None:
    """Forget every cached plan, and empty every other planner cache (layout geometries, digests)."""
    _PLAN_CACHE.clear()
    _checks.clear_caches()


class UnitSpan(NamedTuple):
    """Units `rows[first_row:stop_row]` and the forwards of parts `first_part..stop_part - 1` of a `_Transfers`."""

    first_row: int
    stop_row: int
    first_part: int
    stop_part: int


@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity: it holds arrays
class PlanData:
    """What the planner built, as `Plan` takes it: the inputs, every transfer unit and its chunk.

    `Plan(data)` checks all of it (see `Plan`), so a `PlanData` that disagrees with itself or with its layouts
    never becomes a plan.

    Attributes:
        items, topology, relay, staging_bytes, min_split_bytes: the planner's inputs.
        units: every transfer unit, in plan order (stage 0 before the forwards that depend on it).
        chunks: `(N,)` int64, the chunk of each of the N units.
        network_lower_bound: bytes that must cross into the destination domains (see `PlanStats`).
        needed_bytes: bytes the destination ranks hold when done.
        planned: the spans (`UnitSpan`) of the units planned from scratch, when
            every other unit replays one of them (same geometry, same boxes): the box checks then look at these
            only. None checks every unit.
    """

    items: tuple[PlanItem, ...]
    topology: Topology
    relay: bool
    staging_bytes: int
    min_split_bytes: int
    units: _Transfers
    chunks: np.ndarray
    network_lower_bound: int
    needed_bytes: int
    planned: tuple[UnitSpan, ...] | None = None


class Plan:
    """The full, deterministic list of transfers that turns the source layouts into the destination layouts.

    Every rank builds the same plan from the same inputs (`plan`, `plan_many`); `fingerprint` lets ranks check that
    they agree. The constructor validates what it is given and raises `ValueError` when it is inconsistent: a
    transfer's boxes disagree in shape or leave the local tensor, a destination element is written other than
    exactly once, a relay forward is not at least `RELAY_CHUNK_LAG` chunks after its arrival, a rank's chunk
    exceeds `staging_bytes // PIPELINE_DEPTH`, or with relays the network bytes miss the lower bound.

    Attributes:
        items: the planned tensors.
        topology: the NVLink domains used.
        relay: whether boxes needed by several ranks of a domain cross the network once and are forwarded.
        staging_bytes: the staging budget per rank.
        transfers: every transfer, in plan order (stage 0 before the forwards that depend on it).
        stats: byte accounting, see `PlanStats`.
        fingerprint: a stable hex digest of the inputs and the result.
    """

    def __init__(self, data: PlanData) -> None:
        if not isinstance(data, PlanData):
            raise TypeError(f"Plan: expected a PlanData (plans come from plan / plan_many), got {type(data).__name__}")
        self.items = data.items
        self.topology = data.topology
        self.relay = data.relay
        self.staging_bytes = data.staging_bytes
        self.min_split_bytes = data.min_split_bytes
        self._data = data  # what it was built from (kept for `dataclasses.replace` in checks and tests)
        self._raw = data.units
        cols = data.units.columns()
        chunks = np.asarray(data.chunks)
        _check_chunks(data, cols, chunks)
        self._chunks = chunks.tolist()
        self._transfers: tuple[Transfer, ...] | None = None
        self._transfer_columns: TransferColumns | None = None
        self._rank_cols = (cols.src, cols.dst)  # (N,) each: find a rank's transfers without building them all
        self._by_rank: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._rank_plans: dict[int, RankPlan] = {}
        self.stats = self._compute_stats(cols, chunks, data.network_lower_bound, data.needed_bytes)
        _validate(self, data.planned)
        self.fingerprint = self._compute_fingerprint()

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer, in plan order (built on first use: a whole-model plan holds hundreds of thousands)."""
        if self._transfers is None:
            self._transfers = tuple(x for t, c in zip(self._raw, self._chunks) for x in _unit_transfers(t, c))
        return self._transfers

    def transfer_columns(self) -> TransferColumns:
        """Every transfer as numeric columns (`TransferColumns`, entry i is `transfers[i]`), built once: for sums
        over a whole plan, which need no `Transfer` objects."""
        if self._transfer_columns is None:
            self._transfer_columns = transfer_columns(self._raw, self._raw.columns(), np.asarray(self._chunks))
        return self._transfer_columns

    # ---- derived values -------------------------------------------------------------------------------------
    def _compute_stats(self, cols: _Columns, chunks: np.ndarray, network_lower_bound: int,
                       needed_bytes: int) -> PlanStats:
        # vectorized: a whole-model plan has up to millions of transfers
        n = chunks.size
        nbytes, kind, chunk = cols.nbytes, cols.link, chunks
        ranks, src_id, dst_id = cols.ranks, cols.src_id, cols.dst_id
        num_ranks = ranks.size
        # per dense rank, the fields of `RankBytes` in order (float64 sums are exact below 2**53 bytes per rank)
        table = np.zeros((len(_RANK_FIELDS), num_ranks), np.int64)
        weights = nbytes.astype(np.float64)

        def total(row: str, ids: np.ndarray, values: np.ndarray | None) -> None:
            if ids.size:
                sums = np.bincount(ids, weights=values, minlength=num_ranks)
                table[_RANK_FIELDS[row]] = np.rint(sums).astype(np.int64) if values is not None else sums

        by_link = {}
        for code, link in enumerate(LINKS):
            sel = np.flatnonzero(kind == code)
            w = weights[sel]
            by_link[link] = int(nbytes[sel].sum())
            if link == "local":
                total("local", dst_id[sel], w)
                continue
            total(f"{link}_send", src_id[sel], w)
            total(f"{link}_recv", dst_id[sel], w)
            # a message is one (chunk, sender, receiver)
            _, senders, receivers = _unique_triples(chunk[sel], src_id[sel], dst_id[sel], num_ranks, num_ranks)
            total(f"{link}_messages_sent", senders, None)
            total(f"{link}_messages_received", receivers, None)
        num_messages = int(table[_RANK_FIELDS["network_messages_sent"]].sum()
                           + table[_RANK_FIELDS["nvlink_messages_sent"]].sum())
        num_chunks = int(chunk.max()) + 1 if n else 0
        present = np.flatnonzero(table.any(axis=0))
        per_rank = dict(zip(ranks[present].tolist(), itertools.starmap(RankBytes, table[:, present].T.tolist())))
        send_all = table[_RANK_FIELDS["network_send"]] + table[_RANK_FIELDS["nvlink_send"]]
        recv_all = table[_RANK_FIELDS["network_recv"]] + table[_RANK_FIELDS["nvlink_recv"]]
        sends = send_all[send_all > 0]
        recvs = recv_all[recv_all > 0]
        mean_s = int(sends.sum()) / sends.size if sends.size else 0.0
        mean_r = int(recvs.sum()) / recvs.size if recvs.size else 0.0
        max_s = int(sends.max()) if sends.size else 0
        max_r = int(recvs.max()) if recvs.size else 0
        return PlanStats(
            total_bytes=sum(by_link.values()),
            network_bytes=by_link["network"],
            nvlink_bytes=by_link["nvlink"],
            local_bytes=by_link["local"],
            needed_bytes=needed_bytes,
            network_lower_bound=network_lower_bound,
            messages=num_messages,
            num_transfers=int(cols.count.sum()),
            num_forwards=int(cols.count[cols.dep >= 0].sum()),
            num_chunks=num_chunks,
            max_rank_send_bytes=max_s,
            max_rank_recv_bytes=max_r,
            mean_rank_send_bytes=mean_s,
            mean_rank_recv_bytes=mean_r,
            send_imbalance=max_s / mean_s if sends.size else 0.0,
            recv_imbalance=max_r / mean_r if recvs.size else 0.0,
            per_rank=per_rank,
        )

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(repr((PLAN_VERSION, self.topology.key, self.relay, self.staging_bytes, self.min_split_bytes)).encode())
        for it in self.items:
            h.update(_layout_digest(it.src))
            h.update(_layout_digest(it.dst))
            h.update(repr((it.src_tensor, it.dst_tensor, it.name, it.precision)).encode())
        s = self.stats
        h.update(repr((s.total_bytes, s.network_bytes, s.nvlink_bytes, s.local_bytes, s.messages,
                       s.num_transfers, s.num_chunks)).encode())
        return h.hexdigest()[:32]

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that takes part: holds a source or a destination of some item."""
        out: set[int] = set()
        for it in self.items:
            out.update(it.src.ranks)
            out.update(it.dst.ranks)
        return tuple(sorted(out))

    def _indices_of(self, rank: int) -> list[int]:
        """Plan-order indices of the units `rank` sends, receives or copies (one index pass for all ranks)."""
        if self._by_rank is None:
            src, dst = self._rank_cols
            other = np.flatnonzero(dst != src)  # a local copy is listed once
            ends = np.concatenate([src, dst[other]])
            idx = np.concatenate([np.arange(src.size), other])
            order = np.lexsort((idx, ends))
            ends = ends[order]
            ranks, starts = np.unique(ends, return_index=True)
            self._by_rank = (ranks, np.append(starts, ends.size), idx[order])
        ranks, bounds, idx = self._by_rank
        k = int(np.searchsorted(ranks, rank))
        if k == ranks.size or ranks[k] != rank:
            return []
        return idx[bounds[k]:bounds[k + 1]].tolist()

    def for_rank(self, rank: int) -> RankPlan:
        """`rank`'s whole program: what it sends, receives, forwards and copies, chunk by chunk in executable order,
        with the boxes of each chunk's pack and unpack call and the sizes of its staging.

        Within a chunk, messages are ordered by peer and their boxes by plan order, so the sender's packing and the
        receiver's unpacking agree on every byte offset without talking. Built once per rank and kept.
        """
        cached = self._rank_plans.get(rank)
        if cached is not None:
            return cached
        per_chunk: dict[int, tuple[list, dict, dict]] = {}
        deps: dict[int, int] = {}
        for t in (x for i in self._indices_of(rank) for x in _unit_transfers(self._raw.row(i), self._chunks[i])):
            local, sends, recvs = per_chunk.setdefault(t.chunk, ([], defaultdict(list), defaultdict(list)))
            if t.link == "local":
                local.append(t)
            elif t.src_rank == rank:
                sends[t.dst_rank].append(t)
            else:
                recvs[t.src_rank].append(t)
            if t.src_rank == rank and t.stage > 0:
                deps[t.chunk] = max(deps.get(t.chunk, -1), t.chunk - RELAY_CHUNK_LAG)
        chunks = []
        peers: set[int] = set()
        shapes: dict[tuple[bool, int], tuple[int, ...]] = {}

        def contiguous_at(t: Transfer, sending: bool) -> bool:
            """Whether the box is read from (written to) the local tensor of its sender (receiver) as it is:
            contiguous there, no cast while packing. Pure geometry of the plan, so both ends compute the same."""
            item = self.items[t.item]
            if sending and t.stage == 0 and item.casts:
                return False
            on_dst = not sending or t.stage > 0
            end = t.src_rank if sending else t.dst_rank
            key = (on_dst, t.item, end)
            shape = shapes.get(key)
            if shape is None:
                shape = shapes[key] = tuple((item.dst if on_dst else item.src).local_shape(end))
            return _contiguous_in(t.src_box if sending else t.dst_box, shape)

        for c in sorted(per_chunk):
            local, sends, recvs = per_chunk[c]
            send_msgs = _messages(sends, lambda t: contiguous_at(t, True), contiguous_at)
            recv_msgs = _messages(recvs, lambda t: contiguous_at(t, False), contiguous_at)
            peers.update(sends)
            peers.update(recvs)
            chunks.append(RankChunk(c, send_msgs, recv_msgs, tuple(local), sum(m.nbytes for m in send_msgs),
                                    sum(m.nbytes for m in recv_msgs), deps.get(c, -1),
                                    _box_list(self.items, send_msgs, sending=True),
                                    _box_list(self.items, recv_msgs, sending=False)))
        rp = RankPlan(
            rank,
            tuple(chunks),
            max((c.send_bytes for c in chunks), default=0),
            max((c.recv_bytes for c in chunks), default=0),
            tuple(sorted(peers)),
            max_chunk_bytes=max((c.send_bytes + c.recv_bytes for c in chunks), default=0),
            max_send_boxes=max((len(c.pack.boxes) for c in chunks), default=0),
            max_recv_boxes=max((len(c.unpack.boxes) for c in chunks), default=0),
            local_bytes=sum(t.nbytes for c in chunks for t in c.local),
        )
        self._rank_plans[rank] = rp
        return rp

    def describe(self, *, max_transfers: int = 200) -> str:
        """Readable text: the layouts, the statistics, then who sends what to whom, over which link."""
        return describe_plan(self, max_transfers=max_transfers)

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"Plan({len(self.items)} items, {s.num_transfers} transfers, {s.num_chunks} chunks, "
            f"network={s.network_bytes}B nvlink={s.nvlink_bytes}B local={s.local_bytes}B)"
        )


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


def _as_items(items: Iterable[Any]) -> tuple[PlanItem, ...]:
    out = []
    for i, it in enumerate(items):
        if isinstance(it, PlanItem):
            out.append(it)
        else:
            try:
                src, dst = it
            except (TypeError, ValueError):
                raise ValueError(f"plan_many: item {i} must be a PlanItem or a (src, dst) pair, got {it!r}") from None
            out.append(PlanItem(src, dst, src_tensor=i, dst_tensor=i))
    return tuple(out)


def plan_many(
    items: Iterable[Any],
    topology: Topology | None = None,
    *,
    relay: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    limits: _checks.PlanLimits | None = None,
) -> Plan:
    """Plan many tensors at once, so boxes bound for the same peer share messages.

    Args:
        items: `PlanItem`s, or `(src_layout, dst_layout)` pairs (item `i` then lives in local tensor `i` on both
            sides).
        topology: NVLink domains; default: every rank its own domain.
        relay: when several ranks of one domain need a box held outside it, send it across the network once and
            forward it over NVLink (stage 1). Without relay every destination receives directly.
        staging_bytes: staging memory per rank; one chunk's send + receive bytes per rank stay within
            `staging_bytes // PIPELINE_DEPTH`.
        min_split_bytes: smallest part a box is split into to spread it over several senders or relay receivers.
        limits: bounds on the inputs and the plan's size (`PlanLimits`; default `PlanLimits()`); inputs beyond
            them are refused with a `ValueError` before planning.

    Returns:
        A `Plan`, cached on its inputs (see `clear_plan_cache`).

    Algorithm, per item:
        1. Group the source pieces by global box: each unique box and its holders (replicas).
        2. For each destination rank and piece: the part the rank holds in its own source tensor is a local copy.
           The rest is cut along the unique source boxes (found through a `BoxIndex`). A part held by a rank in
           the destination's domain comes over NVLink, from the least-loaded such holder; otherwise it is a
           network need of the domain.
        3. Per domain, identical network needs of several ranks are merged. Each is split into parts (at most one
           per needer) that cross the network once, each to the needer with the least network receive load so
           far, from the holder with the least network send load; the receiver forwards it over NVLink to the
           other needers (stage 1). So network bytes equal the lower bound.
        4. Boxes are cut to fit a chunk; chunks are assigned by first fit (see `reshard.planner._chunks`).

    Steps 1-3 run once per geometry (a pair of layouts up to names and local tensors); items of one geometry then
    move in units of several items that share the choices of steps 2-3 (see `UNIT_SHARE` for their size).

    Example (worked by hand): a `(4, 4)` tensor on ranks `[0, 1]` as `S(0)` to ranks `[2, 3]` as `R`, with
    `Topology(domain_size=2)`: domain 1 (ranks 2, 3) needs rows 0:2 (from rank 0) and 2:4 (from rank 1). Rows
    0:2 go to rank 2 over the network and rank 2 forwards them to rank 3; rows 2:4 go to rank 3 (the less loaded
    receiver) and are forwarded to rank 2. Network bytes = 64 = the lower bound; NVLink bytes = 64.
    """
    items = _as_items(items)
    limits = _checks.check_call(topology, relay, limits)
    topology = topology if topology is not None else Topology()
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < PIPELINE_DEPTH:
        raise ValueError(f"plan: staging_bytes must be an integer >= {PIPELINE_DEPTH}, got {staging_bytes!r}")
    if isinstance(min_split_bytes, bool) or not isinstance(min_split_bytes, int) or min_split_bytes < 1:
        raise ValueError(f"plan: min_split_bytes must be a positive integer, got {min_split_bytes!r}")
    key = (tuple(it.key for it in items), topology.key, relay, staging_bytes, min_split_bytes)
    key = (key, _checks.names_key(items), limits)
    cached = _PLAN_CACHE.get(key)
    if cached is not None:
        _PLAN_CACHE.move_to_end(key)
        return cached
    for i, it in enumerate(items):
        _check_item(it, i)
    chunk_cap = staging_bytes // PIPELINE_DEPTH
    for it in items:
        if it.dst.dtype.itemsize > chunk_cap:
            raise ValueError(
                f"tensor {it.label!r}: staging_bytes={staging_bytes} cannot hold one element of {it.dst.dtype} "
                f"{PIPELINE_DEPTH} times ({PIPELINE_DEPTH} chunks in flight)"
            )
    _checks.check_items(items, staging_bytes, limits)
    # planning allocates many small tuples and no cycles: the cyclic collector would only rescan them
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        b = _Builder(topology, relay, chunk_cap, min_split_bytes)
        lower_by_domain = _network_lower_bound(items, topology)
        dst_per_domain: dict[Any, set[int]] = defaultdict(set)
        for dst in {_geometry_id(it.dst): it.dst for it in items}.values():  # rank sets repeat with geometries
            for r in dst.ranks:
                dst_per_domain[b.domain(r)].add(r)
        b.fair_recv = {d: lower_by_domain[d] / len(rs) for d, rs in dst_per_domain.items() if lower_by_domain.get(d)}
        needed_by_geometry: dict[int, int] = {}
        for it in items:
            g = _geometry_id(it.dst)
            if g not in needed_by_geometry:
                needed_by_geometry[g] = sum(p.global_box.numel for r in it.dst.ranks for p in it.dst.pieces(r)) \
                    * it.dst.dtype.itemsize
        needed = sum(needed_by_geometry[_geometry_id(it.dst)] for it in items)
        # items of equal geometry (every layer of a model) share one recipe, and move in units of several items
        # that take the same choices: fewer, larger transfers (see UNIT_SHARE for how large)
        unit_cap = min(chunk_cap // 2, max(1, needed // (max(1, sum(map(len, dst_per_domain.values()))) * UNIT_SHARE)))
        groups: dict[tuple[int, int], list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault((_geometry_id(it.src), _geometry_id(it.dst)), []).append(i)
        templates: list[UnitSpan] = []  # each geometry's first unit
        for members in groups.values():
            rc = _recipe(b, items[members[0]])
            if rc.check_arrivals:
                size = 1
            else:
                size = max(1, unit_cap // rc.max_part_bytes) if rc.max_part_bytes else len(members)
            for a in range(0, len(members), size):
                unit = tuple(Member(i, items[i].src_tensor, items[i].dst_tensor) for i in members[a:a + size])
                start, first_part = len(b.raw), b.transfers.num_parts
                _emit_recipe(b, rc, unit)
                if a == 0:
                    templates.append(UnitSpan(start, len(b.raw), first_part, b.transfers.num_parts))
        chunks = _assign_chunks(b.transfers.columns(), chunk_cap)
        result = Plan(PlanData(items, topology, relay, staging_bytes, min_split_bytes, b.transfers, chunks,
                               sum(lower_by_domain.values()), needed, tuple(templates)))
        _checks.check_plan(result, limits)
        b.transfers.compact()  # no object per row from here on (see `_Rows`)
    finally:
        if gc_was_enabled:
            gc.enable()
    _PLAN_CACHE[key] = result
    if len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
        _PLAN_CACHE.popitem(last=False)
    logger.debug("planned %d items: %s", len(items), result)
    return result


def plan(
    src: Any,
    dst: Any,
    topology: Topology | None = None,
    *,
    relay: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    precision: str = "same",
    limits: _checks.PlanLimits | None = None,
) -> Plan:
    """Plan moving one tensor from layout `src` to layout `dst`. See `plan_many` for the arguments and algorithm.

    The source and destination rank sets may be disjoint (trainer -> inference), overlap, or be equal. With
    `precision="cast"` the dtypes may differ (e.g. float32 master weights -> bfloat16): values are cast while
    packing, and the wire carries the destination dtype.
    """
    return plan_many(
        [PlanItem(src, dst, precision=precision)], topology, relay=relay, staging_bytes=staging_bytes,
        min_split_bytes=min_split_bytes, limits=limits,
    )


def _invalid(message: str) -> ValueError:
    """The one error of plan validation: a `PlanData` that contradicts itself or its layouts."""
    return ValueError(f"inconsistent plan: {message}")


def _check_chunks(data: PlanData, cols: _Columns, chunks: np.ndarray) -> None:
    """One chunk per unit; forwards at least `RELAY_CHUNK_LAG` chunks after their arrival; each rank's send plus
    receive bytes in a chunk within `staging_bytes // PIPELINE_DEPTH` (the planner cuts every box to fit)."""
    n = cols.src.size
    if chunks.shape != (n,) or (n and (chunks.dtype.kind not in "iu" or int(chunks.min()) < 0)):
        raise _invalid(f"chunks must be {n} non-negative integers (one per unit), got shape {chunks.shape} of "
                       f"{chunks.dtype}")
    fwd = np.flatnonzero(cols.dep >= 0)
    dep = cols.dep[fwd]
    if (dep >= fwd).any():
        i = int(fwd[np.argmax(dep >= fwd)])
        raise _invalid(f"unit {i} forwards arrival {int(cols.dep[i])}, which is not an earlier unit")
    early = chunks[fwd] < chunks[dep] + RELAY_CHUNK_LAG
    if early.any():
        i = int(fwd[np.argmax(early)])
        raise _invalid(f"unit {i} forwards in chunk {chunks[i]} the arrival of chunk {chunks[cols.dep[i]]}; expected "
                       f"at least {RELAY_CHUNK_LAG} chunks later (RELAY_CHUNK_LAG)")
    staged = np.flatnonzero(cols.link != _LOCAL)
    if not staged.size:
        return
    cap = data.staging_bytes // PIPELINE_DEPTH
    num_ranks = cols.ranks.size
    key = chunks[staged] * num_ranks
    nbytes = cols.nbytes[staged].astype(np.float64)
    # a rank's bytes in a chunk: what it sends plus what it receives (float64 sums are exact below 2**53 bytes)
    used = np.bincount(key + cols.src_id[staged], weights=nbytes, minlength=int(key.max()) + num_ranks)
    used += np.bincount(key + cols.dst_id[staged], weights=nbytes, minlength=used.size)
    over = used > cap
    if over.any():
        c, r = divmod(int(np.argmax(over)), num_ranks)
        raise _invalid(f"rank {int(cols.ranks[r])} moves {int(used[c * num_ranks + r])} bytes in chunk {c}, over "
                       f"staging_bytes // PIPELINE_DEPTH = {cap}")


def _overlap(boxes: Sequence[Box]) -> bool:
    """Whether two of `boxes` share an element: a sweep along dim 0, comparing only boxes whose dim-0 ranges
    overlap (a rank's boxes of one tensor are mostly slabs along dim 0)."""
    if not boxes[0].offsets:  # 0-d: every box is the one element
        return len(boxes) > 1
    boxes = sorted(boxes, key=lambda b: b.offsets)
    for i, a in enumerate(boxes):
        end = a.offsets[0] + a.shape[0]
        for j in range(i + 1, len(boxes)):  # indices, not a slice: a slice copies the rest on every step
            b = boxes[j]
            if b.offsets[0] >= end:
                break
            if intersect(a, b) is not None:
                return True
    return False


def _validate(p: Plan, spans: Sequence[UnitSpan] | None = None) -> None:
    """Checks from box arithmetic: boxes agree in shape and lie in bounds, every destination element is written
    exactly once, and with relays the network bytes meet the lower bound.

    `spans`: where the units planned from scratch are; the others replay one of them (same geometry, same boxes),
    so checking the planned ones checks all, and the byte total (every unit's bytes sum to what the destinations
    need) catches a unit left out or added. None checks every unit.

    The per-box checks run on numpy columns of the boxes (one group per number of dims); only the (item, rank)
    pairs whose boxes overlap along dim 0 once sorted are checked box by box (`_overlap`).
    """
    s = p.stats
    if s.total_bytes != s.needed_bytes:
        raise _invalid(f"the transfers write {s.total_bytes} bytes, but the destinations need {s.needed_bytes}")
    store = p._raw
    num_rows = len(store.rows)
    if spans is None:
        spans = (UnitSpan(0, num_rows, 0, store.num_parts),)
        every_member = True
    else:
        # the members of a unit share its boxes and their geometry: the first member of each first unit stands
        # for all
        every_member = False
    starts = store._starts()
    num_items = len(p.items)
    # one entry per checked (unit, member): its item, destination rank and box; `where` finds the unit again
    items_of: list[int] = []
    dst_ranks: list[int] = []
    boxes: list[Box] = []
    where: list[int] = []
    for a, b, pa, pb in spans:
        rows = store.rows[a:b]
        g_shapes = list(map(_SHAPE, map(_GBOX, rows)))
        if g_shapes != list(map(_SHAPE, map(_SRC_BOX, rows))) or g_shapes != list(map(_SHAPE, map(_DST_BOX, rows))):
            u = next(u for u in rows if not u.global_box.shape == u.src_box.shape == u.dst_box.shape)
            raise _invalid(f"transfer shapes disagree: {u}")
        fa, fb = starts[pa], starts[pb]
        counts = store.p_count[pa:pb]
        part_shapes = list(map(_SHAPE, store.p_box[pa:pb]))
        f_dst, f_boxes = store.targets(pa, pb)
        if part_shapes != list(map(_SHAPE, store.p_src_box[pa:pb])) or \
                list(map(_SHAPE, f_boxes)) != list(_repeat_each(part_shapes, counts)):
            j = next(j for j in range(fa, fb) if not store.row(num_rows + j).global_box.shape ==
                     store.row(num_rows + j).src_box.shape == store.row(num_rows + j).dst_box.shape)
            raise _invalid(f"transfer shapes disagree: {store.row(num_rows + j)}")
        if every_member:
            for k, u in enumerate(rows, a):
                for m in u[8]:
                    items_of.append(m[0])
                    dst_ranks.append(u[1])
                    boxes.append(u[3])
                    where.append(k)
            for k, (ms, c) in enumerate(zip(store.p_members[pa:pb], counts), pa):
                for j in range(starts[k], starts[k] + c):
                    for m in ms:
                        items_of.append(m[0])
                        dst_ranks.append(f_dst[j - fa])
                        boxes.append(f_boxes[j - fa])
                        where.append(num_rows + j)
        else:
            items_of.extend(u[8][0][0] for u in rows)
            dst_ranks.extend(map(_DST, rows))
            boxes.extend(map(_DST_BOX, rows))
            where.extend(range(a, b))
            items_of.extend(_repeat_each([ms[0][0] for ms in store.p_members[pa:pb]], counts))
            dst_ranks.extend(f_dst)
            boxes.extend(f_boxes)
            where.extend(range(num_rows + fa, num_rows + fb))
    planned: set[int] | None = None if every_member else set(items_of)
    if items_of and not (0 <= min(items_of) and max(items_of) < num_items):
        k = next(k for k, i in enumerate(items_of) if not 0 <= i < num_items)
        raise _invalid(f"unit names item {items_of[k]}, but the plan has {num_items}: {store.row(where[k])}")
    # every (planned item, destination rank): its key, local shape and the elements it must receive, per geometry
    check_items = sorted(planned) if planned is not None else range(num_items)
    span = 1 + max([*dst_ranks, *(max(p.items[i].dst.ranks, default=0) for i in check_items)], default=0)
    geo: dict[int, tuple[np.ndarray, list[tuple[int, ...]], np.ndarray]] = {}
    table_keys, table_shapes, table_expected = [], [], []
    for i in check_items:
        dst = p.items[i].dst
        gid = _geometry_id(dst)
        g = geo.get(gid)
        if g is None:
            ranks = list(dst.ranks)
            g = geo[gid] = (np.asarray(ranks, np.int64), [tuple(dst.local_shape(r)) for r in ranks],
                            np.asarray([_expected_elements(dst, r) for r in ranks], np.int64))
        table_keys.append(g[0] + i * span)
        table_shapes.extend(g[1])
        table_expected.append(g[2])
    keys_t = np.concatenate(table_keys) if table_keys else np.zeros(0, np.int64)
    expected_t = np.concatenate(table_expected) if table_expected else np.zeros(0, np.int64)
    order_t = np.argsort(keys_t, kind="stable")
    sorted_t = keys_t[order_t]
    keys = np.asarray(items_of, np.int64) * span + np.asarray(dst_ranks, np.int64)
    pos = np.minimum(np.searchsorted(sorted_t, keys), max(sorted_t.size - 1, 0))
    found = sorted_t[pos] == keys if sorted_t.size else np.zeros(keys.size, bool)
    row = np.where(found, order_t[pos] if sorted_t.size else 0, -1)  # table row of each entry, -1: none
    max_nd = max(map(len, table_shapes), default=0)
    bound_t = np.fromiter(itertools.chain.from_iterable((*ls, *(_UNBOUNDED,) * (max_nd - len(ls))) for ls in
                                                        table_shapes), np.int64, len(table_shapes) * max_nd)
    bound_t = bound_t.reshape(len(table_shapes), max_nd)
    got = np.zeros(keys_t.size, np.int64)
    ndims = np.fromiter(map(len, map(_SHAPE, boxes)), np.int64, len(boxes))
    flat = itertools.chain.from_iterable
    suspects: list[int] = []  # table rows whose boxes may overlap
    for ndim in np.unique(ndims).tolist():
        sel = np.flatnonzero(ndims == ndim)
        rows_s = row[sel]
        if not ndim:  # 0-d: every box is the one element
            np.add.at(got, rows_s[rows_s >= 0], 1)
            continue
        sel_boxes = boxes if sel.size == len(boxes) else list(map(boxes.__getitem__, sel.tolist()))
        off = np.fromiter(flat(map(_OFFSETS, sel_boxes)), np.int64, sel.size * ndim).reshape(-1, ndim)
        ext = np.fromiter(flat(map(_SHAPE, sel_boxes)), np.int64, sel.size * ndim).reshape(-1, ndim)
        bound = np.full((sel.size, ndim), _UNBOUNDED, np.int64)
        known = rows_s >= 0
        width = min(ndim, max_nd)
        bound[known, :width] = bound_t[rows_s[known], :width]
        for k in np.flatnonzero(~known).tolist():  # a rank outside the item's destination ranks
            ls = tuple(p.items[items_of[sel[k]]].dst.local_shape(dst_ranks[sel[k]]))[:ndim]
            bound[k, :len(ls)] = ls
        bad = ((off < 0) | (off + ext > bound)).any(axis=1)
        if bad.any():
            k = int(sel[int(np.argmax(bad))])
            ls = p.items[items_of[k]].dst.local_shape(dst_ranks[k])
            raise _invalid(f"destination box out of bounds of local shape {ls}: {store.row(where[k])}")
        np.add.at(got, rows_s[known], ext[known].prod(axis=1))
        # sorted by (row, dim-0 start), boxes that start at or after the previous one's end cannot overlap
        order = np.lexsort((off[:, 0], rows_s))
        ids_s, start, stop = rows_s[order], off[order, 0], (off + ext)[order, 0]
        clash = (ids_s[1:] == ids_s[:-1]) & (start[1:] < stop[:-1]) & (ids_s[1:] >= 0)
        suspects.extend(np.unique(ids_s[1:][clash]).tolist())
    if ndims.size and (ndims == 0).any():
        counts = np.bincount(row[(ndims == 0) & (row >= 0)], minlength=keys_t.size)
        suspects.extend(np.flatnonzero(counts > 1).tolist())
    short = np.flatnonzero(got != expected_t)
    if short.size:
        k = int(short[0])
        i, r = divmod(int(keys_t[k]), span)
        raise _invalid(f"tensor {p.items[i].label!r}: rank {r} receives {int(got[k])} elements, expected "
                       f"{int(expected_t[k])}")
    if suspects:
        members: dict[int, list[Box]] = {k: [] for k in suspects}
        for b, k in zip(boxes, row.tolist()):
            if k in members:
                members[k].append(b)
        for k in sorted(members):
            if _overlap(members[k]):
                i, r = divmod(int(keys_t[k]), span)
                raise _invalid(f"tensor {p.items[i].label!r}: rank {r} receives some elements more than once")
    if p.relay and s.network_bytes != s.network_lower_bound:
        raise _invalid(f"network bytes {s.network_bytes} != lower bound {s.network_lower_bound} with relay")
