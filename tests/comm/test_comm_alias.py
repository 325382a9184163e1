"""Aliasing on 8 gloo ranks: a destination that shares memory with a source or with another destination is a
`ValueError` on every rank before any byte moves; destinations in disjoint parts of one storage, and sources that
share memory, are fine and give DTensor's bytes.

The layouts are colocated (the same 8 ranks hold source and destination), so `dst = src.view(...)` is possible: a
`[16, 16]` float32 weight goes from `S(0)` to `S(1)` over ranks 0-7, a `[2, 16]` local to a `[16, 2]` one. Functions
named `on_rank_*` run on the ranks of the shared pool (`reshard.testing.RankPool`).
"""

from __future__ import annotations

import pytest
import torch
from comm_cases import SENTINEL, as_bytes, dtensor_local, expect_all_raise, full_tensor
from torch.distributed.tensor import Replicate, Shard

from reshard import Layout, Mesh, PlanItem, plan, plan_many
from reshard.comm import execute, reshard
from reshard.comm._alias import _overlap, overlap_errors

pytestmark = pytest.mark.distributed

WORLD = 8
ALL = list(range(WORLD))


def on_rank_clear_cache(w) -> None:
    w.group.cache.clear()


RANK_POOL = WORLD  # the `pool` fixture's ranks (tests/conftest.py)


@pytest.fixture(scope="module", autouse=True)
def _clear_staging(pool):
    yield
    # the staging these tests reserved stays on the shared group otherwise, and later modules measure theirs
    if not pool.broken:
        pool.run_ok(on_rank_clear_cache)


def _layouts(name: str = "w") -> tuple[Layout, Layout]:
    return (Layout((16, 16), Mesh(ALL), [Shard(0)], torch.float32, name=name),
            Layout((16, 16), Mesh(ALL), [Shard(1)], torch.float32, name=name))


def _sentinel(shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32)
    as_bytes(t).fill_(SENTINEL)
    return t


# -------------------------------------------------------------------------------------------------------------
# a destination that is a view of the source
# -------------------------------------------------------------------------------------------------------------


def on_rank_dst_views_src(w, verify: bool, check: bool) -> bool:
    """Rank 3 passes `dst = src.view(16, 2)`; the others separate tensors. With `check=False` the overlap check is
    switched off (the negative control). Returns whether this rank's destination holds DTensor's bytes."""
    import reshard.comm._prepare as ex  # the module whose check_tensors calls it

    src, dst = _layouts()
    p = plan(src, dst, staging_bytes=128, min_split_bytes=16)  # 4 chunks: rank 3 unpacks before it packs again
    full = full_tensor((16, 16), torch.float32, "alias")
    s = dtensor_local(full, src).clone()
    d = s.view(16, 2) if w.rank == 3 else _sentinel(dst.local_shape(w.rank))
    before = as_bytes(s).clone()
    original = ex.overlap_errors
    if not check:
        ex.overlap_errors = lambda *a: []
    try:
        reshard(s, d, p, w.group, verify=verify, timeout=30)
    except ValueError:
        # nothing moved: the source is intact and every other destination still holds the sentinel
        assert torch.equal(as_bytes(s), before), f"rank {w.rank}: the source changed"
        assert w.rank == 3 or bool((as_bytes(d) == SENTINEL).all()), f"rank {w.rank}: bytes moved before the error"
        raise
    finally:
        ex.overlap_errors = original
    return torch.equal(as_bytes(d), as_bytes(dtensor_local(full, dst)))


@pytest.mark.parametrize("verify", [False, True])
def test_dst_view_of_src_raises_on_every_rank(pool, verify) -> None:
    outs = pool.run(on_rank_dst_views_src, verify, True)
    expect_all_raise(outs, "ValueError", "bad input, nothing was moved",
                      "rank 3: destination local tensor 0 (tensor 'w' (item 0)) shares memory with source local "
                      "tensor 0 (tensor 'w' (item 0)) on cpu", "must not share memory")


def test_without_the_check_a_dst_view_of_src_gives_wrong_bytes(pool) -> None:
    """Negative control: the bug the check prevents. Rank 3 overwrites its source while other ranks still read it."""
    got = pool.run_ok(on_rank_dst_views_src, False, False)
    assert not all(got), "the aliased reshard came out right: this test would not show the check matters"


# -------------------------------------------------------------------------------------------------------------
# two destinations in one storage
# -------------------------------------------------------------------------------------------------------------


def _two_items() -> tuple[list[PlanItem], torch.Tensor, list[Layout]]:
    a_src, a_dst = _layouts("a")
    b_src, b_dst = _layouts("b")
    items = [PlanItem(a_src, a_dst, 0, 0, name="a"), PlanItem(b_src, b_dst, 1, 1, name="b")]
    return items, full_tensor((16, 16), torch.float32, "alias2"), [a_src, a_dst, b_src, b_dst]


def on_rank_two_destinations(w, variant: str) -> list[bool]:
    """Two tensors `a`, `b` reshard `S(0) -> S(1)` in one plan; on rank 5 their destinations come from one storage:
    `same` (one tensor twice) or `overlapping` (rows 0-15 and 15-30 of one `[31, 2]` buffer: one row shared); or, on
    every rank, `rows` (disjoint halves of one flat buffer) and `columns` (the two column halves of one `[16, 4]`
    matrix: interleaved in memory, no byte shared)."""
    items, full, (a_src, a_dst, b_src, b_dst) = _two_items()
    p = plan_many(items)
    full_b = full.flip(0).contiguous()  # b differs from a, so a swap would show
    srcs = [dtensor_local(full, a_src), dtensor_local(full_b, b_src)]
    shape = tuple(a_dst.local_shape(w.rank))  # (16, 2)
    d0, d1 = _sentinel(shape), _sentinel(shape)
    if variant == "same" and w.rank == 5:
        d1 = d0
    if variant == "overlapping" and w.rank == 5:
        buf = _sentinel((31,) + shape[1:])
        d0, d1 = buf[:16], buf[15:]  # row 15 of d0 is row 0 of d1
    if variant == "rows":
        buf = _sentinel((2 * shape[0] * shape[1],))
        d0, d1 = buf[:32].view(shape), buf[32:].view(shape)
    if variant == "columns":
        buf = _sentinel((shape[0], 2 * shape[1]))
        d0, d1 = buf[:, :2], buf[:, 2:]
    try:
        execute(p, w.rank, srcs, [d0, d1], w.group, timeout=30)
    except ValueError:
        assert w.rank == 5 or bool((as_bytes(d0) == SENTINEL).all() and (as_bytes(d1) == SENTINEL).all()), \
            f"rank {w.rank}: bytes moved before the error"
        raise
    return [torch.equal(as_bytes(d0), as_bytes(dtensor_local(full, a_dst))),
            torch.equal(as_bytes(d1), as_bytes(dtensor_local(full_b, b_dst)))]


@pytest.mark.parametrize("variant", ["same", "overlapping"])
def test_two_destinations_sharing_memory_raise_on_every_rank(pool, variant) -> None:
    outs = pool.run(on_rank_two_destinations, variant)
    expect_all_raise(outs, "ValueError", "bad input, nothing was moved",
                      "rank 5: destination local tensor 0 (tensor 'a' (item 0)) shares memory with destination local "
                      "tensor 1 (tensor 'b' (item 1))")


@pytest.mark.parametrize("variant", ["rows", "columns"])
def test_disjoint_parts_of_one_storage_as_destinations_are_accepted(pool, variant) -> None:
    assert pool.run_ok(on_rank_two_destinations, variant) == [[True, True]] * WORLD


# -------------------------------------------------------------------------------------------------------------
# sources may share memory
# -------------------------------------------------------------------------------------------------------------


def on_rank_shared_sources(w, variant: str) -> list[bool]:
    """Both items read from one storage: `same` (one tensor for both, as tied weights are) or `views` (two
    overlapping views of one buffer, rows 0-1 and rows 1-2 of a `[3, 16]` local)."""
    items, full, (a_src, a_dst, _b_src, b_dst) = _two_items()
    p = plan_many(items)
    if variant == "same":
        s0 = dtensor_local(full, a_src).clone()
        s1, full_b = s0, full
    else:
        # b's global tensor is a's shifted by one row within each rank's shard, so b's local is a's local shifted
        la = dtensor_local(full, a_src)
        buf = torch.cat([la, la[:1].neg()])  # [3, 16]
        s0, s1 = buf[:2], buf[1:]
        full_b = torch.cat([torch.cat([f[1:], f[:1].neg()]) for f in full.split(2)])
    d0, d1 = _sentinel(a_dst.local_shape(w.rank)), _sentinel(b_dst.local_shape(w.rank))
    execute(p, w.rank, [s0, s1], [d0, d1], w.group, verify=True, timeout=30)
    return [torch.equal(as_bytes(d0), as_bytes(dtensor_local(full, a_dst))),
            torch.equal(as_bytes(d1), as_bytes(dtensor_local(full_b, b_dst)))]


@pytest.mark.parametrize("variant", ["same", "views"])
def test_two_sources_sharing_memory_work(pool, variant) -> None:
    assert pool.run_ok(on_rank_shared_sources, variant) == [[True, True]] * WORLD


# -------------------------------------------------------------------------------------------------------------
# the exact test for strided views (no processes)
# -------------------------------------------------------------------------------------------------------------


def test_overlap_is_exact_for_interleaved_strides() -> None:
    base = torch.zeros(6, 8)
    # spans intersect, but no byte is shared: even / odd columns, column halves, every 4th column from 0 and 1
    assert not _overlap(base[:, 0::2], base[:, 1::2])
    assert not _overlap(base[:, :4], base[:, 4:])
    assert not _overlap(base[:, 0::4], base[:, 1::4])
    assert not _overlap(base.t()[1:3], base[:, 3])  # columns 1-2 (transposed) and column 3
    # a shared element, found among the runs
    assert _overlap(base[:, 0::2], base[:, 2::4])
    assert _overlap(base[:, :5], base[:, 4:])
    assert _overlap(base.t()[1:3], base[:, 2])
    assert _overlap(base.view(torch.uint8)[:, 1::4], base[:, 0::2])  # byte 1 of float 0: a byte, not an element
    # many interleaved views at once: 300 destinations, column k of a [7, 300] matrix each, and a source beside
    from reshard.comm._alias import _cluster_pairs

    m = torch.zeros(7, 301)
    members = [("destination", k, m[:, k]) for k in range(300)] + [("source", 0, m[:, 300])]
    assert _cluster_pairs(members) == []
    assert _cluster_pairs(members + [("source", 1, m[3:5, 17:19])]) == [(17, 301), (18, 301)]
    # member 301 (row 6, columns 299-300) overlaps destination 299; destinations that overlap are named first, and
    # alone (the source test needs disjoint destinations)
    assert _cluster_pairs(members + [("destination", 300, m[6, 299:])]) == [(299, 301)]
    # too many runs for the exact test: intersecting spans count as an overlap (conservative)
    big = torch.zeros(2, (1 << 16) + 1, 2)
    assert _overlap(big[..., 0], big[..., 1])


def test_one_tensor_as_source_and_destination_is_refused() -> None:
    """The identical view as a source and a destination of one plan is an overlap too (no exception for it)."""
    src = Layout((4, 6), Mesh([0]), [Replicate()], torch.float32)
    p = plan(src, Layout((4, 6), Mesh([0]), [Replicate()], torch.float32))
    t = torch.zeros(4, 6)
    errors = overlap_errors(p, 0, [t], [t])
    assert len(errors) == 1 and "rank 0" in errors[0], errors
    assert overlap_errors(p, 0, [t], [torch.zeros(4, 6)]) == []
