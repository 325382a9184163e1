"""A pool of CPU ranks on this machine, for the demo, the benchmarks and the tests.

`RankPool(world_size)` starts `world_size` processes once (each import of torch costs seconds), joins them in a
gloo default process group, and then runs any number of jobs: `pool.run(fn, *args)` calls `fn(rank, world_size,
*args)` on every rank and returns the per-rank results, with a rank's exception returned (not raised) so callers
can check that every rank raised.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


class RankError(Exception):
    """An exception raised on a rank, carried back with its type name, message and traceback."""

    def __init__(self, type_name: str, message: str, tb: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.traceback = tb

    def __reduce__(self) -> tuple:
        return (RankError, (self.type_name, self.message, self.traceback))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, jobs: Any, results: Any, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    results.put((rank, True, "ready"))
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - carried back to the caller
            results.put((rank, False, RankError(type(e).__name__, str(e), traceback.format_exc())))
    # no destroy_process_group: it may wait on peers that are already gone; the process exit releases gloo


class RankPool:
    """`world_size` gloo ranks kept alive across jobs.

    Args:
        world_size: number of ranks.
        timeout_s: the default process group's timeout, and how long `run` waits for a result.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self._jobs[r], self._results, timeout_s),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.run_results("start-up")

    def run_results(self, what: str, timeout_s: float | None = None) -> list[Any]:
        """One result from every rank, in rank order."""
        out: list[Any] = [None] * self.world_size
        for _ in range(self.world_size):
            try:
                rank, _, value = self._results.get(timeout=timeout_s or self.timeout_s)
            except queue.Empty as e:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                raise TimeoutError(f"RankPool: {what}: no result within {timeout_s or self.timeout_s} s "
                                   f"(dead ranks: {dead})") from e
            out[rank] = value
        return out

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """`fn(rank, world_size, *args, **kwargs)` on every rank; per-rank results, a `RankError` where a rank
        raised.

        `fn` must be a top-level (picklable) function.
        """
        for q in self._jobs:
            q.put((fn, args, kwargs))
        return self.run_results(getattr(fn, "__name__", "job"), timeout_s)

    def run_ok(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Like `run`, but raise the first rank's error, with its traceback, if any rank failed."""
        out = self.run(fn, *args, timeout_s=timeout_s, **kwargs)
        for r, v in enumerate(out):
            if isinstance(v, RankError):
                raise RuntimeError(f"rank {r} failed:\n{v.traceback}")
        return out

    def close(self) -> None:
        for q in self._jobs:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
