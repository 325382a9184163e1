"""`Group`: the process group a reshard runs on, and whose rank numbering its plans use.

A `Group` holds up to two `torch.distributed` backends over the same processes:

- a *control* backend, always gloo on CPU tensors, for the small messages that make ranks agree before data moves
  (plan fingerprints, layout metadata, error flags);
- a *data* backend per device type: gloo for CPU tensors, NCCL for CUDA tensors.

`Group.world()` wraps the default `torch.distributed` world. `Group.rendezvous(...)` builds a separate group from a
TCP store, without touching the default group, so trainer and inference processes launched apart (two `torchrun`
jobs, Ray actors), each with its own default world, can share one group.

Rank mapping. Plans speak in the group's ranks. With `Group.world()` these are the default world's ranks. With
`Group.rendezvous`, each process chooses its group rank: a common choice is `group_rank = own_rank` on the trainer
(ranks `0 .. T-1`) and `group_rank = T + own_rank` on the inference side (ranks `T .. T+I-1`). `reshard_dtensor`
does this mapping itself from the DTensors' mesh coordinates, so DTensor meshes may keep the ranks of each side's
own default world.

Threading. A `Group` runs one call at a time (a reshard, an `execute`, a layout exchange, a `transfer` until its
handle is waited on). A call made from a second thread while another thread's call runs on the same group is
refused with `CommError`, and the group is aborted on every rank: peers cannot tell which of this process's threads
their messages belong to, so continuing could hand one thread's bytes to the other. Use one group per thread (each
its own `Group.rendezvous` prefix) to reshard concurrently.

Faults. When a rank sees a peer fail (a closed connection, a timeout, a malformed message), it records a verdict in
the group's store naming the failed rank and itself, signed with the job token (forged entries in the store are
skipped: `reshard.comm._errors.Verdicts`); every other rank polls for it while it waits and raises `CommError`
with that verdict within `FAULT_POLL_S` (plus scheduling). A store that stops answering for `STORE_GRACE_S` names
its host (the rank whose signed claim says it hosts the store), in one logged line; it is not asked again. A
whole-group collective that times out, or fails because a rank left without calling it, names the ranks that never
reached it (`Group.roll_call`, from the arrival each rank records when it enters: `Group.arrive`). After that the
group is unusable: every later call raises the same verdict; close it and rendezvous anew under a fresh prefix.
`close()` frees a hosted store's port at once.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from reshard.comm import _devices as devices
from reshard.comm import _rendezvous as rv
from reshard.comm._errors import JOIN_SESSION, CommError, Verdicts

logger = logging.getLogger(__name__)

STORE_GRACE_S = 1.0
"""How long a waiting rank keeps waiting after the group's store stopped answering before it names the store's host
as failed (a host that closed its group right after a call it completed is not a fault of the calls that end
within this time)."""

ROLL_CALL_S = 2.0
"""How long a rank whose whole-group collective timed out waits for the other ranks' roll-call keys."""

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
"""How long any one wait for a peer may last before it raises (a dead or stuck peer)."""

Timeout = float | datetime.timedelta


def as_timedelta(timeout: Timeout | None, *, default: datetime.timedelta = DEFAULT_TIMEOUT) -> datetime.timedelta:
    """`timeout` in seconds (int/float) or a `timedelta`, as a `timedelta`; None gives `default`."""
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = datetime.timedelta(seconds=float(timeout))
    else:
        raise ValueError(f"timeout must be seconds (a number) or a datetime.timedelta, got {timeout!r}")
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value.total_seconds()} s")
    return value


class Group:
    """A process group as reshard uses it: `rank` and `size` in the numbering that plans use.

    Do not build one directly: use `Group.world()` or `Group.rendezvous(...)`.

    Threading rule: one call at a time. A call from a second thread while another thread's call runs on the group
    raises `CommError` and aborts the group on every rank (see the module docstring); use one group per thread.
    After a `CommError` from a fault (a dead, stuck or misbehaving peer) the group is unusable; close it.

    Attributes:
        rank: this process's rank in the group.
        size: the number of ranks.
        name: a label for messages and logs.
        timeout: the default timeout of operations on this group.
    """

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        control: Any,
        data: dict[str, Any],
        name: str,
        timeout: datetime.timedelta,
        closer: Callable[[], None] | None = None,
        keepalive: tuple = (),
        store: Any = None,
        token: bytes = b"",
        session: str = JOIN_SESSION,
        store_host: int | None = None,
        store_address: str = "",
    ) -> None:
        self.rank = rank
        self.size = size
        self.name = name
        self.timeout = timeout
        self._control = control
        self._data = data
        self._closer = closer
        self._keepalive = keepalive  # the store must outlive the backends built on it
        self.cache: dict[Any, Any] = {}
        """Per-group caches of the comm layer (exchanged layouts, staging); cleared by `close()`."""
        self._store = store  # where fault verdicts meet (None: faults are reported on the observing rank only)
        self._verdicts = Verdicts(store, token, session) if store is not None else None
        self._store_host = store_host  # the group rank whose process serves the store (None: outside the group)
        self._store_address = store_address
        self._store_lost: tuple[float, str] | None = None  # (when, the error) the store first failed to answer
        self._collectives = 0  # whole-group collectives so far: every rank counts alike (the roll call's key)
        self._state = threading.Lock()
        self._owner: int | None = None  # the thread whose call runs now
        self._owner_what = ""
        self._depth = 0
        self._verdict: dict[str, Any] | None = None
        self._waiter: Any = None  # the job queue of the thread that runs blocking waits (see _transfer.wait_watched)
        self._closed = False
        self._users: dict[str, int] = {}  # kind -> how many users of that kind were made on this group
        self.store_port: int | None = None
        """The store's port (a rendezvous group; useful when the store was started on port 0)."""
        self.devices: list[tuple[str, int]] | None = None
        """Each rank's data device `(type, index)` as agreed at rendezvous (`("cpu", -1)`: gloo); None: unknown."""

    # -- construction -------------------------------------------------------------------------------------------

    _WORLD: Group | None = None
    _WORLD_PG: Any = None

    @classmethod
    def world(cls) -> Group:
        """The default `torch.distributed` world as a `Group` (its ranks are the world's ranks).

        The default process group must be initialized. When it has no CPU backend (NCCL only), a gloo group is
        created for control messages with `dist.new_group`, which is collective: then every rank must call
        `Group.world()` the first time. The result is cached until the default group changes.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("Group.world(): torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group first, or use Group.rendezvous(...)")
        pg = dist.group.WORLD
        if cls._WORLD is not None and cls._WORLD_PG is pg:
            return cls._WORLD
        backend = str(dist.get_backend(pg)).lower()
        data: dict[str, Any] = {}
        if "gloo" in backend or "cpu" in backend:
            control = pg
            data["cpu"] = pg
        else:
            control = dist.new_group(backend="gloo")
        if "nccl" in backend or "cuda" in backend:
            data["cuda"] = pg
        try:
            store: Any = dist.PrefixStore("reshard/world/", dist.distributed_c10d._get_default_store())
        except Exception:  # a world without a store of its own: faults are reported on the observing rank only
            store = None
        token = (os.environ.get(rv.TOKEN_ENV) or "").encode()  # verdicts unauthenticated without one
        group = cls(rank=dist.get_rank(), size=dist.get_world_size(), control=control, data=data,
                    name=f"world({backend})", timeout=DEFAULT_TIMEOUT, store=store, token=token, session="world")
        cls._WORLD, cls._WORLD_PG = group, pg
        return group

    @classmethod
    def rendezvous(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        backend: str | None = None,
        timeout: Timeout = DEFAULT_TIMEOUT,
        prefix: str = "reshard",
        is_master: bool | None = None,
        token: str | bytes | None = None,
    ) -> Group:
        """Build a separate group of `world_size` processes that meet at a TCP store on `host:port`.

        The default process group (if any) is neither used nor changed. Every process of the group calls this with
        the same `host`, `port`, `world_size`, `prefix` and token, and its own `rank`.

        Joining is checked (see `reshard.comm._rendezvous`): each rank claims its rank with a claim signed by the job
        token (an HMAC; the token is never written to the store), and refuses the group with `CommError`, within
        `timeout`, when a rank is claimed twice, a rank has another world size or token, or a rank does not join.
        A store hosted here listens on `host` only, not on every interface.

        Args:
            host, port: the TCP store's address. By default group rank 0 hosts the store there (port 0: any free
                port, see `store_port`).
            rank: this process's rank in the new group, `0 <= rank < world_size` (see the module docstring for how
                to map each side's own ranks into the group).
            world_size: the number of processes in the group.
            backend: `None` (gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA is available), `"gloo"`
                or `"nccl"` (NCCL for data; control messages always use gloo).
            timeout: for the whole rendezvous and, by default, for every operation on the group.
            prefix: a namespace in the store, so several groups can share one store; use a fresh one per group.
            is_master: whether this process hosts the store; default `rank == 0`. Pass False on every rank when the
                store is hosted elsewhere.
            token: the job's shared secret (str or bytes); default the `RESHARD_TOKEN` environment variable.
                Required unless `host` is a loopback address (then a missing token logs that the group is
                unauthenticated).

        Returns:
            The group. Call `close()` when done with it.

        Raises:
            ValueError: bad arguments, or no token for a non-loopback host (before any connection).
            CommError: the rendezvous was refused or did not complete within `timeout` (on every rank that joined).
        """
        _check_rendezvous_args(rank, world_size, backend, prefix)
        td = as_timedelta(timeout)
        key = rv.resolve_token(token, host, warn=rank == 0)
        deadline = time.monotonic() + td.total_seconds()
        label = f"rendezvous({prefix})"
        master = rank == 0 if is_master is None else bool(is_master)
        store = _open_store(host, port, rank, master, deadline, td, label)
        base = dist.PrefixStore(f"{prefix}/", store)
        control, session, store_host = _join(store, base, host, port, rank, world_size, key, master, deadline, td,
                                             prefix, label)
        data: dict[str, Any] = {}
        try:
            data, ranks_devices = _data_backends(control, base, backend, rank, world_size, td, lambda device, unable:
                                                 devices.check_devices(control, rank, world_size, device, label,
                                                                       _remaining(deadline), unable=unable))
            for pg in {id(p): p for p in data.values() if devices.follows_nccl(p)}.values():
                devices.connect_eagerly(pg, devices.data_device(data))
        except (ValueError, CommError):
            _closer([control, *data.values()], prefix)()
            raise
        except Exception as e:  # the communicator's creation failed (a peer died while it connected)
            _closer([control, *data.values()], prefix)()
            raise CommError(f"rank {rank} of {label}: connecting the data backend failed: {type(e).__name__}: "
                            f"{e}") from e
        logger.debug("rendezvous %s at %s:%d: rank %d of %d", prefix, host, port, rank, world_size)
        group = cls(rank=rank, size=world_size, control=control, data=data, name=label, timeout=td,
                    closer=_closer([control, *data.values()], prefix), keepalive=(store, base), store=base,
                    token=key, session=session, store_host=store_host, store_address=f"{host}:{port}")
        group.store_port = store.port
        group.devices = ranks_devices
        return group

    # -- use ----------------------------------------------------------------------------------------------------

    @property
    def control(self) -> Any:
        """The gloo backend for control messages (CPU tensors)."""
        return self._control

    @property
    def data_types(self) -> frozenset[str]:
        """The device types this group has a data backend for (`{"cpu"}`: gloo only; `{"cpu", "cuda"}`; ...)."""
        return frozenset(self._data)

    def data_backend(self, device: torch.device) -> Any:
        """The backend that moves tensors on `device`: gloo for CPU, NCCL for CUDA.

        Raises:
            ValueError: the group has no backend for that device type.
        """
        pg = self._data.get(device.type)
        if pg is None:
            raise ValueError(f"{self}: no backend for {device.type} tensors (it has {sorted(self._data)}); use CPU "
                             "tensors with gloo or CUDA tensors with NCCL")
        return pg

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """Run one call on the group: refuse (and abort the group) if another thread's call runs on it.

        Re-entrant in one thread (a reshard inside a refit). Also refuses a group that a fault aborted.

        Raises:
            CommError: another thread is inside a call on this group, or the group was aborted.
        """
        me = threading.get_ident()
        with self._state:
            if self._owner is not None and self._owner != me:
                busy = self._owner_what
                clash = (f"{what} was called from a second thread while {busy} runs on the same group; a Group runs "
                         "one call at a time, and peers cannot tell the two calls apart, so the group is aborted "
                         "on every rank (use one group per thread)")
            else:
                clash = ""
                if self._owner is None:
                    self._owner, self._owner_what = me, what
                self._depth += 1
                outer = self._depth == 1
        if clash:
            verdict = self.report_fault(None, clash)
            raise CommError(self.describe_fault(verdict, what))
        try:
            if self._closed:
                raise CommError(f"{what}: {self} was closed; rendezvous a new group")
            if outer or self._verdict is not None:  # one store round trip per outermost call
                self.raise_if_aborted(what)
            yield
        finally:
            with self._state:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None

    def report_fault(self, failed: int | None, message: str) -> dict[str, Any]:
        """Record that this rank saw rank `failed` (None: unknown) fail; returns the group's first verdict.

        The verdict is signed with the job token; the first valid one written wins, so every rank reports the same
        culprit (forged entries in the store are skipped); later ones are logged only.
        """
        mine = {"failed": failed, "observer": self.rank, "message": message[:4000]}
        verdict = mine
        if self._verdicts is not None and self._store_lost is None:
            try:
                verdict = self._verdicts.record(failed, self.rank, message)
            except Exception as e:  # the store host may be gone too: the local verdict stands
                self._lost(e)
        if verdict != mine:
            logger.info("%s: fault seen here (%s) follows the group's verdict (%s)", self, message, verdict)
        self._verdict = self._verdict or verdict
        return self._verdict

    def fault(self, *, store_grace: float = STORE_GRACE_S) -> dict[str, Any] | None:
        """The group's fault verdict if some rank reported one (a store round trip until one is found), else None.

        A store that stopped answering for `store_grace` seconds is itself the verdict: its host (the group rank
        that serves it) died or closed the group.
        """
        # a lost store is not asked again: each failing call prints a C++ stack of torch's (hundreds of lines)
        if self._verdict is None and self._verdicts is not None and self._store_lost is None:
            try:
                self._verdict = self._verdicts.find()
            except Exception as e:  # a store that stopped answering: see _lost
                self._lost(e)
        if self._verdict is None and self._store_lost is not None \
                and time.monotonic() - self._store_lost[0] >= store_grace:
            host = self._store_host
            who = f"hosted by rank {host}" if host is not None else "hosted outside the group"
            self._verdict = {"failed": host, "observer": self.rank, "message": (
                f"the group's store at {self._store_address or '?'} ({who}) stopped answering "
                f"({self._store_lost[1]}): " + (f"rank {host} died or closed its group" if host is not None else
                                                "its host died or closed it"))}
        return self._verdict

    def _lost(self, error: BaseException) -> None:
        if self._store_lost is None:
            logger.debug("%s: the store stopped answering", self, exc_info=True)
            self._store_lost = (time.monotonic(), f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            host = f"rank {self._store_host}" if self._store_host is not None else "a process outside the group"
            logger.warning("reshard: %s: the group's store at %s, hosted by %s, stopped answering: %s died or closed "
                           "its group (any C++ stack above is torch's store client reporting that)", self,
                           self._store_address or "?", host, host)

    def arrive(self) -> None:
        """Count one more whole-group collective and record in the store, before waiting, that this rank reached
        it (one key per rank holding the count): a rank whose own wait ends later than another's must not look
        absent to the roll call of the one whose wait ended first."""
        self._collectives += 1
        if self._store is not None and self._store_lost is None:
            try:
                self._store.set(f"here/{self.rank}", str(self._collectives).encode())
            except Exception:  # the store is gone: the roll call will say it cannot tell
                logger.debug("%s: roll-call key not written", self, exc_info=True)

    def roll_call(self, wait_s: float = ROLL_CALL_S) -> list[int] | None:
        """After this rank's whole-group collective failed: the ranks that never reached it (each rank that did
        wrote its count of collectives when it entered, `arrive`; this waits up to `wait_s` for late ones), or None
        when the store cannot tell. The keys are not signed: a process that writes to the store can only make an
        absent rank look present (the blame then falls on no rank)."""
        if self._store is None or self._store_lost is not None:
            return None
        store, n = self._store, self._collectives

        def reached(r: int) -> bool:
            key = f"here/{r}"
            return bool(store.check([key])) and int(store.get(key).decode() or 0) >= n

        try:
            deadline = time.monotonic() + wait_s
            while True:
                missing = [r for r in range(self.size) if not reached(r)]
                if not missing or time.monotonic() > deadline:
                    return missing
                time.sleep(0.05)
        except Exception:  # the store is gone: it cannot tell
            logger.debug("%s: roll call failed", self, exc_info=True)
            return None

    def describe_fault(self, verdict: dict[str, Any], what: str) -> str:
        """The `CommError` message for `verdict` as seen by this rank during `what`."""
        failed = "a rank" if verdict["failed"] is None else f"rank {verdict['failed']}"
        return (f"rank {self.rank} of {self}: {what} stopped: {failed} failed, seen by rank {verdict['observer']}: "
                f"{verdict['message']}")

    def raise_if_aborted(self, what: str) -> None:
        """Raise the group's fault verdict as a `CommError` if some rank reported one."""
        verdict = self.fault(store_grace=0.0)
        if verdict is not None:
            raise CommError(self.describe_fault(verdict, what))

    def next_ordinal(self, kind: str) -> int:
        """Count one more user of `kind` (e.g. `"refit"`) made on this group and return its ordinal: 1 for the
        first, 2 for the second, ... (per process; how errors name a user that was given no name)."""
        self._users[kind] = self._users.get(kind, 0) + 1
        return self._users[kind]

    def check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"{what}: rank {rank} is outside {self} (ranks 0..{self.size - 1})")

    def close(self) -> None:
        """Release the group's backends (a rendezvous group only; the default world is left alone). A wait on the
        group in another thread ends with a `CommError` within `FAULT_POLL_S`."""
        if self._keepalive:
            self._closed = True  # first: another thread's wait reads it while the backends shut down
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.put(None)  # ends the waiter thread after its current wait
        self.cache.clear()
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()
        if self._keepalive:
            # drop every reference to the backends and the store now, so a store hosted here stops serving and
            # its port is free at once (a `TCPStore` server lives as long as its Python object); the last
            # references go on a thread of their own (backends first, the store they are built on last)
            refs: list[Any] = [closer, self._control, self._data, self._keepalive]
            self._control, self._data, self._store, self._keepalive = None, {}, None, ()
            self._verdicts = None
            del closer
            _release(refs, self.name)

    def __repr__(self) -> str:
        return f"Group({self.name}, rank {self.rank} of {self.size})"


# -- the steps of `Group.rendezvous` ---------------------------------------------------------------------------------

def _check_rendezvous_args(rank: Any, world_size: Any, backend: Any, prefix: Any) -> None:
    """Raise `ValueError` naming the bad argument of `Group.rendezvous` (before any connection)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or isinstance(world_size, bool) \
            or not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"Group.rendezvous: need integers 0 <= rank < world_size, got rank={rank!r}, "
                         f"world_size={world_size!r}")
    if backend not in (None, "gloo", "nccl") and (not isinstance(backend, str)
                                                  or backend.upper() not in dist.Backend._plugins):
        raise ValueError(f"Group.rendezvous: backend must be None, 'gloo', 'nccl' or the name of a backend "
                         f"registered with torch.distributed.Backend.register_backend, got {backend!r}")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"Group.rendezvous: prefix must be a non-empty str, got {prefix!r}")


def _remaining(deadline: float) -> datetime.timedelta:
    """The time left until `deadline` (`time.monotonic()` seconds), at least 10 ms."""
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.01))


def _open_store(host: str, port: int, rank: int, master: bool, deadline: float, td: datetime.timedelta,
                label: str) -> Any:
    """The TCP store at `host:port`: hosted here (listening on `host` only) when `master`, else reached as a client.

    Raises:
        CommError: the store cannot be reached before `deadline` (`td` is the whole timeout, for the message).
    """
    try:
        if master:
            sock = rv.listen(host, port)
            return dist.TCPStore(host, sock.getsockname()[1], None, True, timeout=_remaining(deadline),
                                 wait_for_workers=False, master_listen_fd=sock.detach())
        rv.wait_for_listener(host, port, deadline, f"rank {rank} of {label}")
        return dist.TCPStore(host, port, None, False, timeout=_remaining(deadline))
    except CommError:
        raise
    except Exception as e:  # DistStoreError, DistNetworkError, TimeoutError: torch's store errors
        raise CommError(f"rank {rank} of {label}: cannot reach the store at {host}:{port} within "
                        f"{td.total_seconds():.1f} s: {type(e).__name__}: {e}") from e


def _join(store: Any, base: Any, host: str, port: int, rank: int, world_size: int, key: bytes, master: bool,
          deadline: float, td: datetime.timedelta, prefix: str, label: str) -> tuple[Any, str, int | None]:
    """Claim `rank` on the store, connect the gloo control backend and prove membership: `(control, session,
    store_host)`, the rank whose process serves the store last (None: outside the group).

    Raises:
        CommError: the rendezvous was refused, or the store stopped answering (naming the rank that hosts it).
    """
    store_host: int | None = None
    try:
        session, store_host = rv.join(base, rank, world_size, key, deadline, label, hosts_store=master)
        store.set_timeout(_remaining(deadline))
        verdicts = Verdicts(base, key, JOIN_SESSION)
        # gloo's connect blocks in a wait on its store client until every peer's address is there; the
        # watcher polls the verdicts through a client of its own, or it would queue behind that wait (up to
        # the whole timeout) and miss a rank that refused the rendezvous meanwhile
        watch = dist.TCPStore(host, store.port, None, False, timeout=_remaining(deadline))
        control = rv.connect(lambda: dist.ProcessGroupGloo(dist.PrefixStore("gloo", base), rank, world_size, td),
                             Verdicts(dist.PrefixStore(f"{prefix}/", watch), key, JOIN_SESSION), rank, label)
        del watch
        rv.prove_membership(control, verdicts, rank, world_size, key, session, _remaining(deadline), label)
    except CommError:
        raise
    except Exception as e:  # torch's store errors while the backend connects
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if store_host is not None and store_host != rank and isinstance(e, dist.DistError):
            raise CommError(f"rank {rank} of {label}: the rendezvous failed: the store at {host}:{port}, hosted "
                            f"by rank {store_host}, stopped answering while the group connected: rank "
                            f"{store_host} failed (it exited or died): {why}") from e
        raise CommError(f"rank {rank} of {label}: the rendezvous failed: {why}") from e
    finally:
        store.set_timeout(td)
    return control, session, store_host


def _data_backends(control: Any, base: Any, backend: str | None, rank: int, world_size: int,
                   td: datetime.timedelta, agree: Callable[[torch.device | None, bool], list[tuple[str, int]]]
                   ) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """`(device type -> backend, every rank's data device)`: gloo (the control backend) for CPU unless
    `backend == "nccl"`, NCCL for CUDA when asked for or (`backend=None`) when every rank has CUDA; a registered
    backend's name: that backend for CPU tensors (`reshard_nccl_rules` in tests). `agree(device, unable)` exchanges
    the devices before any NCCL communicator is made (NCCL's creation needs every rank of the group).

    Raises:
        ValueError: `backend="nccl"` where some rank has no CUDA build of torch and a GPU (on every rank).
    """
    data: dict[str, Any] = {"cpu": control}
    if backend not in (None, "gloo", "nccl"):
        plugin = dist.Backend._plugins[backend.upper()]
        data["cpu"] = plugin.creator_fn(dist.PrefixStore(backend, base), rank, world_size, td)
        return data, agree(devices.data_device(data), False)
    nccl_cls = getattr(dist, "ProcessGroupNCCL", None)
    able = nccl_cls is not None and torch.cuda.is_available()
    want_nccl = backend == "nccl" or (backend is None and able)
    ranks_devices = agree(torch.device("cuda", torch.cuda.current_device()) if want_nccl and able else None,
                          backend == "nccl" and not able)
    without = [r for r, (kind, _) in enumerate(ranks_devices) if kind != "cuda"]
    if backend == "nccl" and without:
        raise ValueError(f"Group.rendezvous: backend='nccl' needs a CUDA build of torch and a GPU on every rank; "
                         f"ranks {without} have none")
    if want_nccl and without:
        logger.info("rendezvous: ranks %s have no CUDA device: no NCCL backend; CPU tensors move over gloo", without)
        want_nccl = False
    if want_nccl:
        devices.set_watchdog()
        opts = nccl_cls.Options()
        opts._timeout = td + devices.WATCHDOG_MARGIN  # reshard's own deadline (td) fires first and aborts
        data["cuda"] = nccl_cls(dist.PrefixStore("nccl", base), rank, world_size, opts)
    if backend == "nccl":
        data.pop("cpu")
    return data, ranks_devices


RELEASE_WAIT_S = 1.0  # how long `Group.close` waits for its backends' destructors


def _release(refs: list[Any], name: str) -> None:
    """Drop `refs` (the only references left to a closed group's backends and store) on a daemon thread, waiting
    for it up to `RELEASE_WAIT_S`: a gloo backend's destructor joins its worker threads, which finish a receive
    still pending (another thread's abandoned wait) only when the peer answers or the operation times out, and
    the closing thread must not wait for that."""
    def drop() -> None:
        while refs:
            refs.pop(0)  # in order: the backends before the store they are built on

    thread = threading.Thread(target=drop, name=f"reshard-release-{name}", daemon=True)
    thread.start()
    thread.join(RELEASE_WAIT_S)
    if thread.is_alive():
        logger.info("%s: closed; its backends are released in the background (an abandoned wait is still "
                    "pending in them)", name)


def _closer(backends: list[Any], prefix: str) -> Callable[[], None]:
    """A function that shuts each distinct backend of `backends` down, ignoring the refusals of a broken group."""
    def close() -> None:
        for pg in {id(p): p for p in backends}.values():
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:  # a broken group (dead peer) may refuse a clean shutdown
                    logger.debug("group %s: shutdown failed", prefix, exc_info=True)
    return close
