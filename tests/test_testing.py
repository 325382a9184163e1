"""The rank pool of `reshard.testing`: values come back per rank, errors with their type and message, a rank that
dies is named with its exit code or signal, and nothing hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from reshard.testing import RankError, RankPool, describe_exit, free_port, launch

pytestmark = pytest.mark.distributed


def on_rank_value(w, base: int) -> tuple:
    """What each rank sees of itself and of the default world, by a real all-reduce over it."""
    import torch.distributed as dist

    t = torch.tensor([w.rank + 1])
    dist.all_reduce(t)
    return (w.rank, w.world_size, base + w.rank, int(t), dist.get_rank(), w.group.rank, str(w.device))


def on_rank_raise(w) -> None:
    if w.rank == 1:
        raise KeyError("only rank 1 is missing 'x'")
    raise ValueError(f"rank {w.rank}: bad value 7, expected 3")


def on_rank_unpicklable(w):
    return lambda: w.rank  # a value that cannot travel back


def on_rank_die(w, victim: int, how: str) -> str:
    if w.rank == victim:
        if how == "exit":
            os._exit(17)
        os.kill(os.getpid(), signal.SIGKILL)
    return "survived"


def on_rank_hang_after_death(w) -> None:
    if w.rank == 0:
        os._exit(3)
    time.sleep(3600)  # a living peer that never reports


RANK_POOL = {"world_size": 3}  # the `pool` fixture's ranks (tests/conftest.py)


def test_one_shot_launch_returns_per_rank_values() -> None:
    out = launch(on_rank_value, 2, 100)
    # 1 + 2 = 3 from the all-reduce: both ranks joined one default world
    assert out == [(0, 2, 100, 3, 0, 0, "cpu"), (1, 2, 101, 3, 1, 1, "cpu")]


def test_pool_runs_many_jobs_in_the_same_ranks(pool) -> None:
    assert pool.run_ok(on_rank_value, 0) == [(r, 3, r, 6, r, r, "cpu") for r in range(3)]
    assert [v[2] for v in pool.run_ok(on_rank_value, 10)] == [10, 11, 12]


def test_raised_error_comes_back_with_type_and_message(pool) -> None:
    outs = pool.run(on_rank_raise)
    assert [o.ok for o in outs] == [False, False, False]
    assert [o.error_type for o in outs] == ["ValueError", "KeyError", "ValueError"]
    assert outs[0].message == "rank 0: bad value 7, expected 3"
    assert outs[2].error == "ValueError: rank 2: bad value 7, expected 3"
    assert "on_rank_raise" in outs[1].trace and not outs[1].died
    with pytest.raises(RankError, match=r"3 of 3 ranks failed\nrank 0: ValueError: rank 0: bad value 7"):
        pool.run_ok(on_rank_raise)
    assert pool.run_ok(on_rank_value, 0)[0][0] == 0  # the pool survives raised errors


def test_unpicklable_value_is_an_error_not_a_hang(pool) -> None:
    outs = pool.run(on_rank_unpicklable, timeout=60)
    assert all(o.error_type == "TypeError" and "cannot return the value of on_rank_unpicklable" in o.message
               for o in outs), outs


@pytest.mark.parametrize("how,expected", [("exit", "exit code 17"), ("kill", "signal SIGKILL")])
def test_dead_rank_is_named_fast(how: str, expected: str) -> None:
    with RankPool(3) as p:
        start = time.monotonic()
        outs = p.run(on_rank_die, 2, how, timeout=120)
        elapsed = time.monotonic() - start
        assert outs[2].died and not outs[2].ok and outs[2].error == f"rank 2 died ({expected})"
        assert [o.value for o in outs[:2]] == ["survived", "survived"]
        assert elapsed < 20, elapsed  # detected by polling, not by a timeout
        assert p.broken
        with pytest.raises(RuntimeError, match="closed or broken"):
            p.run(on_rank_die, 2, how)


def test_living_ranks_that_hang_after_a_death_raise_instead_of_hanging() -> None:
    with RankPool(2, dead_grace_s=2.0) as p:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 2.0 s of the death of rank 0 "
                                               r"\(exit code 3\)"):
            p.run(on_rank_hang_after_death, timeout=600)
        assert time.monotonic() - start < 30


def test_launch_names_the_failed_ranks() -> None:
    with pytest.raises(RankError, match="rank 1: KeyError") as info:
        launch(on_rank_raise, 2)
    assert [o.error_type for o in info.value.outcomes] == ["ValueError", "KeyError"]


def test_describe_exit_and_free_port() -> None:
    assert describe_exit(0) == "exit code 0" and describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(None) == "still running"
    port = free_port()
    assert 0 < port < 65536
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # still free
