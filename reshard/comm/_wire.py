"""The wire format of control messages: versioned JSON with a size limit, never code.

Every control message that carries a variable payload (error lists, plan descriptions, object all-gathers,
rendezvous claims, fault reports) is the UTF-8 JSON text of `{"v": WIRE_VERSION, "kind": KIND, "data": VALUE}`,
where `VALUE` is built from `None`, `bool`, `int`, `float` (finite), `str`, lists and string-keyed dicts. Tuples are
sent as lists. Decoding is `json.loads` and a structural check: a peer's bytes are never deserialised as objects,
evaluated or loaded as tensors, so a member of a group cannot make another member run code. A payload that is
larger than `MAX_MESSAGE_BYTES`, is not valid UTF-8 JSON, has another version or kind, or nests deeper than
`MAX_DEPTH` is a `CommError` naming the sender.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from reshard.comm._errors import CommError

WIRE_VERSION = 3
"""Version of the control-message format; peers with another version are refused. 2: `reshard_dtensor`'s layout
digests travel in one fixed-size all-gather (magic + digest) instead of a size and a JSON payload. 3: rendezvous
claims say (signed) whether their rank hosts the store, fault verdicts carry the job token's MAC, refit metadata
carries the refit's identity."""

MAX_MESSAGE_BYTES = 64 << 20
"""The largest control payload a rank accepts from a peer (64 MiB); larger announced sizes are refused unread."""

MAX_CONTROL_TOTAL_BYTES = 64 << 20
"""What one control call may make a rank hold of its peers' payloads in all (64 MiB), whatever the group's size, when
no payload of the call's other ranks is larger (see `control_allowance`)."""

CONTROL_SLACK = 4
"""A payload may be this many times the next-largest one of its call (or the receiver's own) however large."""

MAX_DEPTH = 32
"""The deepest nesting of lists and dicts accepted in a payload."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} is not allowed")


def _check(value: Any, depth: int, path: str) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{path}: nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path}: non-finite float {value!r}")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check(v, depth + 1, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: dict keys must be str, got {type(k).__name__} {k!r}")
            _check(v, depth + 1, f"{path}[{k!r}]")
        return
    raise TypeError(f"{path}: {type(value).__name__} is not JSON-serialisable (use None, bool, int, float, str, "
                    "lists, tuples and str-keyed dicts)")


def encode(kind: str, value: Any) -> bytes:
    """`value` as a control message of `kind`.

    Raises:
        TypeError: `value` holds something other than JSON values (a tuple is sent as a list).
        ValueError: a non-finite float, nesting deeper than `MAX_DEPTH`, or more than `MAX_MESSAGE_BYTES`.
    """
    _check(value, 0, kind)
    data = json.dumps({"v": WIRE_VERSION, "kind": kind, "data": value}, separators=(",", ":"),
                      allow_nan=False).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{kind}: control message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    return data


def check_size(size: int, sender: int, kind: str, receiver: str) -> None:
    """Refuse an announced payload size before receiving it.

    Raises:
        CommError: naming `sender`, when `size` is negative or over `MAX_MESSAGE_BYTES`.
    """
    if not 0 <= size <= MAX_MESSAGE_BYTES:
        raise CommError(f"{receiver}: rank {sender} announced a {kind} message of {size} bytes; the limit is "
                        f"{MAX_MESSAGE_BYTES} (a malformed or hostile message was refused unread)")


def control_allowance(sizes: Sequence[int], *, own: int = 0) -> int:
    """The largest payload any one rank may announce in a control call whose ranks announced `sizes`.

    One peer cannot make the others hold more than the call needs: a payload is accepted when it is at most
    `CONTROL_SLACK` times the next-largest size announced in the call (or `own`, what the receiver itself sends or
    holds of the same kind), or when the call's payloads fit `MAX_CONTROL_TOTAL_BYTES` in all; never above
    `MAX_MESSAGE_BYTES`. So what the honest ranks need sets the bound, a single padded payload is refused, and the
    memory a call takes grows with the group's size only as far as the honest payloads do.

    Example: four ranks announce `[3_000, 2_500, 20 << 20, 2_800]` bytes: the allowance is
    `max(64 MiB // 4, 4 * 3_000) = 16 MiB`, so the 20 MiB payload is refused.
    """
    ranked = sorted((int(s) for s in sizes), reverse=True)
    second = ranked[1] if len(ranked) > 1 else 0
    floor = MAX_CONTROL_TOTAL_BYTES // max(len(ranked), 1)
    return min(MAX_MESSAGE_BYTES, max(floor, CONTROL_SLACK * max(second, own)))


def over_allowance(sizes: dict[int, int], kind: str, receiver: str, *, own: int = 0) -> tuple[int, str] | None:
    """`(sender, message)` when the announced `sizes` (rank -> bytes) of a control call exceed `control_allowance`,
    naming the rank that announced the most; None when they fit."""
    if not sizes:
        return None
    allowed = control_allowance(list(sizes.values()), own=own)
    sender = max(sorted(sizes), key=lambda r: sizes[r])
    if sizes[sender] <= allowed:
        return None
    return sender, (f"{receiver}: rank {sender} announced a {kind} message of {sizes[sender]} bytes; this call "
                    f"allows at most {allowed} bytes per rank ({CONTROL_SLACK} x the next-largest payload, or "
                    f"{MAX_CONTROL_TOTAL_BYTES} bytes over the call's {len(sizes)} ranks): control metadata is "
                    "bounded per call, and the message was refused unread")


def decode(data: bytes, sender: int, kind: str, receiver: str) -> Any:
    """The value of a control message of `kind` from rank `sender` (`receiver` labels the error).

    Raises:
        CommError: naming `sender`, when the message is oversized, malformed, or of another version or kind.
    """
    check_size(len(data), sender, kind, receiver)
    try:
        msg = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        head = bytes(data[:16])
        raise CommError(f"{receiver}: rank {sender} sent a malformed {kind} message ({len(data)} bytes starting "
                        f"{head!r}): not UTF-8 JSON ({e}); it was not decoded further") from None
    if not isinstance(msg, dict) or set(msg) != {"v", "kind", "data"}:
        raise CommError(f"{receiver}: rank {sender} sent a malformed {kind} message: expected an object with keys "
                        f"v, kind, data")
    if msg["v"] != WIRE_VERSION:
        raise CommError(f"{receiver}: rank {sender} speaks control-message version {msg['v']!r}, this rank "
                        f"{WIRE_VERSION}; run the same reshard version on every rank")
    if msg["kind"] != kind:
        raise CommError(f"{receiver}: rank {sender} sent a {msg['kind']!r} message where {kind!r} was expected")
    try:
        _check(msg["data"], 0, kind)
    except (TypeError, ValueError) as e:
        raise CommError(f"{receiver}: rank {sender} sent a malformed {kind} message: {e}") from None
    return msg["data"]


def expect(value: Any, types: type | tuple[type, ...], sender: int, what: str, receiver: str) -> Any:
    """`value` if it is an instance of `types` (bools are not ints), else a `CommError` naming `sender`."""
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in (
        types if isinstance(types, tuple) else (types,)))
    if not ok:
        raise CommError(f"{receiver}: rank {sender} sent a malformed message: {what} is {type(value).__name__} "
                        f"{str(value)[:80]!r}")
    return value
