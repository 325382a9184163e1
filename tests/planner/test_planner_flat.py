"""Flat-range layouts (ZeRO-3, FSDP1 flat parameters) against a brute-force oracle: flatten the tensor, slice it.

Sizes are odd on purpose: rows that a range splits mid-row, ranges of one element, a rank holding only padding
(numel 4 over 3 ranks), 0-d and 1-d tensors, and an empty dim. A plan from a flat-range source into DTensor
destinations is executed in-process; the windows' elements outside the range hold a sentinel that must never
reach a destination.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planner_plan import execute_in_process

from reshard import Layout, Mesh, Shard, Topology, plan
from reshard.planner import FlatRangeLayout, flat_boxes, flat_partition, flat_window
from reshard.testing import dtensor_local, index_tensor

pytestmark = pytest.mark.usefixtures("fake_world")

SENTINEL = -7  # what a window holds outside its rank's range: never sent


def covered(shape: tuple[int, ...], boxes) -> list[int]:
    """Flat indices the boxes cover, in box order then row-major within each box (the brute-force oracle)."""
    idx = index_tensor(shape)
    return [int(v) for b in boxes for v in idx[b.slices()].reshape(-1).tolist()]


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(shapes, st.data())
def test_flat_boxes_cover_exactly_the_range_in_order(shape, data) -> None:
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    boxes = flat_boxes(shape, start, stop)
    assert covered(shape, boxes) == list(range(start, stop))
    assert len(boxes) <= max(2 * len(shape) - 1, 1)
    if len(shape) == 2:
        assert len(boxes) <= 3


def test_flat_boxes_worked_examples() -> None:
    # the reference's embedding (1001, 63) over 2 ranks: rank 0 rows 0-499 and row 500 columns 0-31
    r = flat_partition(1001 * 63, 2)
    assert r == {0: (0, 31532), 1: (31532, 63063)}
    assert [(b.offsets, b.shape) for b in flat_boxes((1001, 63), *r[0])] == [((0, 0), (500, 63)), ((500, 0), (1, 32))]
    assert [(b.offsets, b.shape) for b in flat_boxes((1001, 63), *r[1])] == [((500, 32), (1, 31)),
                                                                             ((501, 0), (500, 63))]
    r3 = flat_partition(1001 * 63, 3)
    assert [(b.offsets, b.shape) for b in flat_boxes((1001, 63), *r3[1])] == [
        ((333, 42), (1, 21)), ((334, 0), (333, 63)), ((667, 0), (1, 21))]
    assert flat_partition(4, 3) == {0: (0, 2), 1: (2, 4), 2: (4, 4)}  # rank 2: padding only
    with pytest.raises(ValueError, match=r"range \[3, 2\)"):
        flat_boxes((2, 2), 3, 2)


@settings(max_examples=300, deadline=None)
@given(shapes, st.integers(1, 5))
def test_windows_hold_the_range_where_a_flat_view_puts_it(shape, world) -> None:
    """Each rank's local tensor is its window; `window.reshape(-1)[start - first:][:stop - start]` is the range,
    and every piece reads the same global elements from the window as from the full tensor."""
    n = math.prod(shape)
    lay = FlatRangeLayout(shape, torch.int64, flat_partition(n, world), name="w")
    full = index_tensor(shape)
    flat = full.reshape(-1)
    for r, (start, stop) in lay.ranges.items():
        first, wshape = flat_window(shape, start, stop)
        assert lay.local_shape(r) == wshape and lay.window_start(r) == first
        window = torch.full(wshape, SENTINEL, dtype=torch.int64)
        window.reshape(-1)[start - first:stop - first] = flat[start:stop]
        got = sorted(int(v) for p in lay.pieces(r) for v in window[p.local_box.slices()].reshape(-1).tolist())
        assert got == list(range(start, stop))
        for p in lay.pieces(r):
            assert torch.equal(window[p.local_box.slices()], full[p.global_box.slices()])


def flat_cases():
    @st.composite
    def case(draw):
        rows = draw(st.integers(1, 9))
        cols = draw(st.sampled_from([1, 2, 3, 5, 7]))
        shape = (rows, cols) if draw(st.booleans()) else (rows, cols, draw(st.integers(1, 3)))
        world = draw(st.integers(1, 4))
        num_dst = draw(st.sampled_from([1, 2, 3]))
        dim = draw(st.integers(0, len(shape) - 1))
        return shape, world, num_dst, dim
    return case()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flat_cases())
def test_plan_from_flat_ranges_moves_exactly_what_dtensor_holds(case) -> None:
    """ZeRO-3-partitioned trainer ranks 0..W-1 into `S(dim)` engine ranks after them: each destination equals
    DTensor's local shard, each element written once, no element outside a range read."""
    shape, world, num_dst, dim = case
    n = math.prod(shape)
    full = index_tensor(shape)
    src = FlatRangeLayout(shape, torch.int64, flat_partition(n, world), name="w")
    dst_ranks = list(range(world, world + num_dst))
    dst = Layout(shape, Mesh(dst_ranks), [Shard(dim)], torch.int64, name="w")
    p = plan(src, dst, Topology(domain_size=world + num_dst))
    src_locals = {}
    for r, (start, stop) in src.ranges.items():
        first, wshape = flat_window(shape, start, stop)
        window = torch.full(wshape, SENTINEL, dtype=torch.int64)
        window.reshape(-1)[start - first:stop - first] = full.reshape(-1)[start:stop]
        src_locals[r] = window
    expected = {r: dtensor_local(full, dst_ranks, [Shard(dim)], r, world + num_dst) for r in dst_ranks}
    got, writes = execute_in_process(p, src_locals, {r: tuple(e.shape) for r, e in expected.items()})
    for r in dst_ranks:
        assert torch.equal(got[r], expected[r]), (r, p.describe())
        assert bool((writes[r] == 1).all())
    assert p.stats.network_bytes + p.stats.nvlink_bytes + p.stats.local_bytes == n * 8 * 1  # each byte once


def test_bad_ranges_are_refused_naming_the_tensor_and_rank() -> None:
    with pytest.raises(ValueError, match=r"tensor 'w': rank 1 range \[4, 7\) is not within the 6 elements"):
        FlatRangeLayout((2, 3), torch.float32, {0: (0, 4), 1: (4, 7)}, name="w")
    with pytest.raises(ValueError, match="rank 0: a range must be"):
        FlatRangeLayout((2, 3), torch.float32, {0: (0, 1, 2)}, name="w")
