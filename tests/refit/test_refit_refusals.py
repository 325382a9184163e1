"""Refusals of a `Refit` that must say what differs: ranks planning rank-locally with and without delta (one batch
per chunk), on 4 gloo ranks (0-1 trainer, 2-3 engine).

Functions named `on_rank_*` run on the ranks of the shared pool (see `reshard.testing.RankPool`).
"""

from __future__ import annotations

import time

import pytest
import torch
from comm_cases import expect_all_raise
from torch.distributed.tensor import Shard

pytestmark = pytest.mark.distributed

RANK_POOL = 4  # the `pool` fixture's ranks (tests/conftest.py)


def on_rank_local_delta_differs(w, delta_ranks: list[int]) -> str:
    """A `[6, 4]` weight, rows over ranks 0-1, columns over ranks 2-3, planned rank-locally; `Refit(delta=True)` on
    `delta_ranks` only. The destinations must stay untouched."""
    from reshard.planner import Layout, Mesh
    from reshard.refit import Refit

    src = Layout((6, 4), Mesh([0, 1]), [Shard(0)], torch.float32, name="w")
    dst = Layout((6, 4), Mesh([2, 3]), [Shard(1)], torch.float32, name="w")
    refit = Refit(w.group, planning="local", delta=w.rank in delta_ranks, timeout=30)
    local = None
    if w.rank < 2:
        refit.add_source("w", torch.arange(12.0).reshape(3, 4) + 12 * w.rank, src)
    else:
        local = torch.full(dst.local_shape(w.rank), -1.0)
        refit.add_destination("w", local, dst)
    try:
        refit.run()
    except ValueError:
        assert local is None or bool((local == -1.0).all()), f"rank {w.rank}: bytes moved before the refusal"
        raise
    return "ran"


def test_ranks_that_differ_only_in_delta_under_local_planning_are_told_so(pool) -> None:
    """Before, every rank read "same inputs as rank 0 but a different plan; do all ranks run the same reshard and
    torch versions?"; now the field and both values."""
    outs = pool.run(on_rank_local_delta_differs, [3])
    expect_all_raise(outs, "ValueError", "ranks hold different plans",
                     "single_batch_chunks (plan_local's; set by Refit(delta=True)): rank 0 has False, rank 3 has True")
    assert all("same inputs" not in o.error for o in outs)
    assert pool.run_ok(on_rank_local_delta_differs, []) == ["ran"] * 4  # the same refit, agreed, runs


def on_rank_one_never_runs(w, absent: int, late: list[int], tag: str) -> str:
    """The refit of `on_rank_local_delta_differs` (global planning), on a group of its own with a 5 s timeout; rank
    `absent` never calls `run()`, the ranks in `late` call it 3 s after the others (more than the roll call's
    2 s wait, so their own timeouts end after an early rank's)."""
    from reshard.planner import Layout, Mesh
    from reshard.refit import Refit

    group = w.new_group(tag, timeout=60)
    try:
        src = Layout((6, 4), Mesh([0, 1]), [Shard(0)], torch.float32, name="w")
        dst = Layout((6, 4), Mesh([2, 3]), [Shard(1)], torch.float32, name="w")
        refit = Refit(group, timeout=5)
        if w.rank < 2:
            refit.add_source("w", torch.zeros(3, 4), src)
        else:
            refit.add_destination("w", torch.zeros(dst.local_shape(w.rank)), dst)
        if w.rank == absent:
            time.sleep(16)  # never runs; leaves after every other rank raised
            return "absent"
        if w.rank in late:
            time.sleep(3)
        try:
            refit.run()
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {e}"
        return "ran"
    finally:
        group.close()


@pytest.mark.slow  # waits out a 5 s timeout
def test_a_rank_that_never_runs_is_named_on_every_rank(pool) -> None:
    """Rank 2 never calls `run()`; ranks 0 and 1 call it 3 s after rank 3. Before, rank 3's roll call (when its
    wait ended) found ranks 0 and 1 not yet there too, and every rank was told "rank 0 failed"; now every rank
    names rank 2 alone, in the same words."""
    outs = pool.run_ok(on_rank_one_never_runs, 2, [0, 1], "never-runs", timeout=120)
    assert outs[2] == "absent"
    for r in (0, 1, 3):
        assert outs[r].startswith("CommError"), (r, outs[r])
        assert "refit metadata exchange timed out after 5.0 s: ranks [2] never reached it" in outs[r], (r, outs[r])
        assert "rank 0 failed" not in outs[r] and "ranks [0" not in outs[r], (r, outs[r])


def on_rank_counts_token_warnings(w, tag: str) -> int:
    """How many "no token" warnings this rank logs while joining a loopback group with no token."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("reshard.comm._rendezvous")
    log.addHandler(handler)
    try:
        w.new_group(tag, timeout=30).close()
    finally:
        log.removeHandler(handler)
    return sum("no token" in r.getMessage() for r in records)


def test_the_no_token_warning_comes_once_per_group(pool) -> None:
    """Before, every process of a group logged it (`make demo`: 8 times)."""
    assert sum(pool.run_ok(on_rank_counts_token_warnings, "token-warning")) == 1
