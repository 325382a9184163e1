"""Transfer counts against hand-worked minima, exact coverage by independent box arithmetic, the numeric transfer
columns against the `Transfer`s, and the refit policy's per-item sums against `reshard.cost.LinkLoads`."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from reshard import Layout, Mesh, Topology, clear_plan_cache, plan, plan_many
from reshard.cost import HARDWARE, LinkLoads, link_time
from reshard.planner import LINKS, PlanItem
from reshard.planner import _build as planner_build
from reshard.refit._policy import item_seconds_and_bytes


def layout(shape: tuple[int, ...], ranks: list[int], dims: tuple[int, ...], placements: list,
           dtype: torch.dtype = torch.float32) -> Layout:
    return Layout(shape, Mesh(torch.tensor(ranks).reshape(dims)), placements, dtype)


def rows_written(p, rank: int, num_rows: int) -> np.ndarray:
    """How many times each global row is written on `rank`, from the transfers' global boxes (full-width rows)."""
    count = np.zeros(num_rows, np.int64)
    for t in p.transfers:
        if t.dst_rank == rank:
            g = t.global_box
            count[g.offsets[0]:g.offsets[0] + g.shape[0]] += 1
    return count


def test_tp8_to_tp4_replicas_plans_one_transfer_per_box_and_domain() -> None:
    """TP8 x DP2 (ranks 0-15) -> TP4 x 4 replicas (ranks 16-31), domains of 8, a (64, 8) float32 (row slabs of 8
    rows = 256 B, `min_split_bytes=64` so a box could be cut into 4). Each domain holds two TP4 replicas: every TP8
    box is needed by 2 of its ranks, so it crosses the network once (8 per domain) and is forwarded once: 32 transfers,
    the same count as a per-tensor exact-overlap plan (16 ranks x 2 boxes). Splitting each box over both needers
    (the rule before `SPREAD_FACTOR = 1`) doubles that to 64 with the same per-rank loads: the negative control."""
    shape = (64, 8)
    src = layout(shape, list(range(16)), (2, 8), [Replicate(), Shard(0)])
    dst = layout(shape, list(range(16, 32)), (4, 4), [Replicate(), Shard(0)])
    topo = Topology(domain_size=8)
    p = plan(src, dst, topo, min_split_bytes=64)
    assert p.stats.num_transfers == 32
    assert p.stats.network_bytes == p.stats.network_lower_bound == 2 * 64 * 8 * 4  # each domain receives it once
    recv = [p.stats.per_rank[r].network_recv for r in range(16, 32)]
    assert max(recv) == min(recv) == 8 * 8 * 4  # one 8-row box each
    for r in range(16, 32):
        j = (r - 16) % 4  # TP4 index: rows 16j:16j+16
        expected = np.zeros(64, np.int64)
        expected[16 * j:16 * j + 16] = 1
        assert (rows_written(p, r, 64) == expected).all(), r
    old = planner_build.SPREAD_FACTOR
    try:
        planner_build.SPREAD_FACTOR = 8
        clear_plan_cache()
        split = plan(src, dst, topo, min_split_bytes=64)
    finally:
        planner_build.SPREAD_FACTOR = old
        clear_plan_cache()
    assert split.stats.num_transfers == 64 and split.stats.network_bytes == p.stats.network_bytes


@pytest.mark.parametrize("replicas, shards, per_rank", [(2, 8, 2), (8, 2, 8)])
def test_s0_to_replicated_s0_makes_the_exact_overlap_count(replicas: int, shards: int, per_rank: int) -> None:
    """`S(0)` on 16 ranks -> `[R, S(0)]` on a `replicas x shards` mesh of 16 other ranks, every rank its own domain
    (no relay), a (32, 3) float32. A destination shard is `32 / shards` rows; the source shards are 2 rows each, so
    it meets `16 / shards` of them: 2 per rank on `2 x 8` (32 transfers, the "512 boxes" of 256 ranks), 8 per rank on
    `8 x 2` (128: each destination needs half the tensor, held by 8 distinct ranks, so no fewer transfers cover
    it). Every row of the rank's shard is written exactly once."""
    shape = (32, 3)
    src = layout(shape, list(range(16)), (16,), [Shard(0)])
    dst = layout(shape, list(range(16, 32)), (replicas, shards), [Replicate(), Shard(0)])
    p = plan(src, dst)
    assert p.stats.num_transfers == 16 * per_rank
    assert p.stats.messages == 16 * per_rank  # one box per (sender, receiver): nothing left to merge
    rows = 32 // shards
    for r in range(16, 32):
        j = (r - 16) % shards
        expected = np.zeros(32, np.int64)
        expected[rows * j:rows * (j + 1)] = 1
        assert (rows_written(p, r, 32) == expected).all(), r


def many_item_plan():
    """60 tensors of one geometry (units of several members) plus one other: (8, 6) TP2 x 2 -> 4 replicas x TP2
    and a (5, 3) `S(0)` -> `R`, domains of 4."""
    items = [PlanItem(layout((8, 6), [0, 1, 2, 3], (2, 2), [Shard(0), Shard(1)]),
                      layout((8, 6), list(range(4, 12)), (4, 2), [Replicate(), Shard(0)]), i, i) for i in range(60)]
    items.append(PlanItem(layout((5, 3), [0, 1], (2,), [Shard(0)]),
                          layout((5, 3), [2, 3, 4, 5], (4,), [Replicate()]), 99, 99))
    return plan_many(items, Topology(domain_size=4))


def test_transfer_columns_are_the_transfers() -> None:
    p = many_item_plan()
    assert max(len(u.members) for u in p._raw.rows) > 1  # units of several tensors are expanded member by member
    c = p.transfer_columns()
    got = list(zip(c.src.tolist(), c.dst.tolist(), c.nbytes.tolist(), [LINKS[k] for k in c.link.tolist()],
                   c.stage.tolist(), c.chunk.tolist(), c.item.tolist()))
    assert got == [(t.src_rank, t.dst_rank, t.nbytes, t.link, t.stage, t.chunk, t.item) for t in p.transfers]
    assert int(c.nbytes.sum()) == p.stats.total_bytes


def test_policy_item_seconds_and_bytes_match_link_loads_per_transfer() -> None:
    """The refit policy's per-item sums on columns equal summing each `Transfer` into `reshard.cost.LinkLoads`."""
    p = many_item_plan()
    hw = next(iter(HARDWARE.values()))
    loads: dict[int, LinkLoads] = defaultdict(LinkLoads)
    moved: dict[int, int] = defaultdict(int)
    for t in p.transfers:
        loads[t.item].add_transfer(t.src_rank, t.dst_rank, t.link, t.nbytes, messages=0)
        if t.link != "local" and t.src_rank != t.dst_rank:
            moved[t.item] += t.nbytes
    expected = [(link_time(loads[i], hw).seconds if i in loads else 0.0, moved[i]) for i in range(len(p.items))]
    got = item_seconds_and_bytes(p, hw)
    assert got == expected
    assert any(s > 0 for s, _ in got) and any(b > 0 for _, b in got)
