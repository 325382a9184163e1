"""The data path of a verl sync on one rank: bucket plans kept across syncs, and one all-rank round per steady sync.

A sync's stream is cut into buckets (`_buckets`). Bucket `i` of a sync has a reshard `Refit` of its own: the
bucket's tensors plus a header, a `(T, 4)` int64 tensor whose row `t` trainer rank `t` sends to every rollout
rank inside the same plan (`[sync number, bucket index, status, last]`).

- First sync on a group, or after the stream changed: per bucket a manifest round (every trainer rank's names,
  shapes, dtypes and kinds reach every rank; the trainer ranks must agree), then the bucket's plan runs with its
  own agreement and completion rounds. The plan is kept under the bucket's index.
- Steady state (the last sync on this group succeeded): a trainer rank compares each bucket's manifest with the
  kept one of the same index, locally. Equal: the kept plan runs with no round at all (`Refit.run(agreed=True,
  confirm=False)`), the header saying `SAME`. Different (or the last sync had no bucket of this index): the kept
  plan of this index runs once more with the header saying `CHANGED` and data the rollout ranks drop (so no rank
  waits for bytes that do not come), and from this bucket on the sync goes back to manifest rounds, every rank
  having read the same header; a bucket index the last sync did not have starts manifest rounds on every rank,
  since the previous bucket's header said it was not the last. Nothing of a changed bucket reaches the engine.
- Every sync ends with one commit round: every rank's digest of the buckets it sent or received (index, manifest,
  last flag) and the bucket count; all must be equal, else every rank raises. A rollout rank joins it only once
  its engine took every bucket but the last (so an engine that fails on any earlier tensor fails every rank), and
  yields the last bucket only after it. So a steady sync costs exactly this one all-rank round.

Buffers: a trainer rank packs bucket `i` into shared buffer `i % 2` (bucket `i + 1` is packed while bucket `i`
is sent); a rollout rank receives bucket `i` into shared buffer `i % 3`, so the views of bucket `i` it yields stay
valid until the consumer asks for the tensors of bucket `i + 2` (bucket `i + 1` is received while the consumer
loads bucket `i`, bucket `i + 3` only once the consumer asked for bucket `i + 2`). A bucket larger than
`bucket_size` has a buffer of its own, kept with its plan.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.comm import CommError, Group, all_gather_json
from reshard.integrations.group_layout import GroupLayout
from reshard.integrations.trainer import full_layout, local_of, spec_dtensor
from reshard.integrations.verl import _buckets as bk
from reshard.planner import Layout, Mesh, Topology
from reshard.refit import Refit

HEADER = "reshard.verl/bucket_header"
"""The name of every bucket's header tensor in its plan (no Hugging Face weight has a `/` in its name)."""

SAME, CHANGED = 0, 1
"""Header status: the bucket is the kept plan's, or the stream changed here (data dropped, manifest rounds follow)."""

TRAINER_SLOTS, ROLLOUT_SLOTS = 2, 3
"""Shared bucket buffers per trainer rank and per rollout rank (see the module docstring)."""


class StreamMismatch(CommError):
    """The ranks' digests of a sync differ at the commit round (a trainer rank streamed something else)."""


@dataclass
class SyncStats:
    """What the last sync did on this rank (also returned, summed up, by `send_weights` as verl metrics).

    Attributes:
        rounds: all-rank rounds this rank took part in (manifest rounds, plan agreement and completion rounds,
            the commit round): 1 in a steady sync.
        replanned: the bucket index at which this sync found the stream changed (-1: it did not).
        seconds_stream: trainer: time spent waiting for the stream's next item (the framework's assembly, e.g.
            `full_tensor()` of every parameter); seconds_first_send: trainer: from the call to the first bucket's
            transfer.
    """

    step: int | None = None
    buckets: int = 0
    tensors: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    seconds_transfer: float = 0.0
    first_plans: int = 0
    largest_bucket: int = 0  # bytes of the largest bucket holding more than one tensor (at most bucket_size)
    seconds_rounds: float = 0.0  # in all-rank rounds: manifests, each bucket's agreement and completion, the commit
    rounds: int = 0
    replanned: int = -1
    seconds_stream: float = 0.0
    seconds_first_send: float = 0.0


@dataclass
class Bucket:
    """One bucket's plan, kept under its index: its manifest rows, entries, Refit and tensors."""

    rows: list
    entries: list[bk.Entry]
    refit: Refit
    header: torch.Tensor  # trainer: this rank's (1, 4) row; rollout: the (T, 4) header received
    buffer: torch.Tensor | None = None  # the bucket's own buffer (an oversized bucket), else None: a shared slot
    sources: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)  # name -> (local tensor, first row)
    ran: bool = False
    layouts: tuple = ()  # trainer: each item's own layout (`layout_key`), which the manifest does not carry


class Stream:
    """The bucket plans of one rank on one live group, and the steady-state protocol (module docstring).

    Args:
        group: the live group (trainer ranks `0 .. T-1` first).
        num_trainers: T.
        bucket_size: bytes per shared bucket buffer.
        device: where the buffers live.
        refit_kwargs: keyword arguments of every bucket's `Refit` (topology, policy, verify, timeout, staging).
        timeout_s: the longest wait of a manifest or commit round.
    """

    def __init__(self, group: Group, num_trainers: int, bucket_size: int, device: torch.device,
                 refit_kwargs: dict[str, Any], timeout_s: float) -> None:
        self.group, self.T, self.bucket_size, self.device = group, num_trainers, bucket_size, device
        self.refit_kwargs, self.timeout = refit_kwargs, datetime.timedelta(seconds=timeout_s)
        self.trainer = GroupLayout(num_trainers, group.size - num_trainers).is_trainer(group.rank)
        self.plans: dict[int, Bucket] = {}
        self.known = 0  # buckets of the last successful sync: the kept plans steady syncs may use
        self.steady = False  # the last sync on this group succeeded: its plans are used without rounds
        self.seq = 0  # syncs started on this group (the same count on every rank)
        self.slots: list[torch.Tensor] = []
        self._digest: Any = None
        self._buckets = 0
        self._steady_now = False  # within the sync: still on the kept plans

    # ---- per sync -------------------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a sync (every rank)."""
        self.seq += 1
        self._digest = hashlib.sha256()
        self._buckets = 0
        self._steady_now = self.steady

    def send(self, index: int, items: list[tuple[str, Any, Any]], rows: list, last: bool, stats: SyncStats) -> None:
        """Trainer rank: send bucket `index` (`items`: `(name, tensor, ShardSpec or None)`, `rows` their manifest)."""
        kept = self.plans.get(index) if self._steady_now and index < self.known else None
        layouts = tuple(layout_key(t, spec) for _, t, spec in items)
        if kept is not None and kept.rows == rows and kept.layouts == layouts:
            self._fill(kept, items)
            self._run(kept, index, SAME, last, stats, agreed=True)
        else:
            if kept is not None:  # the rollout ranks wait for this index's kept plan: run it, marked CHANGED
                self._run(kept, index, CHANGED, last, stats, agreed=True)
            if self._steady_now:
                stats.replanned = index
            self._steady_now = False
            old = self.plans.get(index)
            fresh = old is None or old.rows != rows or old.layouts != layouts
            rows, entries, last, fresh = self._exchange(rows, last, fresh, stats)
            b = self._planned(index, rows, entries, items, layouts, fresh)
            self._fill(b, items)
            self._run(b, index, SAME, last, stats, agreed=False)
        self._account(index, rows, last)
        if last:
            self.commit(stats)

    def receive(self, index: int, stats: SyncStats) -> tuple[list[bk.Entry], list[torch.Tensor], bool]:
        """Rollout rank: receive bucket `index`; its entries, views of the received tensors, and whether it is the
        last (the caller then runs `commit` once its engine took every earlier bucket, before handing this one)."""
        kept = self.plans.get(index) if self._steady_now and index < self.known else None
        b = None
        if kept is not None:
            self._run(kept, index, None, False, stats, agreed=True)
            status, last = self._check_header(kept, index)
            if status == SAME:
                b = kept
        if b is None:
            if self._steady_now:
                stats.replanned = index
            self._steady_now = False
            rows, entries, last, fresh = self._exchange(None, False, False, stats)
            b = self._planned(index, rows, entries, None, (), fresh)
            self._run(b, index, None, False, stats, agreed=False)
            status, head_last = self._check_header(b, index)
            if status != SAME or head_last != last:
                raise self._fault(f"rollout rank {self.group.rank}: bucket {index}'s header says status {status}, "
                                  f"last {head_last} after its manifest said last {last}")
        self._account(index, b.rows, last)
        return b.entries, [b.sources[e.name][0] for e in b.entries], last

    def commit(self, stats: SyncStats) -> None:
        """The sync's one steady round: every rank's digest and bucket count; all equal, or every rank raises."""
        t0 = time.perf_counter()
        mine = {"digest": self._digest.hexdigest(), "buckets": self._buckets, "seq": self.seq}
        got = all_gather_json(self.group, mine, timeout=self.timeout, what="reshard verl sync commit")
        stats.rounds += 1
        stats.seconds_rounds += time.perf_counter() - t0
        differ = [r for r, g in enumerate(got) if g != got[0]]
        if differ:
            raise StreamMismatch(f"reshard verl backend: rank {self.group.rank}: the ranks disagree on what this sync "
                                 f"moved (a trainer rank streamed other names, shapes or dtypes than the others?): "
                                 f"rank 0 has {got[0]}, rank {differ[0]} has {got[differ[0]]}")
        self.known, self.steady = self._buckets, True

    # ---- internals ------------------------------------------------------------------------------------------------
    def _account(self, index: int, rows: list, last: bool) -> None:
        self._digest.update(json.dumps([index, rows, last]).encode())
        self._buckets += 1

    def _fault(self, message: str) -> CommError:
        self.group.report_fault(self.group.rank, message)
        return CommError(message)

    def _exchange(self, rows: list | None, last: bool, fresh: bool,
                  stats: SyncStats) -> tuple[list, list[bk.Entry], bool, bool]:
        """One manifest round: every trainer rank's manifest of the next bucket (and whether the trainer ranks plan it
        anew: `fresh`) reaches every rank; they must agree. Returns the manifest's rows, entries, last and fresh."""
        t0 = time.perf_counter()
        mine_ = {"manifest": rows, "last": last, "fresh": fresh} if rows is not None else None
        got = all_gather_json(self.group, mine_, timeout=self.timeout, what="reshard verl bucket manifest")
        stats.rounds += 1
        stats.seconds_rounds += time.perf_counter() - t0
        mine = got[: self.T]
        if any(m is None for m in mine) or any(m != mine[0] for m in mine):
            first = next(i for i, m in enumerate(mine) if m != mine[0] or m is None)
            raise ValueError(f"reshard verl backend: trainer ranks disagree on the next bucket (every trainer rank "
                             f"must stream the same names, shapes and dtypes in the same order): rank 0 has "
                             f"{short(mine[0])}, rank {first} has {short(mine[first])}")
        rows = mine[0]["manifest"]
        return rows, bk.layout_entries(rows), bool(mine[0]["last"]), bool(mine[0]["fresh"])

    def _planned(self, index: int, rows: list, entries: list[bk.Entry], items: list | None, layouts: tuple,
                 fresh: bool) -> Bucket:
        """The kept plan of `index`, or (`fresh`, which the trainer ranks decided: another manifest, or their items'
        own layouts changed) a new one, kept under `index`."""
        b = self.plans.get(index)
        if b is None or fresh or b.rows != rows:
            b = self._build_source(index, rows, entries, items) if self.trainer else \
                self._build_dest(index, rows, entries)
            b.layouts = layouts
            self.plans[index] = b
        return b

    def _shared(self, index: int) -> torch.Tensor:
        slot = index % (TRAINER_SLOTS if self.trainer else ROLLOUT_SLOTS)
        while len(self.slots) <= slot:
            self.slots.append(torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device))
        return self.slots[slot]

    def _header_layouts(self) -> tuple[Layout, Layout]:
        shape = (self.T, 4)
        src = Layout(shape, Mesh(list(range(self.T))), [Shard(0)], torch.int64, name=HEADER)
        dst = Layout(shape, Mesh(list(range(self.T, self.group.size))), [Replicate()], torch.int64, name=HEADER)
        return src, dst

    def _build_source(self, index: int, rows: list, entries: list[bk.Entry], items: list) -> Bucket:
        refit = Refit(self.group, **self.refit_kwargs)
        rank = self.group.rank
        plan: list[tuple[bk.Entry, Any, tuple[int, ...], torch.dtype, int]] = []  # entry, layout, shape, dtype, row
        for (_, tensor, spec), e in zip(items, entries):
            if e.kind == "full":
                block = full_layout(e.name, e.shape, e.dtype, rank, self.T)
                if block is not None:
                    plan.append((e, block.layout, block.local_shape, e.dtype, block.start))
            else:
                src = local_of(tensor, spec)
                placement = (tensor.device_mesh, tuple(tensor.placements)) if spec is None else \
                    (spec.mesh, tuple(spec.placements))
                plan.append((e, placement, tuple(src.shape), src.dtype, 0))
        need = sum(bk.aligned(bk.nbytes_of(shape, dtype)) for _, _, shape, dtype, _ in plan)
        own = torch.empty(need, dtype=torch.uint8, device=self.device) if need > self.bucket_size else None
        buf = own if own is not None else self._shared(index)
        header = torch.zeros(1, 4, dtype=torch.int64, device=self.device)
        refit.add_source(HEADER, header, self._header_layouts()[0])
        b = Bucket(rows, entries, refit, header, buffer=own)
        off = 0
        for e, layout, shape, dtype, start in plan:
            local = _carve(buf, off, shape, dtype)
            off += bk.aligned(local.nbytes)
            if e.kind == "full":
                refit.add_source(e.name, local, layout)
            else:
                mesh, placements = layout
                refit.add_source(e.name, spec_dtensor(local, mesh, placements, e.shape))
            b.sources[e.name] = (local, start)
        return b

    def _build_dest(self, index: int, rows: list, entries: list[bk.Entry]) -> Bucket:
        refit = Refit(self.group, **self.refit_kwargs)
        size = bk.buffer_bytes(entries)
        own = torch.empty(size, dtype=torch.uint8, device=self.device) if size > self.bucket_size else None
        buf = own if own is not None else self._shared(index)
        header = torch.zeros(self.T, 4, dtype=torch.int64, device=self.device)
        refit.add_destination(HEADER, header, self._header_layouts()[1])
        b = Bucket(rows, entries, refit, header, buffer=own)
        ranks = list(range(self.T, self.group.size))
        for e in entries:
            dst = bk.view(buf, e)
            refit.add_destination(e.name, dst, Layout(e.shape, Mesh(ranks), [Replicate()], e.dtype, name=e.name))
            b.sources[e.name] = (dst, 0)
        return b

    def _fill(self, b: Bucket, items: list[tuple[str, Any, Any]]) -> None:
        for (_, tensor, spec), e in zip(items, b.entries):
            held = b.sources.get(e.name)
            if held is None:  # this trainer rank holds no part of it (a scalar is sent by trainer rank 0)
                continue
            local, start = held
            if e.kind == "full":
                src = tensor.reshape(e.shape)[start: start + local.shape[0]] if len(e.shape) else tensor.reshape(())
            else:
                src = local_of(tensor, spec)
            if tuple(src.shape) != tuple(local.shape) or src.dtype != local.dtype:
                raise ValueError(f"reshard verl backend: {e.name!r} on trainer rank {self.group.rank}: its local "
                                 f"tensor {tuple(src.shape)} {src.dtype} differs from the planned "
                                 f"{tuple(local.shape)} {local.dtype} (a shard's layout changed between syncs?)")
            local.copy_(src)

    def _run(self, b: Bucket, index: int, status: int | None, last: bool, stats: SyncStats, *, agreed: bool) -> None:
        if self.trainer:
            b.header.copy_(torch.tensor([[self.seq, index, status, int(last)]], dtype=torch.int64))
        else:
            b.header.fill_(-1)  # what a header that did not arrive reads as
        if stats.buckets == 0 and self.trainer:
            stats.seconds_first_send = time.perf_counter()  # the caller subtracts its start
        report = b.refit.run(agreed=agreed and b.ran, confirm=not (agreed and b.ran))
        stats.rounds += 0 if agreed and b.ran else (2 if b.ran else 3)  # metadata (first run), agreement, completion
        if not b.ran:
            stats.first_plans += 1
        b.ran = True
        stats.buckets += 1
        if len(b.entries) > 1:
            stats.largest_bucket = max(stats.largest_bucket, bk.buffer_bytes(b.entries))
        ex = report.execution
        if ex is not None:
            stats.bytes_sent += ex.bytes_sent
            stats.bytes_received += ex.bytes_received
            stats.seconds_rounds += ex.seconds_handshake + ex.seconds_confirm
        stats.seconds_transfer += report.seconds.get("transfer", 0.0)

    def _check_header(self, b: Bucket, index: int) -> tuple[int, bool]:
        """The received header's status and last flag; a header that is not this sync's bucket `index` from every
        trainer rank, or trainer ranks that disagree, is a fault on every rank."""
        rows = b.header.cpu().tolist()
        want = [self.seq, index]
        if any(r[:2] != want for r in rows) or any(r[2:] != rows[0][2:] for r in rows) \
                or rows[0][2] not in (SAME, CHANGED):
            raise self._fault(f"reshard verl backend: rollout rank {self.group.rank}: bucket {index} of sync "
                              f"{self.seq}: the trainer ranks' headers [sync, bucket, status, last] read {rows} "
                              "(trainer ranks out of step, or one of them streamed something else)")
        return rows[0][2], bool(rows[0][3])


def layout_key(t: Any, spec: Any) -> tuple | None:
    """What a trainer rank's item is laid out by beyond the manifest (which has its global shape and kind): the mesh
    (its ranks and shape) and placements of a DTensor or a `ShardSpec`; None for a full tensor."""
    mesh, placements = (spec.mesh, spec.placements) if spec is not None else \
        (getattr(t, "device_mesh", None), getattr(t, "placements", None))
    if mesh is None:
        return None
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), repr(tuple(placements)))


def _carve(buf: torch.Tensor, off: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = bk.nbytes_of(shape, dtype)
    return buf[off: off + n].view(dtype).view(shape)


def short(v: Any, n: int = 300) -> str:
    s = repr(v)
    return s if len(s) <= n else s[:n] + "..."


def topology_of(domains: Sequence[Any], by_node: bool) -> Topology:
    """The reshard topology of the group: ranks of one domain share it when `by_node`."""
    return Topology(domain_of={r: repr(d) for r, d in enumerate(domains)}) if by_node else Topology()
