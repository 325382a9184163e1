"""A steady refit's all-rank control rounds, counted from the messages on 4 real gloo ranks' control backends
(`reshard.testing.counted_group`): one agreement before data moves (the live check, which is also the plan
handshake) and the completion round after it, 2 in all; the older protocol (the live check, then the plan
handshake) is 3. What the single agreement must still refuse, it refuses on every rank before any byte moves.

Setup (`live_cases.job_rounds`): ranks 0 and 1 train `weight` (8, 6) as a DTensor `Shard(0)`, ranks 2 and 3 hold it
`Shard(1)`; the expected values are cut by hand from the full tensor of each run's seed.
"""

from __future__ import annotations

import pytest
import torch
from live_cases import ENGINE, full, job_rounds

pytestmark = pytest.mark.distributed

RANK_POOL = 4  # the `pool` fixture's ranks (tests/conftest.py)
RUNS = 3  # steady runs per job: the count holds run after run, not only on the first steady one


def _landed(out: list, ranks: tuple[int, ...], cut) -> None:
    """After steady run `i`, each engine rank holds its cut of `full(2 + i)` (the values really moved)."""
    for r in ranks:
        for i, got in enumerate(out[r]["runs"]):
            assert torch.equal(got, cut(full(2 + i), r)), (r, i)


def _columns(t: torch.Tensor, rank: int) -> torch.Tensor:
    i = ENGINE.index(rank)
    return t[:, 3 * i: 3 * i + 3]


def test_a_steady_refit_has_two_all_rank_control_rounds(pool) -> None:
    out = pool.run_ok(job_rounds, RUNS)
    for r in (1, 2, 3):  # any rank but the lowest sends one message down-tree per agreement (see counted_group)
        assert out[r]["rounds"] == [2] * RUNS, (r, out[r]["rounds"])
    assert all(o["collectives"] == [[]] * RUNS for o in out), [o["collectives"] for o in out]
    assert all(o["error"] is None for o in out)
    _landed(out, ENGINE, _columns)


def test_the_older_protocol_counts_three_rounds(pool) -> None:
    """The control: the counter sees the extra agreement of the older steady run (live check + plan handshake)."""
    out = pool.run_ok(job_rounds, RUNS, separate=True)
    for r in (1, 2, 3):
        assert out[r]["rounds"] == [3] * RUNS, (r, out[r]["rounds"])
    _landed(out, ENGINE, _columns)


def test_a_rank_outside_the_plan_takes_part_in_the_agreement_only(pool) -> None:
    """Rank 3 holds nothing (rank 2 is the whole engine): it still agrees before data moves (1 round: the completion
    round is the plan's ranks'), and the others have 2."""
    out = pool.run_ok(job_rounds, RUNS, idle=True)
    for r in (1, 2):
        assert out[r]["rounds"] == [2] * RUNS, (r, out[r]["rounds"])
    assert out[3]["rounds"] == [1] * RUNS, out[3]["rounds"]
    assert out[3]["runs"] == []
    _landed(out, (2,), lambda t, r: t)


@pytest.mark.parametrize("fault, words", [
    ("shape", "source 'weight' on rank 1 changed since the plan was built: local shape (4, 6) -> (5, 6)"),
    ("alias", "shares memory"),
])
def test_a_steady_refit_still_refuses_on_every_rank_before_data_moves(pool, fault, words) -> None:
    """A changed source shape on one rank (the live check's) and a destination that now shares memory with another
    (the executor's own check, which the plan handshake carried before): every rank raises, naming it; the engine
    keeps the last good run's values."""
    out = pool.run_ok(job_rounds, 2, fault=fault)
    for r, o in enumerate(out):
        assert o["error"] is not None, (r, "ran")
        assert "Refit: registered tensors changed since the plan was built, nothing was moved" in o["error"], o["error"]
        assert words in o["error"], (r, o["error"])
    for r in ENGINE:
        first, last = out[r]["runs"]
        assert torch.equal(first, _columns(full(2), r)), r
        assert torch.equal(last, first), (r, "data moved after a refusal")
