"""The many-box and cut message paths, end to end on 8 gloo ranks, against DTensor's `distribute_tensor`.

A peer's large boxes that are contiguous at one end travel as messages of their own (sent from / received into
the local tensors), small or doubly strided ones packed together, and a one-box message strided at one end is cut
into parts (`Message.cuts`). The size thresholds (`DIRECT_SPLIT_BYTES`, `PART_BYTES`) are lowered inside the jobs
(on every rank alike, plan cache cleared) so that small tensors take these paths; each case then runs on the
zero-copy path and on the staged one, which must give DTensor's bytes both times. One case per path also has a
negative control: the same plan with the direct receives disabled gives the same bytes, and a plan that differs
between ranks raises on every rank with every destination untouched.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import pytest
import torch
from comm_cases import B2, S0, S1, SENTINEL, A, B, R, as_bytes, dtensor_local, expect_all_raise, full_tensor
from torch.distributed.tensor import Shard

from reshard import Layout, Mesh, Topology
from reshard.planner import PlanItem, plan_many

pytestmark = pytest.mark.distributed

WORLD = 8
SPLIT, PART = 1024, 512  # bytes: boxes of >= 1 KiB go alone, strided one-box messages are cut into ~512 B parts


RANK_POOL = WORLD  # the `pool` fixture's ranks (tests/conftest.py)


@contextlib.contextmanager
def small_thresholds(split: int = SPLIT, part: int = PART):
    """Lower the planner's split and part sizes (and clear its caches) for the body, then restore them."""
    import reshard.planner._messages as pl
    from reshard.planner import clear_plan_cache

    saved = pl.DIRECT_SPLIT_BYTES, pl.PART_BYTES
    pl.DIRECT_SPLIT_BYTES, pl.PART_BYTES = split, part
    clear_plan_cache()
    try:
        yield
    finally:
        pl.DIRECT_SPLIT_BYTES, pl.PART_BYTES = saved
        clear_plan_cache()


def _case(name: str) -> tuple[list[PlanItem], Topology | None, int]:
    """(items, topology, staging bytes) of one case; shapes say why they are there."""
    f32, bf16 = torch.float32, torch.bfloat16
    if name == "many-box":
        # TP4 S(0) -> TP2 x 2 [R, S(0)] of a small model's layer, four times: row quarters, contiguous at both
        # ends, 1.5 KiB each (split, direct), plus (6, 12) and (10, 4) tensors whose boxes of 1-3 rows (16-96 B)
        # share one packed message per peer (staged)
        shapes = [(64, 24), (32, 48), (64, 24), (96, 16)] * 4 + [(6, 12), (10, 4)]
        pairs = [(Layout(s, Mesh(A), [S0], f32), Layout(s, Mesh(B2), [R, S0], f32)) for s in shapes]
        return [PlanItem(a, b, src_tensor=i, dst_tensor=i, name=f"t{i}") for i, (a, b) in enumerate(pairs)], None, \
            1 << 14
    if name == "strided-source":
        # FSDP4 S(0) -> TP4 S(1): 16 x 24 column slabs, strided in the source (packed, cut into 3 parts of 6 rows),
        # contiguous in the destination (received into it part by part); 61 columns split unevenly
        s = (64, 61)
        return [PlanItem(Layout(s, Mesh(A), [S0], f32), Layout(s, Mesh(B), [S1], f32), name="w")], None, 1 << 16
    if name == "strided-destination":
        # TP4 S(1) -> S(0): row blocks, contiguous in the source (sent from it part by part), column slabs of the
        # destination (received into staging, unpacked); bf16, 2-byte elements; 20 x 24 boxes of 960 B, 2 parts
        s = (80, 96)
        return [PlanItem(Layout(s, Mesh(A), [S1], bf16), Layout(s, Mesh(B), [S0], bf16), name="w")], None, 1 << 16
    if name == "cast-relay":
        # a float32 -> bfloat16 cast (packed at the sender, received directly) into an NVLink domain that relays:
        # forwards leave from the destination tensor, where the boxes landed
        s = (128, 32)
        items = [PlanItem(Layout(s, Mesh(A), [S0], f32), Layout(s, Mesh(B), [R], bf16), src_tensor=i, dst_tensor=i,
                          name=f"w{i}", precision="cast") for i in range(3)]
        return items, Topology(domain_size=4), 1 << 14
    raise ValueError(name)


CASES = ("many-box", "strided-source", "strided-destination", "cast-relay")


def _expected(item: PlanItem, rank: int, seed: str) -> torch.Tensor:
    full = full_tensor(tuple(item.src.shape), item.src.dtype, seed)
    if item.casts:
        full = full.to(item.dst.dtype)
    return dtensor_local(full, item.dst)


def on_rank_paths(w, name: str, verify: bool) -> dict:
    """Run case `name` on the zero-copy and the staged path; per path: bit-exact against DTensor, bytes direct,
    wire messages."""
    from reshard.comm import execute

    out = {}
    with small_thresholds():
        items, topology, staging = _case(name)
        p = plan_many(items, topology, staging_bytes=staging, min_split_bytes=64)
        srcs = [dtensor_local(full_tensor(tuple(it.src.shape), it.src.dtype, f"{name}{i}"), it.src)
                for i, it in enumerate(items)] if w.rank in items[0].src.ranks else None
        w.group.cache.clear()
        for zero_copy in (True, False):
            dsts = None
            if w.rank in items[0].dst.ranks:
                dsts = [torch.empty(it.dst.local_shape(w.rank), dtype=it.dst.dtype) for it in items]
                for d in dsts:
                    as_bytes(d).fill_(SENTINEL)
            rep = execute(p, w.rank, srcs, dsts, w.group, zero_copy=zero_copy, verify=verify, timeout=30)
            ok = dsts is None or all(torch.equal(as_bytes(d), as_bytes(_expected(it, w.rank, f"{name}{i}")))
                                     for i, (d, it) in enumerate(zip(dsts, items)))
            out[zero_copy] = {"ok": ok, "direct": rep.bytes_direct, "moved": rep.bytes_sent + rep.bytes_received,
                              "verified": rep.verified_boxes}
        w.group.cache.clear()
    return out


def _plan_shape(name: str) -> dict:
    """In the test process: per case, whether some peer gets several messages in a chunk, whether some message
    is cut, and that sender and receiver list the same messages (peer, sizes, cuts) in the same order."""
    with small_thresholds():
        items, topology, staging = _case(name)
        p = plan_many(items, topology, staging_bytes=staging, min_split_bytes=64)
        several = cut = False
        for r in p.ranks:
            for c in p.for_rank(r).chunks:
                per_peer = defaultdict(int)
                for m in c.sends:
                    per_peer[m.peer] += 1
                    cut = cut or bool(m.cuts)
                    theirs = [x for x in {pc.index: pc for pc in p.for_rank(m.peer).chunks}[c.index].recvs
                              if x.peer == r]
                    mine = [x for x in c.sends if x.peer == m.peer]
                    assert [(x.transfers, x.offsets, x.nbytes, x.cuts) for x in theirs] == \
                        [(x.transfers, x.offsets, x.nbytes, x.cuts) for x in mine], (name, r, m.peer, c.index)
                several = several or any(n > 1 for n in per_peer.values())
        return {"several": several, "cut": cut}


@pytest.mark.parametrize("name", CASES)
def test_split_and_cut_messages_give_dtensor_bytes_on_both_paths(pool, name) -> None:
    shape = _plan_shape(name)
    if name == "many-box":
        assert shape["several"], shape  # the boxes for one peer are several messages
    if name.startswith("strided"):
        assert shape["cut"], shape  # the one-box messages are cut into parts
    outs = pool.run_ok(on_rank_paths, name, name == "strided-source")
    for r, o in enumerate(outs):
        assert o[True]["ok"] and o[False]["ok"], (name, r, o)  # bit-exact against DTensor on both paths
        assert o[False]["direct"] == 0, (r, o)  # forced staged: nothing direct
    # the zero-copy path is taken where the plan marks it: some bytes go straight from or into the tensors
    assert sum(o[True]["direct"] for o in outs) > 0, outs
    if name == "many-box":
        dst = [r for r in range(WORLD) if outs[r][True]["moved"] and r >= 4]
        # every destination byte but the two small tensors' (half of each: 144 + 80 B) lands straight in the tensors
        assert all(0 < outs[r][True]["moved"] - outs[r][True]["direct"] <= 224 for r in dst), outs
    if name == "strided-source":
        assert sum(o[True]["verified"] for o in outs) > 0  # verify=True checked the cut parts' boxes


def on_rank_plan_differs(w) -> None:
    """Rank 6 plans with a smaller staging budget: other chunks, other messages; every destination stays
    untouched (and every source unchanged), and every rank raises."""
    from reshard.comm import execute

    with small_thresholds():
        items, topology, staging = _case("many-box")
        p = plan_many(items, topology, staging_bytes=staging // 4 if w.rank == 6 else staging, min_split_bytes=64)
        if w.rank in (0, 4):  # the agreed plan: split, direct messages
            assert sum(m.direct for c in p.for_rank(w.rank).chunks for m in (*c.sends, *c.recvs)) > 1
        srcs = [dtensor_local(full_tensor(tuple(it.src.shape), it.src.dtype, "differ"), it.src) for it in items] \
            if w.rank in items[0].src.ranks else None
        before = [s.clone() for s in srcs] if srcs else None
        dsts = None
        if w.rank in items[0].dst.ranks:
            dsts = [torch.empty(it.dst.local_shape(w.rank), dtype=it.dst.dtype) for it in items]
            for d in dsts:
                as_bytes(d).fill_(SENTINEL)
        try:
            execute(p, w.rank, srcs, dsts, w.group, timeout=30)
        finally:
            assert dsts is None or all(bool((as_bytes(d) == SENTINEL).all()) for d in dsts), \
                f"rank {w.rank}: bytes moved before the error"
            assert srcs is None or all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(srcs, before))
            w.group.cache.clear()


def test_a_plan_that_differs_leaves_destinations_untouched_on_the_split_path(pool) -> None:
    outs = pool.run(on_rank_plan_differs)
    expect_all_raise(outs, "ValueError", "ranks hold different plans", "staging_bytes: rank 0 has 16384, rank 6 has "
                     "4096")


def test_default_thresholds_split_the_many_tensor_refit() -> None:
    """With the default thresholds (planning only, no tensors): boxes of exactly `DIRECT_SPLIT_BYTES` go direct box
    by box, boxes one row smaller are packed per peer, and a strided source box of twice `PART_BYTES` is cut once,
    at a row boundary."""
    import reshard.planner._messages as pl

    bf16 = torch.bfloat16
    assert (pl.DIRECT_SPLIT_BYTES, pl.PART_BYTES) == (256 << 10, 8 << 20)
    s = (1024, 512)  # bf16 row quarters of 256 x 512: 256 KiB each
    pairs = [(Layout(s, Mesh(A), [S0], bf16), Layout(s, Mesh(B2), [R, S0], bf16)) for _ in range(3)]
    msgs = [m for c in plan_many(pairs, staging_bytes=64 << 20).for_rank(0).chunks for m in c.sends]
    assert len(msgs) == 6 and all(m.direct and len(m.transfers) == 1 and m.nbytes == 256 << 10 and not m.cuts
                                  for m in msgs), msgs
    s = (1020, 512)  # quarters of 255 rows: below the threshold, packed together again, one message per peer
    pairs = [(Layout(s, Mesh(A), [S0], bf16), Layout(s, Mesh(B2), [R, S0], bf16)) for _ in range(3)]
    msgs = [m for c in plan_many(pairs, staging_bytes=64 << 20).for_rank(0).chunks for m in c.sends]
    assert len(msgs) == 2 and all(len(m.transfers) == 3 and not m.direct for m in msgs), msgs
    s = (16384, 8192)  # FSDP4 -> TP4: 4096 x 2048 column slabs of 16 MiB, strided in the source
    p = plan_many([(Layout(s, Mesh(A), [S0], bf16), Layout(s, Mesh(B), [Shard(1)], bf16))], staging_bytes=1 << 26)
    m = p.for_rank(0).chunks[0].sends[0]
    row = 2048 * 2
    assert (m.nbytes, m.direct, m.cuts, m.parts) == (4096 * row, False, (2048 * row,),
                                                     ((0, 2048 * row), (2048 * row, 2048 * row)))
    r = p.for_rank(m.peer).chunks[0].recvs
    assert [x.cuts for x in r if x.peer == 0] == [m.cuts] and all(x.direct for x in r)  # contiguous at the receiver


def on_rank_plan_changes_after_agreement(w) -> None:
    """The strided-source plan runs twice (its checks, prepared copies and staging are cached by then, and the
    sources that are leaves of the handshake's tree pack their first part while the handshake is in flight),
    bit-exact both times; then rank 3, a source that packs ahead, changes its plan (half the staging budget) with
    the same tensors: every rank raises, every destination stays untouched and every source unchanged."""
    from reshard.comm import execute

    with small_thresholds():
        items, topology, staging = _case("strided-source")
        (item,) = items
        srcs = [dtensor_local(full_tensor(tuple(item.src.shape), item.src.dtype, "again"), item.src)] \
            if w.rank in item.src.ranks else None
        expected = _expected(item, w.rank, "again") if w.rank in item.dst.ranks else None
        dsts = [torch.empty(item.dst.local_shape(w.rank), dtype=item.dst.dtype)] if expected is not None else None
        w.group.cache.clear()
        try:
            p = plan_many(items, topology, staging_bytes=staging, min_split_bytes=64)
            for k in range(2):
                for d in dsts or ():
                    as_bytes(d).fill_(SENTINEL)
                rep = execute(p, w.rank, srcs, dsts, w.group, timeout=30)
                assert dsts is None or torch.equal(as_bytes(dsts[0]), as_bytes(expected)), (w.rank, k)
                # sources that are leaves of the handshake's tree (ranks 1, 3) packed their first part during it;
                # the root (0) and rank 2 (rank 3's parent) answer or forward, so they pack after it
                assert rep.sends_packed_early == (1 if w.rank in (1, 3) else 0), (w.rank, k, rep)
            before = [s.clone() for s in srcs] if srcs else None
            for d in dsts or ():
                as_bytes(d).fill_(SENTINEL)
            changed = plan_many(items, topology, staging_bytes=staging // 2 if w.rank == 3 else staging,
                                min_split_bytes=64)
            try:
                execute(changed, w.rank, srcs, dsts, w.group, timeout=30)
            finally:
                assert dsts is None or bool((as_bytes(dsts[0]) == SENTINEL).all()), \
                    f"rank {w.rank}: bytes moved before the error"
                assert srcs is None or torch.equal(as_bytes(srcs[0]), as_bytes(before[0]))
        finally:
            w.group.cache.clear()


def test_a_plan_changed_on_one_rank_after_agreement_leaves_destinations_untouched(pool) -> None:
    outs = pool.run(on_rank_plan_changes_after_agreement)
    expect_all_raise(outs, "ValueError", "ranks hold different plans", "staging_bytes: rank 0 has 65536, rank 3 has "
                     "32768")
