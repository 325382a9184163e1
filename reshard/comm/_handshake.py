"""Agreement before and after data moves: plan fingerprints, bad-input flags, a JSON all-gather, and a byte
broadcast (`broadcast_bytes`, gloo's binomial tree: what a refit's metadata round sends once to every rank).

`agree` is a star exchange over the control backend among the ranks of a plan, rooted at the lowest of them: every
rank sends its plan fingerprint and its local errors, the root decides, and every rank gets the same verdict. So
when the plans differ or some rank got bad input, every rank raises the same error, and no rank hangs. Only ranks
that take part in the plan talk, so ranks of the group outside the plan need not call.

Message sizes are fixed per round (a header) with a variable payload announced by the header, so no rank ever
posts a receive of the wrong size.
"""

from __future__ import annotations

import datetime
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from reshard.comm._group import CommError, Group
from reshard.comm._transfer import TAG_CONTROL, blame, fault, post, wait_watched
from reshard.comm._wire import WIRE_VERSION, check_size, decode, encode, over_allowance

_FP_BYTES = 32
_MAGIC = 0x52530000 | WIRE_VERSION  # "RS" + wire version: a peer of another version is named, not misread
_HEADER = struct.Struct(f"<I{_FP_BYTES}sq")  # magic, fingerprint, payload length
_REPLY = struct.Struct("<Iqq")  # magic, status, payload length
_LENGTH = struct.Struct("<Iq")  # magic, payload length

_OK, _FAIL, _DESCRIBE, _WAIT = 0, 1, 2, 3
EXACT_SUFFIX = " (exact)"
"""A described field `NAME (exact)` repeats field `NAME` exactly; it is reported only when `NAME` itself agrees."""
_MAX_RANKS_SHOWN = 4
_MAX_FIELDS_SHOWN = 4


def member_timeout(timeout: datetime.timedelta) -> datetime.timedelta:
    """How long a non-root rank waits for the root's answer: `timeout` plus a grace of 10% (2 s to 30 s)."""
    return timeout + datetime.timedelta(seconds=min(max(0.1 * timeout.total_seconds(), 2.0), 30.0))


def _to_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _exchange(group: Group, sends: Sequence[tuple[int, bytes]], recvs: Sequence[tuple[int, int]],
              timeout: datetime.timedelta, what: str) -> dict[int, bytes]:
    """Send `(peer, bytes)` and receive `(peer, nbytes)` on the control backend; returns the received bytes."""
    send_list = [(p, _to_tensor(b)) for p, b in sends if b]
    recv_list = [(p, torch.empty(n, dtype=torch.uint8)) for p, n in recvs if n]
    post(send_list, recv_list, group, tag=TAG_CONTROL, timeout=timeout, what=what, control=True).wait()
    out = {p: b"" for p, _ in recvs}
    out.update({p: t.numpy().tobytes() for p, t in recv_list})
    return out


def _refused(group: Group, sender: int, error: CommError, what: str) -> CommError:
    """A malformed or oversized message from `sender`: a fault every rank learns, naming `sender`."""
    return fault(group, sender, str(error), what)


def _unpack(fmt: struct.Struct, data: bytes, sender: int, group: Group, label: str) -> tuple:
    values = fmt.unpack(data)
    if values[0] != _MAGIC:
        raise _refused(group, sender, CommError(
            f"rank {group.rank} of {group}: {label}: rank {sender} sent a control header with magic "
            f"{values[0]:#x}, expected {_MAGIC:#x} (another reshard version, or not a reshard process)"), label)
    return values[1:]


def _strings(value: Any, sender: int, group: Group, what: str, label: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refused(group, sender, CommError(f"rank {group.rank} of {group}: {label}: rank {sender} sent {what} "
                                                "that is not a list of strings"), label)
    return value


def _pairs(value: Any, sender: int, group: Group, label: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not all(isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v)
                                              for v in value):
        raise _refused(group, sender, CommError(f"rank {group.rank} of {group}: {label}: rank {sender} sent a plan "
                                                "description that is not a list of [field, value] strings"), label)
    return [(k, v) for k, v in value]


def _payload(group: Group, data: bytes, sender: int, kind: str, label: str) -> Any:
    try:
        return decode(data, sender, kind, f"rank {group.rank} of {group}: {label}")
    except CommError as e:
        raise _refused(group, sender, e, label) from None


def _allowance(group: Group, sizes: dict[int, int], kind: str, label: str, *, own: int = 0) -> None:
    """Refuse (a fault naming the sender) a call whose announced sizes exceed what it needs (`over_allowance`)."""
    over = over_allowance(sizes, kind, f"rank {group.rank} of {group}: {label}", own=own)
    if over is not None:
        raise _refused(group, over[0], CommError(over[1]), label)


def _size(group: Group, size: int, sender: int, kind: str, label: str) -> int:
    try:
        check_size(size, sender, kind, f"rank {group.rank} of {group}: {label}")
    except CommError as e:
        raise _refused(group, sender, e, label) from None
    return size


def agree(
    group: Group,
    ranks: Sequence[int],
    fingerprint: str,
    errors: Sequence[str],
    describe: Callable[[], list[tuple[str, str]]],
    *,
    timeout: datetime.timedelta,
    what: str,
    error_type: type[Exception] = ValueError,
    failure: str = "bad input, nothing was moved",
) -> None:
    """Make every rank of `ranks` agree that all hold the same plan and no rank has an error; else raise on all.

    Wire format: fixed-size struct headers (magic with the wire version, fingerprint, status, lengths) and
    variable payloads in the JSON wire format of `reshard.comm._wire` (error strings, `[field, value]` pairs, the
    verdict text); every announced length is checked against the size limit before the receive is posted.

    Args:
        group: the group `ranks` belong to (this process is `group.rank`, one of `ranks`).
        ranks: the ranks that take part; the lowest is the root.
        fingerprint: this rank's plan fingerprint.
        errors: this rank's local error messages (empty if none).
        describe: called only when fingerprints differ: `(field, value)` string pairs saying what the plan was built
            from (layouts, topology, budgets), so the root can say what differs.
        timeout: for each wait.
        what: a label for messages ("plan handshake").
        error_type: the exception raised on every rank when something is wrong.
        failure: what the error message says happened.

    Raises:
        `error_type` on every rank, with the same message: which ranks have which plan inputs, or every rank's
        errors. `CommError` if a rank does not answer within `timeout`, or sends a malformed or oversized message
        (naming it, on every rank).
    """
    with group.exclusive(what):
        PendingAgreement(group, ranks, fingerprint, errors, describe, timeout=timeout, what=what,
                         error_type=error_type, failure=failure).finish()


class PendingAgreement:
    """`agree` in two steps: constructing it posts this rank's first messages (a non-root rank its header and the
    receive of the root's reply, the root the receives of every header) and returns; `finish()` completes the round
    (and raises as `agree` does). In between the caller may do local work that writes nothing another rank or a
    destination can see (packing from source tensors into staging). Arguments as in `agree`; construct and finish it
    inside `group.exclusive`.

    Attributes:
        is_root: whether this rank is the round's root (the lowest rank): it answers the others, so work done
            between construction and `finish` there delays every rank's verdict.
    """

    def __init__(self, group: Group, ranks: Sequence[int], fingerprint: str, errors: Sequence[str],
                 describe: Callable[[], list[tuple[str, str]]], *, timeout: datetime.timedelta, what: str,
                 error_type: type[Exception] = ValueError, failure: str = "bad input, nothing was moved") -> None:
        self.group, self.describe, self.timeout = group, describe, timeout
        self.error_type, self.failure = error_type, failure
        self.root = min(ranks)
        self.me = group.rank
        self.is_root = self.me == self.root
        self.fp = fingerprint.encode()[:_FP_BYTES].ljust(_FP_BYTES, b"\0")
        self.errors = [str(e) for e in errors]
        self.label = f"{what} (root rank {self.root})"
        self.what = what
        self.others = [r for r in sorted(set(ranks)) if r != self.me]
        if self.is_root:
            self._recvs = [(r, torch.empty(_HEADER.size, dtype=torch.uint8)) for r in self.others]
            sends: list[tuple[int, torch.Tensor]] = []
        else:
            # the header (and the errors, if any) and the receive of the root's reply, in one post: one wait
            payload = encode("errors", self.errors) if self.errors else b""
            sends = [(self.root, _to_tensor(_HEADER.pack(_MAGIC, self.fp, len(payload))))]
            if payload:
                sends.append((self.root, _to_tensor(payload)))
            self._recvs = [(self.root, torch.empty(_REPLY.size, dtype=torch.uint8))]
        # a member waits a little longer than the root, so that when a rank never joins the round, the root's
        # timeout (which names that rank) is the verdict, not a member's (which could only name the live root)
        self._handle = post(sends, self._recvs, group, tag=TAG_CONTROL,
                            timeout=timeout if self.is_root else member_timeout(timeout), what=self.label,
                            control=True)

    def finish(self) -> None:
        """Complete the round: return when every rank agrees, else raise (see `agree`)."""
        group, label = self.group, self.label
        self._handle.wait()
        got = {p: t.numpy().tobytes() for p, t in self._recvs}
        if not self.is_root:
            self._finish_member(got[self.root])
            return
        fps: dict[int, bytes] = {self.me: self.fp}
        sizes: dict[int, int] = {}
        for r in self.others:
            fps[r], size = _unpack(_HEADER, got[r], r, group, label)
            sizes[r] = _size(group, size, r, "errors", label)
        own = len(encode("errors", self.errors)) if self.errors else 0
        _allowance(group, {**sizes, self.me: own}, "errors", label)
        self._finish_root(fps, sizes)

    def _finish_member(self, reply: bytes) -> None:
        group, label, root, timeout = self.group, self.label, self.root, self.timeout
        status, size = _unpack(_REPLY, reply, root, group, label)
        if status in (_DESCRIBE, _WAIT):
            if status == _DESCRIBE:
                desc = encode("describe", [[str(k), str(v)] for k, v in self.describe()])
                _exchange(group, [(root, _LENGTH.pack(_MAGIC, len(desc))), (root, desc)], [], timeout, label)
            reply = _exchange(group, [], [(root, _REPLY.size)], timeout, label)[root]
            status, size = _unpack(_REPLY, reply, root, group, label)
        if status == _OK:
            return
        data = _exchange(group, [], [(root, _size(group, size, root, "verdict", label))], timeout, label)[root]
        message = _payload(group, data, root, "verdict", label)
        if status != _FAIL or not isinstance(message, str):
            raise _refused(group, root, CommError(f"rank {self.me} of {group}: {label}: the root sent status "
                                                  f"{status} with a {type(message).__name__} verdict"), label)
        raise self.error_type(message)

    def _finish_root(self, fps: dict[int, bytes], sizes: dict[int, int]) -> None:
        group, label, timeout, me, others = self.group, self.label, self.timeout, self.me, self.others
        blobs = _exchange(group, [], [(r, n) for r, n in sizes.items() if n], timeout, label)
        all_errors: dict[int, list[str]] = {me: self.errors} if self.errors else {}
        for r, b in blobs.items():
            if b:
                all_errors[r] = _strings(_payload(group, b, r, "errors", label), r, group, "errors", label)
        differ = [r for r in others if fps[r] != self.fp]
        message = ""
        if differ:
            _exchange(group, [(r, _REPLY.pack(_MAGIC, _DESCRIBE if r in differ else _WAIT, 0)) for r in others], [],
                      timeout, label)
            lens = _exchange(group, [], [(r, _LENGTH.size) for r in differ], timeout, label)
            want = {r: _size(group, _unpack(_LENGTH, lens[r], r, group, label)[0], r, "describe", label)
                    for r in differ}
            mine = [(str(k), str(v)) for k, v in self.describe()]
            _allowance(group, want, "describe", label, own=len(encode("describe", [list(p) for p in mine])))
            descs = _exchange(group, [], list(want.items()), timeout, label)
            theirs = {r: _pairs(_payload(group, descs[r], r, "describe", label), r, group, label) for r in differ}
            message = _describe_difference(me, mine, theirs, fps, self.what)
            if all_errors:
                message += "\n" + _describe_errors(all_errors, self.failure)
        elif all_errors:
            message = _describe_errors(all_errors, self.failure)
        data = encode("verdict", message) if message else b""
        status = _FAIL if message else _OK
        sends: list[tuple[int, bytes]] = []
        for r in others:
            sends.append((r, _REPLY.pack(_MAGIC, status, len(data))))
            if data:
                sends.append((r, data))
        _exchange(group, sends, [], timeout, label)
        if message:
            raise self.error_type(message)


def _describe_errors(all_errors: dict[int, list[str]], failure: str) -> str:
    lines = [f"{failure}: {sum(len(v) for v in all_errors.values())} error(s) on rank(s) {sorted(all_errors)}:"]
    for r in sorted(all_errors):
        lines.extend(f"  {e}" for e in all_errors[r])
    return "\n".join(lines)


def _describe_difference(root: int, mine: list[tuple[str, str]], theirs: dict[int, list[tuple[str, str]]],
                         fps: dict[int, bytes], what: str) -> str:
    def fp_str(b: bytes) -> str:
        return b.rstrip(b"\0").decode(errors="replace")[:12]

    groups: dict[bytes, list[int]] = {}
    for r, f in sorted(fps.items()):
        groups.setdefault(f, []).append(r)
    lines = [
        f"{what}: ranks hold different plans, nothing was moved (the same layouts, topology and budgets must be "
        "passed on every rank). Plan fingerprints: "
        + "; ".join(f"{fp_str(f)} on ranks {rs}" for f, rs in groups.items())
    ]
    ref = dict(mine)
    for r in sorted(theirs)[:_MAX_RANKS_SHOWN]:
        other = dict(theirs[r])
        keys = list(ref) + [k for k in other if k not in ref]
        differ = {k for k in keys if ref.get(k) != other.get(k)}
        diffs = [(k, ref.get(k, "<absent>"), other.get(k, "<absent>")) for k in keys
                 if k in differ and not (k.endswith(EXACT_SUFFIX) and k[: -len(EXACT_SUFFIX)] in differ)]
        if not diffs:
            lines.append(f"  rank {r}: same inputs as rank {root} but a different plan; do all ranks run the same "
                         "reshard and torch versions?")
            continue
        for k, a, b in diffs[:_MAX_FIELDS_SHOWN]:
            lines.append(f"  {k}: rank {root} has {a}, rank {r} has {b}")
        if len(diffs) > _MAX_FIELDS_SHOWN:
            lines.append(f"  ... and {len(diffs) - _MAX_FIELDS_SHOWN} more differences on rank {r}")
    if len(theirs) > _MAX_RANKS_SHOWN:
        lines.append(f"  ... and {len(theirs) - _MAX_RANKS_SHOWN} more ranks differ from rank {root}")
    return "\n".join(lines)


def all_gather_json(group: Group, value: Any, *, timeout: datetime.timedelta, what: str) -> list[Any]:
    """Every rank of `group` gets every rank's `value`, in rank order, over the control backend.

    `value` must be JSON-serialisable (None, bool, int, finite float, str, lists, tuples, str-keyed dicts); it
    travels in the wire format of `reshard.comm._wire`, so what comes back holds lists where tuples were sent.
    Collective: every rank of the group calls it.

    Raises:
        TypeError, ValueError: `value` is not JSON-serialisable or too large (on this rank, before any message).
        CommError: a rank did not answer within `timeout`, or announced or sent an oversized or malformed payload
            (naming it; every rank sees the same bytes, so every rank raises).
    """
    data = encode(what, value)
    with group.exclusive(what):
        group._collectives += 1
        pg = group.control
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(group.size)]
        _wait(lambda: pg.allgather([sizes], [size]), group, timeout, what)
        for r, s in enumerate(sizes):
            _size(group, int(s.item()), r, what, what)
        _allowance(group, {r: int(s.item()) for r, s in enumerate(sizes)}, what, what)
        width = max(int(s.item()) for s in sizes)
        buf = torch.zeros(width, dtype=torch.uint8)
        buf[: len(data)] = _to_tensor(data)
        bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(group.size)]
        _wait(lambda: pg.allgather([bufs], [buf]), group, timeout, what)
        return [_payload(group, b[: int(s.item())].numpy().tobytes(), r, what, what)
                for r, (b, s) in enumerate(zip(bufs, sizes))]


_DIGEST = struct.Struct(f"<I{_FP_BYTES}s")  # magic, digest (ASCII)


def all_gather_digest(group: Group, digest: str, *, timeout: datetime.timedelta, what: str) -> list[str]:
    """Every rank's `digest` (`_FP_BYTES` ASCII characters, e.g. 32 hex digits), in rank order: one fixed-size
    all-gather on the control backend (magic with the wire version + the digest), so no size round first.
    Collective: every rank of the group calls it.

    Raises:
        ValueError: `digest` is not `_FP_BYTES` ASCII characters (on this rank, before any message).
        CommError: a rank did not answer within `timeout`, or sent another magic (another reshard version) or bytes
            that are not ASCII (naming it; every rank sees the same bytes, so every rank raises).
    """
    data = digest.encode("ascii", errors="replace")
    if len(data) != _FP_BYTES or not digest.isascii():
        raise ValueError(f"{what}: the digest must be {_FP_BYTES} ASCII characters, got {digest!r}")
    with group.exclusive(what):
        group._collectives += 1
        pg = group.control
        buf = _to_tensor(_DIGEST.pack(_MAGIC, data))
        bufs = [torch.empty(_DIGEST.size, dtype=torch.uint8) for _ in range(group.size)]
        _wait(lambda: pg.allgather([bufs], [buf]), group, timeout, what)
        out = []
        for r, b in enumerate(bufs):
            (d,) = _unpack(_DIGEST, b.numpy().tobytes(), r, group, what)
            if not d.isascii():
                raise _refused(group, r, CommError(f"rank {group.rank} of {group}: {what}: rank {r} sent a digest "
                                                   f"that is not ASCII: {d!r}"), what)
            out.append(d.decode("ascii"))
        return out


def _wait(start: Callable[[], Any], group: Group, timeout: datetime.timedelta, what: str) -> None:
    """Start a collective and wait for it (watching for other ranks' fault reports); a failure to start (gloo
    refuses a connection a dead peer closed) or to finish is a `CommError` that every rank learns. After a timeout
    a roll call in the store names the ranks that never reached the collective (`Group.roll_call`)."""
    began = time.monotonic()
    try:
        wait_watched(group, lambda: start().wait(timeout), what)
    except CommError:
        raise
    except Exception as e:
        timed_out = time.monotonic() - began >= 0.9 * timeout.total_seconds()
        absent = group.roll_call() if timed_out else None
        if absent:
            raise fault(group, absent[0], f"rank {group.rank} of {group}: {what} timed out after "
                        f"{timeout.total_seconds():.1f} s: ranks {absent} never reached it (every other rank did, by "
                        "the roll call in the store); every rank of the group must call it", what) from e
        raise blame(group, None, f"rank {group.rank} of {group}: {what} failed or timed out after "
                    f"{timeout.total_seconds():.1f} s; every rank of the group must call it: {e}", what,
                    timed_out=timed_out) from e


def broadcast_bytes(group: Group, data: bytes | None, *, root: int, size: int, timeout: datetime.timedelta,
                    what: str) -> bytes:
    """`root`'s `data` (`size` bytes, announced to every rank in an earlier round) on every rank of `group`, in one
    broadcast on the control backend (gloo's, a tree over the group, not a star through one rank's links).
    Collective: every rank calls it with the same `root` and `size`; `data` is read on `root` only.

    Raises:
        ValueError: on `root`, `data` is not `size` bytes (before any message).
        CommError: `size` is over the control limit (naming `root`), or a rank did not take part within `timeout`.
    """
    if group.rank == root and (data is None or len(data) != size):
        raise ValueError(f"{what}: rank {root} has {None if data is None else len(data)} bytes to broadcast, "
                         f"announced {size}")
    _size(group, size, root, what, what)
    with group.exclusive(what):
        group._collectives += 1
        buf = _to_tensor(data) if group.rank == root else torch.empty(size, dtype=torch.uint8)
        if not size:
            return b""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        _wait(lambda: group.control.broadcast([buf], opts), group, timeout, what)
        return buf.numpy().tobytes()
