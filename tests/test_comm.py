"""Comm, end to end on 8 gloo ranks on this machine, against DTensor's own `distribute_tensor` as ground truth.

One pool of ranks serves the whole module (see `reshard.testing.RankPool`); the correctness cases run in one job
(`comm_cases.run_cases`) and each is reported as its own test.
"""

from __future__ import annotations

import pytest
from comm_cases import build_cases, run_cases

from reshard.testing import shared_pool

pytestmark = pytest.mark.distributed

WORLD = 8
CASES = build_cases()


@pytest.fixture(scope="module")
def pool():
    return shared_pool(WORLD)


@pytest.fixture(scope="module")
def case_results(pool):
    """Every case, run once on every rank: `{case id: [(ok, result or error) per rank]}`."""
    outs = pool.run_ok(run_cases, CASES, timeout=600)
    return {c.id: [outs[r][i] for r in range(WORLD)] for i, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reshard_matches_dtensor(case, case_results) -> None:
    per_rank = case_results[case.id]
    errors = [f"rank {r}: {res}" for r, (ok, res) in enumerate(per_rank) if not ok]
    assert not errors, "\n".join(errors)
    results = [res for _, res in per_rank]
    assert any(r["checked"] for r in results) or not case.dst_mesh
    stats = results[0]
    for key, want in case.expect.items():
        if want is True:
            assert stats[key], (key, stats)
        else:
            assert stats[key] == want, (key, stats)
