"""What every run of a plan does before data moves: check the local tensors against the plan, reserve staging, and
describe the plan for the agreement round; and the report a run returns.

Shared by the full executor (`reshard.comm._executor`) and delta runs (`reshard.comm._delta`).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.comm._alias import overlap_errors
from reshard.comm._group import Group
from reshard.comm._handshake import EXACT_SUFFIX, PendingAgreement
from reshard.comm._hoststage import HostStaging, Route, choose_route
from reshard.planner import PIPELINE_DEPTH, FlatRun, Plan, RankChunk, RankPlan, region_fits

logger = logging.getLogger(__name__)

__all__ = ["NUM_SLOTS", "ExecutionReport", "Staging", "check_tensors", "describe_plan", "prepare_run",
           "staging_for", "tensor_key"]

NUM_SLOTS = PIPELINE_DEPTH
"""Pipeline slots: chunk i and chunk i+1 are in flight together (the plan's `PIPELINE_DEPTH`)."""


# -------------------------------------------------------------------------------------------------------------
# Staging
# -------------------------------------------------------------------------------------------------------------


class Staging:
    """Staging memory of one rank: `NUM_SLOTS` slots, each one `uint8` buffer for one chunk's sends and receives.

    A chunk with `send_bytes` and `recv_bytes` packs its sends into `slot[:send_bytes]` and receives into
    `slot[send_bytes:send_bytes + recv_bytes]`; the planner keeps their sum within `staging_bytes // PIPELINE_DEPTH`
    (`NUM_SLOTS == PIPELINE_DEPTH`), so all slots together stay within `staging_bytes`. Reserved once per plan and
    reused for every chunk; `execute` keeps it on the group so later calls with the same (or a smaller) plan reuse
    it too. On CUDA it also holds the pipeline's streams and events.

    Attributes:
        device: where the buffers live.
        slots: `NUM_SLOTS` 1-D `uint8` tensors of `slot_bytes` each (separate allocations: no slot aliases another).
        send_sums, recv_sums: `NUM_SLOTS` 1-D `int64` checksum buffers (`verify=True`), one entry per box.
        host: on a host-staged route (`reshard.comm._hoststage`), the pinned host mirror of the slots that the wire
            reads and writes; None when the wire moves the slots themselves.
    """

    def __init__(self, device: torch.device, slot_bytes: int, send_boxes: int = 0, recv_boxes: int = 0, *,
                 host: bool = False) -> None:
        self.device = device
        self.slot_bytes = slot_bytes
        self.send_boxes, self.recv_boxes = send_boxes, recv_boxes
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(NUM_SLOTS)]
        self.send_sums = [torch.zeros(send_boxes, dtype=torch.int64, device=device) for _ in range(NUM_SLOTS)]
        self.recv_sums = [torch.zeros(recv_boxes, dtype=torch.int64, device=device) for _ in range(NUM_SLOTS)]
        self.streams = _Streams(device) if device.type == "cuda" else None
        self.host = HostStaging(device, slot_bytes, NUM_SLOTS, send_boxes, recv_boxes) if host else None

    def fits(self, device: torch.device, slot_bytes: int, send_boxes: int, recv_boxes: int, host: bool = False
             ) -> bool:
        return (self.device == device and self.slot_bytes >= slot_bytes and self.send_boxes >= send_boxes
                and self.recv_boxes >= recv_boxes and (self.host is not None) == host)

    def send(self, slot: int, step: RankChunk) -> torch.Tensor:
        """The slot's send area for `step`: `step.send_bytes` bytes."""
        return self.slots[slot].narrow(0, 0, step.send_bytes)

    def recv(self, slot: int, step: RankChunk) -> torch.Tensor:
        """The slot's receive area for `step`: `step.recv_bytes` bytes after its send area."""
        return self.slots[slot].narrow(0, step.send_bytes, step.recv_bytes)

    @property
    def nbytes(self) -> int:
        """Device slots plus, host-staged, their host mirror."""
        return NUM_SLOTS * self.slot_bytes + (self.host.nbytes if self.host is not None else 0)

    def __repr__(self) -> str:
        mirror = ", host-staged" if self.host is not None else ""
        return f"Staging({self.device}, {NUM_SLOTS} slots x {self.slot_bytes} B{mirror})"


class _Streams:
    """The CUDA streams of the pipeline and the events that order them; one event per hand-off and slot."""

    def __init__(self, device: torch.device) -> None:
        self.pack = torch.cuda.Stream(device)
        self.comm = torch.cuda.Stream(device)
        self.unpack = torch.cuda.Stream(device)
        # pack -> comm: the slot's send buffer holds the chunk's packed boxes
        self.packed = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        # comm -> unpack: the slot's receive buffer holds the chunk's bytes; comm -> pack: its send buffer is free
        self.transferred = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        # unpack -> comm: the slot's receive buffer is free; unpack -> pack: relayed boxes have landed
        self.unpacked = [torch.cuda.Event() for _ in range(NUM_SLOTS)]
        # caller -> pipeline: inputs are ready; pipeline -> caller: outputs are ready (per stream)
        self.inputs_ready = torch.cuda.Event()
        self.done = [torch.cuda.Event() for _ in range(3)]


def staging_for(group: Group | None, prog: RankPlan, device: torch.device, verify: bool, *,
                host: bool = False) -> Staging:
    """The group's cached staging if it fits (device, sizes, host mirror), else a new one, cached.
    `host`: with a host mirror (a host-staged route)."""
    need = (prog.max_chunk_bytes, prog.max_send_boxes if verify else 0, prog.max_recv_boxes if verify else 0)
    cached = group.cache.get("staging") if group is not None else None
    if isinstance(cached, Staging) and cached.fits(device, *need, host):
        return cached
    staging = Staging(device, *need, host=host)
    if group is not None:
        group.cache["staging"] = staging
    return staging


# -------------------------------------------------------------------------------------------------------------
# Report
# -------------------------------------------------------------------------------------------------------------


@dataclass
class ExecutionReport:
    """What one rank did in one `execute` call (bytes exclude checksums; seconds are host wall time).

    `bytes_direct`: bytes sent or received on the zero-copy path (straight from or into the local tensors).
    `bytes_host_staged`: on a host-staged route, the data bytes copied between the device slots and their host
    mirror (each sent byte device -> host, each received byte host -> device); `route`: `"direct"` or
    `"host-staged"` (empty: no chunks ran).
    `seconds_handshake`: checks, staging and the plan agreement round, including any packing done while the round
    is in flight (`sends_packed_early` wire sends, also counted in `seconds_pack`); `seconds_confirm`: the
    completion (or verify) round at the end, which includes waiting for the slowest rank.
    """

    rank: int
    chunks: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    bytes_direct: int = 0
    bytes_host_staged: int = 0
    route: str = ""
    staging_bytes: int = 0
    seconds: float = 0.0
    seconds_handshake: float = 0.0
    seconds_pack: float = 0.0
    seconds_wait: float = 0.0
    seconds_unpack: float = 0.0
    seconds_confirm: float = 0.0
    verified_boxes: int = 0
    sends_packed_early: int = 0
    notes: list[str] = field(default_factory=list)


# -------------------------------------------------------------------------------------------------------------
# Validation
# -------------------------------------------------------------------------------------------------------------


def _flat_partition(layout: Any, rank: int, t: torch.Tensor) -> bool:
    """Whether `t` is given as `rank`'s flat partition in place of its window: a 1-D tensor, not of the window's
    shape, for a layout with flat frames (`FlatRangeLayout`)."""
    return (hasattr(layout, "flat_frame") and isinstance(t, torch.Tensor) and t.dim() == 1
            and tuple(t.shape) != tuple(layout.local_shape(rank)))


def flat_frames(plan: Plan, rank: int, src: Sequence[torch.Tensor] | None) -> dict[int, FlatRun]:
    """Source tensor index -> its window as a run of the flat partition given in its place (`on_flat_sources`)."""
    out: dict[int, FlatRun] = {}
    for item in plan.items:
        k = item.src_tensor
        if src is not None and k < len(src) and rank in item.src.ranks and _flat_partition(item.src, rank, src[k]):
            out[k] = item.src.flat_frame(rank)
    return out


def check_tensors(plan: Plan, rank: int, src: Sequence[torch.Tensor] | None,
                  dst: Sequence[torch.Tensor] | None, *, flat: bool = False) -> tuple[list[str], torch.device | None]:
    """Local shapes, dtypes and devices against the plan's layouts; returns error messages and the device.

    `flat`: a `FlatRangeLayout` source may be its 1-D flat partition (element 0 its range's first) in place of its
    window, as long enough as every piece's run needs (`FlatRangeLayout.flat_pieces`)."""
    errors: list[str] = []
    devices: dict[str, torch.device] = {}
    seen: set[tuple[str, int]] = set()
    for i, item in enumerate(plan.items):
        for side, layout, tensors, idx in (("source", item.src, src, item.src_tensor),
                                           ("destination", item.dst, dst, item.dst_tensor)):
            if rank not in layout.ranks or (side, idx) in seen:
                continue
            seen.add((side, idx))
            who = f"tensor {item.label!r} (item {i}): rank {rank}"
            expected = tuple(layout.local_shape(rank))
            if tensors is None:
                errors.append(f"{who} holds a {side} shard of {layout!r} but got no {side} tensors (None); expected "
                              f"a {side} local tensor of shape {expected} and dtype {layout.dtype}")
                continue
            if idx >= len(tensors) or tensors[idx] is None:
                errors.append(f"{who}: {side} local tensor {idx} is missing (got {len(tensors)} {side} tensors); "
                              f"expected shape {expected} and dtype {layout.dtype}")
                continue
            t = tensors[idx]
            if not isinstance(t, torch.Tensor):
                errors.append(f"{who}: {side} local tensor {idx} must be a torch.Tensor, got {type(t).__name__}")
                continue
            if flat and side == "source" and _flat_partition(layout, rank, t):
                need = max((p.local_box.span()[1] for p in layout.flat_pieces(rank)), default=0)
                if not all(region_fits(tuple(t.shape), p.local_box) for p in layout.flat_pieces(rank)):
                    errors.append(f"{who}: source flat partition {idx} has {t.numel()} elements, expected at least "
                                  f"{need} (the range {layout.ranges.get(rank)} of {layout!r})")
            elif tuple(t.shape) != expected:
                errors.append(f"{who}: {side} local tensor {idx} has shape {tuple(t.shape)}, expected {expected} "
                              f"(the local shape of {layout!r})")
            if t.dtype != layout.dtype:
                errors.append(f"{who}: {side} local tensor {idx} has dtype {t.dtype}, expected {layout.dtype}")
            if side == "destination" and t.numel() > 1 and any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
                errors.append(f"{who}: destination local tensor {idx} has stride 0 (expanded) along a dim of "
                              f"shape {tuple(t.shape)}, strides {t.stride()}; it cannot be written")
            devices.setdefault(str(t.device), t.device)
    if len(devices) > 1:
        errors.append(f"rank {rank}: local tensors are on several devices {sorted(devices)}; expected one")
    errors.extend(overlap_errors(plan, rank, src, dst))  # a destination sharing memory with a source or destination
    device = next(iter(devices.values())) if len(devices) == 1 else None
    return errors, device


def describe_plan(plan: Plan) -> list[tuple[str, str]]:
    """What a plan was built from, field by field, for saying what differs between ranks."""
    out = [
        ("planning", repr(getattr(plan, "planning", "global"))),
        ("topology", repr(plan.topology)),
        ("relay", repr(plan.relay)),
        ("staging_bytes", repr(plan.staging_bytes)),
        ("min_split_bytes", repr(plan.min_split_bytes)),
        # a rank-local plan's scheduling rule (one batch per chunk): what `Refit(delta=True)` sets
        ("single_batch_chunks (plan_local's; set by Refit(delta=True))", repr(getattr(plan, "single_batch_chunks",
                                                                                    False))),
        ("number of tensors", repr(len(plan.items))),
    ]
    for i, it in enumerate(plan.items):
        who = f"tensor {it.label!r} (item {i})"
        for side, lay in (("source", it.src), ("destination", it.dst)):
            text = repr(lay)
            out.append((f"{who} {side} layout", text))
            # the exact key catches what the repr does not show; shown only when the reprs agree
            out.append((f"{who} {side} layout{EXACT_SUFFIX}", repr(getattr(lay, "key", text))))
        out.append((f"{who} local tensor indices", repr((it.src_tensor, it.dst_tensor))))
    return out


def tensor_key(tensors: Sequence[Any] | None) -> tuple | None:
    """What `check_tensors` reads of a list of local tensors (address, shape, strides, dtype, device per tensor), or
    None when some entry is not a tensor (not cached)."""
    if tensors is None:
        return ()
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
        elif isinstance(t, torch.Tensor):
            out.append((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device))
        else:
            return None
    return tuple(out)


_CHECKED = 4
"""`(plan, rank, tensors)` whose clean `check_tensors` result a group remembers."""


def _checked(group: Group, plan: Plan, rank: int, src: Sequence[torch.Tensor] | None,
             dst: Sequence[torch.Tensor] | None, flat: bool = False) -> tuple[list[str], torch.device | None]:
    """`check_tensors`, skipped when the same plan and the same tensors (addresses, shapes, strides, dtypes,
    devices: everything it reads) passed it before on this group; only clean results are remembered."""
    ks, kd = tensor_key(src), tensor_key(dst)
    key = None if ks is None or kd is None else (plan.fingerprint, rank, ks, kd, flat)
    cache: OrderedDict = group.cache.setdefault("checked", OrderedDict())
    if key is not None and key in cache:
        cache.move_to_end(key)
        return [], cache[key]
    errs, device = check_tensors(plan, rank, src, dst, flat=flat)
    if not errs and key is not None:
        cache[key] = device
        while len(cache) > _CHECKED:
            cache.popitem(last=False)
    return errs, device


def with_device(plan: Plan, kind: str) -> tuple[str, Callable[[], list[tuple[str, str]]]]:
    """The plan's fingerprint and description with the device type of this rank's wire buffers folded in (its
    route's `wire`; without a route, its tensors' device type), so ranks whose bytes would go on different
    backends (CPU tensors on gloo, CUDA tensors on NCCL) are refused on every rank, naming them, before any byte
    moves. A CUDA rank staged through host memory has a `"cpu"` wire and agrees with CPU peers. `"cpu"` leaves
    the fingerprint as it is."""
    if kind == "cpu":
        return plan.fingerprint, lambda: [*describe_plan(plan), ("tensors' device type on the wire", "'cpu'")]
    folded = hashlib.sha256(f"{plan.fingerprint}|{kind}".encode()).hexdigest()[:len(plan.fingerprint)]
    return folded, lambda: [*describe_plan(plan), ("tensors' device type on the wire", repr(kind))]


def prepare_run(plan: Plan, prog: RankPlan, rank: int, group: Group, src: Sequence[torch.Tensor] | None,
                dst: Sequence[torch.Tensor] | None, timeout: datetime.timedelta, *, verify: bool = False,
                errors: Sequence[str] = (), reserve: Callable[[torch.device], Any] | None = None,
                reserving: str = "staging", early: Callable[[Staging], None] | None = None,
                ranks: Sequence[int] | None = None, agreed: bool | Callable[[list[str]], None] = False,
                host_staging: bool = False, flat_sources: bool = False) -> tuple[Staging | None, Any]:
    """What every run does before data moves, on every rank of the plan: check the local tensors (`check_tensors`,
    plus the caller's own `errors`), reserve staging and, through `reserve(device)`, whatever else the run needs on
    the device, then agree with the other ranks (plan fingerprint + error flags), so bad input raises on every rank
    before any byte moves (alone, without a round, on a one-rank plan).

    `early(staging)`, if given, runs while the agreement round is in flight, on a rank with staging, no local error
    and that is not the round's root (whose answer every rank waits for): work that writes only this rank's staging
    (packing from source tensors), so a refused call still leaves every destination untouched. If it raises, the
    error is logged and its result dropped (the run does the same work again after the verdict, where a failure
    counts as usual).

    `ranks`: `plan.ranks` if the caller has it already (it is computed from every item).

    `host_staging`: whether the caller can run a host-staged route (`choose_route`); when it cannot, a rank that
    needs one is refused like any bad input.

    `flat_sources`: a flat-range source may be its flat partition (`check_tensors`'s `flat`); the caller reads it
    through `on_flat_sources`.

    `agreed`: the caller already agreed on this plan with every rank of it (the same plan ran on this group before,
    and the caller's own round says every rank runs it again now): no agreement round. A local error then raises
    here after recording a fault on the group (`Group.report_fault`), so the peers' waits for this rank end at once
    with it instead of at their timeout. A callable: the caller's own all-rank round in place of the plan
    handshake, called with this rank's errors (empty when none) once the checks and reservations are done: it must
    raise on every rank when any rank has errors, and return on every rank when none has (a caller that agreed on
    this plan before: `Refit`'s live check, whose fingerprint holds the plan's).

    Returns:
        `(staging, reserve(device))`, or `(None, None)` for a rank without chunks.
    """
    ranks = plan.ranks if ranks is None else ranks
    errs, device = _checked(group, plan, rank, src, dst, flat_sources)
    errs.extend(errors)
    staging, reserved = None, None
    # the route (direct, or through host staging) is decided here, once, from the group's data backends (made at
    # rendezvous from the exchanged devices); the executor follows it. Its wire type goes into the fingerprint.
    route: Route | None = None
    wire = device.type if device is not None else "cpu"
    if not errs and device is not None:
        try:
            route = choose_route(device, group.data_types)
            wire = route.wire
        except ValueError as e:
            if prog.max_chunk_bytes:
                errs.append(f"rank {rank}: cannot reserve {reserving} on {device}: {e}")
        if route is not None and route.staged and not host_staging and prog.max_chunk_bytes:
            errs.append(f"rank {rank}: this run cannot stage {device} tensors through host memory (full runs can; "
                        f"the group moves data over {sorted(group.data_types)})")
    if not errs and prog.chunks:
        device = device or torch.device("cpu")
        route = route or Route(device, device.type)
        try:
            staging = staging_for(group, prog, route.device, verify, host=route.staged and bool(prog.max_chunk_bytes))
            reserved = reserve(device) if reserve is not None else None
        except (ValueError, RuntimeError) as e:  # out of memory
            errs.append(f"rank {rank}: cannot reserve {reserving} on {device}: {e}")
    if callable(agreed):
        agreed(list(errs))
        if errs:  # the caller's round returned although this rank has errors: its contract is broken
            raise ValueError("bad input, nothing was moved (the caller's agreement passed it):\n  " + "\n  ".join(errs))
    elif agreed and errs:
        message = f"rank {rank}: bad input, nothing was moved by this rank:\n  " + "\n  ".join(errs)
        report = getattr(group, "report_fault", None)
        if report is not None and len(ranks) > 1:
            report(rank, message)
        raise ValueError(message)
    if len(ranks) > 1 and not agreed:
        fingerprint, describe = with_device(plan, wire)
        with group.exclusive("plan handshake"):
            pending = PendingAgreement(group, ranks, fingerprint, errs, describe, timeout=timeout,
                                       what="plan handshake")
            if early is not None and staging is not None and not errs and not pending.relays:
                try:
                    early(staging)
                except Exception:  # redone after the verdict, where it raises as usual
                    logger.debug("rank %d: work during the plan handshake failed; redone after it", rank,
                                 exc_info=True)
            pending.finish()
    elif errs:
        raise ValueError("bad input, nothing was moved:\n  " + "\n  ".join(errs))
    return staging, reserved
