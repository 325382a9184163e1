"""Rank-local plans (`plan_local`): every rank's program, run together in one process by a strict model of the
executor, against the layouts' own pieces.

The model: each rank posts its chunks in order, and posts chunk `c` only once its chunk `c - 1` has received
everything (the strictest pipeline: the executor keeps more in flight, and posting more never stops a first-in
first-out transport from matching). A message goes into its pair's queue when posted and is taken by the receiver's
next receive from that peer, which must list the same boxes at the same offsets. Forwards are packed from the
relay's destination tensor when posted, so a forward before its arrival sends stale values. The run must end with
every rank done (no deadlock), every destination element equal to the global tensor's, each chunk within the
staging share, and the bytes per link kind equal to the global plan's.
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_planner_local import local_cases

from reshard.planner import PIPELINE_DEPTH, Layout, Mesh, PlanItem, Topology, fuse, plan_local, plan_many
from reshard.planner._local_plan import BLOCK_ITEMS


def _global(item: int, layout) -> torch.Tensor:
    """Distinct values per element and item (exact in float32 for the small shapes here)."""
    n = 1
    for s in layout.shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + 1000 * item + 1).reshape(tuple(layout.shape)).to(layout.dtype)


def _sl(box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape))


def run_local_plans(items, topology, relay: bool, staging: int, single: bool = False) -> dict:
    """Plan every rank locally and run the programs together (see the module docstring); returns statistics."""
    items = [it if isinstance(it, PlanItem) else PlanItem(it[0], it[1], src_tensor=i, dst_tensor=i)
             for i, it in enumerate(items)]
    ranks = sorted({r for it in items for r in (*it.src.ranks, *it.dst.ranks)})
    plans = {r: plan_local(items, topology, r, relay=relay, staging_bytes=staging, single_batch_chunks=single)
             for r in ranks}
    fingerprints = {p.fingerprint for p in plans.values()}
    assert len(fingerprints) == 1, "ranks with the same inputs must agree on the fingerprint"
    progs = {r: p.for_rank(r) for r, p in plans.items()}
    cap = staging // PIPELINE_DEPTH
    for r, prog in progs.items():
        for c in prog.chunks:
            assert c.send_bytes + c.recv_bytes <= cap, f"rank {r} chunk {c.index} over the staging share"
            assert c.unpack_before_pack < c.index, f"rank {r} chunk {c.index} forwards what it receives itself"
            if single:
                assert len({(True, m.peer) for m in c.sends} | {(False, m.peer) for m in c.recvs}) <= 1
    fulls = [_global(i, it.src) for i, it in enumerate(items)]
    # local tensors: sources from the global tensor, destinations empty (NaN where floating)
    src: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
    dst: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
    for i, it in enumerate(items):
        for r in it.src.ranks:
            t = src[r].setdefault(it.src_tensor, torch.zeros(tuple(it.src.local_shape(r)), dtype=it.src.dtype))
            for p in it.src.pieces(r):
                t[_sl(p.local_box)] = fulls[i][_sl(p.global_box)]
        for r in it.dst.ranks:
            dst[r].setdefault(it.dst_tensor, torch.full(tuple(it.dst.local_shape(r)), -1, dtype=it.dst.dtype))
    queues: dict[tuple[int, int], deque] = defaultdict(deque)
    at = {r: 0 for r in ranks}  # the next chunk to post
    posted_not_done = {r: False for r in ranks}

    def post(r: int) -> None:
        c = progs[r].chunks[at[r]]
        for m in c.sends:
            payload = []
            for t in m.transfers:
                tensor = dst[r][t.src_tensor] if t.stage else src[r][t.src_tensor]
                payload.append(tensor[_sl(t.src_box)].clone().to(items[t.item].dst.dtype))
            key = [(t.item, t.stage, t.global_box, t.dst_box, t.nbytes) for t in m.transfers]
            queues[(r, m.peer)].append((key, m.offsets, m.nbytes, m.cuts, payload))
        for t in c.local:
            tensor = dst[r][t.src_tensor] if t.stage else src[r][t.src_tensor]
            dst[r][t.dst_tensor][_sl(t.dst_box)] = tensor[_sl(t.src_box)].to(items[t.item].dst.dtype)

    def complete(r: int) -> bool:
        c = progs[r].chunks[at[r]]
        need = defaultdict(int)
        for m in c.recvs:
            need[m.peer] += 1
        if any(len(queues[(p, r)]) < n for p, n in need.items()):
            return False
        for m in c.recvs:
            key, offsets, nbytes, cuts, payload = queues[(m.peer, r)].popleft()
            assert key == [(t.item, t.stage, t.global_box, t.dst_box, t.nbytes) for t in m.transfers], \
                f"rank {r} chunk {c.index}: message from {m.peer} lists other boxes than its sender"
            assert (offsets, nbytes, cuts) == (m.offsets, m.nbytes, m.cuts)
            for t, values in zip(m.transfers, payload):
                dst[r][t.dst_tensor][_sl(t.dst_box)] = values
        return True

    progress = True
    while progress:
        progress = False
        for r in ranks:
            if at[r] >= len(progs[r].chunks):
                continue
            if not posted_not_done[r]:
                post(r)
                posted_not_done[r] = True
                progress = True
            if complete(r):
                posted_not_done[r] = False
                at[r] += 1
                progress = True
    stuck = {r: at[r] for r in ranks if at[r] < len(progs[r].chunks)}
    assert not stuck, f"deadlock: ranks stuck at chunks {stuck}"
    assert not any(queues.values()), "messages sent that nobody received"
    for i, it in enumerate(items):
        for r in it.dst.ranks:
            for p in it.dst.pieces(r):
                got = dst[r][it.dst_tensor][_sl(p.local_box)]
                assert torch.equal(got, fulls[i][_sl(p.global_box)].to(it.dst.dtype)), f"rank {r} item {i} wrong"
    g = plan_many(items, topology, relay=relay, staging_bytes=staging).stats
    total = defaultdict(int)
    for p in plans.values():
        total["network"] += p.stats.network_bytes
        total["nvlink"] += p.stats.nvlink_bytes
        total["local"] += p.stats.local_bytes
    assert (total["network"], total["nvlink"], total["local"]) == (g.network_bytes, g.nvlink_bytes, g.local_bytes)
    return {"chunks": max(len(p.chunks) for p in progs.values()),
            "messages": sum(p.stats.messages for p in plans.values()), "global_messages": g.messages}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(local_cases())
def test_every_rank_runs_its_own_plan_to_the_right_bytes_without_deadlock(case) -> None:
    src, src2, dst, topology, relay, staging = case
    run_local_plans([(src, dst), (src, dst), (src2, dst)], topology, relay, staging)


@pytest.mark.parametrize("num_items", [3, 2 * BLOCK_ITEMS + 3])
@pytest.mark.parametrize("staging", [256, 1 << 20])
@pytest.mark.parametrize("relay", [True, False])
def test_items_within_and_across_blocks_with_relays(relay: bool, staging: int, num_items: int) -> None:
    """A few items, or more than a block (forwards ordered a block later); relays in domains of 4; chunks of a few
    boxes, or room for everything (a forward must still wait for the chunk its arrival came in)."""
    src = Layout((8, 12), Mesh([0, 1, 2, 3]), "S(1)")
    dst = Layout((8, 12), Mesh([[4, 5], [6, 7]]), "R,S(0)")
    src2 = Layout((8, 12), Mesh([[6, 7], [0, 1]]), "S(0),R")
    items = [(src if i % 3 else src2, dst) for i in range(num_items)]
    out = run_local_plans(items, Topology(domain_size=4), relay, staging)
    assert out["chunks"] > (3 if staging == 256 else 1 if relay else 0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(local_cases())
def test_single_batch_chunks_for_delta_runs(case) -> None:
    """One batch (one peer, one direction) per chunk, as delta runs need: the same bytes, no deadlock."""
    src, src2, dst, topology, relay, staging = case
    run_local_plans([(src, dst), (src2, dst)], topology, relay, staging, single=True)


def test_fused_destination_and_overlapping_groups() -> None:
    """A fused qkv destination (three items into one tensor) on ranks that also hold sources."""
    q = Layout((8, 4), Mesh([0, 1, 2, 3]), "S(0)")
    k = Layout((4, 4), Mesh([0, 1, 2, 3]), "S(1)")
    dst_q = Layout((8, 4), Mesh([2, 3, 4, 5]), "S(0)")
    dst_k = Layout((4, 4), Mesh([2, 3, 4, 5]), "S(0)")
    fq, fk, fv = fuse([dst_q, dst_k, dst_k], dim=0)
    items = [PlanItem(q, fq, 0, 0), PlanItem(k, fk, 1, 0), PlanItem(k, fv, 2, 0)]
    run_local_plans(items, Topology(domain_size=2), True, 512)


@pytest.mark.parametrize("relay", [True, False])
def test_custom_layouts_overlapping_needs_and_a_box_held_twice(relay: bool) -> None:
    """Ranks of one domain need partially overlapping rows (a custom layout); and a rank that holds one global box at
    two places of its tensor, so a relay forwards to itself (a local copy once the box has arrived)."""
    from reshard.planner import Box, ExplicitLayout, Piece

    src = Layout((10, 2), Mesh([0, 1]), "S(0)")
    windows = {2: (0, 6), 3: (3, 6), 4: (5, 5)}
    dst = ExplicitLayout((10, 2), torch.float32,
                         {r: [Piece(Box((a, 0), (n, 2)), Box((0, 0), (n, 2)))] for r, (a, n) in windows.items()},
                         {r: (n, 2) for r, (a, n) in windows.items()})
    twice = ExplicitLayout((10, 2), torch.float32,
                           {5: [Piece(Box((0, 0), (4, 2)), Box((0, 0), (4, 2))),
                                Piece(Box((0, 0), (4, 2)), Box((4, 0), (4, 2)))],
                            6: [Piece(Box((0, 0), (4, 2)), Box((0, 0), (4, 2)))]},
                           {5: (8, 2), 6: (4, 2)})
    topology = Topology(domain_of={0: "a", 1: "b", 2: "c", 3: "c", 4: "c", 5: "d", 6: "d"})
    items = [(src, dst), (src, twice), (src, twice)]
    run_local_plans(items, topology, relay, 1 << 20)
    if relay:
        copies = [t for r in (5, 6) for t in plan_local(items, topology, r).part.transfers
                  if t.stage and t.src == t.dst]
        assert copies, "expected a relay forwarding to itself"
