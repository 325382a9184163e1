"""The executor: run one rank's part of a `Plan`, chunk by chunk, with packing, transfer and unpacking overlapped.

One call, on every rank of the plan:

1. check the local tensors against the plan's layouts (skipped for the same plan and tensors as before), reserve
   staging (once per plan, reused), and agree with the other ranks (plan fingerprint + error flags, see
   `_handshake.agree`), on every call: bad input raises on every rank before any byte moves. On CPU a source that
   is not the round's root packs its first staged send while the round is in flight (`_Run.pack_ahead`: sources
   read, staging written, nothing another rank or a destination sees);
2. for each of the rank's chunks, in increasing chunk index:
   pack the boxes bound for each peer into the chunk's send slot (`reshard.kernels.pack`), post the chunk's sends
   and receives, make its local copies, then finish the *previous* chunk (wait for it and unpack it into the
   destination tensors with `reshard.kernels.unpack`). So chunk i is in flight while chunk i+1 is packed and chunk
   i-1 unpacked. Relayed boxes are packed from the destination tensor after they landed. On CPU the chunk's
   receives are posted first, then each wire send is packed and posted at once (`Message.parts`: a strided box is
   sent in parts), so packing the next part overlaps the transfer of this one (sends that need no packing go out
   together, in one post, just before the next pack). Chunks whose messages are all
   direct use no staging slot, so they are all in flight together. On CUDA the chunk is packed in one call on the
   pack stream and its sends posted together on the comm stream.
   Zero-copy: a message the plan marks `direct` (one box, contiguous in its local tensor; large boxes are messages
   of their own, see `Message`) skips pack and unpack: it is sent from the tensor's view and received into it
   (relays forward from the destination tensor), and only after step 1's agreement, so a refused call leaves every
   destination untouched;
3. with `verify=True`, per-box checksums travel next to the data, every receiver checks them after unpacking, and
   a last agreement round makes every rank raise if any box was corrupted.

Deadlock freedom. Every rank posts the messages of a chunk before it waits on any message of that chunk or of a
later one, and it waits on chunks in increasing index. In a `Plan`, sender and receiver of a message put it in the
same chunk. Take the lowest chunk index `c` some rank is blocked on: its peer in that message only blocks on chunks
>= `c`, and only after posting every chunk <= the one it blocks on, so it has posted its side of the message in
chunk `c`; both sides are posted, and the transport (gloo's threads, NCCL's kernels, which see groups in the same
chunk order on every rank) completes it. Hence no cycle of waits, for any plan. A rank-local plan
(`reshard.planner.plan_local`) numbers each rank's chunks on its own; there the same induction runs over one global
order of the pairs' batches, of which every rank's chunks are consecutive runs (see `reshard.planner._local_plan`),
and messages match by their order per peer, which both ends share.

The program. `Plan.for_rank` gives the rank's whole program (`RankPlan`): per chunk its messages, local copies and
the box lists of its one pack and one unpack call, and the staging sizes. The executor runs it as it is.

Staging. `NUM_SLOTS` slots, each one buffer of the rank's largest chunk send + receive bytes, which the planner
keeps within `staging_bytes // PIPELINE_DEPTH`: a chunk's packed sends at its start, its receives right after.
Reserved before the handshake, cached on the group and reused by later calls. The steady-state loop allocates
nothing (except checksums with `verify=True`).

On CUDA the stages run on three streams, ordered by events named for each hand-off, with no host synchronization
in the steady state; on CPU the same order runs on the host, with gloo progressing transfers in the background.
A host-staged rank (its route, `reshard.comm._hoststage`) runs the CUDA order with its slots' host mirror on the wire.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard.comm._delta import execute_delta
from reshard.comm._group import CommError, Group, Timeout, as_timedelta
from reshard.comm._paths import Paths, SendUnits
from reshard.comm._prepare import NUM_SLOTS, ExecutionReport, Staging, flat_frames, prepare_run
from reshard.comm._run import run_plan
from reshard.comm._devices import follows_nccl
from reshard.comm._transfer import TAG_CHECKSUM, TAG_DATA, TransferHandle, joined, post
from reshard.kernels import PreparedCopy, checksum, prepare_pack, prepare_unpack
from reshard.planner import BoxList, Plan, RankChunk, RankPlan, on_flat_sources, region_view

logger = logging.getLogger(__name__)

ZERO_COPY_ENV = "RESHARD_ZERO_COPY"
"""`execute(zero_copy=None)` reads this environment variable: `0` sends every message through staging (the
staged path, for comparing both paths on the same cases); anything else, or unset, takes the zero-copy path."""

_PREPARED_PLANS = 2
"""Plans whose prepared copies a group keeps (each pins the tensors it was prepared for)."""


class ChecksumError(CommError):
    """With `verify=True`: a box arrived with other bytes than its sender's checksum says."""


# -------------------------------------------------------------------------------------------------------------
# Checksums
# -------------------------------------------------------------------------------------------------------------


def _checksum(view: torch.Tensor, out: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Write into `out` (0-D `int64`) the checksum of `view`'s bytes (cast to `dtype` if given) in row-major order:
    `reshard.kernels.checksum`, position-sensitive and non-linear, computed in slices (no box-sized temporary)."""
    checksum(view, out=out, dtype=dtype)


# -------------------------------------------------------------------------------------------------------------
# The run
# -------------------------------------------------------------------------------------------------------------


class _Prepared:
    """The pack, unpack and local copies of one rank's part of one plan, for one set of tensors and one staging:
    checked and planned once (`reshard.kernels.prepare_pack` / `prepare_unpack`), run by every later call that
    passes the same tensors. It references those tensors (the planned copies hold their addresses)."""

    def __init__(self, key: tuple, staging: Staging) -> None:
        self.key = key
        self.staging = staging
        self.copies: dict[tuple, Any] = {}


def _tensor_key(tensors: Sequence[torch.Tensor | None]) -> tuple:
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
                 for t in tensors)


def _prepared_for(group: Group, plan: Plan, rank: int, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                  staging: Staging) -> _Prepared:
    """The group's prepared copies for this call, reused when the plan, tensors and staging are the same.

    A cached entry pins the tensors it was prepared for, so their addresses cannot be reused by other tensors while
    it lives: equal addresses mean the same tensors. At most `_PREPARED_PLANS` plans are kept per group;
    `group.cache.clear()` releases them.
    """
    cache: OrderedDict = group.cache.setdefault("prepared", OrderedDict())
    key = (_tensor_key(src), _tensor_key(dst))
    plan_key = (plan.fingerprint, rank, NUM_SLOTS)
    entry = cache.get(plan_key)
    if entry is None or entry.key != key or entry.staging is not staging:
        entry = cache[plan_key] = _Prepared(key, staging)
    cache.move_to_end(plan_key)
    while len(cache) > _PREPARED_PLANS:
        cache.popitem(last=False)
    return entry


@dataclass
class _InFlight:
    step: RankChunk
    slot: int
    handle: TransferHandle


class _Run:
    """One `execute` call on one rank: the pipeline's state. See the module docstring for the order of work."""

    def __init__(self, prog: RankPlan, plan: Plan, group: Group, src: Sequence[torch.Tensor],
                 dst: Sequence[torch.Tensor], staging: Staging, verify: bool, timeout: datetime.timedelta,
                 report: ExecutionReport, prepared: _Prepared, zero_copy: bool = True) -> None:
        self.prog = prog
        self.host = staging.host  # a host-staged route: the wire moves the slots' host mirror (see _hoststage)
        self.zero_copy = zero_copy and self.host is None  # gloo cannot read device memory: all through the mirror
        self.prepared = prepared.copies
        self.plan = plan
        self.group = group
        self.src = src
        self.dst = dst
        self.staging = staging
        self.verify = verify
        self.timeout = timeout
        self.report = report
        self.streams = staging.streams
        # NCCL-style data backend (NCCL, or NCCL's rules on CPU): each chunk is one batch, as on CUDA; its
        # operations run in order, so recvs posted apart from the sends of the same chunk could wait on each other
        self.batched = (self.streams is not None or self.host is not None
                        or follows_nccl(group.data_backend(staging.device)))
        self.errors: list[str] = []
        self.debug = logger.isEnabledFor(logging.DEBUG)
        self.packed_ahead: tuple[int, int] | None = None  # (chunk index, unit) packed during the handshake

    def _tensors(self, copies: BoxList) -> list[torch.Tensor]:
        src, dst = self.src, self.dst
        return [dst[i] if d else src[i] for d, i in zip(copies.from_dst, copies.tensors)]

    def _paths(self, step: RankChunk) -> Paths:
        key = ("paths", step.index, self.zero_copy)
        paths = self.prepared.get(key)
        if paths is None:
            paths = self.prepared[key] = Paths(step, self._tensors(step.pack), self._tensors(step.unpack),
                                                self.zero_copy)
        return paths

    def _send_units(self, step: RankChunk, slot: int) -> SendUnits:
        key = ("units", step.index, slot, self.zero_copy)
        units = self.prepared.get(key)
        if units is None:
            units = self.prepared[key] = SendUnits(step, self._paths(step), self._tensors(step.pack),
                                                    self.staging.send(slot, step))
        return units

    def _staged(self, step: RankChunk) -> bool:
        """Whether the chunk uses its staging slot: some message packed or unpacked there, or checksums."""
        paths = self._paths(step)
        return self.verify or bool(paths.pack_groups) or bool(paths.unpack_boxes)

    # -- stages ---------------------------------------------------------------------------------------------

    def pack_ahead(self) -> None:
        """CPU, while the plan handshake is in flight: pack the first staged wire send of the first chunk (the first
        one the run packs after the verdict) into its staging slot. It reads only source tensors and writes only
        staging, so a refused call still leaves every destination untouched."""
        if self.batched or self.verify or not self.prog.chunks:
            return
        step = self.prog.chunks[0]
        if (not step.sends or step.unpack_before_pack >= 0 or any(step.pack.from_dst)
                or not self._staged(step)):
            return
        for u, (copies, _, _) in enumerate(self._send_units(step, 0).units):
            if copies:
                t0 = time.perf_counter()
                for copy in copies:
                    copy.run()
                self.report.seconds_pack += time.perf_counter() - t0
                self.report.sends_packed_early += 1
                self.packed_ahead = (step.index, u)
                return

    def pack(self, step: RankChunk, slot: int, reused: bool, relay_ready: Any) -> None:
        if not step.pack.boxes:
            return
        paths = self._paths(step)
        s = self.streams
        t0 = time.perf_counter()
        with _on(s and s.pack):
            if s is not None:
                if reused:
                    # comm -> pack and unpack -> pack: chunk i-2 is sent and unpacked, so its slot is free
                    s.pack.wait_event(s.transferred[slot])
                    s.pack.wait_event(s.unpacked[slot])
                if relay_ready is not None:
                    s.pack.wait_event(relay_ready)  # unpack -> pack: the boxes this chunk forwards have landed
            copies = self.prepared.get(("pack", step.index, slot, self.zero_copy))
            if copies is None:
                tensors, area, pk = self._tensors(step.pack), self.staging.send(slot, step), step.pack
                copies = self.prepared[("pack", step.index, slot, self.zero_copy)] = [
                    prepare_pack([tensors[i] for i in ix], [pk.boxes[i] for i in ix], area, [pk.offsets[i] for i in ix],
                                 dtype=wire)
                    for wire, ix in paths.pack_groups]  # one prepared copy per wire dtype (casting items cast here)
            for copy in copies:
                copy.run()
            if self.verify:
                self._send_sums(step, slot)
            if s is not None:
                s.packed[slot].record(s.pack)
        self.report.seconds_pack += time.perf_counter() - t0

    def _send_sums(self, step: RankChunk, slot: int) -> None:
        tensors = self._tensors(step.pack)
        sums = self.staging.send_sums[slot]
        for k, (t, box, wire) in enumerate(zip(tensors, step.pack.boxes, step.pack.wire)):
            _checksum(region_view(t, box), sums[k], wire)

    def _count(self, step: RankChunk, paths: Paths) -> None:
        self.report.bytes_direct += paths.direct_bytes
        if self.debug:
            logger.debug("rank %d chunk %d: send %s, receive %s, %d local copies", self.prog.rank, step.index,
                         [(m.peer, m.nbytes) for m in step.sends], [(m.peer, m.nbytes) for m in step.recvs],
                         len(step.local))
        self.report.messages_sent += len(step.sends)
        self.report.messages_received += len(step.recvs)
        self.report.bytes_sent += step.send_bytes
        self.report.bytes_received += step.recv_bytes

    def post(self, step: RankChunk, slot: int, reused: bool) -> TransferHandle:
        st = self.staging
        paths = self._paths(step)
        self._count(step, paths)
        s = self.streams
        with _on(s and s.comm):
            if s is not None:
                s.comm.wait_event(s.packed[slot])  # pack -> comm
                if reused:
                    s.comm.wait_event(s.unpacked[slot])  # unpack -> comm: chunk i-2's receive area is read
            areas = st.send(slot, step), st.recv(slot, step), st.send_sums[slot], st.recv_sums[slot]
            if self.host is not None:  # the packed sends go to the host mirror, the wire moves the mirror
                areas = self.host.wire_areas(st, slot, step.send_bytes, step.recv_bytes, verify=self.verify)
                self.report.bytes_host_staged += step.send_bytes
            sends = Paths.wire(step.sends, paths.sends, areas[0])
            recvs = Paths.wire(step.recvs, paths.recvs, areas[1])
            num_sends, num_recvs = len(sends), len(recvs)
            what = f"chunk {step.index}"
            if self.verify:
                sends += [(m.peer, areas[2].narrow(0, m.first_box, len(m.transfers))) for m in step.sends]
                recvs += [(m.peer, areas[3].narrow(0, m.first_box, len(m.transfers))) for m in step.recvs]
            handle = _post_tagged(sends, recvs, self.group, num_sends, num_recvs, self.verify, self.timeout, what)
            if s is not None:
                handle.order_stream()  # CUDA: the comm stream waits for NCCL; the host waits in `finish`
                s.transferred[slot].record(s.comm)
        return handle

    def pack_and_post(self, step: RankChunk, slot: int) -> TransferHandle:
        """CPU: post the chunk's receives, then pack each wire send and post it at once, so packing the next one
        overlaps the transfer of this one (gloo moves posted messages on its own threads)."""
        st = self.staging
        paths = self._paths(step)
        recvs = Paths.wire(step.recvs, paths.recvs, st.recv(slot, step))
        self._count(step, paths)
        what = f"chunk {step.index}"
        num_recvs = len(recvs)
        sums: list[tuple[int, torch.Tensor]] = []
        if self.verify:
            if step.pack.boxes:
                self._send_sums(step, slot)
            sums = [(m.peer, st.send_sums[slot].narrow(0, m.first_box, len(m.transfers))) for m in step.sends]
            recvs += [(m.peer, st.recv_sums[slot].narrow(0, m.first_box, len(m.transfers))) for m in step.recvs]
        # the receives (and checksums) of the chunk in one call, then each data send as soon as it is packed: the
        # sends that need no packing now are posted together, just before the next pack (or at the end)
        first = _post_tagged(sums, recvs, self.group, 0, num_recvs, self.verify, self.timeout, what)
        handles: list[TransferHandle] = []
        ready: list[tuple[int, torch.Tensor]] = []
        for u, (copies, peer, tensor) in enumerate(self._send_units(step, slot).units if step.sends else ()):
            if copies and self.packed_ahead != (step.index, u):
                if ready:
                    handles.append(post(ready, [], self.group, tag=TAG_DATA, timeout=self.timeout, what=what))
                    ready = []
                t0 = time.perf_counter()
                for copy in copies:
                    copy.run()
                self.report.seconds_pack += time.perf_counter() - t0
            ready.append((peer, tensor))
        if ready:
            handles.append(post(ready, [], self.group, tag=TAG_DATA, timeout=self.timeout, what=what))
        return _Both(first, joined(handles, self.group, self.timeout, what)) if handles else first

    def local(self, step: RankChunk) -> None:
        if not step.local:
            return
        with _on(self.streams and self.streams.unpack):
            views = self.prepared.get(("local", step.index))
            if views is None:
                outs, ins = [], []
                for t in step.local:
                    source = self.dst[t.src_tensor] if t.stage > 0 else self.src[t.src_tensor]
                    outs.append(region_view(self.dst[t.dst_tensor], t.dst_box))
                    ins.append(region_view(source, t.src_box))
                views = self.prepared[("local", step.index)] = (outs, ins)
            torch._foreach_copy_(*views)  # one call for all of the chunk's local copies
            self.report.bytes_copied_locally += sum(t.nbytes for t in step.local)

    def finish(self, flight: _InFlight) -> None:
        step, slot = flight.step, flight.slot
        s = self.streams
        t0 = time.perf_counter()
        flight.handle.wait()  # CUDA: until the chunk's batch completed (its events), under reshard's deadline
        if self.host is not None:
            with _on(s and s.comm):  # the host mirror's receive area goes on to the device slot
                self.host.land(self.staging, slot, step.send_bytes, step.recv_bytes, verify=self.verify)
                if s is not None:
                    s.transferred[slot].record(s.comm)  # comm -> unpack: the bytes are on the device now
            self.report.bytes_host_staged += step.recv_bytes
        t1 = time.perf_counter()
        self.report.seconds_wait += t1 - t0
        if step.unpack.boxes:
            with _on(s and s.unpack):
                if s is not None:
                    s.unpack.wait_event(s.transferred[slot])  # comm -> unpack
                ix = self._paths(step).unpack_boxes
                if ix:
                    copy: PreparedCopy | None = self.prepared.get(("unpack", step.index, slot, self.zero_copy))
                    if copy is None:
                        tensors, up = self._tensors(step.unpack), step.unpack
                        copy = self.prepared[("unpack", step.index, slot, self.zero_copy)] = prepare_unpack(
                            self.staging.recv(slot, step), [up.offsets[i] for i in ix], [tensors[i] for i in ix],
                            [up.boxes[i] for i in ix])
                    copy.run()
                if self.verify:
                    self._check_sums(step, slot, self._tensors(step.unpack))
                if s is not None:
                    s.unpacked[slot].record(s.unpack)
        elif s is not None:
            with _on(s.unpack):
                s.unpack.wait_event(s.transferred[slot])
                s.unpacked[slot].record(s.unpack)
        self.report.seconds_unpack += time.perf_counter() - t1

    def _check_sums(self, step: RankChunk, slot: int, tensors: list[torch.Tensor]) -> None:
        n = len(step.unpack.boxes)
        got = torch.empty(n, dtype=torch.int64, device=self.staging.device)
        for k, (t, box) in enumerate(zip(tensors, step.unpack.boxes)):
            _checksum(region_view(t, box), got[k])
        expected = self.staging.recv_sums[slot][:n].cpu()  # verify mode syncs the host here, once per chunk
        got = got.cpu()
        self.report.verified_boxes += n
        for k in torch.nonzero(got != expected).flatten().tolist():
            t = step.unpack.transfers[k]
            item = self.plan.items[t.item]
            self.errors.append(
                f"checksum mismatch in chunk {step.index}: box {t.global_box} of tensor {item.label!r} "
                f"(item {t.item}), sent by rank {t.src_rank} (from its {'destination' if t.stage else 'source'} "
                f"box {t.src_box}) to rank {t.dst_rank} (destination box {t.dst_box}): sender checksum "
                f"{int(expected[k]):#x}, receiver checksum {int(got[k]):#x}")

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self) -> None:
        s = self.streams
        pending: deque[_InFlight] = deque()
        last_unpacked: dict[str, Any] = {"index": -1, "event": None}
        if s is not None:
            caller = torch.cuda.current_stream(self.staging.device)
            s.inputs_ready.record(caller)
            for stream in (s.pack, s.comm, s.unpack):
                stream.wait_event(s.inputs_ready)  # caller -> pipeline: source tensors and staging are ready

        def finish_oldest() -> None:
            flight = pending.popleft()
            self.finish(flight)
            last_unpacked["index"] = flight.step.index
            last_unpacked["event"] = s.unpacked[flight.slot] if s is not None else None

        def staged_in_flight() -> int:
            return sum(self._staged(f.step) for f in pending)

        try:
            num_staged = 0
            for k, step in enumerate(self.prog.chunks):
                if not self.batched:
                    # CPU: a chunk whose messages are all direct takes no slot: it is only waited for when a later
                    # chunk forwards what it brought, or at the end, so such chunks are all in flight together
                    staged = self._staged(step)
                    slot = num_staged % NUM_SLOTS if staged else 0
                    num_staged += staged
                    while pending and ((staged and staged_in_flight() >= NUM_SLOTS)
                                       or pending[0].step.index <= step.unpack_before_pack):
                        finish_oldest()
                    handle = self.pack_and_post(step, slot)  # packed and posted message by message
                else:
                    slot = k % NUM_SLOTS
                    while pending and (len(pending) >= NUM_SLOTS or pending[0].step.index <= step.unpack_before_pack):
                        finish_oldest()
                    relay_ready = last_unpacked["event"] if step.unpack_before_pack >= 0 else None
                    self.pack(step, slot, k >= NUM_SLOTS, relay_ready)
                    handle = self.post(step, slot, k >= NUM_SLOTS)
                pending.append(_InFlight(step, slot, handle))
                self.local(step)
                # unpack chunk i-1 while chunk i is in flight (CPU: only chunks that hold a slot count)
                while len(pending) > 1 and (self.batched or staged_in_flight() > 1):
                    finish_oldest()
                self.report.chunks += 1
            while pending:
                finish_oldest()
        finally:
            if s is not None:
                # pipeline -> caller: whatever happened, the caller's stream runs after every stage's work
                caller = torch.cuda.current_stream(self.staging.device)
                for ev, stream in zip(s.done, (s.pack, s.comm, s.unpack)):
                    ev.record(stream)
                    caller.wait_event(ev)


class _on:
    """`torch.cuda.stream(stream)` when given a stream, nothing on CPU."""

    def __init__(self, stream: Any) -> None:
        self.ctx = torch.cuda.stream(stream) if stream else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _post_tagged(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], group: Group,
                 num_send_msgs: int, num_recv_msgs: int, verify: bool, timeout: datetime.timedelta,
                 what: str) -> TransferHandle:
    """Data messages with `TAG_DATA`, checksum messages (after them in the lists) with `TAG_CHECKSUM`."""
    if not verify:
        return post(sends, recvs, group, tag=TAG_DATA, timeout=timeout, what=what)
    data = post(sends[:num_send_msgs], recvs[:num_recv_msgs], group, tag=TAG_DATA, timeout=timeout, what=what)
    sums = post(sends[num_send_msgs:], recvs[num_recv_msgs:], group, tag=TAG_CHECKSUM, timeout=timeout,
                what=f"{what} checksums")
    return _Both(data, sums)


class _Both(TransferHandle):
    def __init__(self, a: TransferHandle, b: TransferHandle) -> None:
        self.a, self.b = a, b

    def wait(self, timeout: Timeout | None = None) -> None:
        self.a.wait(timeout)
        self.b.wait(timeout)

    def order_stream(self) -> None:
        self.a.order_stream()
        self.b.order_stream()

    def is_completed(self) -> bool:
        return self.a.is_completed() and self.b.is_completed()


# -------------------------------------------------------------------------------------------------------------
# Public entry
# -------------------------------------------------------------------------------------------------------------


def execute(
    plan: Plan,
    rank: int | None,
    src_tensors: Sequence[torch.Tensor] | None,
    dst_tensors: Sequence[torch.Tensor] | None,
    group: Group | None = None,
    *,
    verify: bool = False,
    timeout: Timeout | None = None,
    confirm: bool = True,
    zero_copy: bool | None = None,
    delta: Any = None,
    agreed: bool | Callable[[list[str]], None] = False,
) -> ExecutionReport:
    """Run `rank`'s part of `plan`: send what it holds, receive and write what it needs, forward relayed boxes.

    Every rank of `plan.ranks` calls this with the same plan; other ranks of the group need not (a call from a rank
    outside the plan returns at once).

    Args:
        plan: from `plan` / `plan_many`, built with the group's rank numbering, identical on every rank.
        rank: this process's rank in `group` (None: `group.rank`).
        src_tensors: the source local tensors, indexed by the plan items' `src_tensor` (None: this rank holds none),
            of the items' source layouts' local shapes and dtypes (a `FlatRangeLayout`'s: or its flat partition).
        dst_tensors: the destination local tensors, indexed by the items' `dst_tensor`, written in place; None on
            a rank that holds no destination. None may share memory with a source tensor or another destination
            (two sources may share memory).
        group: default `Group.world()`.
        verify: send per-box checksums with the data and check every received box; every rank raises
            `ChecksumError` naming the box, its sender and receiver if one differs. Costs an extra read of every
            box on both sides (and, on CUDA, a host sync per chunk).
        timeout: seconds or a `timedelta` that any one wait for a peer may last (default: the group's).
        confirm: end with a completion round (one small message to and from the lowest rank of the plan), so
            that if any rank failed, every rank raises, and a rank that returns knows the whole plan is done.
            Without it, a rank returns as soon as its own part is done.
        zero_copy: send and receive the messages the plan marks `direct` (one box, contiguous in its local tensor)
            straight from and into the local tensors; False: every message goes through staging (same wire bytes).
            None: True unless the environment variable `RESHARD_ZERO_COPY` is `0`. Destinations are written only
            after the plan handshake either way.
        delta: a `reshard.comm.DeltaSession`: after the first run, send per box only the changed elements (see
            `reshard.comm._delta`; returns a `DeltaReport`; `zero_copy` does not apply). None: a full run.
        agreed: skip the plan handshake: the caller has already agreed with every rank of the plan that they run
            this very plan now (it ran on this group before, and a round of the caller's own says so). Bad local
            input then raises on this rank (recording a fault on the group, so peers waiting for it raise too)
            instead of on every rank before any byte moves. Not with `delta`. A callable (with `delta` too): the
            caller's own all-rank round in the handshake's place, given this rank's local errors (`prepare_run`).

    Returns:
        An `ExecutionReport` of this rank's work.

    Raises:
        ValueError: on every rank of the plan, before any byte moves, when plans differ between ranks (saying
            what differs) or some rank's local tensors have the wrong shape, dtype or device (naming the tensor,
            the rank, the expected and the actual value), or a destination shares memory with a source or another
            destination (naming both and the rank).
        CommError: a peer died, failed or did not answer within `timeout` (with `confirm`, on every rank).
        ChecksumError: with `verify=True`, on every rank, when a received box does not match its checksum.
    """
    group = group if group is not None else Group.world()
    if rank is None:
        rank = group.rank
    if rank != group.rank:
        raise ValueError(f"execute: rank {rank} is not this process's rank {group.rank} in {group}")
    td = as_timedelta(timeout, default=group.timeout)
    if delta is not None:
        if agreed and not callable(agreed):
            raise ValueError("execute: agreed=True is not supported with delta runs")
        return execute_delta(plan, rank, src_tensors, dst_tensors, group, delta, verify=verify, timeout=td,
                             agreed=agreed or False)
    if zero_copy is None:
        zero_copy = os.environ.get(ZERO_COPY_ENV, "1").strip() != "0"
    srcs, dsts = src_tensors or (), dst_tensors or ()
    report = ExecutionReport(rank)
    ahead: list[_Run] = []
    frames = flat_frames(plan, rank, src_tensors)  # flat partitions given in place of their windows

    def new_run(prog: RankPlan, staging: Staging) -> _Run:
        prepared, prog = _prepared_for(group, plan, rank, srcs, dsts, staging), on_flat_sources(prog, frames)
        return _Run(prog, plan, group, srcs, dsts, staging, verify, td, report, prepared, zero_copy)

    def prepare(prog: RankPlan) -> Staging | None:
        def early(staging: Staging) -> None:  # while the handshake is in flight: pack the first send (CPU)
            if staging.streams is None and not verify:
                first = new_run(prog, staging)
                first.pack_ahead()
                ahead.append(first)

        staging, _ = prepare_run(plan, prog, rank, group, src_tensors, dst_tensors, td, verify=verify,
                                 early=None if agreed else early, ranks=plan.ranks, agreed=agreed,
                                 host_staging=True, flat_sources=True)
        return staging

    def run(prog: RankPlan, staging: Staging) -> list[str]:
        active = ahead[0] if ahead and ahead[0].staging is staging else new_run(prog, staging)
        report.route = "host-staged" if staging.host is not None else "direct"
        active.run()
        return active.errors

    return run_plan(plan, rank, group, report, timeout=td, prepare=prepare, run=run, confirm=verify or confirm,
                    what="verify" if verify else "completion", error_type=ChecksumError,
                    failure="received bytes differ from what was sent")
