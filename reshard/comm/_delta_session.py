"""What delta runs keep between calls: the `DeltaSession`, each rank's state per plan (snapshots of its send boxes
and their versions, the versions and fingerprints of its receive boxes, a relay's stores for the boxes it
forwards), and the report types of a delta run. A run (`reshard.comm._delta`) reads and updates them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from reshard.comm._fingerprint import CHECKS
from reshard.comm._prepare import ExecutionReport
from reshard.kernels import DELTA_DENSE_FRACTION
from reshard.planner import Box, Plan, RankPlan

SNAPSHOTS = ("device", "host")
"""Where a `DeltaSession` may keep its snapshots, the default first."""
NO_VERSION = -1
"""The version of a box that holds none (never received, stale, or a forwarded box not received this run)."""
_KEPT_PLANS = 2


@dataclass
class DeltaLinkStats:
    """What one rank sent over one link kind in one delta run.

    Attributes:
        elements: elements of the boxes sent.
        changed: elements sent as changed (every element of a DENSE or raw box counts as changed).
        dense_bytes: the boxes' planned (dense) bytes.
        encoded_bytes: payload bytes sent (headers included; raw messages count their planned bytes).
        dense_boxes, sparse_boxes: boxes sent DENSE (or raw) and BITMASK / INDICES.
    """

    elements: int = 0
    changed: int = 0
    dense_bytes: int = 0
    encoded_bytes: int = 0
    dense_boxes: int = 0
    sparse_boxes: int = 0

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    def add(self, other: DeltaLinkStats) -> None:
        for k in ("elements", "changed", "dense_bytes", "encoded_bytes", "dense_boxes", "sparse_boxes"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class DeltaReport(ExecutionReport):
    """`ExecutionReport` of a delta run, plus per link kind (`"nvlink"`, `"network"`) what this rank sent
    (`links`), the bytes of the state and size messages it sent (`control_bytes`), the messages that went raw
    (`raw_messages`), the boxes whose receiver was stale (`stale_boxes`, received side), the size of this
    rank's snapshot (`snapshot_bytes`), the sparse boxes it forwarded as they arrived (`forwarded_boxes`, a
    relay) and the seconds of each phase of the run (`phases`: `scan`, `state_fingerprint`, `state_round`,
    `encode`, `size_round`, `data`, `decode`, `decode_fingerprint`, `local`, `completion`)."""

    links: dict[str, DeltaLinkStats] = field(default_factory=dict)
    control_bytes: int = 0
    raw_messages: int = 0
    stale_boxes: int = 0
    snapshot_bytes: int = 0
    forwarded_boxes: int = 0
    phases: dict[str, float] = field(default_factory=dict)

    def _time(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds


class SendBox:
    __slots__ = ("forward", "nbytes", "snap_offset", "version")

    def __init__(self, snap_offset: int, nbytes: int, forward: tuple[int, int] | None = None) -> None:
        self.snap_offset = snap_offset  # -1: a forwarded box, which has no snapshot
        self.nbytes = nbytes
        self.forward = forward  # (chunk position in the program, unpack box) of the received box it forwards
        self.version = NO_VERSION  # the version the snapshot was last sent as


def forwarded_boxes(prog: RankPlan) -> dict[tuple[int, int], tuple[int, int]]:
    """The relay sends of `prog` that forward, unchanged, a box the rank received in an earlier chunk: per
    `(chunk position, pack box)` the `(chunk position, unpack box)` it received (same destination tensor, same box,
    no cast). Such a box is forwarded in the encoded form it arrived in."""
    received: dict[tuple[int, Box], tuple[int, int]] = {}
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for k, step in enumerate(prog.chunks):
        p = step.pack
        for b, (from_dst, t, box, wire) in enumerate(zip(p.from_dst, p.tensors, p.boxes, p.wire)):
            got = received.get((t, box)) if from_dst and wire is None else None
            if got is not None:
                out[(k, b)] = got
        u = step.unpack
        for b, (t, box) in enumerate(zip(u.tensors, u.boxes)):
            received.setdefault((t, box), (k, b))
    return out


class RankState:
    """One rank's delta state for one plan: snapshot slots of its send boxes, held versions of its receive boxes,
    and, on a relay, a store per received box it forwards (its encoded bytes, between the chunk it arrives in and
    the chunk that forwards it; the box's dense bytes, in the snapshot buffer: a forwarded box has no snapshot)."""

    def __init__(self, prog: RankPlan, wire_itemsizes: list[list[int]], device: torch.device, where: str) -> None:
        forwards = forwarded_boxes(prog)
        self.send: list[list[SendBox]] = []
        self.stores: dict[tuple[int, int], tuple[int, int]] = {}  # received box -> (offset, capacity)
        pos = 0
        for k, (step, sizes) in enumerate(zip(prog.chunks, wire_itemsizes)):
            boxes = []
            for b, (box, size) in enumerate(zip(step.pack.boxes, sizes)):
                n = box.numel * size
                got = forwards.get((k, b))
                boxes.append(SendBox(-1 if got is not None else pos, n, got))
                if got is None or got not in self.stores:
                    if got is not None:
                        self.stores[got] = (pos, (n + 7) & -8)
                    pos += (n + 7) & -8
            self.send.append(boxes)
        pin = where == "host" and torch.cuda.is_available()
        snap_device = device if where == "device" else torch.device("cpu")
        self.snapshot = torch.empty(pos, dtype=torch.uint8, device=snap_device, pin_memory=pin)
        self.device = device
        # per chunk, per unpack box: (version, fingerprint) after the last apply, or None
        self.held: list[list[tuple[int, tuple] | None]] = [[None] * len(s.unpack.boxes) for s in prog.chunks]

    @property
    def nbytes(self) -> int:
        return self.snapshot.numel()


class DeltaSession:
    """What delta runs remember between calls: pass the same session to every `execute(..., delta=session)`.

    Args:
        snapshot: where senders keep their snapshots: `"device"` (the tensors' device) or `"host"` (CPU memory,
            pinned when CUDA is available; on CUDA each message's snapshot is copied to the device to compare).
        check: how a receiver finds that its box changed since it applied it (then it asks for a DENSE box; see
            `reshard.comm._fingerprint`): `"checksum"` (default; `reshard.kernels.checksum`, non-linear and
            position-sensitive: any change of the bytes, swaps, permutations and paired ulp moves included),
            `"sum"` (the wrapping 64-bit sums of the box's words, all and every other one: cheaper, but it misses
            swaps and permutations within a word parity class and `+d` / `-d` on two words of one parity) or
            `"none"` (versions only: a reloaded engine or a failed run, not an in-place overwrite).
        threshold: the fraction of changed elements above which a box goes DENSE (`choose_delta_format`).

    The first run of a plan on a session is full; so is any box whose receiver holds another version. State is kept
    for the last two plans per rank.
    """

    def __init__(self, *, snapshot: str = "device", check: str = "checksum",
                 threshold: float = DELTA_DENSE_FRACTION) -> None:
        if snapshot not in SNAPSHOTS:
            raise ValueError(f"DeltaSession: snapshot must be one of {SNAPSHOTS}, got {snapshot!r}")
        if check not in CHECKS:
            raise ValueError(f"DeltaSession: check must be one of {CHECKS}, got {check!r}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"DeltaSession: threshold must be in [0, 1], got {threshold}")
        self.snapshot = snapshot
        self.check = check
        self.threshold = threshold
        self._states: OrderedDict[tuple[str, int], RankState] = OrderedDict()

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of every snapshot this session holds."""
        return sum(s.nbytes for s in self._states.values())

    def reset(self) -> None:
        """Forget everything: the next run of every plan is full."""
        self._states.clear()

    def _state(self, plan: Plan, prog: RankPlan, wire: list[list[int]], device: torch.device) -> RankState:
        key = (plan.fingerprint, prog.rank)
        st = self._states.get(key)
        if st is None or st.device != device or [[b.nbytes for b in c] for c in st.send] != [
                [box.numel * s for box, s in zip(step.pack.boxes, sizes)] for step, sizes in zip(prog.chunks, wire)]:
            st = self._states[key] = RankState(prog, wire, device, self.snapshot)
        self._states.move_to_end(key)
        while len(self._states) > _KEPT_PLANS:
            self._states.popitem(last=False)
        return st

    def __repr__(self) -> str:
        return f"DeltaSession(snapshot={self.snapshot!r}, check={self.check!r}, {self.snapshot_bytes} snapshot bytes)"
