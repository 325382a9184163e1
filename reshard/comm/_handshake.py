"""Agreement before and after data moves: plan fingerprints, bad-input flags, a JSON all-gather, and a byte
broadcast (`broadcast_bytes`, gloo's binomial tree: what a refit's metadata round sends once to every rank).

`agree` runs over a binomial tree of the ranks of a plan, rooted at the lowest of them (`PendingAgreement`): every
rank sends its plan fingerprint and its local errors up (a subtree's summarised), the root decides, and every rank
gets the same verdict down the tree. So
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

from reshard.comm._errors import FAULT_POLL_S
from reshard.comm._group import CommError, Group
from reshard.comm._transfer import CLOSED_GRACE_S, TAG_CONTROL, blame, fault, post, wait_watched
from reshard.comm._wire import WIRE_VERSION, check_size, decode, encode, over_allowance

_FP_BYTES = 32
_MAGIC = 0x52530000 | WIRE_VERSION  # "RS" + wire version: a peer of another version is named, not misread
_HEADER = struct.Struct(f"<I{_FP_BYTES}sq")  # magic, fingerprint, payload length
_REPLY = struct.Struct("<Iqq")  # magic, status, payload length
_LENGTH = struct.Struct("<Iq")  # magic, payload length

_OK, _FAIL, _DESCRIBE = 0, 1, 2
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


def _tree(ranks: Sequence[int], me: int) -> tuple[int | None, list[int], int, int]:
    """`me`'s place in the binomial tree over `ranks` (sorted, distinct) rooted at the lowest: `(parent or None,
    children, first, end)`, where the subtree of `me` is `ranks[first:end]` (contiguous) and `len(children)` is its
    height. Index `i`'s parent is `i` without its lowest set bit; its children are `i + 2**k` below that bit."""
    i = ranks.index(me)
    n = len(ranks)
    low = i & -i if i else 1 << n.bit_length()
    children = []
    k = 1
    while k < low and i + k < n:
        children.append(ranks[i + k])
        k <<= 1
    return (ranks[i & (i - 1)] if i else None), children, i, min(i + low, n)


def tree_grace(timeout: datetime.timedelta) -> datetime.timedelta:
    """How much longer a rank of `agree`'s tree waits for its children per level of its subtree's height: 5% of
    `timeout` (0.5 s to 10 s), so that a rank that never joins is named by its parent, whose wait ends first."""
    return datetime.timedelta(seconds=min(max(0.05 * timeout.total_seconds(), 0.5), 10.0))


def _runs(indices: Sequence[int]) -> list[list[int]]:
    """Sorted indices as `[first, end]` runs: `[0, 1, 2, 5]` -> `[[0, 3], [5, 6]]`."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


class PendingAgreement:
    """`agree` in two steps: constructing it posts this rank's first messages and returns; `finish()` completes the
    round (and raises as `agree` does). In between the caller may do local work that writes nothing another rank or
    a destination can see (packing from source tensors into staging). Arguments as in `agree`; construct and finish
    it inside `group.exclusive`.

    The round runs over a binomial tree of the ranks rooted at the lowest (`_tree`): each rank sends its parent one
    header (its fingerprint) and, only when its subtree holds another fingerprint or errors, a summary of the
    subtree (fingerprints as runs of rank indices, errors per rank); the root decides and the verdict travels back
    down. So no rank handles more than `log2(ranks)` peers' messages per round, where a star's root handled every
    rank's. When plans differ, the root asks the first few differing ranks (named in the reply) for a description
    of their plan inputs, directly.

    Attributes:
        is_root: whether this rank is the round's root (the lowest rank).
        relays: whether this rank has children in the tree (the root included): it answers or forwards for them,
            so work done between construction and `finish` there delays their verdict.
    """

    def __init__(self, group: Group, ranks: Sequence[int], fingerprint: str, errors: Sequence[str],
                 describe: Callable[[], list[tuple[str, str]]], *, timeout: datetime.timedelta, what: str,
                 error_type: type[Exception] = ValueError, failure: str = "bad input, nothing was moved") -> None:
        self.group, self.describe, self.timeout = group, describe, timeout
        self.error_type, self.failure = error_type, failure
        self.ranks = sorted(set(ranks))
        self.root = self.ranks[0]
        self.me = group.rank
        self.is_root = self.me == self.root
        self.parent, self.children, self.first, _ = _tree(self.ranks, self.me)
        # child k (`ranks[first + 2**k]`) roots `ranks[first + 2**k : first + 2**(k + 1)]`, clipped at the end
        self._spans = [(c, self.first + (1 << k), min(self.first + (2 << k), len(self.ranks)))
                       for k, c in enumerate(self.children)]
        self.relays = bool(self.children)
        self.fp = fingerprint.encode()[:_FP_BYTES].ljust(_FP_BYTES, b"\0")
        self.errors = [str(e) for e in errors]
        self.label = f"{what} (root rank {self.root})"
        self.what = what
        grace = tree_grace(timeout)
        # a rank waits for its children longer the higher its subtree, so that the lowest waiting rank, the parent
        # of one that never joined, is the one that names it; a rank waits for its parent's answer longer than the
        # root waits for all
        self._up_timeout = timeout + grace * len(self.children)
        self._down_timeout = member_timeout(timeout + grace * max(len(self.ranks) - 1, 1).bit_length())
        self._recvs = [(c, torch.empty(_HEADER.size, dtype=torch.uint8)) for c in self.children]
        sends: list[tuple[int, torch.Tensor]] = []
        if not self.children and self.parent is not None:
            # a leaf: the header (and its errors, if any) and the receive of the parent's reply, in one post
            payload = self._summary({self.fp: [self.first]}, {self.first: self.errors} if self.errors else {})
            sends = [(self.parent, _to_tensor(_HEADER.pack(_MAGIC, self.fp, len(payload))))]
            if payload:
                sends.append((self.parent, _to_tensor(payload)))
            self._recvs = [(self.parent, torch.empty(_REPLY.size, dtype=torch.uint8))]
        self._handle = post(sends, self._recvs, group, tag=TAG_CONTROL,
                            timeout=self._down_timeout if not self.children else self._up_timeout, what=self.label,
                            control=True)

    def _summary(self, fps: dict[bytes, list[int]], errors: dict[int, list[str]]) -> bytes:
        """What this rank tells its parent of its subtree: nothing when every rank holds this rank's fingerprint
        and none has errors; else `{"fps": [[fingerprint, [[first, end], ...]], ...], "errors": [[index, [...]]]}`
        (rank indices into the sorted ranks)."""
        if set(fps) == {self.fp} and not errors:
            return b""
        return encode("agreement", {
            "fps": [[f.rstrip(b"\0").decode("ascii", errors="replace"), _runs(sorted(ix))] for f, ix in fps.items()],
            "errors": [[i, e] for i, e in sorted(errors.items())]})

    def _gather(self) -> tuple[dict[bytes, list[int]], dict[int, list[str]]]:
        """Wait for the children's headers and summaries; this subtree's fingerprints (fingerprint -> rank indices)
        and errors (rank index -> messages). Raises `CommError` naming a child that sent a malformed summary."""
        group, label = self.group, self.label
        self._handle.wait()
        got = {c: t.numpy().tobytes() for c, t in self._recvs}
        heads: dict[int, tuple[bytes, int]] = {}
        for c in self.children:
            fp, size = _unpack(_HEADER, got[c], c, group, label)
            heads[c] = (fp, _size(group, size, c, "agreement", label))
        own = len(encode("errors", self.errors)) if self.errors else 0
        _allowance(group, {c: n for c, (_, n) in heads.items()}, "agreement", label, own=own)
        blobs = _exchange(group, [], [(c, n) for c, (_, n) in heads.items() if n], self._up_timeout, label)
        fps: dict[bytes, list[int]] = {self.fp: [self.first]}
        errors: dict[int, list[str]] = {self.first: self.errors} if self.errors else {}
        for c, first, end in self._spans:
            fp, size = heads[c]
            if not size:
                fps.setdefault(fp, []).extend(range(first, end))
                continue
            sub_fps, sub_errors = self._parse(blobs[c], c, first, end)
            for f, ix in sub_fps.items():
                fps.setdefault(f, []).extend(ix)
            errors.update(sub_errors)
        return fps, errors

    def _parse(self, data: bytes, child: int, first: int, end: int) -> tuple[dict[bytes, list[int]],
                                                                              dict[int, list[str]]]:
        """A child's summary, checked: its runs cover its subtree `[first, end)` exactly once, fingerprints are
        ASCII of at most `_FP_BYTES`, errors are lists of strings of ranks in the subtree."""
        group, label = self.group, self.label
        value = _payload(group, data, child, "agreement", label)

        def bad(why: str) -> CommError:
            return _refused(group, child, CommError(f"rank {self.me} of {group}: {label}: rank {child} sent a "
                                                    f"malformed agreement summary ({why})"), label)

        if not isinstance(value, dict) or set(value) != {"fps", "errors"} \
                or not isinstance(value["fps"], list) or not isinstance(value["errors"], list):
            raise bad("not {fps, errors} lists")
        fps: dict[bytes, list[int]] = {}
        seen = 0
        for entry in value["fps"]:
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[0].isascii()
                    and len(entry[0]) <= _FP_BYTES and isinstance(entry[1], list)):
                raise bad("a fingerprint entry is not [ASCII fingerprint, runs]")
            ix = fps.setdefault(entry[0].encode().ljust(_FP_BYTES, b"\0"), [])
            for run in entry[1]:
                if not (isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run)
                        and first <= run[0] < run[1] <= end):
                    raise bad(f"a run outside its subtree, ranks {self.ranks[first]}..{self.ranks[end - 1]}")
                ix.extend(range(run[0], run[1]))
                seen += run[1] - run[0]
        covered = {i for ix in fps.values() for i in ix}
        if seen != end - first or len(covered) != seen:
            raise bad("its runs do not cover its subtree exactly once")
        errors: dict[int, list[str]] = {}
        for entry in value["errors"]:
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                    and first <= entry[0] < end and entry[0] not in errors):
                raise bad("an error entry is not [rank index in its subtree, errors], once per rank")
            errors[entry[0]] = _strings(entry[1], child, group, "errors", label)
        return fps, errors

    def _send_down(self, reply: bytes, payload: bytes) -> None:
        sends = [(c, reply) for c in self.children]
        if payload:
            sends = [m for c in self.children for m in ((c, reply), (c, payload))]
        _exchange(self.group, sends, [], self.timeout, self.label)

    def _receive_down(self, reply: bytes | None = None) -> tuple[int, bytes, bytes]:
        """The parent's reply (already received, or received now) and its payload, forwarded to the children."""
        group, label, parent = self.group, self.label, self.parent
        assert parent is not None
        if reply is None:
            reply = _exchange(group, [], [(parent, _REPLY.size)], self._down_timeout, label)[parent]
        status, size = _unpack(_REPLY, reply, parent, group, label)
        data = b""
        if size:
            data = _exchange(group, [], [(parent, _size(group, size, parent, "verdict", label))], self.timeout,
                             label)[parent]
        self._send_down(reply, data)
        return status, reply, data

    def finish(self) -> None:
        """Complete the round: return when every rank agrees, else raise (see `agree`)."""
        group, label = self.group, self.label
        if self.children:
            fps, errors = self._gather()
            if not self.is_root:
                payload = self._summary(fps, errors)
                assert self.parent is not None
                _exchange(group, [(self.parent, _HEADER.pack(_MAGIC, self.fp, len(payload))), (self.parent, payload)],
                          [], self.timeout, label)
                self._finish_member(None)
                return
            self._finish_root(fps, errors)
            return
        if self.parent is None:  # alone
            if self.errors:
                raise self.error_type(_describe_errors({self.me: self.errors}, self.failure))
            return
        self._handle.wait()
        self._finish_member(self._recvs[0][1].numpy().tobytes())

    def _finish_member(self, reply: bytes | None) -> None:
        group, label, root, timeout = self.group, self.label, self.root, self.timeout
        status, _, data = self._receive_down(reply)
        if status == _DESCRIBE:
            asked = _payload(group, data, self.parent, "describers", label) if data else []
            if not (isinstance(asked, list) and all(type(r) is int for r in asked)):
                raise _refused(group, self.parent, CommError(f"rank {self.me} of {group}: {label}: rank "
                                                             f"{self.parent} forwarded a malformed list of ranks"),
                               label)
            if self.me in asked:
                desc = encode("describe", [[str(k), str(v)] for k, v in self.describe()])
                _exchange(group, [(root, _LENGTH.pack(_MAGIC, len(desc))), (root, desc)], [], timeout, label)
            status, _, data = self._receive_down()
        if status == _OK:
            if self.errors:  # only a relaying rank that dropped them can say so: act on what this rank knows
                raise self.error_type(_describe_errors({self.me: self.errors}, self.failure) + "\n  (the agreement "
                                      f"reached rank {self.me} as 'every rank agreed', which its own errors "
                                      "contradict: a rank between it and the root lost them)")
            return
        message = _payload(group, data, self.parent, "verdict", label)
        if status != _FAIL or not isinstance(message, str):
            raise _refused(group, self.parent, CommError(f"rank {self.me} of {group}: {label}: rank {self.parent} "
                                                         f"sent status {status} with a {type(message).__name__} "
                                                         "verdict"), label)
        raise self.error_type(message)

    def _finish_root(self, index_fps: dict[bytes, list[int]], index_errors: dict[int, list[str]]) -> None:
        group, label, timeout, me = self.group, self.label, self.timeout, self.me
        ranks = self.ranks
        fps = {ranks[i]: f for f, ix in index_fps.items() for i in ix}
        all_errors = {ranks[i]: e for i, e in index_errors.items()}
        differ = [r for r in ranks if fps[r] != self.fp]
        message = ""
        if differ:
            asked = differ[:_MAX_RANKS_SHOWN]  # the ranks whose plan inputs the verdict shows
            names = encode("describers", asked)
            self._send_down(_REPLY.pack(_MAGIC, _DESCRIBE, len(names)), names)
            lens = _exchange(group, [], [(r, _LENGTH.size) for r in asked], timeout, label)
            want = {r: _size(group, _unpack(_LENGTH, lens[r], r, group, label)[0], r, "describe", label)
                    for r in asked}
            mine = [(str(k), str(v)) for k, v in self.describe()]
            _allowance(group, want, "describe", label, own=len(encode("describe", [list(p) for p in mine])))
            descs = _exchange(group, [], list(want.items()), timeout, label)
            theirs = {r: _pairs(_payload(group, descs[r], r, "describe", label), r, group, label) for r in asked}
            message = _describe_difference(me, mine, theirs, fps, self.what, differing=len(differ))
            if all_errors:
                message += "\n" + _describe_errors(all_errors, self.failure)
        elif all_errors:
            message = _describe_errors(all_errors, self.failure)
        data = encode("verdict", message) if message else b""
        self._send_down(_REPLY.pack(_MAGIC, _FAIL if message else _OK, len(data)), data)
        if message:
            raise self.error_type(message)


def _describe_errors(all_errors: dict[int, list[str]], failure: str) -> str:
    lines = [f"{failure}: {sum(len(v) for v in all_errors.values())} error(s) on rank(s) {sorted(all_errors)}:"]
    for r in sorted(all_errors):
        lines.extend(f"  {e}" for e in all_errors[r])
    return "\n".join(lines)


def _describe_difference(root: int, mine: list[tuple[str, str]], theirs: dict[int, list[tuple[str, str]]],
                         fps: dict[int, bytes], what: str, *, differing: int | None = None) -> str:
    """The verdict when plans differ: the fingerprints and the ranks holding each, then what differs between the
    root's inputs and each described rank's (`theirs`: the first differing ranks; `differing`: how many differ)."""
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
    total = len(theirs) if differing is None else differing
    if total > _MAX_RANKS_SHOWN:
        lines.append(f"  ... and {total - _MAX_RANKS_SHOWN} more ranks differ from rank {root}")
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
        group.arrive()
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
        group.arrive()
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
        # also when gloo failed early (a rank that exited without calling it closed its connections), unless a
        # peer's verdict says why it left (a rank that raised before calling it): `blame` then gives that
        absent = group.roll_call() if timed_out or not _peer_verdict(group) else None
        if absent:
            how = f"timed out after {timeout.total_seconds():.1f} s" if timed_out else "failed"
            raise fault(group, absent[0], f"rank {group.rank} of {group}: {what} {how}: ranks {absent} never reached "
                        "it (every other rank did, by the roll call in the store); every rank of the group must call "
                        "it", what) from e
        raise blame(group, None, f"rank {group.rank} of {group}: {what} failed or timed out after "
                    f"{timeout.total_seconds():.1f} s; every rank of the group must call it: {e}", what,
                    timed_out=timed_out) from e


def _peer_verdict(group: Group) -> bool:
    """Whether some rank reports a fault within `CLOSED_GRACE_S` (a closed connection is often its consequence)."""
    deadline = time.monotonic() + CLOSED_GRACE_S
    while getattr(group, "_verdicts", None) is not None and time.monotonic() < deadline:
        if group.fault(store_grace=float("inf")) is not None:
            return True
        time.sleep(FAULT_POLL_S / 2)
    return False


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
        group.arrive()
        buf = _to_tensor(data) if group.rank == root else torch.empty(size, dtype=torch.uint8)
        if not size:
            return b""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        _wait(lambda: group.control.broadcast([buf], opts), group, timeout, what)
        return buf.numpy().tobytes()
