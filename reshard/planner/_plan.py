"""The planner: turn source layouts into destination layouts with a minimal, balanced list of transfers.

`plan(src, dst)` plans one tensor; `plan_many(items)` plans many tensors into one `Plan` whose chunks coalesce
every box bound for the same peer. Planning is pure Python on plain values: no device, no process group.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import math
import operator

import numpy as np
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from reshard.planner import _checks
from reshard.planner._box import Box, intersect, split_box, split_to_fit, subtract
from reshard.planner._chunks import (
    RELAY_CHUNK_LAG,
    _assign_chunks,
    _Columns,
    _Transfers,
    _unique_triples,
    Members,
)
from reshard.planner._index import BoxIndex, intersection_volume, union_volume
from reshard.planner._layout import _geometry_id
from reshard.planner._topology import Topology
from reshard.planner._types import LINKS, Message, PlanStats, RankBytes, RankChunk, RankPlan, Transfer

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 << 20
"""Staging memory per rank. The executor keeps two chunks in flight, so one chunk's send plus receive bytes on a
rank are at most half of this."""

DEFAULT_MIN_SPLIT_BYTES = 1 << 20
"""A box is split across several senders (or relay receivers) only into parts of at least this many bytes."""

SPREAD_FACTOR = 8
"""A box is split over several relay receivers only when it exceeds 1/SPREAD_FACTOR of a receiver's fair share of
its domain's network bytes."""

UNIT_SHARE = 16
"""Items of equal geometry move together in units of at most 1/UNIT_SHARE of a destination rank's mean bytes, so
that choosing one sender and relay for a whole unit still spreads the load, and at most half a chunk, so that a
rank can still send one unit and receive another in the same chunk."""

PLAN_VERSION = 2
"""Part of every fingerprint: bumped when the same inputs plan differently (2: first-fit chunk placement over bit
sets, relay forwards after all stage-0 transfers in plan order, items of equal geometry in units)."""


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
        # a row: (src, dst, src_box, dst_box, global_box, nbytes, link, stage, members, dep), see `_Transfers`
        self.raw = self.transfers.rows
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
        self.raw.append((src, dst, src_box, dst_box, gbox, nbytes, link, stage, members, dep))
        nbytes *= len(members)
        if link == "network":
            self.net_send[src] += nbytes
            self.net_recv[dst] += nbytes
        elif link == "nvlink":
            self.nvl_send[src] += nbytes
        return len(self.raw) - 1

    def parts(self, box: Box, num_candidates: int, itemsize: int, fair_share: float = 0.0) -> list[Box]:
        """Split `box` for spreading over `num_candidates` ranks, then to fit a chunk; row-major order.

        A box is spread only when it is large next to `fair_share` (the bytes each candidate would carry if the
        whole plan were spread evenly): many boxes much smaller than that balance by assignment alone, without
        multiplying transfers.
        """
        nbytes = box.numel * itemsize
        want = min(num_candidates, max(1, nbytes // self.min_split_bytes))
        if fair_share > 0:
            want = min(want, max(1, math.ceil(SPREAD_FACTOR * nbytes / fair_share)))
        cap_numel = max(1, self.chunk_cap // itemsize)
        out: list[Box] = []
        for part in split_box(box, want):
            out.extend(split_to_fit(part, cap_numel))
        return out


def _delta(global_box: Box, local_box: Box) -> tuple[int, ...]:
    return tuple(lo - go for lo, go in zip(local_box.offsets, global_box.offsets))


@dataclass(slots=True)
class _Part:
    """One box to move, with its place in every candidate's local tensor (computed once per geometry)."""

    box: Box
    nbytes: int
    dst_boxes: tuple[Box, ...]  # per needer
    src_boxes: tuple[Box, ...]  # per holder


@dataclass(slots=True)
class _Recipe:
    """The geometry of an item's plan, independent of load: what each destination needs and who can send it.

    Every layer of a model repeats a few geometries; the recipe is computed once per geometry and each item then
    only makes its choices (which replica sends, which relay receives) against the plan's running loads.
    """

    itemsize: int
    local: list[tuple[int, Box, Box, Box]]  # (rank, src_box, dst_box, global_box)
    nvl: list[tuple[int, list[int], _Part]]  # (destination rank, holder ranks, part)
    # (domain, group, box, needer ranks, needer deltas, holder ranks, holder deltas, parts, split count)
    net: list[tuple[Any, int, Box, list[int], list[tuple[int, ...]], list[int], list[tuple[int, ...]],
                    list[_Part], int]]
    check_arrivals: bool
    max_part_bytes: int  # the largest box that takes staging (0 when there is none)


def _translate(box: Box, delta: tuple[int, ...]) -> Box:
    return Box._make(tuple(map(operator.add, box.offsets, delta)), box.shape)


def _part(box: Box, itemsize: int, dst_deltas: Sequence[tuple[int, ...]],
          src_deltas: Sequence[tuple[int, ...]]) -> _Part:
    # replicas usually sit at the same place in their local tensors: translate once per distinct delta
    moved = {d: _translate(box, d) for d in {*dst_deltas, *src_deltas}}
    return _Part(box, box.numel * itemsize, tuple(map(moved.__getitem__, dst_deltas)),
                 tuple(map(moved.__getitem__, src_deltas)))


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
    local: list[tuple[int, Box, Box, Box]] = []
    nvl_needs: list[tuple[Box, int, tuple[int, ...], list[tuple[int, tuple[int, ...]]]]] = []
    net_needs: dict[Any, dict[tuple[int, Box], list[tuple[int, tuple[int, ...]]]]] = {}
    for r in sorted(dst.ranks):
        dom = domain(r)
        own = src.pieces(r) if r in src_ranks else ()
        for piece in dst.pieces(r):
            d_delta = _delta(piece.global_box, piece.local_box)
            remaining = [piece.global_box]
            for sp in own:
                x = intersect(sp.global_box, piece.global_box)
                if x is None:
                    continue
                local.append((r, _translate(x, _delta(sp.global_box, sp.local_box)), _translate(x, d_delta), x))
                remaining = [y for rem in remaining for y in subtract(rem, x)]
            for rem in remaining:
                for gid in index.query(rem):
                    x = intersect(rem, group_boxes[gid])
                    if x is None:
                        continue
                    near = group_near[gid].get(dom)
                    if near:
                        nvl_needs.append((x, r, d_delta, near))
                    else:
                        net_needs.setdefault(dom, {}).setdefault((gid, x), []).append((r, d_delta))

    # NVLink: largest boxes first; a box is split over several in-domain replicas only as far as other needs do
    # not already keep them busy
    nvl_needs.sort(key=lambda n: (-n[0].numel, n[1], n[0].offsets))
    nvl_demand: dict[int, int] = defaultdict(int)
    for x, r, d_delta, near in nvl_needs:
        nvl_demand[id(near)] += 1
    nvl = []
    for x, r, d_delta, near in nvl_needs:
        ranks = [h[0] for h in near]
        deltas = [h[1] for h in near]
        for box in b.parts(x, -(-len(near) // nvl_demand[id(near)]), itemsize):
            nvl.append((r, ranks, _part(box, itemsize, [d_delta], deltas)))

    # network: per destination domain, each needed box crosses once (relay) or once per needer (no relay)
    net_demand: dict[int, int] = defaultdict(int)
    for needs in net_needs.values():
        for gid, _ in needs:
            net_demand[gid] += 1
    net = []
    for dom in sorted(net_needs, key=repr):
        needs = net_needs[dom]
        for (gid, x) in sorted(needs, key=lambda k: (-k[1].numel, k[0], k[1].offsets)):
            needers = needs[(gid, x)]
            holders = group_holders[gid]
            if b.relay:
                k = max(len(needers), -(-len(holders) // net_demand[gid]))
                boxes = b.parts(x, k, itemsize, b.fair_recv.get(dom, 0.0))
            else:
                k = -(-len(holders) // (net_demand[gid] * len(needers)))
                boxes = b.parts(x, k, itemsize)
            n_deltas = [n[1] for n in needers]
            h_deltas = [h[1] for h in holders]
            net.append((dom, gid, x, [n[0] for n in needers], n_deltas, [h[0] for h in holders], h_deltas,
                        [_part(box, itemsize, n_deltas, h_deltas) for box in boxes], k))
    check = not (getattr(src, "regular", False) and getattr(dst, "regular", False))
    largest = max([p.nbytes for _, _, p in nvl] + [p.nbytes for n in net for p in n[7]], default=0)
    return _Recipe(itemsize, local, nvl, net, check, largest)


def _least(ranks: list[int], load: dict[int, int]) -> int:
    """Index of the least-loaded rank; among equals the first, which is the lowest rank (`ranks` is ascending)."""
    loads = list(map(load.__getitem__, ranks))
    return loads.index(min(loads))


def _emit_recipe(b: _Builder, rc: _Recipe, members: Members) -> None:
    """Phase two: choose senders and relay receivers against the running loads, and emit the transfers.

    `members`: `(item, src_tensor, dst_tensor)` of the items (all of this recipe's geometry) that move together:
    one choice for all, each box once per member, in one transfer unit."""
    raw = b.raw
    k = len(members)
    relayed = tuple((i, dt, dt) for i, _, dt in members)  # a forward reads the relay's destination tensor
    for r, sbox, dbox, x in rc.local:
        raw.append((r, r, sbox, dbox, x, x.numel * rc.itemsize, "local", 0, members, -1))
    nvl_send = b.nvl_send
    for r, ranks, part in rc.nvl:
        h = _least(ranks, nvl_send)
        raw.append((ranks[h], r, part.src_boxes[h], part.dst_boxes[0], part.box, part.nbytes, "nvlink", 0,
                    members, -1))
        nvl_send[ranks[h]] += part.nbytes * k
    net_send, net_recv = b.net_send, b.net_recv
    arrivals: dict[tuple[Any, int], list[tuple[Box, int, tuple[int, ...], int]]] = defaultdict(list)
    for dom, gid, x, needers, n_deltas, holders, h_deltas, parts, spread in rc.net:
        if not b.relay:
            for n, r in enumerate(needers):
                for part in parts:
                    h = _least(holders, net_send)
                    raw.append((holders[h], r, part.src_boxes[h], part.dst_boxes[n], part.box, part.nbytes,
                                "network", 0, members, -1))
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
                         for box in b.parts(rem, spread, rc.itemsize, b.fair_recv.get(dom, 0.0))]
        for part in parts:
            n = _least(needers, net_recv)
            h = _least(holders, net_send)
            recv, recv_box = needers[n], part.dst_boxes[n]
            a_idx = len(raw)
            raw.append((holders[h], recv, part.src_boxes[h], recv_box, part.box, part.nbytes, "network", 0,
                        members, -1))
            net_send[holders[h]] += part.nbytes * k
            net_recv[recv] += part.nbytes * k
            if rc.check_arrivals:
                arrivals[(dom, gid)].append((part.box, recv, n_deltas[n], a_idx))
            if len(needers) > 1:
                nvl_send[recv] += b.transfers.add_forwards(recv, recv_box, needers, part.dst_boxes, n, part.box,
                                                           part.nbytes, relayed, a_idx)


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
        for d, boxes in need.items():
            this[d] = (union_volume(boxes) - intersection_volume(boxes, held.get(d, []))) * item.dst.dtype.itemsize
            out[d] += this[d]
    return out


def _unit_transfers(t: tuple, chunk: int) -> list[Transfer]:
    """The transfers of unit `t` in `chunk`: one per member tensor, same ranks and boxes."""
    return [Transfer(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], chunk, item, src_t, dst_t)
            for item, src_t, dst_t in t[8]]


_PLAN_CACHE: OrderedDict[tuple, Plan] = OrderedDict()
_PLAN_CACHE_SIZE = 128


def clear_plan_cache() -> None:
    """Forget every cached plan, and empty every other planner cache (layout geometries, digests)."""
    _PLAN_CACHE.clear()
    _checks.clear_caches()


class Plan:
    """The full, deterministic list of transfers that turns the source layouts into the destination layouts.

    Every rank builds the same plan from the same inputs; `fingerprint` lets ranks check that they agree.

    Attributes:
        items: the planned tensors.
        topology: the NVLink domains used.
        relay: whether boxes needed by several ranks of a domain cross the network once and are forwarded.
        staging_bytes: the staging budget per rank.
        transfers: every transfer, in plan order (stage 0 before the forwards that depend on it).
        stats: byte accounting, see `PlanStats`.
        fingerprint: a stable hex digest of the inputs and the result.
    """

    def __init__(
        self,
        items: tuple[PlanItem, ...],
        topology: Topology,
        relay: bool,
        staging_bytes: int,
        min_split_bytes: int,
        raw: _Transfers,
        cols: _Columns,
        chunks: np.ndarray,
        network_lower_bound: int,
        needed_bytes: int,
    ) -> None:
        self.items = items
        self.topology = topology
        self.relay = relay
        self.staging_bytes = staging_bytes
        self.min_split_bytes = min_split_bytes
        self._raw = raw
        self._chunks = chunks.tolist()
        self._transfers: tuple[Transfer, ...] | None = None
        self._rank_cols = (cols.src, cols.dst)  # (N,) each: find a rank's transfers without building them all
        self._by_rank: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._rank_plans: dict[int, RankPlan] = {}
        self.stats = self._compute_stats(cols, chunks, network_lower_bound, needed_bytes)
        self.fingerprint = self._compute_fingerprint()

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every transfer, in plan order (built on first use: a whole-model plan holds hundreds of thousands)."""
        if self._transfers is None:
            self._transfers = tuple(x for t, c in zip(self._raw, self._chunks) for x in _unit_transfers(t, c))
        return self._transfers

    # ---- derived values -------------------------------------------------------------------------------------
    def _compute_stats(self, cols: _Columns, chunks: np.ndarray, network_lower_bound: int,
                       needed_bytes: int) -> PlanStats:
        # vectorized: a whole-model plan has up to millions of transfers
        n = chunks.size
        src, dst, nbytes, kind, chunk = cols.src, cols.dst, cols.nbytes, cols.link, chunks
        ranks, src_id, dst_id = cols.ranks, cols.src_id, cols.dst_id
        per: dict[int, dict[str, int]] = defaultdict(dict)

        def accumulate(name: str, ranks: np.ndarray, values: np.ndarray | None) -> None:
            """`per[rank][name]` = sum of `values` (or the count) over entries of each rank."""
            if not ranks.size:
                return
            if values is None:
                totals = np.bincount(ranks)
            else:  # float64 sums are exact below 2**53 bytes per rank
                totals = np.rint(np.bincount(ranks, weights=values.astype(np.float64))).astype(np.int64)
            for r in np.flatnonzero(totals).tolist():
                per[r][name] = int(totals[r])

        by_link = {}
        for code, link in enumerate(LINKS):
            sel = kind == code
            by_link[link] = int(nbytes[sel].sum())
            if link == "local":
                accumulate("local", dst[sel], nbytes[sel])
                continue
            accumulate(f"{link}_send", src[sel], nbytes[sel])
            accumulate(f"{link}_recv", dst[sel], nbytes[sel])
            # a message is one (chunk, sender, receiver)
            _, senders, receivers = _unique_triples(chunk[sel], src_id[sel], dst_id[sel], ranks.size, ranks.size)
            accumulate(f"{link}_messages_sent", ranks[senders], None)
            accumulate(f"{link}_messages_received", ranks[receivers], None)
        num_messages = sum(v for d in per.values() for k, v in d.items() if k.endswith("_messages_sent"))
        num_chunks = int(chunk.max()) + 1 if n else 0
        per_rank = {r: RankBytes(**v) for r, v in sorted(per.items())}
        sends = [rb.send for rb in per_rank.values() if rb.send]
        recvs = [rb.recv for rb in per_rank.values() if rb.recv]
        mean_s = sum(sends) / len(sends) if sends else 0.0
        mean_r = sum(recvs) / len(recvs) if recvs else 0.0
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
            max_rank_send_bytes=max(sends, default=0),
            max_rank_recv_bytes=max(recvs, default=0),
            mean_rank_send_bytes=mean_s,
            mean_rank_recv_bytes=mean_r,
            send_imbalance=max(sends) / mean_s if sends else 0.0,
            recv_imbalance=max(recvs) / mean_r if recvs else 0.0,
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
        """What `rank` sends, receives, forwards and copies, grouped into chunks in executable order.

        Within a chunk, messages are ordered by peer and their boxes by plan order, so the sender's packing and the
        receiver's unpacking agree on every byte offset without talking.
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
        max_send = max_recv = 0
        peers: set[int] = set()
        for c in sorted(per_chunk):
            local, sends, recvs = per_chunk[c]
            send_msgs = _messages(sends)
            recv_msgs = _messages(recvs)
            sb = sum(m.nbytes for m in send_msgs)
            rb = sum(m.nbytes for m in recv_msgs)
            max_send, max_recv = max(max_send, sb), max(max_recv, rb)
            peers.update(sends)
            peers.update(recvs)
            chunks.append(RankChunk(c, send_msgs, recv_msgs, tuple(local), sb, rb, deps.get(c, -1)))
        rp = RankPlan(rank, tuple(chunks), max_send, max_recv, tuple(sorted(peers)))
        self._rank_plans[rank] = rp
        return rp

    def describe(self, *, max_transfers: int = 200) -> str:
        """Readable text: the layouts, the statistics, then who sends what to whom, over which link."""
        s = self.stats
        lines = [f"Plan {self.fingerprint[:12]}: {len(self.items)} tensor(s), {self.topology}, relay={self.relay}"]
        for i, it in enumerate(self.items[:20]):
            lines.append(f"  item {i} {it.label!r}: {it.src!r} -> {it.dst!r}")
        if len(self.items) > 20:
            lines.append(f"  ... {len(self.items) - 20} more items")
        lines.append(format_stats(s))
        lines.append("transfers (chunk: src -> dst, link, bytes, item, global box, src box -> dst box):")
        for t in self.transfers[:max_transfers]:
            relay = f" relay-stage{t.stage}" if t.stage else ""
            lines.append(
                f"  [{t.chunk}] {t.src_rank:>4} -> {t.dst_rank:<4} {t.link:<7}{relay} {format_bytes(t.nbytes):>10} "
                f"item {t.item} global {t.global_box} src {t.src_box} -> dst {t.dst_box}"
            )
        if len(self.transfers) > max_transfers:
            lines.append(f"  ... {len(self.transfers) - max_transfers} more transfers")
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"Plan({len(self.items)} items, {s.num_transfers} transfers, {s.num_chunks} chunks, "
            f"network={s.network_bytes}B nvlink={s.nvlink_bytes}B local={s.local_bytes}B)"
        )


def _messages(by_peer: dict[int, list[Transfer]]) -> tuple[Message, ...]:
    out = []
    buf = 0
    for peer in sorted(by_peer):
        ts = by_peer[peer]
        offsets = []
        pos = 0
        for t in ts:
            offsets.append(pos)
            pos += t.nbytes
        out.append(Message(peer, tuple(ts), tuple(offsets), buf, pos))
        buf += pos
    return tuple(out)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_stats(s: PlanStats) -> str:
    return "\n".join(
        [
            f"  needed by destinations {format_bytes(s.needed_bytes):>12}",
            f"  network                {format_bytes(s.network_bytes):>12}   (lower bound "
            f"{format_bytes(s.network_lower_bound)})",
            f"  nvlink                 {format_bytes(s.nvlink_bytes):>12}",
            f"  local copies           {format_bytes(s.local_bytes):>12}",
            f"  transfers {s.num_transfers}, messages {s.messages}, chunks {s.num_chunks}",
            f"  busiest rank: send {format_bytes(s.max_rank_send_bytes)} (imbalance {s.send_imbalance:.2f}), "
            f"recv {format_bytes(s.max_rank_recv_bytes)} (imbalance {s.recv_imbalance:.2f})",
        ]
    )


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
        staging_bytes: staging memory per rank; one chunk's send + receive bytes per rank stay within half of it.
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
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 2:
        raise ValueError(f"plan: staging_bytes must be an integer >= 2, got {staging_bytes!r}")
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
    chunk_cap = staging_bytes // 2
    for it in items:
        if it.dst.dtype.itemsize > chunk_cap:
            raise ValueError(
                f"tensor {it.label!r}: staging_bytes={staging_bytes} cannot hold one element of {it.dst.dtype} "
                "twice (two chunks in flight)"
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
        templates: list[tuple[int, int, int, int]] = []  # rows and forwarded parts of each geometry's first unit
        for members in groups.values():
            rc = _recipe(b, items[members[0]])
            if rc.check_arrivals:
                size = 1
            else:
                size = max(1, unit_cap // rc.max_part_bytes) if rc.max_part_bytes else len(members)
            for a in range(0, len(members), size):
                unit = tuple((i, items[i].src_tensor, items[i].dst_tensor) for i in members[a:a + size])
                start, first_part = len(b.raw), b.transfers.num_parts
                _emit_recipe(b, rc, unit)
                if a == 0:
                    templates.append((start, len(b.raw), first_part, b.transfers.num_parts))
        cols = b.transfers.columns()
        chunks = _assign_chunks(cols, chunk_cap)
        result = Plan(items, topology, relay, staging_bytes, min_split_bytes, b.transfers, cols, chunks,
                      sum(lower_by_domain.values()), needed)
        _checks.check_plan(result, limits)
        _validate(result, spans=templates)
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


def _validate(p: Plan, spans: Sequence[tuple[int, int, int, int]] | None = None) -> None:
    """Cheap self-check from box arithmetic: every destination element is written exactly once, boxes are in
    bounds, and with relays the network bytes meet the lower bound.

    `spans`: `(first row, stop row, first forwarded part, stop part)` of the units planned from scratch; the others
    replay one of them (same geometry, same boxes), so checking the planned ones checks all. None checks every
    unit.
    """
    store = p._raw
    if spans is not None:
        # the members of a unit share its boxes and their geometry: the first member of each first unit stands
        # for all
        units = [t for a, b, pa, pb in spans for t in (*store.rows[a:b], *store.forwards(pa, pb))]
        planned: set[int] | None = {t[8][0][0] for t in units}
    else:
        units, planned = list(store), None
    written: dict[tuple[int, int], int] = defaultdict(int)
    local_shapes: dict[tuple[int, int], tuple[int, ...]] = {}
    for t in units:
        dst_rank, src_box, dst_box, gbox = t[1], t[2], t[3], t[4]
        if gbox.shape != src_box.shape or gbox.shape != dst_box.shape:
            raise AssertionError(f"transfer shapes disagree: {t}")
        for item, _, _ in t[8] if planned is None else t[8][:1]:
            dst_local = local_shapes.get((item, dst_rank))
            if dst_local is None:
                dst_local = local_shapes[(item, dst_rank)] = p.items[item].dst.local_shape(dst_rank)
            if any(o + s > n for o, s, n in zip(dst_box.offsets, dst_box.shape, dst_local)):
                raise AssertionError(f"destination box out of bounds of local shape {dst_local}: {t}")
            written[(item, dst_rank)] += gbox.numel
    for i, it in enumerate(p.items):
        if planned is not None and i not in planned:
            continue
        for r in it.dst.ranks:
            expected = sum(piece.global_box.numel for piece in it.dst.pieces(r))
            got = written.get((i, r), 0)
            if got != expected:
                raise AssertionError(
                    f"tensor {it.label!r}: rank {r} receives {got} elements, expected {expected}"
                )
    s = p.stats
    if p.relay and s.network_bytes != s.network_lower_bound:
        raise AssertionError(f"network bytes {s.network_bytes} != lower bound {s.network_lower_bound} with relay")


def gather_broadcast_bytes(src: Any, dst: Any) -> dict[str, int]:
    """Bytes that gather-and-broadcast moves for one tensor, the baseline users run today.

    The source ranks all-gather the full tensor (each source rank receives what it lacks), then one source rank
    broadcasts the full tensor to every destination rank that is not a source rank; each keeps its slice.

    Returns:
        `{"gather": ..., "broadcast": ..., "total": ...}` in bytes.
    """
    full = math.prod(src.shape) * src.dtype.itemsize
    gather = 0
    for r in src.ranks:
        held = union_volume([p.global_box for p in src.pieces(r)]) * src.dtype.itemsize
        gather += full - held
    src_ranks = set(src.ranks)
    broadcast = full * sum(1 for r in dst.ranks if r not in src_ranks)
    return {"gather": gather, "broadcast": broadcast, "total": gather + broadcast}
