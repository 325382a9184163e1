"""The rank pool: `world_size` processes on this machine that run the same function together.

Starting a rank costs seconds of imports (torch, DTensor), so ranks are forked from a forkserver that imported them
once (`PRELOAD`). Every rank joins, at a TCP store hosted by the calling process:

- a default `torch.distributed` world of the pool's size (gloo, or NCCL with one GPU per rank), so DTensor's
  `distribute_tensor` and `Group.world()` work;
- a separate `Group.rendezvous` group over the same processes (`worker.group`).

`pool.run(fn, *args)` calls `fn(worker, *args)` on every rank and returns one `Outcome` per rank: the value, or the
exception's type, message and traceback. A rank that dies (`os._exit`, a signal, a crash in C++) is reported with
its rank and exit code or signal within a fraction of a second; the living ranks get `dead_grace_s` to report, and
a rank that still has not answered then raises `TimeoutError` naming it: a run never hangs. A pool whose rank died
is `broken`; `shared_pool` replaces it on next use.

`fn` must be a module-level function: it travels by module and name, and ranks import the module (the caller's
`sys.path` travels with each task, so test modules and scripts' `__main__` functions work).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from reshard.comm import Group
from reshard.testing._nccl_rules import BACKEND as NCCL_RULES
from reshard.testing._nccl_rules import set_device as set_rules_device

logger = logging.getLogger(__name__)

PRELOAD = ("__main__", "torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "reshard.comm",
           "reshard.testing")
"""Modules the forkserver imports once, before it forks any rank (`__main__`: a script's own functions)."""

_POLL_S = 0.2  # how often a waiting caller checks that its ranks are alive
_CTX: Any = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for a store or rendezvous the caller hosts)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(list(PRELOAD))
    return _CTX


def describe_exit(exitcode: int | None) -> str:
    """`"exit code 17"`, `"signal SIGKILL"` or `"still running"`, from a `multiprocessing` exit code."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass
class Outcome:
    """What `fn` did on one rank.

    Attributes:
        rank: the rank.
        ok: whether `fn` returned; then `value` holds what it returned.
        error: `"Type: message"` when it raised (or `"rank 1 died (exit code 17)"`), else None.
        error_type: the exception's class name (`"ValueError"`), or `"died"`.
        message: `str(exception)` (no type prefix).
        trace: the formatted traceback on the rank.
        died: the rank's process ended during the run; `exitcode` says how (negative: the signal).
        seconds: how long `fn` ran on the rank.
    """

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None
    message: str | None = None
    trace: str | None = None
    died: bool = False
    exitcode: int | None = None
    seconds: float = 0.0


class RankError(RuntimeError):
    """Some ranks did not return (`RankPool.run_ok`, `launch`); `outcomes` holds every rank's `Outcome`."""

    def __init__(self, what: str, outcomes: list[Outcome]) -> None:
        bad = [o for o in outcomes if not o.ok]
        super().__init__(f"{what}: {len(bad)} of {len(outcomes)} ranks failed\n"
                         + "\n".join(f"rank {o.rank}: {o.error}\n{o.trace or ''}" for o in bad))
        self.outcomes = outcomes


class Worker:
    """What `fn` gets on its rank.

    Attributes:
        rank, world_size: this rank and the pool's size (also the default world's rank and size).
        host, port: the TCP store every rank of the pool meets at.
        backend: the default world's backend, `"gloo"` or `"nccl"`.
        data_backend: `"reshard_nccl_rules"` in a pool of that backend (its groups' CPU data backend), else None.
        device: `cpu`, or this rank's GPU with NCCL (`cuda:<rank>`).
        group: a `reshard.comm.Group` from `Group.rendezvous` over the pool's ranks.
        scratch: a dict that lives as long as the rank, for state kept between runs.
    """

    def __init__(self, rank: int, world_size: int, host: str, port: int, backend: str = "gloo") -> None:
        import torch

        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.port = port
        self.backend = "gloo" if backend == NCCL_RULES else backend
        self.data_backend = NCCL_RULES if backend == NCCL_RULES else None
        self.device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        self.group: Any = None
        self.scratch: dict[str, Any] = {}

    def new_group(self, tag: str, *, ranks: int | None = None, rank: int | None = None, timeout: float = 30.0,
                  backend: str | None = None) -> Any:
        """A fresh `Group.rendezvous` group under `tag` (for cases that break their group: dead or stuck peers).

        Args:
            tag: names the group in the store; every member passes the same tag, once.
            ranks: the group's size (default: the pool's); rank: this process's rank in it (default: its own).
            timeout: the group's timeout, seconds.
            backend: `Group.rendezvous`'s; default the pool's data backend for CPU tensors (`"reshard_nccl_rules"`
                in such a pool, else None).
        """
        return Group.rendezvous(self.host, self.port, self.rank if rank is None else rank,
                                self.world_size if ranks is None else ranks, prefix=f"case/{tag}", timeout=timeout,
                                is_master=False, backend=backend or self.data_backend)

    def init_world(self, prefix: str, rank: int, world_size: int, *, backend: str | None = None,
                   timeout_s: float = 60.0) -> None:
        """(Re)initialise this process's default world as rank `rank` of `world_size`, meeting under `prefix`."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        store = dist.PrefixStore(prefix, dist.TCPStore(self.host, self.port, is_master=False,
                                                       timeout=datetime.timedelta(seconds=60)))
        dist.init_process_group(backend or self.backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))


def _resolve(module: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(rank: int, world_size: int, host: str, port: int, gen: int, backend: str, timeout_s: float,
                 inbox: Any, outbox: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank: the pool refuses more ranks than GPUs
        elif backend == NCCL_RULES:
            set_rules_device(rank)

        w = Worker(rank, world_size, host, port, backend)
        w.init_world(f"world{gen}/", rank, world_size, timeout_s=timeout_s)
        w.group = Group.rendezvous(host, port, rank, world_size, prefix=f"pool{gen}", is_master=False, timeout=60,
                                   backend={"gloo": "gloo", "nccl": None}.get(backend, backend))
    except BaseException as e:  # noqa: BLE001 - a rank that cannot start says why
        outbox.put(("failed", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    outbox.put(("ready", rank, None))
    while True:
        task = inbox.get()
        if task is None:
            break
        task_id, path, module, qualname, args, kwargs = task
        for p in reversed(path):
            if p not in sys.path:
                sys.path.insert(0, p)
        start = time.perf_counter()
        try:
            out = Outcome(rank, True, value=_resolve(module, qualname)(w, *args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - everything, assertion errors too, goes back to the caller
            out = Outcome(rank, False, error=f"{type(e).__name__}: {e}", error_type=type(e).__name__,
                          message=str(e), trace=traceback.format_exc())
        out.seconds = time.perf_counter() - start
        try:  # the queue pickles in a background thread, where a failure would be lost: pickle here first
            ForkingPickler.dumps(out)
        except Exception as e:  # noqa: BLE001 - an unpicklable value or error
            msg = f"cannot return the value of {qualname}: {type(e).__name__}: {e}"
            out = Outcome(rank, False, error=f"TypeError: {msg}", error_type="TypeError", message=msg,
                          seconds=out.seconds)
        outbox.put((task_id, rank, out))
    # no destroy_process_group: it may wait on peers that are gone; the process exit releases gloo


class RankPool:
    """`world_size` ranks, each a process, that run the same function together (see the module docstring).

    Args:
        world_size: the number of ranks.
        backend: `"gloo"` (CPU tensors), `"nccl"` (one GPU per rank: at most as many ranks as GPUs), or
            `"reshard_nccl_rules"` (CPU tensors moved by the backend that obeys NCCL's rules, `worker.group`'s data
            backend, each rank on its own device id; the default world stays gloo).
        timeout_s: the default world's timeout (a collective waiting longer raises).
        start_timeout: seconds the ranks may take to start and meet.
        dead_grace_s: once a rank died, seconds the living ranks get to report before the run gives up.

    Example::

        def job(w, n):            # module level
            return w.rank * n

        with RankPool(2) as pool:
            assert pool.run_ok(job, 10) == [0, 10]
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout_s: float = 60.0,
                 start_timeout: float = 180.0, dead_grace_s: float = 60.0) -> None:
        import torch.distributed as dist

        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"RankPool: world_size must be a positive int, got {world_size!r}")
        if backend not in ("gloo", "nccl", NCCL_RULES):
            raise ValueError(f"RankPool: backend must be 'gloo', 'nccl' or {NCCL_RULES!r}, got {backend!r}")
        if backend == "nccl":
            import torch

            if world_size > torch.cuda.device_count():
                raise ValueError(f"RankPool: backend='nccl' needs one GPU per rank (NCCL refuses two ranks on one "
                                 f"device): {world_size} ranks, {torch.cuda.device_count()} GPUs visible; use "
                                 f"{NCCL_RULES!r} to run NCCL's rules on CPU ranks")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.start_timeout = start_timeout
        self.dead_grace_s = dead_grace_s
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60),
                                   wait_for_workers=False)
        self.host, self.port = "127.0.0.1", self.store.port
        self._task = 0
        self._gen = 0
        self.procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = _context()
        self._gen += 1
        self.inboxes = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, daemon=True, name=f"rank{r}",
                                  args=(r, self.world_size, self.host, self.port, self._gen, self.backend,
                                        self.timeout_s, self.inboxes[r], self.outbox))
                      for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < self.world_size:
            try:
                kind, rank, info = self.outbox.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in ready]
                late = time.monotonic() > deadline
                if not dead and not late:
                    continue
                exits = [describe_exit(self.procs[r].exitcode) for r in dead]
                self.close()
                if dead:
                    raise RuntimeError("RankPool: " + ", ".join(
                        f"rank {r} died while starting ({how})" for r, how in zip(dead, exits))) from None
                raise TimeoutError(f"RankPool: ranks {sorted(set(range(self.world_size)) - ready)} of "
                                   f"{self.world_size} did not start within {self.start_timeout} s") from None
            if kind == "failed":
                self.close()
                raise RuntimeError(f"RankPool: rank {rank} failed to start: {info}")
            ready.add(rank)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Outcome]:
        """Run `fn(worker, *args, **kwargs)` on every rank; one `Outcome` per rank, in rank order.

        Raises:
            RuntimeError: the pool is closed or broken (a rank died in an earlier run).
            TimeoutError: some rank did not answer within `timeout`, or within `dead_grace_s` of another rank's
                death; the pool is then closed.
        """
        if not self.procs or self.broken:
            raise RuntimeError(f"RankPool.run({fn.__name__}): the pool is closed or broken (a rank died); start a "
                               "new one")
        self._task += 1
        task = (self._task, list(sys.path), fn.__module__, fn.__qualname__, args, kwargs)
        for box in self.inboxes:
            box.put(task)
        results: dict[int, Outcome] = {}
        deadline = time.monotonic() + timeout
        died_at: float | None = None
        while len(results) < self.world_size:
            try:
                task_id, rank, out = self.outbox.get(timeout=_POLL_S)
                if task_id == self._task:
                    results[rank] = out
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(self.procs):
                if r not in results and not p.is_alive():
                    how = describe_exit(p.exitcode)
                    logger.warning("RankPool: rank %d died (%s) running %s", r, how, fn.__name__)
                    results[r] = Outcome(r, False, died=True, exitcode=p.exitcode, error=f"rank {r} died ({how})",
                                         error_type="died", message=f"rank {r} died ({how})")
                    died_at = died_at or time.monotonic()
            now = time.monotonic()
            late = now > deadline or (died_at is not None and now > died_at + self.dead_grace_s)
            if late and len(results) < self.world_size:
                missing = sorted(set(range(self.world_size)) - set(results))
                dead = [f"rank {o.rank} ({describe_exit(o.exitcode)})" for o in results.values() if o.died]
                self.close()
                why = f"within {self.dead_grace_s} s of the death of {', '.join(dead)}" if dead \
                    else f"in {timeout} s"
                raise TimeoutError(f"RankPool.run({fn.__name__}): ranks {missing} did not finish {why} (a hang); "
                                   "the pool was closed")
        return [results[r] for r in range(self.world_size)]

    def run_ok(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`run`, raising `RankError` (every failed rank's error and traceback) unless every rank returned; the
        ranks' values in rank order."""
        outs = self.run(fn, *args, **kwargs)
        if not all(o.ok for o in outs):
            raise RankError(f"RankPool.run_ok({fn.__name__})", outs)
        return [o.value for o in outs]

    @property
    def broken(self) -> bool:
        """Whether a rank has died (the pool's groups are then unusable)."""
        return any(not p.is_alive() for p in self.procs)

    def close(self) -> None:
        """Stop every rank (those that do not stop within seconds are killed). Idempotent."""
        for box, p in zip(self.inboxes, self.procs):
            if p.is_alive():
                with contextlib.suppress(OSError, ValueError):  # the queue may be closed already
                    box.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_POOLS: dict[tuple[int, str], RankPool] = {}


def shared_pool(world_size: int, *, backend: str = "gloo") -> RankPool:
    """The process's pool of `world_size` ranks, started on first use and replaced if a rank died; reuse it across
    test modules to pay start-up once. Closed at exit (or by `close_shared_pools`)."""
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is not None and (pool.broken or not pool.procs):
        pool.close()
        pool = None
    if pool is None:
        pool = _POOLS[key] = RankPool(world_size, backend=backend)
    return pool


@atexit.register
def close_shared_pools() -> None:
    """Close every pool `shared_pool` started."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 1800.0,
           **kwargs: Any) -> list[Any]:
    """Run `fn(worker, *args, **kwargs)` once on `world_size` new ranks; their values in rank order.

    Start-up (imports, rendezvous) is paid per call, so `fn` should do all the work of a run; use a `RankPool` to
    run many jobs. Raises `RankError` naming every rank that raised or died.
    """
    with RankPool(world_size, backend=backend, timeout_s=timeout) as pool:
        return pool.run_ok(fn, *args, timeout=timeout, **kwargs)
