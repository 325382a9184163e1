"""Rank-local planning: the transfers ONE rank sends, receives or forwards, from the layouts, topology and rank alone.

`plan_rank(items, topology, rank)` computes rank `rank`'s part of a plan without building anyone else's: both ends
of every transfer compute it identically, because every choice is a rotation over geometry, never a running load:

- a box a destination domain needs from outside it is cut into disjoint atoms (the refinement of what its ranks
  need) and each atom into chunk-sized parts; part `j` of the need `(item, source group g)` in domain number `o`
  (domains in `repr` order) crosses the network once, from holder `(u + o) % holders` to needer `u % needers`,
  `u = item + g + j`, which forwards it over NVLink to the atom's other needers (stage 1);
- without relays each needer receives each part directly, from holder `(u + o + n) % holders` (`n`: the needer's
  index);
- a box a holder in the destination's own domain has comes over NVLink from holder `(item + g + j + dst) % near`;
- what a rank already holds is a local copy.

So network bytes equal the network lower bound, and the bytes per link kind and the relay forwards equal
`plan_many`'s (which chooses by running loads: the same amounts, a different balance). Cost: each distinct layout's
pieces are indexed once (`_SrcIndex`, `_DstIndex`); a rank then computes only the needs of its own domain and, as a
sender, of the ranks that need its boxes. No chunks are assigned here: `plan_local` (`reshard.planner._local_plan`)
schedules the part into the chunks and messages the executor runs.

Example (worked by hand): a `(4, 4)` fp32 tensor on ranks `[0, 1]` as `S(0)` to ranks `[2, 3]` as `R`, domains of
2. Domain 1 (number 1 of the destination's domains, `o = 1`) needs group 0 (rows 0:2, held by rank 0) and group 1
(rows 2:4, rank 1). Group 0: `u = 0`, receiver rank 2, forwarded to rank 3; group 1: `u = 1`, receiver rank 3,
forwarded to rank 2. `plan_rank(items, Topology(domain_size=2), 2)` holds rank 0 -> 2 (network, rows 0:2),
2 -> 3 (nvlink, stage 1, rows 0:2) and 3 -> 2 (nvlink, stage 1, rows 2:4): 32 B in, 32 B forwarded.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, NamedTuple, Sequence

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard.planner._box import Box, intersect, split_to_fit, subtract
from reshard.planner._index import BoxIndex
from reshard.planner._item import PlanItem
from reshard.planner._layout import Layout, _geometry_id
from reshard.planner._plan import _as_items
from reshard.planner._region import delta as _delta, shift as _translate
from reshard.planner._topology import Topology
from reshard.planner._types import PIPELINE_DEPTH, Link, Transfer

__all__ = ["LocalTransfer", "RankPart", "plan_rank"]

Delta = tuple[int, ...]


LocalTransfer = Transfer
"""A rank part's transfer: the plan's one transfer record (`Transfer`), before it is scheduled (`chunk`,
`src_tensor` and `dst_tensor` are 0 until `plan_local` sets them); `src` / `dst` are its ranks."""


@dataclass(frozen=True)
class RankPart:
    """Rank `rank`'s part of a plan: every transfer it sends, receives or forwards, sorted (deterministic).

    Attributes:
        rank: the rank.
        transfers: `(T,)` transfers with `rank` as `src` or `dst` (a local copy has both).
    """

    rank: int
    transfers: tuple[LocalTransfer, ...]

    @property
    def sends(self) -> list[LocalTransfer]:
        """What this rank sends to other ranks (network, NVLink, forwards)."""
        return [t for t in self.transfers if t.src == self.rank and t.dst != self.rank]

    @property
    def recvs(self) -> list[LocalTransfer]:
        """What this rank receives from other ranks."""
        return [t for t in self.transfers if t.dst == self.rank and t.src != self.rank]

    def bytes_by_link(self, direction: str = "send") -> dict[str, int]:
        """Bytes per link kind this rank sends (`"send"`, local copies included) or receives (`"recv"`)."""
        out = {"local": 0, "nvlink": 0, "network": 0}
        key = operator.attrgetter("src" if direction == "send" else "dst")
        for t in self.transfers:
            if key(t) == self.rank:
                out[t.link] += t.nbytes
        return out


_new_transfer = tuple.__new__  # a Transfer without NamedTuple argument parsing (hot)




def _pieces_of(layout: Any) -> Callable[[int], tuple[Any, ...]]:
    """`layout.pieces`, computed once per distinct shard coordinate for a DTensor `Layout` (ranks that differ only
    on replicated mesh axes hold the same pieces), so indexing a layout costs a dict lookup per rank."""
    if type(layout) is not Layout:
        return layout.pieces
    axes = [a for a, p in enumerate(layout.placements) if isinstance(p, (Shard, _StridedShard))]
    coordinate = layout.mesh.coordinate
    cache: dict[tuple[int, ...], tuple[Any, ...]] = {}

    def pieces(rank: int) -> tuple[Any, ...]:
        c = coordinate(rank)
        if c is None:
            return ()
        key = tuple(c[a] for a in axes)
        out = cache.get(key)
        if out is None:
            out = cache[key] = layout.pieces(rank)
        return out

    return pieces


class _SrcIndex:
    """A source layout's distinct global boxes (groups, sorted), their holders `(rank, delta)` ascending, and the
    holders per domain: built once per distinct layout, O(its pieces)."""

    def __init__(self, src: Any, topology: Topology, partitions: dict[tuple[Box, ...], int]) -> None:
        """`partitions`: the distinct partitions seen so far (boxes -> number), shared by one `plan_rank` call."""
        holders: dict[Box, list[tuple[int, Delta]]] = {}
        self.pieces = _pieces_of(src)
        for r in sorted(src.ranks):
            for p in self.pieces(r):
                holders.setdefault(p.global_box, []).append((r, _delta(p.global_box, p.local_box)))
        self.boxes = sorted(holders, key=lambda b: (b.offsets, b.shape))
        self.partition = partitions.setdefault(tuple(self.boxes), len(partitions))  # alike layouts share it
        self.gid = {b: i for i, b in enumerate(self.boxes)}
        self.holders = [holders[b] for b in self.boxes]
        self.near: list[dict[Hashable, list[tuple[int, Delta]]]] = []
        for hs in self.holders:
            by: dict[Hashable, list[tuple[int, Delta]]] = {}
            for h in hs:
                by.setdefault(topology.domain(h[0]), []).append(h)
            self.near.append(by)
        self.index = BoxIndex(self.boxes)
        self.ranks = frozenset(src.ranks)
        self.domains = frozenset(d for by in self.near for d in by)


class _DstIndex:
    """A destination layout's distinct global boxes, the ranks holding each per domain (ascending), and the order of
    its domains: built once per distinct layout."""

    def __init__(self, dst: Any, topology: Topology) -> None:
        by_box: dict[Box, dict[Hashable, list[int]]] = {}
        domains: set[Hashable] = set()
        self.pieces = _pieces_of(dst)
        for r in sorted(dst.ranks):
            d = topology.domain(r)
            domains.add(d)
            for p in self.pieces(r):
                lst = by_box.setdefault(p.global_box, {}).setdefault(d, [])
                if not lst or lst[-1] != r:
                    lst.append(r)
        self.boxes = list(by_box)
        self.ranks_by_domain = [by_box[b] for b in self.boxes]
        self.index = BoxIndex(self.boxes)
        self.domain_ord = {d: i for i, d in enumerate(sorted(domains, key=repr))}


class _Need(NamedTuple):
    kind: str  # "local", "nvlink", "network"
    gid: int
    box: Box  # global
    delta: Delta  # the needer's local minus global offsets
    src_delta: Delta  # local copies: the rank's own source delta


class _Geometry:
    """One (source, destination) geometry: the per-rank needs and the per-(domain, group) network atoms, computed
    lazily and kept."""

    def __init__(self, src: _SrcIndex, dst: _DstIndex, dst_layout: Any, src_layout: Any, topology: Topology,
                 itemsize: int, cap_numel: int, rank: int, shared: dict[str, dict], dst_id: int) -> None:
        self.rank = rank  # whose part is planned
        self.src, self.dst = src, dst
        self.dst_layout, self.src_layout = dst_layout, src_layout
        self.topology = topology
        self.itemsize = itemsize
        self.cap_numel = cap_numel
        self._needs: dict[int, list[_Need]] = {}
        self._shared: dict[tuple, list[_Need]] = {}
        self._by_gid: dict[int, dict[int, list[_Need]]] = {}  # by id of a list in `_shared` (kept alive there)
        self._hits: dict[int, tuple[int, ...]] = {}
        self._cands: dict[tuple[Hashable, tuple[int, ...]], tuple[list[int], list[tuple[int, list[int]]]]] = {}
        self._atoms: dict[tuple[Hashable, int], list[tuple[Box, list[tuple[int, Delta]]]]] = {}
        self._direct: dict[tuple, list[tuple[Box, list[tuple[int, Delta]]]]] = shared.setdefault("direct", {})
        self._spans: dict[tuple, list[tuple[Box, int, list[int], list[Delta], list[int]]]] = \
            shared.setdefault("spans", {})
        self._dst_id = dst_id

    def needs(self, q: int) -> list[_Need]:
        """What destination rank `q` needs, cut by source groups (as `plan_many`'s recipe cuts it). Ranks with the
        same pieces on both sides, in domains alike for the source (replicas of one shard), share one list."""
        out = self._needs.get(q)
        if out is not None:
            return out
        dom = self.topology.domain(q)
        own = tuple(self.src.pieces(q)) if q in self.src.ranks else ()
        key = (tuple((p.global_box, p.local_box) for p in self.dst.pieces(q)),
               tuple((p.global_box, p.local_box) for p in own), dom if dom in self.src.domains else None)
        out = self._shared.get(key)
        if out is None:
            out = self._shared[key] = self._cut(q, dom, own)
        self._needs[q] = out
        return out

    def _cut(self, q: int, dom: Hashable, own: Sequence[Any]) -> list[_Need]:
        out: list[_Need] = []
        src = self.src
        for piece in self.dst.pieces(q):
            gbox = piece.global_box
            d_delta = _delta(gbox, piece.local_box)
            remaining = [gbox]
            for sp in own:
                x = intersect(sp.global_box, gbox)
                if x is None:
                    continue
                out.append(_Need("local", src.gid[sp.global_box], x, d_delta, _delta(sp.global_box, sp.local_box)))
                remaining = [y for rem in remaining for y in subtract(rem, x)]
            for rem in remaining:
                for gid in src.index.query(rem):
                    x = intersect(rem, src.boxes[gid])
                    if x is None:
                        continue
                    kind = "nvlink" if src.near[gid].get(dom) else "network"
                    out.append(_Need(kind, gid, x, d_delta, ()))
        return out

    def _meets(self, gid: int) -> list[int]:
        """The destination's distinct boxes that meet group `gid` (indices), cached."""
        out = self._hits.get(gid)
        if out is None:
            g = self.src.boxes[gid]
            boxes = self.dst.boxes
            out = self._hits[gid] = tuple(k for k in self.dst.index.query(g) if intersect(boxes[k], g) is not None)
        return out

    def candidates(self, dom: Hashable, gid: int) -> list[int]:
        """Destination ranks of domain `dom` whose pieces meet group `gid`, ascending (cached per set of
        destination boxes met: most groups meet the same few)."""
        return self._alike(dom, gid)[0]

    def _alike(self, dom: Hashable, gid: int) -> tuple[list[int], list[tuple[int, list[int]]]]:
        """`candidates(dom, gid)`, and the same ranks grouped by their needs list (ranks sharing one: replicas of
        one shard) as `(a rank of the group, the group's ranks)`, groups in order of their lowest rank."""
        key = (dom, self._meets(gid))
        out = self._cands.get(key)
        if out is None:
            ranks: set[int] = set()
            for k in key[1]:
                ranks.update(self.dst.ranks_by_domain[k].get(dom, ()))
            cands = sorted(ranks)
            alike: dict[int, tuple[int, list[int]]] = {}  # id of a needs list -> (a rank holding it, the ranks)
            for q in cands:
                needs = self.needs(q)
                group = alike.get(id(needs))
                if group is None:
                    alike[id(needs)] = (q, [q])
                else:
                    group[1].append(q)
            out = self._cands[key] = (cands, list(alike.values()))
        return out

    def domains_of(self, gid: int) -> list[Hashable]:
        """The destination domains with a rank whose pieces meet group `gid`."""
        out: set[Hashable] = set()
        for k in self._meets(gid):
            out.update(self.dst.ranks_by_domain[k])
        return sorted(out, key=repr)

    def needs_of(self, q: int, gid: int) -> list[_Need]:
        """`needs(q)` of group `gid` only (indexed by group once per rank)."""
        needs = self.needs(q)
        by = self._by_gid.get(id(needs))
        if by is None:
            by = self._by_gid[id(needs)] = {}
            for n in needs:
                by.setdefault(n.gid, []).append(n)
        return by.get(gid, [])

    def _net_needs(self, dom: Hashable, gid: int) -> dict[Box, list[tuple[int, Delta]]]:
        """What domain `dom`'s ranks need of group `gid` over the network: box -> needers `(rank, delta)`, ranks
        ascending. Ranks that share one needs list (replicas of one shard) are visited together."""
        needs: dict[Box, list[tuple[int, Delta]]] = {}
        for first, ranks in self._alike(dom, gid)[1]:
            for n in self.needs_of(first, gid):
                if n.kind == "network":
                    needs.setdefault(n.box, []).extend(zip(ranks, itertools.repeat(n.delta, len(ranks))))
        for needers in needs.values():
            needers.sort()
        return needs

    def _key(self, dom: Hashable, gid: int) -> tuple:
        """The key of `(dom, gid)`'s needs across geometries: in a domain without a rank of the source, they depend
        on the destination layout and the source's partition only, not on which ranks hold it (the stages of a
        pipelined trainer send the same pieces of alike layers to each domain)."""
        if dom in self.src.domains:
            return (id(self), dom, gid)
        return (self._dst_id, self.src.partition, self.cap_numel, self.itemsize, dom, gid)

    def direct(self, dom: Hashable, gid: int) -> list[tuple[Box, list[tuple[int, Delta]]]]:
        """Without relays: the needed boxes of group `gid` in domain `dom` and their needers, boxes sorted."""
        key = self._key(dom, gid)
        out = self._direct.get(key)
        if out is None:
            needs = self._net_needs(dom, gid)
            out = self._direct[key] = [(b, needs[b]) for b in sorted(needs, key=lambda b: (b.offsets, b.shape))]
        return out

    def atoms(self, dom: Hashable, gid: int) -> list[tuple[Box, list[tuple[int, Delta]]]]:
        """With relays: the disjoint atoms of what domain `dom` needs of group `gid` from outside, each with its
        needers `(rank, delta)` (ascending, no repeats), atoms sorted."""
        key = (dom, gid)
        out = self._atoms.get(key)
        if out is not None:
            return out
        atoms: list[tuple[Box, list[tuple[int, Delta]]]] = []
        for box, needers in self.direct(dom, gid):
            needers = sorted(set(needers))
            rest = [box]
            nxt: list[tuple[Box, list[tuple[int, Delta]]]] = []
            for a, who in atoms:
                x = intersect(a, box)
                if x is None:
                    nxt.append((a, who))
                    continue
                nxt.append((x, sorted(set(who).union(needers))))
                nxt.extend((y, who) for y in subtract(a, x))
                rest = [y for r in rest for y in subtract(r, x)]
            nxt.extend((r, needers) for r in rest)
            atoms = nxt
        atoms.sort(key=lambda a: (a[0].offsets, a[0].shape))
        self._atoms[key] = atoms
        return atoms

    def spans(self, dom: Hashable, gid: int) -> list[tuple[Box, int, list[int], list[Delta], list[int]]]:
        """With relays: every part of `atoms(dom, gid)` in order, as `(box, nbytes, needer ranks, each needer's
        delta, the indices of this plan's rank among the needers)`: cut once per geometry, not per item."""
        key = self._key(dom, gid)
        out = self._spans.get(key)
        if out is None:
            out = self._spans[key] = []
            split: dict[int, tuple[list[int], list[Delta], list[int]]] = {}  # atoms often share a needers list
            for atom, needers in self.atoms(dom, gid):
                cut = split.get(id(needers))
                if cut is None:
                    ranks = [q for q, _ in needers]
                    cut = split[id(needers)] = (ranks, [qd for _, qd in needers],
                                                [i for i, q in enumerate(ranks) if q == self.rank])
                ranks, deltas, mine = cut
                for part in self.parts(atom):
                    out.append((part, part.numel * self.itemsize, ranks, deltas, mine))
        return out

    def parts(self, box: Box) -> list[Box]:
        return split_to_fit(box, self.cap_numel) if box.numel > self.cap_numel else [box]


class _Emitter:
    """Collects rank `rank`'s transfers; each is emitted once by construction (a (domain, group) need is visited
    once per item, from the destination side for the rank's own domain and from the holder side for the others)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.out: list[LocalTransfer] = []

    def add(self, src: int, dst: int, item: int, src_box: Box, dst_box: Box, gbox: Box, nbytes: int, link: Link,
            stage: int) -> None:
        if self.rank in (src, dst):
            self.out.append(_new_transfer(Transfer, (src, dst, src_box, dst_box, gbox, nbytes, link, stage, 0, item, 0,
                                                     0)))


def _network(geo: _Geometry, item: int, dom: Hashable, gid: int, relay: bool, em: _Emitter) -> None:
    """Every transfer of what domain `dom` needs of group `gid` from outside it that touches `em.rank`."""
    holders = geo.src.holders[gid]
    o = geo.dst.domain_ord[dom]
    size = geo.itemsize
    j = 0
    if not relay:
        for box, needers in geo.direct(dom, gid):
            for part in geo.parts(box):
                u = item + gid + j
                j += 1
                for n, (q, qd) in enumerate(needers):
                    h, hd = holders[(u + o + n) % len(holders)]
                    em.add(h, q, item, _translate(part, hd), _translate(part, qd), part, part.numel * size,
                           "network", 0)
        return
    me = em.rank
    for k, (box, nbytes, needers, deltas, mine) in enumerate(geo.spans(dom, gid)):
        u = item + gid + k
        n = u % len(needers)
        r = needers[n]
        h, hd = holders[(u + o) % len(holders)]
        if me != r and me != h and not mine:
            continue  # not this rank's (most parts of a domain's needs, for any one rank)
        rbox = _translate(box, deltas[n])
        if me == h or me == r:
            em.add(h, r, item, _translate(box, hd), rbox, box, nbytes, "network", 0)
        for i in (range(len(needers)) if me == r else mine):  # the relay forwards to all; a needer sees its own
            if i != n:
                q = needers[i]
                em.add(r, q, item, rbox, _translate(box, deltas[i]), box, nbytes, "local" if q == r else "nvlink",
                       1)


def _nvlink(geo: _Geometry, item: int, q: int, need: _Need, em: _Emitter) -> None:
    near = geo.src.near[need.gid][geo.topology.domain(q)]
    for j, part in enumerate(geo.parts(need.box)):
        h, hd = near[(item + need.gid + j + q) % len(near)]
        em.add(h, q, item, _translate(part, hd), _translate(part, need.delta), part, part.numel * geo.itemsize,
               "nvlink", 0)


def _rank_item(geo: _Geometry, item: int, rank: int, relay: bool, em: _Emitter) -> None:
    """Rank `rank`'s transfers of one item."""
    topology = geo.topology
    dom = topology.domain(rank)
    if rank in geo.dst_layout.ranks:  # as a destination, relay or forward recipient
        net_gids: set[int] = set()
        for n in geo.needs(rank):
            if n.kind == "local":
                em.add(rank, rank, item, _translate(n.box, n.src_delta), _translate(n.box, n.delta), n.box,
                       n.box.numel * geo.itemsize, "local", 0)
            elif n.kind == "nvlink":
                _nvlink(geo, item, rank, n, em)
            else:
                net_gids.add(n.gid)
        for gid in sorted(net_gids):
            _network(geo, item, dom, gid, relay, em)
    if rank in geo.src.ranks:  # as a holder: NVLink to its own domain, the network to the others
        gids = sorted({geo.src.gid[p.global_box] for p in geo.src.pieces(rank)})
        for gid in gids:
            for d in geo.domains_of(gid):
                if d == dom:
                    for q in geo.candidates(d, gid):
                        if q == rank:
                            continue
                        for n in geo.needs_of(q, gid):
                            if n.kind == "nvlink":
                                _nvlink(geo, item, q, n, em)
                elif not geo.src.near[gid].get(d):
                    _network(geo, item, d, gid, relay, em)


def plan_rank(items: Iterable[Any], topology: Topology | None, rank: int, *, relay: bool = True,
              staging_bytes: int = 256 << 20) -> RankPart:
    """Rank `rank`'s part of the plan of `items`: the transfers it sends, receives or forwards.

    Args:
        items: `PlanItem`s, or `(src_layout, dst_layout)` pairs, as for `plan_many` (item `i`: index `i`, which
            enters the rotations, so every rank must pass the same items in the same order).
        topology: NVLink domains (default: every rank its own domain).
        rank: the rank whose part to compute.
        relay: as for `plan_many`.
        staging_bytes: a part is at most `staging_bytes // PIPELINE_DEPTH` bytes (as `plan_many` fits chunks).

    Returns:
        A `RankPart`; for every pair of ranks `r`, `s`, what `plan_rank(.., r)` says `r` sends to `s` is exactly
        what `plan_rank(.., s)` says `s` receives from `r` (see the module docstring for the rule). No chunks.

    Example:
        >>> from reshard.planner import Layout, Mesh
        >>> src = Layout((4, 4), Mesh([0, 1]), "S(0)")
        >>> dst = Layout((4, 4), Mesh([2, 3]), "R")
        >>> part = plan_rank([(src, dst)], Topology(domain_size=2), 2)
        >>> [(t.src, t.dst, t.link, t.stage, t.nbytes) for t in part.transfers]
        [(0, 2, 'network', 0, 32), (2, 3, 'nvlink', 1, 32), (3, 2, 'nvlink', 1, 32)]
    """
    items_t: Sequence[PlanItem] = _as_items(items)
    topology = topology if topology is not None else Topology()
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < PIPELINE_DEPTH:
        raise ValueError(f"plan_rank: staging_bytes must be an integer >= {PIPELINE_DEPTH}, got {staging_bytes!r}")
    cap = staging_bytes // PIPELINE_DEPTH
    srcs: dict[int, _SrcIndex] = {}
    dsts: dict[int, _DstIndex] = {}
    geos: dict[tuple[int, int], _Geometry] = {}
    partitions: dict[tuple[Box, ...], int] = {}
    shared: dict[str, dict] = {}
    em = _Emitter(rank)
    for i, it in enumerate(items_t):
        if rank not in it.src.ranks and rank not in it.dst.ranks:
            continue
        sg, dg = _geometry_id(it.src), _geometry_id(it.dst)
        geo = geos.get((sg, dg))
        if geo is None:
            if sg not in srcs:
                srcs[sg] = _SrcIndex(it.src, topology, partitions)
            if dg not in dsts:
                dsts[dg] = _DstIndex(it.dst, topology)
            size = it.dst.dtype.itemsize
            if size > cap:
                raise ValueError(f"tensor {it.label!r}: staging_bytes={staging_bytes} cannot hold one element of "
                                 f"{it.dst.dtype} {PIPELINE_DEPTH} times")
            geo = geos[(sg, dg)] = _Geometry(srcs[sg], dsts[dg], it.dst, it.src, topology, size, max(1, cap // size),
                                                rank, shared, dg)
        _rank_item(geo, i, rank, relay, em)
    return RankPart(rank, tuple(sorted(em.out, key=lambda t: (t.item, t.stage, t.src, t.dst, t.global_box.offsets,
                                                              t.dst_box.offsets, t.src_box.offsets))))
