"""The rank-local plan: one rank's whole program from the layouts, topology and rank alone, with no global plan.

`plan_local(items, topology, rank)` takes the rank's part (`plan_rank`: what it sends, receives and forwards) and
schedules it into chunks that the executor runs as it runs a `Plan`'s (`LocalPlan.for_rank` is a `RankPlan`).
Neither end of a message knows the other's other transfers, so the schedule rests on what both ends share:

- a global order of transfers, `_order`: the item, a forward counted `BLOCK_ITEMS` items later (it sorts with the
  arrivals of later items, so it is never waited for before its own arrival), then the ranks and boxes;
- the batches of a pair of ranks: the pair's transfers in that order, cut where the block (`order[0] //
  BLOCK_ITEMS`) changes or the batch would pass `chunk_cap // BATCH_SHARE` bytes. Both ends cut the same batches,
  and a batch's messages are the same on both (`_messages` of the batch alone);
- each rank's chunks: its batches in the order of their first transfer, cut greedily where the chunk would pass
  `staging_bytes // PIPELINE_DEPTH` bytes (send + receive), already holds a batch of the same peer and direction,
  or would forward a box that arrives in it. Chunk indices are the rank's own; messages match by their order per
  peer (the transport is first in, first out per pair), which both ends share.

Deadlock freedom: every rank's chunks are consecutive runs of one global order of batches. Take the first batch in
that order that some pair has not completed: both its ends have completed every earlier batch, so each can post the
chunk holding it (it only waits on earlier chunks, and a forward only on arrivals in earlier chunks, which hold
earlier batches); both ends post it, and it completes. So every batch completes.

Delta runs wait for all of a chunk's sizes before its data moves, which ties the chunk's messages together (a rank
could wait on a size whose sender waits on this rank's data); for them, `single_batch_chunks=True` puts one batch in
each chunk, so the induction above holds as it stands.

What it does not have: the global plan's greedy balance (the rotation of `plan_rank` spreads the load instead) and
its overlap of relay forwards `RELAY_CHUNK_LAG` chunks behind their arrival (here a forward waits for its arrival's
chunk to be unpacked, which is at least one chunk earlier). Bytes per link kind equal the global plan's.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any, Iterable, Sequence

from reshard.planner import _checks
from reshard.planner._format import format_bytes
from reshard.planner._item import PlanItem, _check_item
from reshard.planner._local import LocalTransfer, RankPart, plan_rank
from reshard.planner._plan import DEFAULT_MIN_SPLIT_BYTES, DEFAULT_STAGING_BYTES, _as_items
from reshard.planner._plan_type import PLAN_VERSION, digest_items, ranks_of
from reshard.planner._program import ChunkWork, rank_program
from reshard.planner._topology import Topology
from reshard.planner._types import PIPELINE_DEPTH, PlanStats, RankBytes, RankPlan, Transfer

__all__ = ["BATCH_SHARE", "BLOCK_ITEMS", "LocalPlan", "plan_local"]

BLOCK_ITEMS = 16
"""Items per block of the global order: a pair's batch never spans two blocks, and a relay forward of item `i` is
ordered with the arrivals of item `i + BLOCK_ITEMS` (the next block), so it follows its own arrival."""

BATCH_SHARE = 2
"""A batch of one pair is at most `chunk_cap // BATCH_SHARE` bytes (or one transfer, which is at most `chunk_cap`),
so a chunk can hold batches of several peers."""

LOCAL_VERSION = 1
"""Part of a rank-local plan's fingerprint: bumped when the same inputs schedule differently."""


def _order(t: LocalTransfer) -> tuple:
    """The global order of transfers (equal on both ends of each)."""
    return (t.item + t.stage * BLOCK_ITEMS, t.stage, t.item, t.src, t.dst, t.global_box.offsets, t.dst_box.offsets)


def _batches(part: RankPart, limit: int) -> list[tuple[tuple, bool, int, list[LocalTransfer], int]]:
    """`part`'s exchanges with other ranks as batches `(order of the first transfer, sending, peer, transfers,
    bytes)`, sorted by their first transfer."""
    by_pair: dict[tuple[bool, int], list[LocalTransfer]] = defaultdict(list)
    for t in part.transfers:
        if t.src == t.dst:
            continue
        sending = t.src == part.rank
        by_pair[(sending, t.dst if sending else t.src)].append(t)
    out = []
    for (sending, peer), ts in by_pair.items():
        ts.sort(key=_order)
        cur: list[LocalTransfer] = []
        nbytes = block = 0
        for t in ts:
            b = (t.item + t.stage * BLOCK_ITEMS) // BLOCK_ITEMS
            if cur and (b != block or nbytes + t.nbytes > limit):
                out.append((_order(cur[0]), sending, peer, cur, nbytes))
                cur, nbytes = [], 0
            cur.append(t)
            nbytes += t.nbytes
            block = b
        if cur:
            out.append((_order(cur[0]), sending, peer, cur, nbytes))
    out.sort(key=lambda b: b[0])
    return out


def _arrival(t: LocalTransfer) -> tuple:
    """What a forward and the arrival it forwards share: the item and the global box."""
    return (t.item, t.global_box.offsets, t.global_box.shape)


def schedule(part: RankPart, items: Sequence[PlanItem], chunk_cap: int,
             single_batch_chunks: bool = False) -> list[ChunkWork]:
    """`part` in chunks (see the module docstring): `(index, local copies, sends by peer, receives by peer,
    unpack_before_pack)` per chunk, indices from 0, each chunk's send + receive bytes within `chunk_cap` (a
    transfer is at most `chunk_cap`, as `plan_rank` cuts them). `single_batch_chunks`: one batch per chunk."""
    rank = part.rank
    chunks: list[list] = []  # [bytes, (sending, peer) used, batches, latest arrival forwarded]
    arrived: dict[tuple[int, tuple, tuple], int] = {}  # (item, global box offsets, shape) of an arrival -> its chunk
    for _, sending, peer, ts, nbytes in _batches(part, max(1, chunk_cap // BATCH_SHARE)):
        # a batch may hold forwards of earlier items next to the arrivals of its own block's items
        dep = max((arrived[_arrival(t)] for t in ts if t.stage),
                  default=-1) if sending else -1
        cur = chunks[-1] if chunks else None
        if (cur is None or single_batch_chunks or (sending, peer) in cur[1] or cur[0] + nbytes > chunk_cap
                or dep >= len(chunks) - 1):
            cur = [0, set(), [], -1]
            chunks.append(cur)
        cur[0] += nbytes
        cur[1].add((sending, peer))
        cur[2].append((sending, peer, ts))
        cur[3] = max(cur[3], dep)
        if not sending:
            for t in ts:
                if t.stage == 0:
                    arrived[_arrival(t)] = len(chunks) - 1
    local0 = [t for t in part.transfers if t.src == t.dst == rank and t.stage == 0]
    local1 = [t for t in part.transfers if t.src == t.dst == rank and t.stage > 0]
    if (local0 or local1) and not chunks:
        chunks.append([0, set(), [], -1])
    copies: dict[int, list[LocalTransfer]] = defaultdict(list)
    copies[0].extend(local0)
    for t in local1:  # a relay that also needs the box elsewhere in its tensor: copied once it has arrived
        c = arrived[_arrival(t)] + 1
        if c == len(chunks):
            chunks.append([0, set(), [], -1])
        copies[c].append(t)
        chunks[c][3] = max(chunks[c][3], c - 1)

    def as_transfer(t: LocalTransfer, chunk: int) -> Transfer:
        it = items[t.item]
        src_tensor = it.dst_tensor if t.stage else it.src_tensor  # a forward reads the relay's destination
        return t._replace(chunk=chunk, src_tensor=src_tensor, dst_tensor=it.dst_tensor)

    out: list[ChunkWork] = []
    for c, (_, _, batches, dep) in enumerate(chunks):
        sends: dict[int, list[Transfer]] = {}
        recvs: dict[int, list[Transfer]] = {}
        for sending, peer, ts in batches:
            (sends if sending else recvs)[peer] = [as_transfer(t, c) for t in ts]
        out.append((c, [as_transfer(t, c) for t in copies.get(c, ())], sends, recvs, dep))
    return out


class LocalPlan:
    """One rank's part of a plan, scheduled for the executor: what `execute` needs of a plan (`items`, `ranks`,
    `fingerprint`, `for_rank(rank)` for this rank) without anyone else's part. Every rank of the plan builds its
    own from the same inputs (`plan_local`); `fingerprint` digests the inputs, so the plan handshake still refuses
    ranks that planned from different ones.

    Attributes:
        rank: whose part this is.
        items, topology, relay, staging_bytes, min_split_bytes: the inputs, as for `plan_many`.
        part: the rank's transfers (`RankPart`), unscheduled.
        single_batch_chunks: every chunk holds one batch (one peer, one direction): what delta runs need, whose
            per-chunk size round would otherwise tie a chunk's messages to each other.
        stats: this rank's share (`PlanStats`): the transfers it *receives* (local copies included), so that the
            sums over all ranks are the plan's bytes and transfers; `max_*` / `mean_*` and `per_rank` are this
            rank's sends and receives; `network_lower_bound` is not computed (0).
        fingerprint: a digest of the inputs and the scheduling rule.
    """

    planning = "local"
    """How it was planned: this rank's part only (`Plan.planning` is `"global"`)."""

    def __init__(self, items: Sequence[PlanItem], topology: Topology, relay: bool, staging_bytes: int,
                 min_split_bytes: int, rank: int, part: RankPart, single_batch_chunks: bool = False) -> None:
        self.items = tuple(items)
        self.topology = topology
        self.relay = relay
        self.staging_bytes = staging_bytes
        self.min_split_bytes = min_split_bytes
        self.rank = rank
        self.part = part
        self.single_batch_chunks = single_batch_chunks
        self._ranks: tuple[int, ...] | None = None
        self.fingerprint = self._compute_fingerprint()
        self._program = rank_program(self.items, rank, schedule(part, self.items, staging_bytes // PIPELINE_DEPTH,
                                                                single_batch_chunks))
        self.stats = self._compute_stats()

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(repr(("local", LOCAL_VERSION, BLOCK_ITEMS, BATCH_SHARE, self.single_batch_chunks, PLAN_VERSION,
                       self.topology.key, self.relay, self.staging_bytes, self.min_split_bytes)).encode())
        digest_items(h, self.items)
        return h.hexdigest()[:32]

    def _compute_stats(self) -> PlanStats:
        rank = self.rank
        by = {"local": 0, "nvlink": 0, "network": 0}
        send = {"nvlink": 0, "network": 0}
        received = forwards = 0
        for t in self.part.transfers:
            if t.dst == rank:
                by[t.link] += t.nbytes
                received += 1
                forwards += t.stage > 0
            if t.src == rank and t.dst != rank:
                send[t.link] += t.nbytes
        needed = sum(p.global_box.numel * it.dst.dtype.itemsize
                     for it in self.items if rank in it.dst.ranks for p in it.dst.pieces(rank))
        rb = RankBytes(network_send=send["network"], network_recv=by["network"], nvlink_send=send["nvlink"],
                       nvlink_recv=by["nvlink"], local=by["local"])
        s, r = rb.send, rb.recv
        return PlanStats(total_bytes=sum(by.values()), network_bytes=by["network"], nvlink_bytes=by["nvlink"],
                         local_bytes=by["local"], needed_bytes=needed, network_lower_bound=0,
                         messages=sum(len(c.recvs) for c in self._program.chunks), num_transfers=received,
                         num_forwards=forwards, num_chunks=len(self._program.chunks), max_rank_send_bytes=s,
                         max_rank_recv_bytes=r, mean_rank_send_bytes=float(s), mean_rank_recv_bytes=float(r),
                         send_imbalance=1.0 if s else 0.0, recv_imbalance=1.0 if r else 0.0, per_rank={rank: rb})

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that takes part: holds a source or a destination of some item."""
        if self._ranks is None:
            self._ranks = ranks_of(self.items)
        return self._ranks

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """This rank's transfers, with this rank's chunk indices."""
        return self.for_rank(self.rank).transfers

    def for_rank(self, rank: int) -> RankPlan:
        """This rank's program (built with the plan): its batches in chunks, messages per peer in the order both
        ends share. Only `self.rank`'s: a rank-local plan holds no other rank's part."""
        if rank != self.rank:
            raise ValueError(f"LocalPlan: this plan holds rank {self.rank}'s part only, not rank {rank}'s "
                             "(each rank plans its own with plan_local)")
        return self._program

    def describe(self, *, max_transfers: int = 200) -> str:
        """Readable text: the inputs' size, this rank's share, then its transfers chunk by chunk."""
        s = self.stats
        rb = s.per_rank[self.rank]
        lines = [f"LocalPlan {self.fingerprint[:12]} (rank {self.rank}): {len(self.items)} tensor(s), "
                 f"{self.topology}, relay={self.relay}",
                 f"  receives network {format_bytes(rb.network_recv)}, nvlink {format_bytes(rb.nvlink_recv)}, "
                 f"local {format_bytes(rb.local)}; sends network {format_bytes(rb.network_send)}, "
                 f"nvlink {format_bytes(rb.nvlink_send)}; {s.num_transfers} transfers received"]
        transfers = self.transfers if max_transfers else ()
        for t in transfers[:max_transfers]:
            relay = f" relay-stage{t.stage}" if t.stage else ""
            lines.append(f"  [{t.chunk}] {t.src_rank:>4} -> {t.dst_rank:<4} {t.link:<7}{relay} "
                         f"{format_bytes(t.nbytes):>10} item {t.item} global {t.global_box}")
        if len(transfers) > max_transfers:
            lines.append(f"  ... {len(transfers) - max_transfers} more transfers")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"LocalPlan(rank {self.rank}, {len(self.items)} items, {len(self.part.transfers)} transfers)"


def plan_local(items: Iterable[Any], topology: Topology | None, rank: int, *, relay: bool = True,
               staging_bytes: int = DEFAULT_STAGING_BYTES, min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
               single_batch_chunks: bool = False) -> LocalPlan:
    """Rank `rank`'s part of the plan of `items`, ready for `execute`: `plan_rank`'s transfers, scheduled.

    Every rank of the plan calls it with the same arguments but `rank`; the parts fit together (each transfer in
    both ends' parts, batched and ordered alike: see the module docstring). Cost grows with the rank's own
    transfers and the distinct layouts, not with the cluster (`perf/bench_scale.py`). The items are checked as
    `plan_many` checks them, except the bounds of `PlanLimits` on the whole plan's size.

    Args:
        items, topology, relay, staging_bytes: as for `plan_many`.
        rank: the rank whose part to plan.
        min_split_bytes: kept for the handshake's description; the rotation splits parts by `staging_bytes` only.
        single_batch_chunks: one batch (one peer, one direction) per chunk, as delta runs (`execute(...,
            delta=...)`) need: their size round waits for every size of a chunk before its data moves, which with
            several peers per chunk could wait on a peer that waits on this rank.
    """
    items_t = _as_items(items)
    _checks.check_call(topology, relay, None)
    topology = topology if topology is not None else Topology()
    if isinstance(min_split_bytes, bool) or not isinstance(min_split_bytes, int) or min_split_bytes < 1:
        raise ValueError(f"plan_local: min_split_bytes must be a positive integer, got {min_split_bytes!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"plan_local: rank must be an integer >= 0, got {rank!r}")
    for i, it in enumerate(items_t):
        _check_item(it, i)
    _checks.check_destinations_and_coverage(items_t)
    part = plan_rank(items_t, topology, rank, relay=relay, staging_bytes=staging_bytes)
    if not isinstance(single_batch_chunks, bool):
        raise TypeError(f"plan_local: single_batch_chunks must be a bool, got {single_batch_chunks!r}")
    return LocalPlan(items_t, topology, relay, staging_bytes, min_split_bytes, rank, part, single_batch_chunks)
