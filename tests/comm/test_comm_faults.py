"""A rank killed in the middle of a reshard: every other rank raises within the timeout, none hangs.

Runs on its own small pool (3 ranks), because a killed rank breaks the pool's groups.
"""

from __future__ import annotations

import os

import pytest
import torch
from comm_cases import Hooked, as_bytes, dtensor_local, full_tensor
from torch.distributed.tensor import Shard

from reshard import Layout, Mesh, plan

pytestmark = pytest.mark.distributed

TIMEOUT = 3.0


RANK_POOL = {"world_size": 3}  # the `pool` fixture's ranks (tests/conftest.py)
RANK_POOL_BACKENDS = ("gloo", "reshard_nccl_rules")  # NCCL's rules: a dead peer is a stall until reshard's deadline


def on_rank_killed(w, victim: int) -> bool:
    """Everyone sends to everyone in many chunks; `victim` exits abruptly when packing its second chunk."""
    import reshard.comm._executor as ex
    import reshard.comm._paths as paths
    from reshard.comm import reshard

    src = Layout((96, 64), Mesh([0, 1, 2]), [Shard(0)], torch.float32)
    dst = Layout((96, 64), Mesh([2, 0, 1]), [Shard(1)], torch.float32)
    p = plan(src, dst, staging_bytes=4096, min_split_bytes=256)
    assert p.stats.num_chunks > 4
    full = full_tensor(src.shape, src.dtype, "killed")
    s = dtensor_local(full, src)
    d = torch.zeros(dst.local_shape(w.rank))
    original = ex.prepare_pack
    calls = []

    def dying_prepare_pack(*args, **kw):
        calls.append(1)
        inner = original(*args, **kw)
        return Hooked(inner, lambda: os._exit(17)) if len(calls) == 2 else inner

    if w.rank == victim:  # every pack the executor prepares: its own and its send programs' (`_paths`)
        ex.prepare_pack = paths.prepare_pack = dying_prepare_pack
    try:
        reshard(s, d, p, w.group, timeout=TIMEOUT)
    finally:
        ex.prepare_pack = paths.prepare_pack = original
    return torch.equal(as_bytes(d), as_bytes(dtensor_local(full, dst)))


def test_killed_rank_makes_every_other_rank_raise_within_timeout(pool) -> None:
    outs = pool.run(on_rank_killed, 1, timeout=60)
    assert outs[1].died and "exit code 17" in outs[1].error
    for o in (outs[0], outs[2]):
        assert o.error_type == "CommError", f"rank {o.rank}: {o.error}\n{o.trace}"
        assert f"rank {o.rank} of" in o.error
        assert "rank 1" in o.error.replace(f"rank {o.rank} of", ""), o.error  # the victim is named
        assert o.seconds < TIMEOUT + 5.0, (o.rank, o.seconds)  # time-to-error (a hang takes 60 s)
