"""A pool of gloo ranks on this machine, started once and reused by many test cases.

Starting a rank costs seconds of imports (torch, DTensor), so the pool forks its ranks from a forkserver that
has imported them once. Every rank then joins:

- a default `torch.distributed` world of the pool's size (gloo), so DTensor's `distribute_tensor` (the ground
  truth) and `Group.world()` work;
- a separate `Group.rendezvous` group over the same processes (`worker.group`).

Both meet at a TCP store hosted by the test process. `pool.run(fn, *args)` runs `fn(worker, *args)` on every rank
(`fn` must be a module-level function of an importable module, such as a test module) and returns one `Outcome`
per rank. A rank that dies is reported as such; the pool must then be restarted (`pool.restart()`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "reshard.comm"]
_CTX = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


@dataclass
class Outcome:
    """What `fn` did on one rank: `value` if it returned, else `error` (`"Type: message"`) and `trace`."""

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    error_type: str | None = None
    trace: str | None = None
    died: bool = False
    seconds: float = 0.0


class Worker:
    """What a test function gets on its rank."""

    def __init__(self, rank: int, world_size: int, host: str, port: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.port = port
        self.group: Any = None
        self._groups = 0
        self.scratch: dict[str, Any] = {}

    def new_group(self, tag: str, *, ranks: int | None = None, rank: int | None = None, timeout: float = 30.0) -> Any:
        """A fresh `Group.rendezvous` group (for cases that break their group: dead or stuck peers)."""
        from reshard.comm import Group

        self._groups += 1
        return Group.rendezvous(self.host, self.port, self.rank if rank is None else rank,
                                self.world_size if ranks is None else ranks, prefix=f"case/{tag}", timeout=timeout,
                                is_master=False)

    def init_world(self, prefix: str, rank: int, world_size: int) -> None:
        """(Re)initialise this process's default world, as rank `rank` of `world_size` meeting under `prefix`."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        store = dist.PrefixStore(prefix, dist.TCPStore(self.host, self.port, is_master=False,
                                                       timeout=datetime.timedelta(seconds=60)))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=60))


def _worker_main(rank: int, world_size: int, host: str, port: int, gen: int, inbox: Any, outbox: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from reshard.comm import Group

    w = Worker(rank, world_size, host, port)
    w.init_world(f"world{gen}/", rank, world_size)
    w.group = Group.rendezvous(host, port, rank, world_size, prefix=f"pool{gen}", is_master=False, timeout=60)
    outbox.put(("ready", rank, None))
    while True:
        task = inbox.get()
        if task is None:
            break
        task_id, module, name, args, kwargs = task
        start = time.perf_counter()
        try:
            fn = getattr(importlib.import_module(module), name)
            value = fn(w, *args, **kwargs)
            out = Outcome(rank, True, value=value)
        except BaseException as e:  # noqa: BLE001 - report everything, including assertion errors, to the test process
            out = Outcome(rank, False, error=f"{type(e).__name__}: {e}", error_type=type(e).__name__,
                          trace=traceback.format_exc())
        out.seconds = time.perf_counter() - start
        try:
            outbox.put((task_id, rank, out))
        except Exception as e:  # noqa: BLE001 - an unpicklable value
            outbox.put((task_id, rank, Outcome(rank, False, error=f"cannot return the value: {e}")))


class RankPool:
    """`world_size` ranks, each a process, that run the same function together (see the module docstring)."""

    def __init__(self, world_size: int, *, start_timeout: float = 180.0) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self.start_timeout = start_timeout
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
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        if tests_dir not in sys.path:
            sys.path.insert(0, tests_dir)
        self.inboxes = [ctx.SimpleQueue() for _ in range(self.world_size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker_main, daemon=True, name=f"rank{r}",
                                  args=(r, self.world_size, self.host, self.port, self._gen, self.inboxes[r],
                                        self.outbox))
                      for r in range(self.world_size)]
        for p in self.procs:
            p.start()
        ready = 0
        deadline = time.monotonic() + self.start_timeout
        while ready < self.world_size:
            try:
                kind, _, _ = self.outbox.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                self.close()
                raise RuntimeError(f"RankPool: {self.world_size - ready} of {self.world_size} ranks did not start "
                                   f"within {self.start_timeout} s") from None
            ready += kind == "ready"

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Outcome]:
        """Run `fn(worker, *args, **kwargs)` on every rank; one `Outcome` per rank, in rank order."""
        self._task += 1
        task = (self._task, fn.__module__, fn.__name__, args, kwargs)
        for box in self.inboxes:
            box.put(task)
        results: dict[int, Outcome] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            try:
                task_id, rank, out = self.outbox.get(timeout=0.2)
                if task_id == self._task:
                    results[rank] = out
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in results]
            if dead:
                # let the living ranks report (they should raise within their timeout), then give up
                for r in dead:
                    results[r] = Outcome(r, False, died=True, error=f"rank {r} died (exit code "
                                         f"{self.procs[r].exitcode})", error_type="died")
                continue
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(results))
                self.close()
                raise TimeoutError(f"RankPool.run({fn.__name__}): ranks {missing} did not finish in {timeout} s "
                                   "(a hang); the pool was closed")
        return [results[r] for r in range(self.world_size)]

    def run_ok(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`run`, asserting that every rank returned; the ranks' values."""
        outs = self.run(fn, *args, **kwargs)
        bad = [o for o in outs if not o.ok]
        if bad:
            raise AssertionError("\n".join(f"rank {o.rank}: {o.error}\n{o.trace or ''}" for o in bad))
        return [o.value for o in outs]

    @property
    def broken(self) -> bool:
        return any(not p.is_alive() for p in self.procs)

    def close(self) -> None:
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


_POOLS: dict[int, RankPool] = {}


def shared_pool(world_size: int) -> RankPool:
    """The session's pool of `world_size` ranks, started on first use (restarted if a rank died)."""
    pool = _POOLS.get(world_size)
    if pool is not None and pool.broken:
        pool.close()
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool


def close_shared_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
