"""Flat partitions as sources, end to end on gloo ranks, against DTensor's `distribute_tensor`.

Each source rank of a `FlatRangeLayout` passes `execute` its 1-D flat partition (the range's elements, then
padding), not its row-aligned window: the executor reads the plan's window boxes in the partition itself
(`reshard.planner.on_flat_sources`). The partitions start one element into a larger buffer, so a window would
reach before the storage (no `as_strided` view of it exists: before, such a rank needed a copy); the padding and
the buffer around hold NaN, which must never reach a destination. Sizes are odd on purpose: rows split mid-row over
3 ranks, a 1-D tensor whose last rank holds less than a full partition, a 3-D tensor, a tiny tensor whose last
ranks hold only padding, and a `(97, 12)` tensor whose 32 whole rows per rank (1.5 KiB, over the lowered split
size) go straight out of the partition. Destinations shard the last dim (strided boxes out of the partition) or
rows (contiguous boxes).
"""

from __future__ import annotations

import math

import pytest
import torch
from comm_cases import SENTINEL, as_bytes, dtensor_local, expect_all_raise, full_tensor
from test_zero_copy import small_thresholds
from torch.distributed.tensor import Shard

from reshard import Layout, Mesh
from reshard.planner import FlatRangeLayout, PlanItem, flat_partition, plan_many

pytestmark = pytest.mark.distributed

WORLD = 8
RANK_POOL = WORLD  # the shared pool of tests/comm/test_zero_copy.py
SHAPES = [(7, 5), (13,), (3, 4, 5), (1, 2), (97, 12)]
DIM = [1, 0, 2, 1, 0]  # the sharded dim of each destination: the last (strided boxes), or rows (contiguous ones)
SOURCES = 3


def _items() -> list[PlanItem]:
    out = []
    for i, shape in enumerate(SHAPES):
        n = math.prod(shape)
        src = FlatRangeLayout(shape, torch.float32, flat_partition(n, SOURCES), name=f"t{i}")
        dst = Layout(shape, Mesh((3, 4)), (Shard(DIM[i]),), torch.float32, name=f"t{i}")
        out.append(PlanItem(src, dst, src_tensor=i, dst_tensor=i, name=f"t{i}"))
    return out


def _partitions(rank: int, items: list[PlanItem], seed: str, short: int = 0) -> list[torch.Tensor]:
    """This rank's partitions of the seeded tensors: `ps = ceil(n / 3)` elements each (`short` fewer), from
    element 1 of a NaN buffer."""
    out = []
    for i, it in enumerate(items):
        n = math.prod(it.src.shape)
        start, stop = it.src.ranges[rank]
        ps = -(-n // SOURCES) - short
        buffer = torch.full((ps + 3,), float("nan"))
        part = buffer[1:1 + ps]
        held = min(stop - start, ps)  # a short partition holds what fits
        part[:held] = full_tensor(tuple(it.src.shape), torch.float32, f"{seed}{i}").reshape(-1)[start:start + held]
        out.append(part)
    return out


def _fill(parts: list[torch.Tensor], rank: int, items: list[PlanItem], seed: str) -> None:
    """Write the seeded tensors' ranges into the partitions in place (an optimizer step)."""
    for part, new in zip(parts, _partitions(rank, items, seed)):
        part.copy_(new)


def on_rank_flat(w) -> dict:
    """Per path (zero-copy, staged, verified): bit-exact against DTensor; then the same partitions updated in place
    and sent again (the executor reads them, not a copy of them)."""
    from reshard.comm import execute

    items = _items()
    out = {}
    with small_thresholds():
        p = plan_many(items, None, staging_bytes=1 << 12, min_split_bytes=64)
        srcs = _partitions(w.rank, items, "a") if w.rank < SOURCES else None
        w.group.cache.clear()
        for path, (zero_copy, verify) in {"direct": (True, False), "staged": (False, False),
                                          "verified": (True, True)}.items():
            for seed in ("a", "b"):
                if srcs is not None:
                    _fill(srcs, w.rank, items, seed)
                dsts = None
                if w.rank in items[0].dst.ranks:
                    dsts = [torch.empty(it.dst.local_shape(w.rank)) for it in items]
                    for d in dsts:
                        as_bytes(d).fill_(SENTINEL)
                rep = execute(p, w.rank, srcs, dsts, w.group, zero_copy=zero_copy, verify=verify, timeout=30)
                out[(path, seed)] = (dsts is None or all(
                    torch.equal(as_bytes(d), as_bytes(dtensor_local(full_tensor(tuple(it.src.shape), torch.float32,
                                                                                 f"{seed}{i}"), it.dst)))
                    for i, (d, it) in enumerate(zip(dsts, items))), rep.bytes_direct)
        w.group.cache.clear()
    return out


def test_flat_partitions_are_sources_without_a_window(pool) -> None:
    outs = pool.run_ok(on_rank_flat)
    for r, o in enumerate(outs):
        assert all(ok for ok, _ in o.values()), (r, o)
    assert sum(o[("direct", "a")][1] for o in outs) > 0  # some bytes go straight out of the partitions
    assert all(o[("staged", "a")][1] == 0 for o in outs)


def on_rank_short(w) -> None:
    from reshard.comm import execute

    items = _items()
    p = plan_many(items, None)
    srcs = _partitions(w.rank, items, "a", short=1 if w.rank == 1 else 0) if w.rank < SOURCES else None
    dsts = [torch.empty(it.dst.local_shape(w.rank)) for it in items] if w.rank in items[0].dst.ranks else None
    w.group.cache.clear()
    execute(p, w.rank, srcs, dsts, w.group, timeout=30)


def test_a_short_partition_is_refused_on_every_rank(pool) -> None:
    outs = pool.run(on_rank_short)
    expect_all_raise([o for o in outs if o.rank <= 4], "ValueError", "tensor 't0' (item 0): rank 1",
                     "source flat partition 0 has 11 elements, expected at least 12")
