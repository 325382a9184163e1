"""The refit metadata round on real gloo ranks (4, one pool for the module): records all-gathered, each distinct
registration table broadcast once by its lowest holder (`reshard.refit._metawire`).

Oracle: DTensor's own shards (`dtensor_local`: `distribute_tensor(...).to_local()`, compared as bytes) for the
refit that runs; for a table whose bytes do not match the digest its owner announced, a `CommError` naming the
owner on every rank, with the same refit run untampered as the negative control.
"""

from __future__ import annotations

import pytest
import torch
from comm_cases import as_bytes, dtensor_local, full_tensor
from torch.distributed.tensor import Replicate, Shard

from reshard import Layout, Mesh
from reshard.testing import RankPool

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def pool():
    with RankPool(4) as ranks:  # trainer 0, 1; engine 2, 3
        yield ranks


def on_rank_refit(w, tamper: bool) -> dict:
    """Trainer ranks 0, 1 (`S(0)`) -> engine ranks 2, 3 (`[R, S(1)]` over a 2x1 mesh: two replicas), two weights.
    With `tamper`, rank 2 (the engine table's owner) broadcasts a table other than the one it announced."""
    import reshard.refit._metawire as rr  # the module of the metadata round
    from reshard import Refit

    src = Layout((12, 6), Mesh([0, 1]), [Shard(0)], torch.float32)
    dst = Layout((12, 6), Mesh([[2], [3]]), [Replicate(), Shard(1)], torch.float32)
    full = {n: full_tensor(src.shape, src.dtype, n) for n in ("a", "b")}
    refit = Refit(w.group, timeout=30)
    got = {}
    for n in full:
        if w.rank in src.ranks:
            refit.add_source(n, dtensor_local(full[n], src).clone(), src)
        else:
            got[n] = torch.zeros(dst.local_shape(w.rank))
            refit.add_destination(n, got[n], dst)
    original = rr.split_registration
    if tamper and w.rank == 2:
        def split(meta):
            record, table, data = original(meta)
            return record, table, data.replace(b'"a"', b'"z"')
        rr.split_registration = split
    try:
        refit.run()
    finally:
        rr.split_registration = original
    return {n: torch.equal(as_bytes(t), as_bytes(dtensor_local(full[n], dst))) for n, t in got.items()}


def test_the_round_moves_every_weight(pool) -> None:
    outs = pool.run_ok(on_rank_refit, False, timeout=120)
    assert outs[2] == outs[3] == {"a": True, "b": True}


def test_a_table_that_does_not_match_its_digest_is_refused_on_every_rank_naming_its_owner(pool) -> None:
    outs = pool.run(on_rank_refit, True, timeout=120)
    for o in outs:
        assert o.error_type == "CommError", f"rank {o.rank}: {o.error}\n{o.trace}"
        assert "rank 2's registration table does not match its digest" in o.error, (o.rank, o.error)
