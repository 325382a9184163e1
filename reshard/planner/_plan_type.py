"""The plan: `Plan`, built from its stored form (`PlanData`, in `_data`) and validated when built, with its byte
accounting, fingerprint, every rank's program and its description for people."""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from typing import Any

import numpy as np

from reshard.planner import _checks
from reshard.planner._chunks import RELAY_CHUNK_LAG, TransferColumns, Unit, _Columns, _unique_triples, transfer_columns
from reshard.planner._data import PlanData
from reshard.planner._format import format_bytes, format_stats
from reshard.planner._layout import _geometry_id
from reshard.planner._program import rank_program
from reshard.planner._types import LINKS, PlanStats, RankBytes, RankPlan, Transfer
from reshard.planner._validate import _check_chunks, _validate

__all__ = ["PLAN_VERSION", "Plan"]

PLAN_VERSION = 3
"""Part of every fingerprint: bumped when the same inputs plan differently (2: first-fit chunk placement over bit
sets, relay forwards after all stage-0 transfers in plan order, items of equal geometry in units; 3: a box is split
over relay receivers only beyond one fair share, `SPREAD_FACTOR = 1`; large boxes contiguous at one end travel as
messages of their own, strided one-box messages are cut into parts)."""

_MAX_ITEMS = 20
"""`describe_plan` lists at most this many items."""

_KEY_DIGESTS = _checks.bounded_cache("layout digests", 4096)


def _layout_digest(layout: Any) -> bytes:
    """A digest of `layout.key` (shape, dtype, ranks, pieces), computed once per geometry: the key of an explicit
    layout lists every piece, and a model repeats each geometry in every layer."""
    gid = _geometry_id(layout)
    d = _KEY_DIGESTS.get(gid)
    if d is None:
        d = _KEY_DIGESTS[gid] = hashlib.sha256(repr(layout.key).encode()).digest()
    return d


def digest_items(h: Any, items: Any) -> None:
    """Feed `h` (a `hashlib` hash) every item's layouts (by digest), tensor indices, name and precision: the
    inputs part of a plan's fingerprint, whole (`Plan`) or rank-local (`LocalPlan`)."""
    for it in items:
        h.update(_layout_digest(it.src))
        h.update(_layout_digest(it.dst))
        h.update(repr((it.src_tensor, it.dst_tensor, it.name, it.precision)).encode())


def ranks_of(items: Any) -> tuple[int, ...]:
    """Every rank that holds a source or a destination of some item, ascending (each distinct layout read once)."""
    out: set[int] = set()
    seen: set[int] = set()
    for it in items:
        for lay in (it.src, it.dst):
            g = _geometry_id(lay)
            if g not in seen:
                seen.add(g)
                out.update(lay.ranks)
    return tuple(sorted(out))


def _unit_transfers(u: Unit, chunk: int) -> list[Transfer]:
    """The transfers of unit `u` in `chunk`: one per member tensor, same ranks and boxes."""
    return [Transfer(u.src, u.dst, u.src_box, u.dst_box, u.global_box, u.nbytes, u.link, u.stage, chunk, item,
                     src_t, dst_t) for item, src_t, dst_t in u.members]


_RANK_FIELDS = {f: i for i, f in enumerate(RankBytes.__dataclass_fields__)}  # `RankBytes` fields in order


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

    planning = "global"
    """How it was planned: the whole plan on every rank (`LocalPlan.planning` is `"local"`)."""

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
        _validate(data, self.stats)
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
        digest_items(h, self.items)
        s = self.stats
        h.update(repr((s.total_bytes, s.network_bytes, s.nvlink_bytes, s.local_bytes, s.messages,
                       s.num_transfers, s.num_chunks)).encode())
        return h.hexdigest()[:32]

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that takes part: holds a source or a destination of some item."""
        return ranks_of(self.items)

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
        rp = rank_program(self.items, rank, ((c, *per_chunk[c], deps.get(c, -1)) for c in sorted(per_chunk)))
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


def describe_plan(p: Plan, *, max_transfers: int = 200) -> str:
    """The text of `Plan.describe`: the layouts, the statistics, then who sends what to whom, over which link."""
    lines = [f"Plan {p.fingerprint[:12]}: {len(p.items)} tensor(s), {p.topology}, relay={p.relay}"]
    for i, it in enumerate(p.items[:_MAX_ITEMS]):
        lines.append(f"  item {i} {it.label!r}: {it.src!r} -> {it.dst!r}")
    if len(p.items) > _MAX_ITEMS:
        lines.append(f"  ... {len(p.items) - _MAX_ITEMS} more items")
    lines.append(format_stats(p.stats))
    lines.append("transfers (chunk: src -> dst, link, bytes, item, global box, src box -> dst box):")
    transfers = p.transfers
    for t in transfers[:max_transfers]:
        relay = f" relay-stage{t.stage}" if t.stage else ""
        lines.append(
            f"  [{t.chunk}] {t.src_rank:>4} -> {t.dst_rank:<4} {t.link:<7}{relay} {format_bytes(t.nbytes):>10} "
            f"item {t.item} global {t.global_box} src {t.src_box} -> dst {t.dst_box}"
        )
    if len(transfers) > max_transfers:
        lines.append(f"  ... {len(transfers) - max_transfers} more transfers")
    return "\n".join(lines)
