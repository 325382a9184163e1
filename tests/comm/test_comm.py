"""Comm, end to end on 8 gloo ranks on this machine, against DTensor's own `distribute_tensor` as ground truth.

One pool of ranks serves the whole module (see `reshard.testing.RankPool`); the correctness cases run in one job
(`comm_cases.run_cases`) and each is reported as its own test.
"""

from __future__ import annotations

import pytest
import torch
from comm_cases import build_cases, run_cases

pytestmark = pytest.mark.distributed

WORLD = 8
CASES = build_cases()


RANK_POOL = WORLD  # the `pool` fixture's ranks (tests/conftest.py)


@pytest.fixture(scope="module", params=["zero_copy", "staged"])
def case_results(pool, request):
    """Every case, run once on every rank, on the zero-copy path and on the staged path (`RESHARD_ZERO_COPY=0`):
    `{case id: [(ok, result or error) per rank]}`."""
    outs = pool.run_ok(run_cases, CASES, staged=request.param == "staged", timeout=600)
    return {c.id: [outs[r][i] for r in range(WORLD)] for i, c in enumerate(CASES)}


def test_cases_take_the_zero_copy_path() -> None:
    """Some cases' plans mark messages direct and some do not, so both paths are exercised by the cases above."""
    from comm_cases import _mesh_ranks

    from reshard import Layout, Mesh, Topology, plan

    marked = []
    for c in CASES:
        src = Layout(c.shape, Mesh(torch.as_tensor(c.src_mesh)), list(c.src_pl), c.dtype)
        dst = Layout(c.shape, Mesh(torch.as_tensor(c.dst_mesh)), list(c.dst_pl), c.dtype)
        p = plan(src, dst, Topology(domain_size=c.domain_size), relay=c.relay, staging_bytes=c.staging,
                 min_split_bytes=c.min_split)
        ranks = set(_mesh_ranks(torch.as_tensor(c.src_mesh))) | set(_mesh_ranks(torch.as_tensor(c.dst_mesh)))
        msgs = [m for r in ranks for ch in p.for_rank(r).chunks for m in (*ch.sends, *ch.recvs)]
        marked.append((any(m.direct for m in msgs), any(not m.direct for m in msgs)))
    assert any(d for d, _ in marked) and any(s for _, s in marked), marked


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


def on_rank_zero_copy(w, dst_strided: bool) -> dict:
    """TP4 `S(0)` -> TP2 x 2 `[R, S(0)]`: every message is one box contiguous on both sides (planned direct)."""
    from comm_cases import as_bytes, dtensor_local, full_tensor
    from torch.distributed.tensor import Replicate, Shard

    from reshard import Layout, Mesh, plan
    from reshard.comm import execute

    src = Layout((64, 48), Mesh([0, 1, 2, 3]), [Shard(0)], torch.float32)
    dst = Layout((64, 48), Mesh([[4, 5], [6, 7]]), [Replicate(), Shard(0)], torch.float32)
    p = plan(src, dst, staging_bytes=1 << 14)  # several chunks
    full = full_tensor(src.shape, src.dtype, "zero-copy")
    s = [dtensor_local(full, src)] if w.rank in src.ranks else None
    out = {}
    w.group.cache.clear()  # fresh staging, and none left behind for later tests on the shared pool
    for zero_copy in (True, False):
        d = None
        if w.rank in dst.ranks:
            shape = dst.local_shape(w.rank)
            # a strided destination (a transposed buffer): its boxes are not contiguous, the staged path is taken
            d = torch.zeros(shape[::-1]).t() if dst_strided else torch.zeros(shape)
        rep = execute(p, w.rank, s, None if d is None else [d], w.group, zero_copy=zero_copy, timeout=30)
        ok = d is None or torch.equal(as_bytes(d.contiguous()), as_bytes(dtensor_local(full, dst)))
        out[zero_copy] = (ok, rep.bytes_direct, rep.bytes_sent + rep.bytes_received)
    w.group.cache.clear()
    return out


@pytest.mark.parametrize("dst_strided", [False, True])
def test_zero_copy_and_staged_paths_give_dtensor_bytes(pool, dst_strided) -> None:
    outs = pool.run_ok(on_rank_zero_copy, dst_strided)
    for r, o in enumerate(outs):
        assert o[True][0] and o[False][0], (r, o)  # bit-exact against DTensor on both paths
        assert o[False][1] == 0, (r, o)  # forced staged: nothing direct
        moved = o[True][2]
        assert moved > 0, (r, o)
        if dst_strided and r >= 4:
            assert o[True][1] == 0, (r, o)  # strided destination: received through staging
        else:
            assert o[True][1] == moved, (r, o)  # every byte straight from / into the tensors
