"""Agreement before and after data moves: plan fingerprints, bad-input flags, and object all-gather.

`agree` is a star exchange over the control backend among the ranks of a plan, rooted at the lowest of them: every
rank sends its plan fingerprint and its local errors, the root decides, and every rank gets the same verdict. So
when the plans differ or some rank got bad input, every rank raises the same error, and no rank hangs. Only ranks
that take part in the plan talk, so ranks of the group outside the plan need not call.

Message sizes are fixed per round (a header) with a variable payload announced by the header, so no rank ever
posts a receive of the wrong size.
"""

from __future__ import annotations

import datetime
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from reshard.comm._group import CommError, Group
from reshard.comm._transfer import TAG_CONTROL, post

_FP_BYTES = 32
_HEADER = struct.Struct(f"<{_FP_BYTES}sq")  # fingerprint, payload length
_REPLY = struct.Struct("<qq")  # status, payload length

_OK, _FAIL, _DESCRIBE, _WAIT = 0, 1, 2, 3
EXACT_SUFFIX = " (exact)"
"""A described field `NAME (exact)` repeats field `NAME` exactly; it is reported only when `NAME` itself agrees."""
_MAX_RANKS_SHOWN = 4
_MAX_FIELDS_SHOWN = 4


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

    Args:
        group: the group `ranks` belong to (this process is `group.rank`, one of `ranks`).
        ranks: the ranks that take part; the lowest is the root.
        fingerprint: this rank's plan fingerprint.
        errors: this rank's local error messages (empty if none).
        describe: called only when fingerprints differ: `(field, value)` pairs saying what the plan was built
            from (layouts, topology, budgets), so the root can say what differs.
        timeout: for each wait.
        what: a label for messages ("plan handshake").
        error_type: the exception raised on every rank when something is wrong.
        failure: what the error message says happened.

    Raises:
        `error_type` on every rank, with the same message: which ranks have which plan inputs, or every rank's
        errors. `CommError` if a rank does not answer within `timeout`.
    """
    root = min(ranks)
    me = group.rank
    fp = fingerprint.encode()[:_FP_BYTES].ljust(_FP_BYTES, b"\0")
    payload = pickle.dumps(list(errors)) if errors else b""
    label = f"{what} (root rank {root})"
    if me != root:
        _exchange(group, [(root, _HEADER.pack(fp, len(payload))), (root, payload)], [], timeout, label)
        reply = _exchange(group, [], [(root, _REPLY.size)], timeout, label)[root]
        status, size = _REPLY.unpack(reply)
        if status in (_DESCRIBE, _WAIT):
            if status == _DESCRIBE:
                desc = pickle.dumps(describe())
                _exchange(group, [(root, struct.pack("<q", len(desc))), (root, desc)], [], timeout, label)
            status, size = _REPLY.unpack(_exchange(group, [], [(root, _REPLY.size)], timeout, label)[root])
        if status == _OK:
            return
        message = _exchange(group, [], [(root, size)], timeout, label)[root].decode()
        raise error_type(message)

    others = [r for r in sorted(set(ranks)) if r != me]
    headers = _exchange(group, [], [(r, _HEADER.size) for r in others], timeout, label)
    fps: dict[int, bytes] = {me: fp}
    sizes: dict[int, int] = {}
    for r, h in headers.items():
        fps[r], sizes[r] = _HEADER.unpack(h)
    blobs = _exchange(group, [], [(r, n) for r, n in sizes.items() if n], timeout, label)
    all_errors: dict[int, list[str]] = {me: list(errors)} if errors else {}
    for r, b in blobs.items():
        if b:
            all_errors[r] = pickle.loads(b)
    differ = [r for r in others if fps[r] != fp]
    message = ""
    if differ:
        _exchange(group, [(r, _REPLY.pack(_DESCRIBE if r in differ else _WAIT, 0)) for r in others], [], timeout,
                  label)
        lens = _exchange(group, [], [(r, 8) for r in differ], timeout, label)
        descs = _exchange(group, [], [(r, struct.unpack("<q", lens[r])[0]) for r in differ], timeout, label)
        message = _describe_difference(me, describe(), {r: pickle.loads(descs[r]) for r in differ}, fps, what)
        if all_errors:
            message += "\n" + _describe_errors(all_errors, failure)
    elif all_errors:
        message = _describe_errors(all_errors, failure)
    data = message.encode()
    status = _FAIL if message else _OK
    sends: list[tuple[int, bytes]] = []
    for r in others:
        sends.append((r, _REPLY.pack(status, len(data))))
        if data:
            sends.append((r, data))
    _exchange(group, sends, [], timeout, label)
    if message:
        raise error_type(message)


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


def all_gather_object(group: Group, obj: Any, *, timeout: datetime.timedelta, what: str) -> list[Any]:
    """Every rank of `group` gets every rank's `obj` (pickled), in rank order, over the control backend.

    Collective: every rank of the group calls it.
    """
    pg = group.control
    data = pickle.dumps(obj)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(group.size)]
    _wait(lambda: pg.allgather([sizes], [size]), group, timeout, what)
    width = max(int(s.item()) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(data)] = _to_tensor(data)
    bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(group.size)]
    _wait(lambda: pg.allgather([bufs], [buf]), group, timeout, what)
    return [pickle.loads(b[: int(s.item())].numpy().tobytes()) for b, s in zip(bufs, sizes)]


def _wait(start: Callable[[], Any], group: Group, timeout: datetime.timedelta, what: str) -> None:
    """Start a collective and wait for it; a failure to start (gloo refuses a connection a dead peer closed) or to
    finish is a `CommError`."""
    try:
        start().wait(timeout)
    except Exception as e:
        raise CommError(f"rank {group.rank} of {group}: {what} failed or timed out after "
                        f"{timeout.total_seconds():.1f} s; every rank of the group must call it: {e}") from e
