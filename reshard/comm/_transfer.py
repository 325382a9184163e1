"""`transfer`: post the sends and receives of one step together and return a handle with `wait()`.

With `reshard.kernels.pack` / `unpack`, this is the third primitive a user needs to build their own pipeline:
pack boxes into a buffer per peer, `transfer` the buffers, unpack on arrival.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from reshard.comm._devices import follows_nccl
from reshard.comm._errors import FAULT_POLL_S, CommError
from reshard.comm._group import Group, Timeout, as_timedelta

logger = logging.getLogger(__name__)

TAG_DATA = 1
"""Tag of staging-buffer messages. Matching per (peer, tag) is first-in first-out, and both ends of a pair post
their messages in the same order ((chunk, peer) in a `Plan`; the pair's batches in a rank-local plan), so equal tags
never mismatch."""
TAG_CHECKSUM = 2
TAG_CONTROL = 3

CLOSED_GRACE_S = 0.5
"""How long a rank that saw a peer's connection close waits for that peer's own verdict before it writes one naming
the peer: gloo closes every connection of a rank whose wait timed out, so the peers of a rank that timed out waiting
for an absent rank see closed connections first, and the verdict must name the absent rank, not the one that
noticed."""

STALL_CALL_S = 1.0
"""How long a rank whose NCCL-style batch timed out waits for its peers' own stall reports before it names the first
peer that sent none (its peers' deadlines end about when its own does)."""


def closed_by_peer(error: BaseException) -> bool:
    """Whether gloo's `error` says the peer closed the connection (it failed or gave up, maybe on its own timeout:
    evidence about the peer, not this rank's timeout, however long this rank waited)."""
    text = str(error)
    return "Connection closed by peer" in text or "Connection reset by peer" in text


def blame(group: Group, failed: int | None, message: str, what: str, *, timed_out: bool) -> CommError:
    """`fault`, after waiting up to `CLOSED_GRACE_S` for another rank's verdict unless this rank's own wait timed
    out (a timeout is this rank's evidence; a closed connection may be the consequence of the peer's timeout)."""
    if not timed_out and getattr(group, "_verdicts", None) is not None:
        deadline = time.monotonic() + CLOSED_GRACE_S
        while time.monotonic() < deadline:
            verdict = group.fault(store_grace=float("inf"))
            if verdict is not None:
                return CommError(f"{group.describe_fault(verdict, what)}\n  (here: {message})")
            time.sleep(FAULT_POLL_S / 2)
    return fault(group, failed, message, what)


def fault(group: Group, failed: int | None, message: str, what: str) -> CommError:
    """The `CommError` to raise when this rank saw rank `failed` fail: records the verdict for every rank.

    If another rank reported first, the error gives that verdict (the root cause) and this rank's observation.
    """
    report = getattr(group, "report_fault", None)
    if report is None:
        return CommError(message)
    verdict = report(failed, message)
    if verdict["observer"] == group.rank and verdict["message"] == message[:4000]:
        return CommError(message)
    return CommError(f"{group.describe_fault(verdict, what)}\n  (here: {message})")


def wait_watched(group: Group, block: Callable[[], None], what: str) -> None:
    """Run `block` (waits on gloo work) while checking every `FAULT_POLL_S` whether a rank reported a fault.

    `block` runs on the group's waiter thread (a daemon, started on first use), so a verdict from another rank ends
    this rank's wait at once; the abandoned wait then ends at its own timeout, on a group that is aborted anyway.

    A `Group.close` from another thread (an engine dropping a stage in flight) ends the wait too, within
    `FAULT_POLL_S`: gloo's shutdown does not always end a pending receive, and the closing thread waits for this one.

    Raises:
        CommError: with the group's verdict, when some rank reported a fault before `block` finished; or the group
            was closed before or while waiting.
    """
    if getattr(group, "_closed", False):
        raise CommError(f"{what}: {group} was closed; rendezvous a new group")
    if getattr(group, "_store", None) is None:
        block()
        return
    done = threading.Event()
    error: list[BaseException] = []
    _waiter(group).put((block, done, error))
    while not done.wait(FAULT_POLL_S):
        if group._closed:
            raise CommError(f"{what}: {group} was closed while this rank waited (its wait is abandoned)")
        verdict = group.fault()
        if verdict is not None:
            raise CommError(group.describe_fault(verdict, what))
    if error:
        raise error[0]


def _waiter(group: Group) -> queue.SimpleQueue:
    """The queue of `group`'s waiter thread, which runs `(block, done, error)` jobs one after another."""
    with group._state:
        jobs = group._waiter
        if jobs is None:
            jobs = group._waiter = queue.SimpleQueue()
            threading.Thread(target=_wait_loop, args=(jobs,), name=f"reshard-wait-{group.rank}", daemon=True).start()
    return jobs


def _wait_loop(jobs: queue.SimpleQueue) -> None:
    """Run the jobs of `jobs` until a `None`. Between jobs the thread holds no reference to the last one: a job's
    `block` holds the group's backends, and a closed group's last reference dropped here at interpreter exit would
    run a gloo destructor on a daemon thread that Python is stopping (`std::terminate`, SIGABRT)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        block, done, error = job
        del job
        try:
            block()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            error.append(e)
        finally:
            del block
            done.set()
            del done, error


TensorMap = Mapping[int, "torch.Tensor | Sequence[torch.Tensor]"]


def _as_list(value: torch.Tensor | Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    out = list(value)
    for t in out:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"transfer: {what} must be tensors, got {type(t).__name__}")
    return out


class TransferHandle:
    """The sends and receives of one `transfer` call, in flight.

    Runtime contract: until `wait()` returns, do not write a tensor being sent nor read one being received. A
    handle from `transfer` holds its group's call slot until `wait()` returns (see `Group`: one call at a time). On
    CPU (gloo), `wait()` blocks until every operation completed, at most `timeout` in all, and raises `CommError`
    naming the peer if one failed or did not answer. On an NCCL-style backend (NCCL, or `reshard_nccl_rules` in
    tests), whose waits never end on their own when a peer died, `wait()` polls the batch's completion (CUDA
    events) under the same deadline, watching the group's fault verdicts; on a timeout or a verdict it aborts the
    communicator (the process survives; the group is unusable) and raises `CommError` naming the culprit. Then, on
    CUDA, the current stream is ordered after the transfers. `order_stream()` does only that last step (no host
    wait), for a pipeline that waits for completion later.
    """

    def __init__(self, works: list[tuple[str, int, Any]], group: Group, timeout: datetime.timedelta,
                 what: str, device_type: str = "cpu", *, pg: Any = None, peers: Sequence[int] = ()) -> None:
        self._works = works
        self._group = group
        self._timeout = timeout
        self._what = what
        self._device_type = device_type
        self._pg = pg if pg is not None and follows_nccl(pg) else None  # an NCCL-style backend: poll, abort
        self._peers = sorted(set(peers))
        self._done = not works
        self._release: Callable[[], Any] | None = None  # ends the group call `transfer` started

    def _finish(self) -> None:
        self._done = True
        release, self._release = self._release, None
        if release is not None:
            release()

    def wait(self, timeout: Timeout | None = None) -> None:
        """Complete every send and receive (see the class docstring).

        Raises:
            CommError: a peer died, failed or did not answer within `timeout` (default: the one given to
                `transfer`).
        """
        if self._done:
            return
        if self._pg is not None:
            try:
                wait_completed(self, as_timedelta(timeout, default=self._timeout))
                self.order_stream()
            finally:
                self._finish()
            return
        limit = as_timedelta(timeout, default=self._timeout)
        start = time.monotonic()
        deadline = start + limit.total_seconds()
        failure: list[tuple[str, int, BaseException]] = []

        def wait_all() -> None:
            for kind, peer, work in self._works:
                remaining = max(deadline - time.monotonic(), 0.001)
                try:
                    work.wait(datetime.timedelta(seconds=remaining))
                except Exception as e:  # gloo raises RuntimeError for timeouts and closed connections
                    failure.append((kind, peer, e))
                    return

        try:
            wait_watched(self._group, wait_all, self._what)
        finally:
            self._finish()
        if failure:
            kind, peer, e = failure[0]
            waited = time.monotonic() - start
            message = (f"rank {self._group.rank} of {self._group}: {self._what}: {kind} rank {peer} failed after "
                       f"{waited:.1f} s (timeout {limit.total_seconds():.1f} s); the peer died, is stuck, or ranks run "
                       f"different plans: {e}")
            raise blame(self._group, peer, message, self._what,
                        timed_out=waited >= 0.9 * limit.total_seconds() and not closed_by_peer(e)) from e

    def is_completed(self) -> bool:
        """True when `wait()` would not block (every operation finished or failed)."""
        if self._done and self._pg is None:
            return True
        return all(w.is_completed() for _, _, w in self._works)

    def order_stream(self) -> None:
        """CUDA: make the current stream wait for the transfers (no host wait); nothing elsewhere."""
        if self._device_type == "cuda":
            for _, _, work in self._works:
                work.wait()  # NCCL: a stream wait (a timeout argument would make NCCL block the host)


def wait_completed(handle: TransferHandle, limit: datetime.timedelta) -> None:
    """Poll `handle`'s NCCL-style works until all completed, within `limit`, watching the group's verdicts.

    Raises:
        CommError: the deadline passed (naming the peer that did not reach its side of the batch), another rank
            reported a fault, the group was closed, or a work failed; the communicator is then aborted.
    """
    group, what = handle._group, handle._what
    start = time.monotonic()
    deadline = start + limit.total_seconds()
    next_check = start + FAULT_POLL_S
    pause = 0.0005
    while not all(w.is_completed() for _, _, w in handle._works):
        now = time.monotonic()
        if getattr(group, "_closed", False):
            _abort(handle)
            raise CommError(f"{what}: {group} was closed while this rank waited")
        if now >= next_check:
            next_check = now + FAULT_POLL_S
            verdict = group.fault() if getattr(group, "_verdicts", None) is not None else None
            if verdict is not None:
                _abort(handle)
                raise CommError(group.describe_fault(verdict, what))
        if now >= deadline:
            _abort(handle)
            culprit = _stalled_peer(group, handle._peers)
            who = f"rank {culprit}" if culprit is not None else "a peer"
            message = (f"rank {group.rank} of {group}: {what}: the batch with ranks {handle._peers} did not complete "
                       f"within {limit.total_seconds():.1f} s: {who} did not take part (it died, is stuck, or ranks "
                       "run different plans); the communicator was aborted")
            raise fault(group, culprit, message, what)
        time.sleep(pause)
        pause = min(pause * 2, FAULT_POLL_S / 4)
    errors = [(peer, w.exception()) for _, peer, w in handle._works if callable(getattr(w, "exception", None))]
    failed = [(peer, e) for peer, e in errors if e is not None]
    if failed:
        _abort(handle)
        peer, e = failed[0]
        raise fault(group, None, f"rank {group.rank} of {group}: {what}: the batch with ranks {handle._peers} "
                    f"failed: {e}", what)


def _abort(handle: TransferHandle) -> None:
    """Abort the NCCL-style communicator of `handle` (its pending operations can never complete otherwise)."""
    abort = getattr(handle._pg, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception:  # noqa: BLE001 - a communicator already broken may refuse; the group is aborted anyway
        logger.debug("abort failed", exc_info=True)


def _stalled_peer(group: Group, peers: Sequence[int]) -> int | None:
    """After this rank's batch timed out: the lowest of `peers` (else of the group's ranks) that did not report
    a stall of its own within `STALL_CALL_S` (a rank that died or never posted its side), or None when every one
    did or the store cannot tell."""
    store = getattr(group, "_store", None)
    if store is None:
        return peers[0] if len(peers) == 1 else None
    try:
        store.set(f"stalled/{group.rank}", b"1")
        end = time.monotonic() + STALL_CALL_S
        while True:
            missing = [r for r in range(group.size) if r != group.rank and not store.check([f"stalled/{r}"])]
            if not missing or time.monotonic() > end:
                break
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store is gone: it cannot tell
        return None
    return next((p for p in peers if p in missing), missing[0] if missing else None)


def joined(handles: Sequence[TransferHandle], group: Group, timeout: datetime.timedelta, what: str) -> TransferHandle:
    """One handle over the operations of several `post` calls on one device: one `wait()` completes them all (in
    the order they were posted), with one timeout for all."""
    works = [w for h in handles for w in h._works]
    device_type = next((h._device_type for h in handles if h._works), "cpu")
    pg = next((h._pg for h in handles if h._pg is not None), None)
    return TransferHandle(works, group, timeout, what, device_type, pg=pg, peers=[p for h in handles for p in h._peers])


def post(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: Group,
    *,
    tag: int = TAG_DATA,
    timeout: datetime.timedelta | None = None,
    what: str = "transfer",
    control: bool = False,
) -> TransferHandle:
    """Post `(peer, tensor)` sends and receives on `group`'s data backend for their device (or, with `control`,
    on its gloo control backend); no argument checks.

    Peers must differ from `group.rank`. All operations of one call are posted together: on NCCL inside one
    coalesced group (so a pair that sends both ways cannot block), on gloo one after another (gloo progresses
    them in the background).
    """
    works: list[tuple[str, int, Any]] = []
    dev = torch.device("cpu")
    pg: Any = None
    if sends or recvs:
        dev = (sends[0][1] if sends else recvs[0][1]).device
        pg = group.control if control else group.data_backend(dev)
        coalesce = follows_nccl(pg)
        if coalesce:
            pg._start_coalescing(dev)
        kind, peer = "", -1
        try:
            for peer, t in recvs:
                kind = "receive from"
                works.append((kind, peer, pg.recv([t], peer, tag)))
            for peer, t in sends:
                kind = "send to"
                works.append((kind, peer, pg.send([t], peer, tag)))
        except RuntimeError as e:  # gloo refuses to post on a connection a dead peer closed
            raise blame(group, peer, f"rank {group.rank} of {group}: {what}: cannot post {kind} rank {peer}; the peer "
                        f"died or closed its connection (rank {peer} failed after closing it): {e}", what,
                        timed_out=False) from e
        finally:
            if coalesce:
                work = pg._end_coalescing(dev)
                works = [("transfer with", -1, work)] if work is not None else works
    return TransferHandle(works, group, timeout if timeout is not None else group.timeout, what, dev.type,
                          pg=None if control else pg, peers=[p for p, _ in (*sends, *recvs)])


def transfer(
    sends: TensorMap,
    recvs: TensorMap,
    group: Group | None = None,
    *,
    timeout: Timeout | None = None,
) -> TransferHandle:
    """Post all sends and receives of one step together and return a handle with `wait()`.

    Args:
        sends: peer rank -> tensor (or list of tensors) to send to it, in order.
        recvs: peer rank -> tensor (or list) to receive into. For every pair of ranks, the sender's list for the
            receiver and the receiver's list for the sender must have the same length and sizes, in the same order.
        group: the group whose ranks the peers are; default `Group.world()`.
        timeout: seconds or a `timedelta` for `wait()`; default the group's.

    A rank listed as its own peer is a local copy, never a message: `sends[rank][i]` is copied into
    `recvs[rank][i]`.

    Returns:
        A `TransferHandle`; call `wait()` before touching the tensors.

    Example (each of two ranks swaps a buffer with the other):
        >>> handle = transfer({1 - rank: out}, {1 - rank: inp}, group)
        >>> handle.wait()
    """
    group = group if group is not None else Group.world()
    td = as_timedelta(timeout, default=group.timeout)
    send_list: list[tuple[int, torch.Tensor]] = []
    recv_list: list[tuple[int, torch.Tensor]] = []
    self_sends: list[torch.Tensor] = []
    self_recvs: list[torch.Tensor] = []
    devices: set[torch.device] = set()
    for what, mapping, out, mine in (("sends", sends, send_list, self_sends), ("recvs", recvs, recv_list, self_recvs)):
        for peer in sorted(mapping):
            if isinstance(peer, bool) or not isinstance(peer, int):
                raise ValueError(f"transfer: {what} keys must be integer ranks, got {peer!r}")
            group.check_rank(peer, f"transfer: {what}")
            for t in _as_list(mapping[peer], what):
                devices.add(t.device)
                if peer == group.rank:
                    mine.append(t)
                elif what == "recvs" or t.is_contiguous():
                    out.append((peer, t))
                else:
                    out.append((peer, t.contiguous()))  # a send may be any view: send a contiguous copy
    if len(devices) > 1:
        raise ValueError(f"transfer: all tensors must be on one device, got {sorted(map(str, devices))}")
    for peer, t in recv_list:
        if not t.is_contiguous():
            raise ValueError(f"transfer: the tensor received from rank {peer} must be contiguous")
    if len(self_sends) != len(self_recvs) or any(a.shape != b.shape for a, b in zip(self_sends, self_recvs)):
        raise ValueError(f"transfer: rank {group.rank} sends itself {[tuple(t.shape) for t in self_sends]} but "
                         f"receives {[tuple(t.shape) for t in self_recvs]}; a transfer to yourself is a local copy "
                         "and needs matching tensors")
    guard = group.exclusive("transfer")  # held until the handle's wait() returns (see Group: one call at a time)
    guard.__enter__()
    try:
        for a, b in zip(self_sends, self_recvs):
            b.copy_(a)
        logger.debug("rank %d: transfer posts %d sends, %d receives", group.rank, len(send_list), len(recv_list))
        handle = post(send_list, recv_list, group, timeout=td, what="transfer")
    except BaseException as e:
        guard.__exit__(type(e), e, e.__traceback__)
        raise
    handle._release = lambda: guard.__exit__(None, None, None)
    if handle._done:
        handle._finish()
    return handle
