"""Refusals of a `Refit` that must say what differs: ranks planning rank-locally with and without delta (one batch
per chunk), on 4 gloo ranks (0-1 trainer, 2-3 engine).

Functions named `on_rank_*` run on the ranks of the shared pool (see `reshard.testing.RankPool`).
"""

from __future__ import annotations

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
