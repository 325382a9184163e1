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
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

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


class CommError(RuntimeError):
    """A peer failed, died or did not answer within the timeout, or received bytes failed verification."""


class Group:
    """A process group as reshard uses it: `rank` and `size` in the numbering that plans use.

    Do not build one directly: use `Group.world()` or `Group.rendezvous(...)`.

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
        self._lock = threading.Lock()

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
        group = cls(rank=dist.get_rank(), size=dist.get_world_size(), control=control, data=data,
                    name=f"world({backend})", timeout=DEFAULT_TIMEOUT)
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
    ) -> Group:
        """Build a separate group of `world_size` processes that meet at a TCP store on `host:port`.

        The default process group (if any) is neither used nor changed. Every process of the group calls this with
        the same `host`, `port`, `world_size` and `prefix`, and its own `rank`.

        Args:
            host, port: the TCP store's address. By default group rank 0 hosts the store there.
            rank: this process's rank in the new group, `0 <= rank < world_size` (see the module docstring for how
                to map each side's own ranks into the group).
            world_size: the number of processes in the group.
            backend: `None` (gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA is available), `"gloo"`
                or `"nccl"` (NCCL for data; control messages always use gloo).
            timeout: for the rendezvous and, by default, for every operation on the group.
            prefix: a namespace in the store, so several groups can share one store.
            is_master: whether this process hosts the store; default `rank == 0`. Pass False on every rank when the
                store is hosted elsewhere.

        Returns:
            The group. Call `close()` when done with it.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or isinstance(world_size, bool) \
                or not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Group.rendezvous: need integers 0 <= rank < world_size, got rank={rank!r}, "
                             f"world_size={world_size!r}")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"Group.rendezvous: backend must be None, 'gloo' or 'nccl', got {backend!r}")
        td = as_timedelta(timeout)
        master = rank == 0 if is_master is None else bool(is_master)
        store = dist.TCPStore(host, port, world_size if master else None, master, timeout=td,
                              wait_for_workers=False)
        base = dist.PrefixStore(f"{prefix}/", store)
        control = dist.ProcessGroupGloo(dist.PrefixStore("gloo", base), rank, world_size, td)
        data: dict[str, Any] = {"cpu": control}
        want_nccl = backend == "nccl" or (backend is None and torch.cuda.is_available())
        if want_nccl:
            nccl_cls = getattr(dist, "ProcessGroupNCCL", None)
            if nccl_cls is None or not torch.cuda.is_available():
                raise ValueError("Group.rendezvous: backend='nccl' needs a CUDA build of torch and a GPU")
            opts = nccl_cls.Options()
            opts._timeout = td
            data["cuda"] = nccl_cls(dist.PrefixStore("nccl", base), rank, world_size, opts)
        if backend == "nccl":
            data.pop("cpu")

        def close() -> None:
            for pg in {id(p): p for p in [control, *data.values()]}.values():
                shutdown = getattr(pg, "shutdown", None)
                if shutdown is not None:
                    try:
                        shutdown()
                    except Exception:  # a broken group (dead peer) may refuse a clean shutdown
                        logger.debug("group %s: shutdown failed", prefix, exc_info=True)

        logger.debug("rendezvous %s at %s:%d: rank %d of %d", prefix, host, port, rank, world_size)
        return cls(rank=rank, size=world_size, control=control, data=data, name=f"rendezvous({prefix})",
                   timeout=td, closer=close, keepalive=(store, base))

    # -- use ----------------------------------------------------------------------------------------------------

    @property
    def control(self) -> Any:
        """The gloo backend for control messages (CPU tensors)."""
        return self._control

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

    def check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"{what}: rank {rank} is outside {self} (ranks 0..{self.size - 1})")

    def close(self) -> None:
        """Release the group's backends (a rendezvous group only; the default world is left alone)."""
        self.cache.clear()
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()

    def __repr__(self) -> str:
        return f"Group({self.name}, rank {self.rank} of {self.size})"
