"""Delta execution: after the first run of a plan, send per transfer box only the elements whose bits changed.

`execute(plan, ..., delta=session)` runs here (`execute_delta`) with a `DeltaSession` that keeps, per plan and rank,
what the rank last sent and what it last received:

- every sender keeps a *snapshot* of each box it sends of its own (the wire bytes: a casting item's box after its
  cast), on the device or in pinned host memory (`DeltaSession(snapshot=...)`), and the *version* (a random
  62-bit number drawn per run) that snapshot was sent as. A relay box that forwards, unchanged, a box the relay
  received earlier in the run (`forwarded_boxes`: same destination tensor and box, no cast) has no snapshot: the
  relay keeps instead a *store* of that size for the encoded bytes the box arrives in;
- every receiver keeps, per box, the version it holds and a fingerprint of the box's bytes after it applied it.

One run, on every rank of the plan:

1. the checks and the plan agreement of `execute` (bad input raises on every rank, before any byte moves);
2. senders compare their first messages (boxes read from source tensors, up to one staging slot of planned bytes)
   with their snapshots (`reshard.kernels.scan_changes`) while receivers check their boxes; then the *state round*:
   every receiver tells each sender, per box, the version it holds, or -1 when it holds none or its box's bytes no
   longer match the fingerprint taken when it applied it (a destination overwritten between runs, an engine
   reloaded, a failed run); one small message per pair on the control backend;
3. per chunk, in increasing order: each sender encodes each message (`delta_encode`: DENSE, BITMASK + values or
   INDICES + values, versioned headers) into the chunk's staging area of the message, sparse only where the
   receiver holds the snapshot's version, DENSE otherwise. A forwarded box goes in the encoded form it arrived in
   (its bytes copied from its store) when it arrived sparse from the version the receiver holds; otherwise DENSE
   from the destination tensor it landed in (`delta_encode_dense`), with the version it arrived with: versions
   then name the source's run all along a relay chain. If a message's encoding does not fit its planned bytes
   (less 7 bytes of alignment), the message goes *raw*: packed as the plan packs it, exactly the planned bytes.
   Then a *size round* (per message `[encoded bytes, version, bytes per box]`, or `[-1, version, version per box]`
   for raw; control backend; a size beyond the message's planned bytes is a fault naming the sender, before
   anything is allocated) and the payload of exactly those bytes; receivers decode (`delta_decode`, which
   refuses a sparse box of another base version) or unpack, record version and fingerprint (and, for a box they
   forward, how it arrived), and the chunk's local copies run (always full). So staging stays what the plan
   reserved, within `staging_bytes`;
4. the completion round: any rank's error raises on every rank.

The zero-copy path is not used. Chunks run one after another (the size round needs the encoding); the state and
size messages cost one small message per pair and chunk.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from reshard.comm._delta_session import (
    NO_VERSION,
    SNAPSHOTS,  # noqa: F401  (its home until issue 42; use reshard.comm)
    DeltaLinkStats,
    DeltaReport,
    DeltaSession,
    RankState,
)
from reshard.comm._fingerprint import fingerprint as _fingerprint
from reshard.comm._group import Group
from reshard.comm._prepare import Staging, prepare_run
from reshard.comm._run import run_plan
from reshard.comm._transfer import TAG_CONTROL, TAG_DATA, fault, post
from reshard.kernels import (
    ChangeScan,
    DeltaFormat,
    DeltaHeader,
    delta_decode,
    delta_encode,
    delta_encode_dense,
    delta_offsets,
    pack,
    read_delta_headers,
    scan_changes,
    unpack,
)
from reshard.planner import Box, Message, Plan, RankChunk, RankPlan, region_view

logger = logging.getLogger(__name__)

_ALIGN_SLACK = 7  # an encoded message starts at an 8-aligned address inside the message's planned bytes


@dataclass(frozen=True, slots=True)
class _Received:
    """How a box a relay forwards arrived in this run: sparse (its encoded bytes are in the box's store) or not."""

    version: int
    header: DeltaHeader | None = None  # a sparse box's header; None: the box arrived DENSE or raw


@dataclass(slots=True)
class _Outgoing:
    """How one send box of a chunk goes in this run: what `_Run.encode` chose for it, then its header."""

    version: int  # the version it carries (a forwarded box: the one it arrived with)
    format: DeltaFormat | None = None  # None: sparse or DENSE, chosen by the changed count
    count: int = 0  # elements changed (an own box) or encoded (a forwarded one)
    base: int = 0  # the version an own box is encoded against (0: none, DENSE)
    received: _Received | None = None  # forwarded as it arrived (sparse, from the version the receiver holds)
    at: int = 0  # byte offset of its encoding in the slot's send area
    header: DeltaHeader | None = None


def _box_ix(m: Message) -> list[int]:
    """The pack (or unpack) box indices of message `m`."""
    return list(range(m.first_box, m.first_box + len(m.transfers)))


@dataclass
class _Scanned:
    """One chunk's send boxes (views, cast where the plan casts) and, for its own (not forwarded) boxes, their
    comparison with the snapshot."""

    views: list[torch.Tensor]  # per pack box
    boxes: list[Box]
    own: list[int]  # the pack boxes with a snapshot
    snap: torch.Tensor  # the snapshot, or (host snapshot, CUDA tensors) the chunk's part of it on the device
    snap_offsets: list[int]  # of the own boxes, in `snap`
    snap_base: int
    scan: ChangeScan | None


# -------------------------------------------------------------------------------------------------------------
# Helpers
# -------------------------------------------------------------------------------------------------------------


def _aligned(area: torch.Tensor, offset: int, nbytes: int) -> tuple[int, int]:
    """`(start, room)`: the first 8-aligned byte of `area[offset: offset + nbytes]` and the bytes after it."""
    addr = area.data_ptr() + offset
    start = offset + ((-addr) % 8)
    return start, max(offset + nbytes - start, 0)


def _whole(t: torch.Tensor) -> Box:
    return Box((0,) * t.ndim, tuple(t.shape))


class _Run:
    """One delta `execute` call on one rank (see the module docstring for the order of work)."""

    def __init__(self, prog: RankPlan, plan: Plan, group: Group, src: Sequence[torch.Tensor],
                 dst: Sequence[torch.Tensor], staging, session: DeltaSession, state: RankState,
                 timeout: datetime.timedelta, report: DeltaReport) -> None:
        self.prog, self.plan, self.group = prog, plan, group
        self.src, self.dst = src, dst
        self.staging, self.session, self.state = staging, session, state
        self.timeout, self.report = timeout, report
        self.version = secrets.randbits(62) + 1
        self.errors: list[str] = []
        self.peer_held: dict[tuple[int, int], list[int]] = {}  # (chunk index in prog, message) -> held versions
        self.scanned: dict[int, _Scanned] = {}  # chunk index in prog -> compared early
        self.received: dict[tuple[int, int], _Received] = {}  # forwarded received boxes that arrived this run

    def _pack_tensors(self, step: RankChunk) -> list[torch.Tensor]:
        p = step.pack
        return [self.dst[i] if d else self.src[i] for d, i in zip(p.from_dst, p.tensors)]

    def _unpack_tensors(self, step: RankChunk) -> list[torch.Tensor]:
        return [self.dst[i] for i in step.unpack.tensors]

    # -- state round ----------------------------------------------------------------------------------------

    def state_round(self) -> None:
        t0 = time.perf_counter()
        check = self.session.check
        held_out: dict[int, list[int]] = {}
        expect: dict[int, int] = {}
        for k, step in enumerate(self.prog.chunks):
            tensors = self._unpack_tensors(step)
            for m in step.recvs:
                for j in range(len(m.transfers)):
                    b = m.first_box + j
                    h = self.state.held[k][b]
                    v = NO_VERSION
                    if h is not None:
                        if _fingerprint(region_view(tensors[b], step.unpack.boxes[b]), check) == h[1]:
                            v = h[0]
                        else:
                            self.state.held[k][b] = None
                            self.report.stale_boxes += 1
                    held_out.setdefault(m.peer, []).append(v)
            for m in step.sends:
                expect[m.peer] = expect.get(m.peer, 0) + len(m.transfers)
        sends = [(p, torch.tensor(v, dtype=torch.int64)) for p, v in sorted(held_out.items())]
        recvs = [(p, torch.empty(n, dtype=torch.int64)) for p, n in sorted(expect.items())]
        t1 = time.perf_counter()
        self.report._time("state_fingerprint", t1 - t0)
        post(sends, recvs, self.group, tag=TAG_CONTROL, timeout=self.timeout, what="delta state round",
             control=True).wait()
        self.report._time("state_round", time.perf_counter() - t1)
        self.report.control_bytes += sum(t.numel() * 8 for _, t in sends)
        got = {p: t.tolist() for p, t in recvs}
        pos = dict.fromkeys(got, 0)
        for k, step in enumerate(self.prog.chunks):
            for i, m in enumerate(step.sends):
                n = len(m.transfers)
                self.peer_held[(k, i)] = got[m.peer][pos[m.peer]: pos[m.peer] + n]
                pos[m.peer] += n

    # -- one chunk ------------------------------------------------------------------------------------------

    def scan(self, k: int, step: RankChunk) -> _Scanned:
        """Chunk `k`'s send boxes and the comparison of its own boxes with their snapshot (one call)."""
        tensors = self._pack_tensors(step)
        boxes = self.state.send[k]
        views, bxs = [], []
        for t, box, wire in zip(tensors, step.pack.boxes, step.pack.wire):
            if wire is not None and wire != t.dtype:
                t = region_view(t, box).to(wire)
                box = _whole(t)
            views.append(t)
            bxs.append(box)
        own = [b for b, sb in enumerate(boxes) if sb.forward is None]
        snap, snap_base = self.state.snapshot, 0
        snap_offs = [boxes[b].snap_offset for b in own]
        if own and snap.device != self.state.device:  # host snapshot, CUDA tensors: this chunk's part on device
            lo = min(snap_offs)
            hi = max(o + boxes[b].nbytes for o, b in zip(snap_offs, own))
            snap, snap_base = snap[lo:hi].to(self.state.device, non_blocking=True), lo
            snap_offs = [o - lo for o in snap_offs]
        scan = scan_changes([views[b] for b in own], [bxs[b] for b in own], snap, snap_offs) if own else None
        return _Scanned(views, bxs, own, snap, snap_offs, snap_base, scan)

    def prescan(self) -> None:
        """Compare the first chunks' send boxes with their snapshots before the state round (while receivers check
        their boxes), as long as their own boxes are read from source tensors (which no run writes) and their
        planned bytes stay within one staging slot: the state round then only decides formats."""
        budget, used = self.staging.slot_bytes, 0
        for k, step in enumerate(self.prog.chunks):
            if not step.sends:
                continue
            boxes = self.state.send[k]
            if any(d and sb.forward is None for d, sb in zip(step.pack.from_dst, boxes)):
                continue
            if used and used + step.send_bytes > budget:
                return
            used += step.send_bytes
            self.scanned[k] = self.scan(k, step)

    def encode(self, k: int, step: RankChunk, area: torch.Tensor) -> list[tuple[list[int], torch.Tensor]]:
        """Encode (or pack raw) every send message of chunk `k` into `area`; per message its size words and the
        bytes to send.

        Own boxes are encoded against their snapshot, sparse where the receiver holds the snapshot's version (one
        `delta_encode` call for the chunk). A forwarded box goes as it arrived when it arrived sparse from the
        version the receiver holds (its bytes copied from its store), else DENSE from the destination tensor it
        landed in (`delta_encode_dense`), with the version it arrived with. A message whose encoding would not fit
        its planned bytes goes raw, packed as the plan packs it."""
        sc = self.scanned.pop(k, None) or self.scan(k, step)
        out = [_Outgoing(version=self.version) for _ in self.state.send[k]]
        raw = self._choose(k, step, sc, area, out)
        raw_boxes = {b for i in raw for b in _box_ix(step.sends[i])}
        self._encode_boxes(k, sc, area, out, raw_boxes)
        sent = [self._raw(k, step, m, sc, area, out) if i in raw else self._encoded(m, area, out)
                for i, m in enumerate(step.sends)]
        boxes = self.state.send[k]
        if sc.own and sc.snap is not self.state.snapshot:  # back to the host: the own slots only (not the stores)
            for b, o in zip(sc.own, sc.snap_offsets):
                self.state.snapshot.narrow(0, sc.snap_base + o, boxes[b].nbytes).copy_(sc.snap.narrow(0, o,
                                                                                                   boxes[b].nbytes))
        for b in sc.own:
            boxes[b].version = self.version
        return sent

    def _choose(self, k: int, step: RankChunk, sc: _Scanned, area: torch.Tensor, out: list[_Outgoing]) -> list[int]:
        """Fill each send box's format, count, versions and place in `area` (`out`, per pack box of chunk `k`);
        return the messages that go raw (their encoding would not fit the message's planned bytes)."""
        boxes = self.state.send[k]
        own_at = {b: n for n, b in enumerate(sc.own)}
        raw: list[int] = []
        for i, m in enumerate(step.sends):
            held = self.peer_held[(k, i)]
            ix = _box_ix(m)
            for j, b in enumerate(ix):
                sb, o = boxes[b], out[b]
                if sb.forward is None:
                    fresh = sb.version != NO_VERSION and held[j] == sb.version
                    o.format = None if fresh else DeltaFormat.DENSE
                    o.count = sc.scan.counts[own_at[b]]
                    o.base = sb.version if fresh else 0
                    continue
                r = self.received.get(sb.forward)
                h = r.header if r is not None else None
                if h is not None and h.base_version != NO_VERSION and held[j] == h.base_version:
                    o.format, o.count, o.received = h.format, h.count, r
                else:
                    o.format, o.count = DeltaFormat.DENSE, sc.boxes[b].numel
                o.version = r.version if r is not None else NO_VERSION
            start, room = _aligned(area, m.buffer_offset, m.nbytes)
            offs, end = delta_offsets([sc.boxes[b] for b in ix], [sc.views[b].dtype for b in ix],
                                      [out[b].count for b in ix], [out[b].format for b in ix],
                                      threshold=self.session.threshold)
            if end <= m.nbytes - _ALIGN_SLACK and end <= room:
                for b, off in zip(ix, offs):
                    out[b].at = start + off
            else:
                raw.append(i)
        return raw

    def _encode_boxes(self, k: int, sc: _Scanned, area: torch.Tensor, out: list[_Outgoing],
                      raw_boxes: set[int]) -> None:
        """Write the encoding of every send box of chunk `k` outside `raw_boxes` at its place in `area` and set its
        header: own boxes against their snapshot, forwarded ones DENSE or (sparse) as they arrived."""
        boxes = self.state.send[k]
        own_at = {b: n for n, b in enumerate(sc.own)}
        own = [b for b in sc.own if b not in raw_boxes]
        if own:
            n = [own_at[b] for b in own]
            whole = len(own) == len(sc.own)  # the scan describes exactly these boxes: no second comparison
            got = delta_encode([sc.views[b] for b in own], [sc.boxes[b] for b in own], sc.snap,
                               [sc.snap_offsets[x] for x in n], area, [out[b].at for b in own],
                               counts=sc.scan if whole else [sc.scan.counts[x] for x in n],
                               base_version=[out[b].base for b in own], version=self.version,
                               formats=[out[b].format for b in own], threshold=self.session.threshold)
            for b, h in zip(own, got):
                out[b].header = h
        dense = [b for b, sb in enumerate(boxes)
                 if sb.forward is not None and out[b].received is None and b not in raw_boxes]
        if dense:
            got = delta_encode_dense([sc.views[b] for b in dense], [sc.boxes[b] for b in dense], area,
                                     [out[b].at for b in dense], version=[out[b].version for b in dense])
            for b, h in zip(dense, got):
                out[b].header = h
        for b, o in enumerate(out):
            r = o.received
            if r is not None and b not in raw_boxes:  # forwarded as it arrived
                store = self.state.stores[boxes[b].forward][0]
                area.narrow(0, o.at, r.header.nbytes).copy_(self.state.snapshot.narrow(0, store, r.header.nbytes))
                o.header = r.header
                self.report.forwarded_boxes += 1

    def _encoded(self, m: Message, area: torch.Tensor, out: list[_Outgoing]) -> tuple[list[int], torch.Tensor]:
        """Message `m`'s size words (total, version, per box) and its encoded bytes in `area`; counted per link."""
        ix = _box_ix(m)
        sizes = [out[b].header.nbytes for b in ix]
        for t, b in zip(m.transfers, ix):
            h = out[b].header
            self._tally(t.link, elements=h.numel, changed=h.count, dense_bytes=t.nbytes, encoded_bytes=h.nbytes,
                        dense=h.format == DeltaFormat.DENSE)
        return [sum(sizes), self.version, *sizes], area.narrow(0, out[ix[0]].at, sum(sizes))

    def _raw(self, k: int, step: RankChunk, m: Message, sc: _Scanned, area: torch.Tensor,
             out: list[_Outgoing]) -> tuple[list[int], torch.Tensor]:
        """Message `m` packed exactly as the plan packs it (its size words: -1, the version, each box's version);
        the snapshot takes the packed bytes."""
        ix = _box_ix(m)
        own_at = {b: n for n, b in enumerate(sc.own)}
        boxes = self.state.send[k]
        rel = [step.pack.offsets[b] - m.buffer_offset for b in ix]
        msg = area.narrow(0, m.buffer_offset, m.nbytes)
        pack([sc.views[b] for b in ix], [sc.boxes[b] for b in ix], msg, rel)
        for b, r_off in zip(ix, rel):
            if b in own_at:
                n = boxes[b].nbytes
                sc.snap.narrow(0, sc.snap_offsets[own_at[b]], n).copy_(msg.narrow(0, r_off, n))
        self.report.raw_messages += 1
        for t in m.transfers:
            numel = t.global_box.numel
            self._tally(t.link, elements=numel, changed=numel, dense_bytes=t.nbytes, encoded_bytes=t.nbytes,
                        dense=True)
        return [-1, self.version, *[out[b].version for b in ix]], msg

    def _tally(self, link: str, *, elements: int, changed: int, dense_bytes: int, encoded_bytes: int,
               dense: bool) -> None:
        """Count one box sent over `link` in the report."""
        st = self.report.links.setdefault(link, DeltaLinkStats())
        st.elements += elements
        st.changed += changed
        st.dense_bytes += dense_bytes
        st.encoded_bytes += encoded_bytes
        if dense:
            st.dense_boxes += 1
        else:
            st.sparse_boxes += 1

    def chunk(self, k: int, step: RankChunk, slot: int) -> None:
        st = self.staging
        send_area, recv_area = st.send(slot, step), st.recv(slot, step)
        t0 = time.perf_counter()
        encoded = self.encode(k, step, send_area)
        t1 = time.perf_counter()
        self.report.seconds_pack += t1 - t0
        self.report._time("encode", t1 - t0)
        # size round
        size_sends = [(m.peer, torch.tensor(w, dtype=torch.int64)) for m, (w, _) in zip(step.sends, encoded)]
        size_recvs = [(m.peer, torch.empty(2 + len(m.transfers), dtype=torch.int64)) for m in step.recvs]
        what = f"delta chunk {step.index}"
        post(size_sends, size_recvs, self.group, tag=TAG_CONTROL, timeout=self.timeout, what=f"{what} sizes",
             control=True).wait()
        self.report._time("size_round", time.perf_counter() - t1)
        self.report.control_bytes += sum(t.numel() * 8 for _, t in size_sends)
        words = [t.tolist() for _, t in size_recvs]
        recvs, plans = [], []
        for m, w in zip(step.recvs, words):
            total, sizes = w[0], w[2:]
            if total == -1:
                recvs.append((m.peer, recv_area.narrow(0, m.buffer_offset, m.nbytes)))
                plans.append(("raw", sizes))  # raw: the version of each box
                continue
            start, room = _aligned(recv_area, m.buffer_offset, m.nbytes)
            allowed = min(room, m.nbytes - _ALIGN_SLACK)
            if not 0 < total <= allowed or sum(sizes) != total or min(sizes) < 0:
                # checked against the agreed plan before anything is allocated or received: a fault naming the
                # sender, which every rank learns from the group's verdict (the sender's send is never received)
                raise fault(self.group, m.peer, f"rank {self.prog.rank} of {self.group}: {what}: rank {m.peer} "
                            f"announced {total} bytes (box sizes {sizes[:8]}) for a message the plan allows at most "
                            f"{allowed} bytes of ({m.nbytes} planned); refused before anything was allocated",
                            f"{what} sizes")
            recvs.append((m.peer, recv_area.narrow(0, start, total)))
            offs = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64).tolist()
            plans.append(("encoded", start, offs, sizes))
        sends = [(m.peer, payload) for m, (_, payload) in zip(step.sends, encoded)]
        handle = post([s for s in sends if s[1].numel()], [r for r in recvs if r[1].numel()], self.group,
                      tag=TAG_DATA, timeout=self.timeout, what=what)
        t2 = time.perf_counter()
        handle.wait()
        t3 = time.perf_counter()
        self.report.seconds_wait += t3 - t2
        self.report.messages_sent += len(sends)
        self.report.messages_received += len(recvs)
        self.report.bytes_sent += sum(p.numel() for _, p in sends)
        self.report.bytes_received += sum(r.numel() for _, r in recvs)
        self.report._time("data", t3 - t2)
        self.decode(k, step, recv_area, plans)
        t4 = time.perf_counter()
        self.local(step)
        self.report._time("local", time.perf_counter() - t4)
        self.report.seconds_unpack += time.perf_counter() - t3

    def decode(self, k: int, step: RankChunk, recv_area: torch.Tensor, plans: list) -> None:
        """Apply the chunk's received messages: raw ones by `unpack`, the encoded ones by one `delta_decode` call
        over all of them (every header is checked before any box is written); then record versions and
        fingerprints, and how each box this rank forwards later arrived."""
        tensors = self._unpack_tensors(step)
        held = self.state.held[k]
        check = self.session.check
        t0 = time.perf_counter()
        applied: list[tuple[int, int, DeltaHeader | None, int]] = []  # (box, version, header, offset in recv_area)
        enc_boxes, enc_offs, enc_versions, enc_peers = [], [], [], []
        for m, p in zip(step.recvs, plans):
            ix = _box_ix(m)
            versions = [held[b][0] if held[b] is not None else None for b in ix]
            for b in ix:
                held[b] = None  # until applied
            if p[0] == "raw":
                msg = recv_area.narrow(0, m.buffer_offset, m.nbytes)
                try:
                    unpack(msg, [step.unpack.offsets[b] - m.buffer_offset for b in ix], [tensors[b] for b in ix],
                           [step.unpack.boxes[b] for b in ix])
                except ValueError as e:
                    self.errors.append(f"rank {self.prog.rank}: delta chunk {step.index}: raw message from rank "
                                       f"{m.peer}: {e}")
                    continue
                applied += [(b, v, None, -1) for b, v in zip(ix, p[1])]
                continue
            _, start, offs, sizes = p
            at = [start + o for o in offs]
            try:  # each box must take exactly the bytes its sender announced (so no box reads another's)
                bad = [(h.nbytes, n) for h, n in zip(read_delta_headers(recv_area, at), sizes) if h.nbytes != n]
            except ValueError as e:
                bad = [str(e)]
            if bad:
                self.errors.append(f"rank {self.prog.rank}: delta chunk {step.index}: message from rank {m.peer}: "
                                   f"encoded boxes do not take the bytes announced for them: {bad[:4]}")
                continue
            enc_boxes += ix
            enc_offs += at
            enc_versions += versions
            enc_peers.append(m.peer)
        if enc_boxes:
            try:
                headers = delta_decode(recv_area, enc_offs, [tensors[b] for b in enc_boxes],
                                       [step.unpack.boxes[b] for b in enc_boxes], versions=enc_versions)
            except ValueError as e:
                self.errors.append(f"rank {self.prog.rank}: delta chunk {step.index}: messages from ranks "
                                   f"{enc_peers} (boxes in their order): {e}")
            else:
                applied += [(b, h.version, h, o) for b, h, o in zip(enc_boxes, headers, enc_offs)]
        for b, v, h, o in applied:  # boxes this rank forwards later in the run: keep how they arrived
            store = self.state.stores.get((k, b))
            if store is None:
                continue
            if h is not None and h.format != DeltaFormat.DENSE and h.nbytes <= store[1]:
                self.state.snapshot.narrow(0, store[0], h.nbytes).copy_(recv_area.narrow(0, o, h.nbytes))
            else:
                h = None
            self.received[(k, b)] = _Received(v, h)
        t1 = time.perf_counter()
        self.report._time("decode", t1 - t0)
        for b, v, _, _ in applied:
            held[b] = (v, _fingerprint(region_view(tensors[b], step.unpack.boxes[b]), check))
        self.report._time("decode_fingerprint", time.perf_counter() - t1)

    def local(self, step: RankChunk) -> None:
        if not step.local:
            return
        outs, ins = [], []
        for t in step.local:
            source = self.dst[t.src_tensor] if t.stage > 0 else self.src[t.src_tensor]
            outs.append(region_view(self.dst[t.dst_tensor], t.dst_box))
            ins.append(region_view(source, t.src_box))
        torch._foreach_copy_(outs, ins)
        self.report.bytes_copied_locally += sum(t.nbytes for t in step.local)

    def run(self) -> None:
        t0 = time.perf_counter()
        self.prescan()
        self.report._time("scan", time.perf_counter() - t0)
        self.state_round()
        for k, step in enumerate(self.prog.chunks):
            self.chunk(k, step, k % len(self.staging.slots))
            self.report.chunks += 1


def wire_itemsizes(prog: RankPlan, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> list[list[int]]:
    """Per chunk, per pack box: the bytes per element on the wire (the cast dtype's, or the tensor's)."""
    out = []
    for step in prog.chunks:
        p = step.pack
        out.append([(w.itemsize if w is not None else (dst[i] if d else src[i]).element_size())
                    for w, d, i in zip(p.wire, p.from_dst, p.tensors)])
    return out


def execute_delta(plan: Plan, rank: int, src_tensors: Sequence[torch.Tensor] | None,
                  dst_tensors: Sequence[torch.Tensor] | None, group: Group, session: DeltaSession, *,
                  verify: bool, timeout: datetime.timedelta,
                  agreed: Callable[[list[str]], None] | bool = False) -> DeltaReport:
    """`execute(..., delta=session)`: see the module docstring. Same arguments and errors as `execute`; the
    completion round always runs. `agreed`: False, or the caller's own round in the plan handshake's place (see
    `prepare_run`)."""
    report = DeltaReport(rank)
    errors: list[str] = []
    if not isinstance(session, DeltaSession):
        errors.append(f"rank {rank}: delta must be a reshard.comm.DeltaSession, got {type(session).__name__}")
    if verify:
        errors.append(f"rank {rank}: verify=True is not supported with delta (delta boxes carry checked headers "
                      "and versions; run without delta to verify by checksums)")
    if getattr(plan, "planning", "global") == "local" and not getattr(plan, "single_batch_chunks", False):
        errors.append(f"rank {rank}: a delta run of a rank-local plan needs one batch per chunk "
                      "(plan_local(..., single_batch_chunks=True)): the size round of a chunk waits for all its sizes "
                      "before data moves, which with several peers per chunk can wait on a peer waiting on this rank")
    srcs, dsts = src_tensors or (), dst_tensors or ()
    states: list[RankState] = []

    def prepare(prog: RankPlan) -> Staging | None:
        staging, state = prepare_run(
            plan, prog, rank, group, src_tensors, dst_tensors, timeout, errors=errors, reserving="staging or snapshots",
            reserve=lambda device: session._state(plan, prog, wire_itemsizes(prog, srcs, dsts), device),
            agreed=agreed)
        states.append(state)
        return staging

    def run(prog: RankPlan, staging: Staging) -> list[str]:
        report.snapshot_bytes = states[0].nbytes
        active = _Run(prog, plan, group, srcs, dsts, staging, session, states[0], timeout, report)
        active.run()
        return active.errors

    # the completion round always runs: a receiver's decode error must raise on every rank
    return run_plan(plan, rank, group, report, timeout=timeout, prepare=prepare, run=run, confirm=True,
                    what="delta completion", failure="delta refit failed",
                    confirmed=lambda seconds: report._time("completion", seconds), kind="delta-executed")
