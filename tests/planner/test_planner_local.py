"""Rank-local planning (`plan_rank`): every rank's part, checked against the other ranks' parts, an element-by-element
oracle built from the layouts' pieces, and the global plan (`plan_many`) of the same items.

Single process, pure Python: each rank's part is computed in turn, as that rank alone would compute it.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planner_plan import draw_mesh, placements_for  # the planner tests' mesh and placement strategies
from torch.distributed.tensor import Replicate, Shard

from reshard.planner import (
    LINKS,
    Layout,
    Mesh,
    PlanItem,
    Topology,
    fuse,
    plan_many,
    plan_rank,
    vocab_parallel_layout,
)

logger = logging.getLogger(__name__)


def _cells(box) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in ix) for ix in np.ndindex(*box.shape)] if box.ndim else [()]


def _shift(cell: tuple[int, ...], off: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a + b for a, b in zip(cell, off))


def _parts(items, topology, relay, staging, ranks):
    return {r: plan_rank(items, topology, r, relay=relay, staging_bytes=staging) for r in ranks}


def check_local_plan(items, topology, relay: bool = True, staging: int = 1 << 20) -> dict:
    """(a) consistency between ranks, (b) exactly-once coverage from data the sender holds, (c) bytes per link, the
    network lower bound and relay forwards equal `plan_many`'s; returns the busiest ranks of both (d)."""
    items = [it if isinstance(it, PlanItem) else PlanItem(it[0], it[1], src_tensor=i, dst_tensor=i)
             for i, it in enumerate(items)]
    ranks = sorted({r for it in items for r in (*it.src.ranks, *it.dst.ranks)})
    parts = _parts(items, topology, relay, staging, ranks)
    for r, part in parts.items():
        assert len(set(part.transfers)) == len(part.transfers), f"rank {r} lists a transfer twice"
    # (a) what r says it sends to s is what s says it receives from r
    for r, part in parts.items():
        for t in part.transfers:
            assert r in (t.src, t.dst)
            other = t.dst if t.src == r else t.src
            assert t in parts[other].transfers, f"rank {r} has {t} but rank {other} does not"
    every = list({t for p in parts.values() for t in p.transfers})
    # (b) oracle from the layouts' pieces: what each destination local element must hold, and what a source holds
    src_has: dict[tuple, tuple] = {}
    need: dict[tuple, tuple] = {}
    for i, it in enumerate(items):
        for r in it.src.ranks:
            for p in it.src.pieces(r):
                for c in _cells(p.global_box):
                    src_has[(i, r, _shift(c, p.local_box.offsets))] = _shift(c, p.global_box.offsets)
        for r in it.dst.ranks:
            for p in it.dst.pieces(r):
                for c in _cells(p.global_box):
                    need[(i, r, _shift(c, p.local_box.offsets))] = _shift(c, p.global_box.offsets)
    got: Counter = Counter()
    arrived: dict[tuple, tuple] = {}
    for t in every:
        if t.stage == 0:
            for c in _cells(t.global_box):
                g = _shift(c, t.global_box.offsets)
                assert src_has.get((t.item, t.src, _shift(c, t.src_box.offsets))) == g, f"{t} sends what it lacks"
                arrived[(t.item, t.dst, _shift(c, t.dst_box.offsets))] = g
    for t in every:
        itemsize = items[t.item].dst.dtype.itemsize
        assert t.nbytes == t.global_box.numel * itemsize
        for c in _cells(t.global_box):
            g = _shift(c, t.global_box.offsets)
            if t.stage == 1:
                assert arrived.get((t.item, t.src, _shift(c, t.src_box.offsets))) == g, f"{t} forwards no arrival"
            key = (t.item, t.dst, _shift(c, t.dst_box.offsets))
            assert need.get(key) == g, f"{t} writes {key} which needs {need.get(key)}"
            got[key] += 1
    assert set(got) == set(need), f"uncovered: {sorted(set(need) - set(got))[:5]}"
    assert max(got.values(), default=1) == 1, f"twice: {[k for k, v in got.items() if v > 1][:5]}"
    # (c) against the global plan
    g = plan_many(items, topology, relay=relay, staging_bytes=staging)
    s = g.stats
    by_link = defaultdict(int)
    forwarded = 0
    for t in every:
        by_link[t.link] += t.nbytes
        forwarded += t.nbytes if t.stage else 0
    assert (by_link["network"], by_link["nvlink"], by_link["local"]) == (s.network_bytes, s.nvlink_bytes,
                                                                         s.local_bytes)
    if relay:
        assert by_link["network"] == s.network_lower_bound
    cols = g.transfer_columns()
    assert forwarded == int(cols.nbytes[cols.stage == 1].sum())
    for link in LINKS:  # the relay use per link kind as well
        fwd = sum(t.nbytes for t in every if t.stage and t.link == link)
        assert fwd == int(cols.nbytes[(cols.stage == 1) & (cols.link == LINKS.index(link))].sum())
    # (d) balance next to the global plan's (reported, not asserted)
    send = defaultdict(int)
    for t in every:
        if t.src != t.dst:
            send[t.src] += t.nbytes
    busiest = max(send.values(), default=0)
    logger.info("busiest rank sends %d B locally planned, %d B in the global plan", busiest, s.max_rank_send_bytes)
    return {"local_max_send": busiest, "global_max_send": s.max_rank_send_bytes}


@st.composite
def local_cases(draw: st.DrawFn):
    """Random meshes (replicas on either side), placements and shapes on up to 12 ranks, domains, relays."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    world = draw(st.integers(2, 12))

    def side() -> Layout:
        mesh = draw_mesh(draw, world)
        return Layout(shape, Mesh(mesh), draw(placements_for(ndim, mesh.dim())))

    src, dst = side(), side()
    # another stage of a pipelined trainer: the same partition held by other ranks (parts of alike layers are
    # shared between such geometries, where a domain has no source rank)
    other = draw(st.permutations(list(range(world))))[:src.mesh.size]
    src2 = Layout(shape, Mesh(torch.tensor(other).reshape(src.mesh.shape)), src.placements)
    domain = draw(st.sampled_from([None, 1, 2, 3, 4]))
    topology = Topology(domain_size=domain) if domain else Topology()
    return src, src2, dst, topology, draw(st.booleans()), draw(st.sampled_from([64, 256, 1 << 20]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(local_cases())
def test_every_rank_part_agrees_covers_once_and_matches_global_bytes(case) -> None:
    src, src2, dst, topology, relay, staging = case
    check_local_plan([(src, dst), (src, dst), (src2, dst)], topology, relay, staging)


@pytest.mark.parametrize("relay", [True, False])
def test_pipeline_stages_to_engine_domains(relay: bool) -> None:
    """PP2 trainer (each stage `S(0)` over 2 ranks) -> TP2 x 2 replicas: two source geometries of one partition.
    Stages on ranks 0-1 and 2-3, engine on 4-7, domains of 2 and 4: engine domains without a source rank (the
    stages' needs are shared). Stages on ranks 0-1 and 4-5, engine on 2-3 and 6-7, domains of 4: each domain holds
    one stage and needs the other's over the network (not shared)."""
    stage0 = Layout((8, 6), Mesh([0, 1]), [Shard(0)])
    stage1 = Layout((8, 6), Mesh([2, 3]), [Shard(0)])
    dst = Layout((8, 6), Mesh(torch.arange(4, 8).reshape(2, 2)), [Replicate(), Shard(1)])
    for domain in (2, 4):
        check_local_plan([(stage0, dst), (stage0, dst), (stage1, dst), (stage1, dst)], Topology(domain_size=domain),
                         relay)
    stage1 = Layout((8, 6), Mesh([4, 5]), [Shard(0)])
    dst = Layout((8, 6), Mesh([[2, 3], [6, 7]]), [Replicate(), Shard(1)])
    check_local_plan([(stage0, dst), (stage1, dst), (stage0, dst), (stage1, dst)], Topology(domain_size=4), relay)


@pytest.mark.parametrize("relay", [True, False])
def test_trainer_to_engine_replicas_on_domains(relay: bool) -> None:
    """TP2 x DP2 trainer (ranks 0-3) -> TP2 x 4 engine replicas (ranks 4-11), domains of 4: replicas on both sides,
    several domains, several layers of one geometry."""
    src = Layout((8, 6), Mesh(torch.arange(4).reshape(2, 2)), [Replicate(), Shard(0)])
    dst = Layout((8, 6), Mesh(torch.arange(4, 12).reshape(4, 2)), [Replicate(), Shard(1)])
    d = check_local_plan([(src, dst)] * 4, Topology(domain_size=4), relay)
    assert d["local_max_send"] > 0


def test_fused_and_padded_layouts() -> None:
    """qkv fused on the engine (q, k, v in one local tensor) and a padded vocab-parallel embedding, from FSDP-style
    row shards; the engine overlaps the trainer's ranks."""
    train = Mesh([0, 1, 2, 3])
    q = Layout((8, 4), train, [Shard(0)])
    k = Layout((4, 4), train, [Shard(0)])
    v = Layout((4, 4), train, [Shard(0)])
    eng = Mesh(torch.tensor([[2, 3], [4, 5]]))
    gq, gk, gv = (Layout(x.shape, eng, [Replicate(), Shard(0)]) for x in (q, k, v))
    fused = fuse([gq, gk, gv])
    emb_src = Layout((10, 4), train, [Shard(0)])
    emb_dst = vocab_parallel_layout(10, 4, [2, 3], dtype=torch.float32, pad_to=4, replicas=[[2, 3], [4, 5]])
    items = [PlanItem(q, fused[0], src_tensor=0, dst_tensor=0), PlanItem(k, fused[1], src_tensor=1, dst_tensor=0),
             PlanItem(v, fused[2], src_tensor=2, dst_tensor=0), PlanItem(emb_src, emb_dst, src_tensor=3, dst_tensor=1)]
    for relay in (True, False):
        check_local_plan(items, Topology(domain_size=2), relay)


def test_worked_example_of_the_docstring() -> None:
    src = Layout((4, 4), Mesh([0, 1]), "S(0)")
    dst = Layout((4, 4), Mesh([2, 3]), "R")
    part = plan_rank([(src, dst)], Topology(domain_size=2), 2)
    assert [(t.src, t.dst, t.link, t.stage, t.nbytes) for t in part.transfers] == [
        (0, 2, "network", 0, 32), (2, 3, "nvlink", 1, 32), (3, 2, "nvlink", 1, 32)]
    assert part.bytes_by_link("recv") == {"local": 0, "nvlink": 32, "network": 32}


def test_bad_staging_is_refused() -> None:
    src = Layout((4,), Mesh([0, 1]), "S(0)")
    with pytest.raises(ValueError, match="staging_bytes"):
        plan_rank([(src, src)], None, 0, staging_bytes=1)


@pytest.mark.parametrize("relay", [True, False])
def test_custom_layout_with_partially_overlapping_needs(relay: bool) -> None:
    """Ranks of one domain need partially overlapping rows (windows 0:6, 3:9, 5:10 of a (10, 2) tensor; a custom
    layout): with relays each row still crosses the network once and is forwarded to every other rank needing it."""
    from reshard.planner import Box, ExplicitLayout, Piece

    src = Layout((10, 2), Mesh([0, 1]), [Shard(0)])
    windows = {2: (0, 6), 3: (3, 6), 4: (5, 5)}
    dst = ExplicitLayout((10, 2), torch.float32,
                         {r: [Piece(Box((a, 0), (n, 2)), Box((0, 0), (n, 2)))] for r, (a, n) in windows.items()},
                         {r: (n, 2) for r, (a, n) in windows.items()})
    check_local_plan([(src, dst)], Topology(domain_of={0: "a", 1: "b", 2: "c", 3: "c", 4: "c"}), relay)
