"""`reshard_nccl_rules`: a process-group backend for tests whose CPU ranks obey NCCL's contract where it differs
from gloo's, so the code path CUDA tensors take (coalesced batches, eager connect, completion seen like an event,
abort) runs, and is tested, on machines without GPUs.

The rules (NCCL's documented behaviour; gloo differs on each):

1. *Lazy communicator.* Until a rank is eagerly connected (`eager_connect_single_device`), its first operation
   creates the communicator, and that blocks until every rank of the group has joined it (posted an operation or
   connected eagerly). A rank that never posts stalls its peers.
2. *Asynchronous completion.* `send` / `recv` (alone or in a `_start_coalescing` / `_end_coalescing` batch) return
   at once; the bytes move later on the backend's own thread. `Work.wait()` does not block the host (on CUDA it
   only orders the current stream); completion is observed with `Work.is_completed()` (an event query) or
   `Work.synchronize()` (an event synchronize, no deadline). A receive buffer holds `POISON` bytes until its batch
   completed, so code that reads it early reads garbage; a send buffer written between posting and completion is
   detected (`Work.exception()`, `violations()`).
3. *Sizes not checked.* A send of `n` bytes matched with a receive of `m` bytes moves `min(n, m)` bytes, silently.
4. *One rank per device.* Each rank binds a device id (`set_device`, like `torch.cuda.set_device`, or the device
   given to `eager_connect_single_device`); two ranks on one id fail the communicator's creation ("Duplicate GPU").
5. *A dead peer stalls.* An operation whose peer died never completes and never raises; only the caller's own
   deadline (and `abort()`) ends the wait.

The bytes travel over an inner gloo group on the same store, created when the communicator is.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKEND = "reshard_nccl_rules"
"""The name the backend is registered under (`torch.distributed.Backend.register_backend`)."""

POISON = 0xFF
"""The byte a receive buffer holds from posting until its batch completed (NCCL leaves it undefined)."""

DELAY_ENV = "RESHARD_NCCL_RULES_DELAY_S"
"""Seconds each batch lingers before it completes (default 0.005), so code that does not wait reads poison."""

_state: dict[str, Any] = {"device": 0, "violations": []}


def set_device(index: int) -> None:
    """This process's current device id for the backend (what `torch.cuda.set_device` is to NCCL); default 0."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"set_device: index must be a non-negative int, got {index!r}")
    _state["device"] = index


def current_device() -> torch.device:
    """`torch.device("cpu", <current device id>)`."""
    return torch.device("cpu", _state["device"])


def violations() -> list[str]:
    """Every rule break this process's backends detected (a send buffer written before its batch completed)."""
    return list(_state["violations"])


def _digest(t: torch.Tensor) -> bytes:
    return hashlib.blake2b(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
                           digest_size=16).digest()


class RulesWork(dist.Work):
    """One operation or batch of a `NcclRulesGroup`; see the module docstring (rule 2)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self._done = threading.Event()
        self._error: BaseException | None = None

    def is_completed(self) -> bool:
        """Like a CUDA event query: True once the bytes moved (or the batch broke a rule)."""
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Returns at once, as NCCL's does on CUDA (a stream wait, not a host wait); raises a rule break already
        detected."""
        if self._error is not None:
            raise RuntimeError(str(self._error))
        return True

    def synchronize(self) -> None:
        """Block the host until the batch completed, with no deadline (an event synchronize)."""
        self._done.wait()

    def exception(self) -> BaseException | None:
        return self._error

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error or self._error
        self._done.set()


class NcclRulesGroup(dist.ProcessGroup):
    """A process group over CPU tensors that obeys NCCL's contract (module docstring); point-to-point only.

    `nccl_rules = True` tells reshard to take the CUDA code path (coalesced batches, eager connect, completion
    polled under its own deadline, abort) on this backend's CPU tensors.
    """

    nccl_rules = True

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, *,
                 delay_s: float | None = None) -> None:
        super().__init__(rank, size)
        self._store = store
        self._rank, self._size = rank, size
        self._timeout = timeout
        self._inner: Any = None
        self._connect_lock = threading.Lock()
        self._device: int | None = None
        self._batch: list[tuple[str, int, torch.Tensor, int, RulesWork]] | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._aborted = False
        self.num_posted = 0
        """Sends and receives posted on this rank so far."""
        self._delay = float(os.environ.get(DELAY_ENV, "0.005")) if delay_s is None else delay_s
        self._thread = threading.Thread(target=self._run, name=f"nccl-rules-{rank}", daemon=True)
        self._thread.start()

    # -- NCCL's API as reshard uses it ------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def current_device(self) -> torch.device:
        """The device this rank is bound to, else the process's current one (`set_device`)."""
        return torch.device("cpu", self._device if self._device is not None else _state["device"])

    def eager_connect_single_device(self, device: torch.device | None) -> None:
        """Bind `device` (its index; None: the current device) and create the communicator now: blocks until every
        rank joined, raises like NCCL's init when two ranks share a device id or the group's timeout passes."""
        self._device = device.index if device is not None and device.index is not None else _state["device"]
        self._connect()

    def _start_coalescing(self, device: torch.device) -> None:
        if self._batch is not None:
            raise RuntimeError(f"{BACKEND}: _start_coalescing while a batch is open")
        self._batch = []

    def _end_coalescing(self, device: torch.device) -> RulesWork:
        batch, self._batch = self._batch, None
        if batch is None:
            raise RuntimeError(f"{BACKEND}: _end_coalescing without _start_coalescing")
        work = RulesWork(f"batch of {len(batch)}")
        self._jobs.put((batch, work))
        return work

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> RulesWork:
        return self._post("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> RulesWork:
        return self._post("recv", tensors, src, tag)

    def abort(self) -> None:
        """End the communicator: pending operations never complete, later ones raise (the process survives)."""
        self._aborted = True
        self._inner = None  # pending gloo operations end at their own timeout, on the backend's thread

    def shutdown(self) -> None:
        self.abort()
        self._jobs.put(None)

    # -- inside --------------------------------------------------------------------------------------------------

    def _post(self, kind: str, tensors: list[torch.Tensor], peer: int, tag: int) -> RulesWork:
        if self._aborted:
            raise RuntimeError(f"{BACKEND}: rank {self._rank}: the communicator was aborted")
        (t,) = tensors
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{BACKEND}: {kind} needs a contiguous CPU tensor, got {t.device} "
                             f"contiguous={t.is_contiguous()}")
        work = RulesWork(f"{kind} rank {peer}")
        self.num_posted += 1
        if kind == "recv":
            t.view(-1).view(torch.uint8).fill_(POISON)  # NCCL: undefined until complete
        op = (kind, peer, t, tag, work, _digest(t) if kind == "send" else b"")
        if self._batch is not None:
            self._batch.append(op)
        else:
            self._jobs.put(([op], RulesWork("single")))
        return work

    def _connect(self) -> Any:
        """The inner gloo group, created on first use (blocking until every rank joins)."""
        with self._connect_lock:
            if self._inner is None:
                if self._aborted:
                    raise RuntimeError(f"{BACKEND}: rank {self._rank}: the communicator was aborted")
                device = self._device if self._device is not None else _state["device"]
                self._store.set(f"device/{self._rank}", str(device))
                keys = [f"device/{r}" for r in range(self._size)]
                # poll, not `store.wait`: a wait holds the store client (shared with the caller's group, which
                # polls it for fault verdicts) until every rank joined
                end = time.monotonic() + self._timeout.total_seconds()
                while not self._store.check(keys):
                    if time.monotonic() > end or self._aborted:
                        missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
                        raise RuntimeError(f"{BACKEND}: rank {self._rank}: ranks {missing} never joined the "
                                           "communicator")
                    time.sleep(0.01)
                owners: dict[int, int] = {}
                for r, key in enumerate(keys):
                    d = int(self._store.get(key))
                    if d in owners:
                        raise RuntimeError(f"{BACKEND}: Duplicate GPU detected: rank {owners[d]} and rank {r} both "
                                           f"on device {d}")
                    owners[d] = r
                self._inner = dist.ProcessGroupGloo(dist.PrefixStore("inner", self._store), self._rank, self._size,
                                                    self._timeout)
            return self._inner

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch, work = job
            try:
                self._move(batch)
            except Exception as e:  # noqa: BLE001 - a dead peer or an abort: rule 5, a stall, never an error
                logger.debug("%s rank %d: batch stalls: %s", BACKEND, self._rank, e)
                continue
            error = next((w._error for *_, w, _ in batch if w._error is not None), None)
            for *_, w, _ in batch:
                if not w.is_completed():
                    w._finish()
            work._finish(error)

    def _reused(self, peer: int) -> str:
        message = (f"{BACKEND}: rank {self._rank}: the buffer sent to rank {peer} was written after its send was "
                   "posted and before the batch completed (NCCL may send either version)")
        _state["violations"].append(message)
        logger.error("%s", message)
        return message

    def _move(self, batch: list[tuple]) -> None:
        """Move one batch: a length header per message, then its payload, so sizes are never checked (rule 3)."""
        inner = self._connect()
        if self._aborted:
            raise RuntimeError("aborted")
        heads: list[tuple[Any, torch.Tensor, tuple]] = []
        pending: list[Any] = []
        for op in batch:
            kind, peer, t, tag, w, digest = op
            if kind == "recv":
                head = torch.zeros(1, dtype=torch.int64)
                heads.append((inner.recv([head], peer, 2 * tag), head, op))
            else:
                if _digest(t) != digest:
                    w._error = RuntimeError(self._reused(peer))
                payload = t.view(-1).view(torch.uint8)
                pending.append(inner.send([torch.tensor([payload.numel()], dtype=torch.int64)], peer, 2 * tag))
                pending.append(inner.send([payload], peer, 2 * tag + 1))
        landed: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        for head_work, head, (_, peer, t, tag, _, _) in heads:
            head_work.wait(self._timeout)
            wire = torch.empty(int(head.item()), dtype=torch.uint8)
            landed.append((inner.recv([wire], peer, 2 * tag + 1), wire, t))
        for recv_work, wire, t in landed:
            recv_work.wait(self._timeout)
            out = t.view(-1).view(torch.uint8)
            n = min(out.numel(), wire.numel())
            out[:n].copy_(wire[:n])
        for w in pending:
            w.wait(self._timeout)
        time.sleep(self._delay)
        for kind, peer, t, _, w, digest in batch:
            if kind == "send" and w._error is None and _digest(t) != digest:
                w._error = RuntimeError(self._reused(peer))


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> NcclRulesGroup:
    return NcclRulesGroup(store, rank, size, timeout)


def register() -> None:
    """Register the backend under `BACKEND` (idempotent; done when `reshard.testing` is imported)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
