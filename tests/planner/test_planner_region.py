"""Local regions (`reshard.planner.LocalRegion`): where a box lives in its local tensor, against plain torch slicing.

The oracle is always torch itself: `full[global_box.slices()]` of the global tensor, `t[box.slices()]` of a local
tensor, and `Tensor.stride()` / `data_ptr()` of torch's own views. Shapes are odd on purpose (0 and 1 extents,
primes, ranges that split rows mid-row, a rank holding only padding); local tensors are contiguous, transposed and
strided, so a region's strides are the tensor's, not row-major ones.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard import Shard
from reshard.kernels import pack, unpack
from reshard.planner import (
    Box,
    ExplicitLayout,
    FlatRangeLayout,
    FlatRun,
    Layout,
    LayoutLike,
    Mesh,
    Piece,
    Transfer,
    flat_partition,
    is_dtensor,
    local_region,
    on_flat_sources,
    plan_local,
    plan_many,
    plan_rank,
    region_fits,
    region_strides,
    region_view,
)

shapes = st.lists(st.integers(0, 6), min_size=1, max_size=4).map(tuple)


@st.composite
def box_in(draw: st.DrawFn, shape: tuple[int, ...]) -> Box:
    """A box inside `shape` (possibly empty)."""
    offsets, extents = [], []
    for n in shape:
        lo = draw(st.integers(0, n))
        offsets.append(lo)
        extents.append(draw(st.integers(0, n - lo)))
    return Box(tuple(offsets), tuple(extents))


def local_tensor(shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """A tensor of `shape` holding distinct values: contiguous, transposed (dims reversed in memory) or strided
    (every other element of a larger tensor, from index 1)."""
    n = math.prod(shape)
    if kind == "contiguous":
        return torch.arange(n, dtype=torch.int64).reshape(shape)
    if kind == "transposed":
        return torch.arange(n, dtype=torch.int64).reshape(shape[::-1]).permute(*reversed(range(len(shape))))
    return torch.arange(2 * n + 1, dtype=torch.int64)[1::2].reshape(shape)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes, st.sampled_from(["contiguous", "transposed", "strided"]), st.data())
def test_box_region_view_is_torch_slicing(shape, kind, data) -> None:
    t = local_tensor(shape, kind)
    box = data.draw(box_in(shape))
    want = t[box.slices()]
    got = region_view(t, box)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)
    if box.numel:
        assert got.data_ptr() == want.data_ptr() and got.stride() == want.stride()
        first, strides = region_strides(tuple(t.stride()), box)
        assert t.data_ptr() + first * t.element_size() == want.data_ptr()
        assert tuple(s for s, n in zip(strides, box.shape) if n > 1) == tuple(
            s for s, n in zip(want.stride(), box.shape) if n > 1)
    assert region_fits(shape, box)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes, st.integers(1, 4), st.data())
def test_flat_pieces_are_views_of_the_partition_itself(shape, ranks, data) -> None:
    """Each rank's partition (`full.reshape(-1)[start:stop]`, followed by padding, inside a larger buffer) is the
    local tensor: every flat piece is a view of it (same storage, no copy) equal to torch's slice of the global
    tensor, and so is any sub-box of a piece through `local_region`."""
    n = math.prod(shape)
    full = torch.arange(n, dtype=torch.int32).reshape(shape)
    lay = FlatRangeLayout(shape, torch.int32, flat_partition(n, ranks))
    rank = data.draw(st.integers(0, ranks - 1))
    start, stop = lay.ranges[rank]
    ps = -(-n // ranks)
    buffer = torch.full((ps + 5,), -1, dtype=torch.int32)  # 2 elements before, padding and 3 after: never read
    part = buffer[2:2 + ps]
    part[:stop - start] = full.reshape(-1)[start:stop]
    pieces = lay.flat_pieces(rank)
    assert [p.global_box for p in pieces] == [p.global_box for p in lay.pieces(rank)]
    assert sum(p.global_box.numel for p in pieces) == stop - start
    for p in pieces:
        assert isinstance(p.local_box, FlatRun) and region_fits(tuple(part.shape), p.local_box)
        view = region_view(part, p.local_box)
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(view, full[p.global_box.slices()])
        sub = data.draw(box_in(p.global_box.shape)).translate(p.global_box.offsets)
        region = local_region(sub, p.global_box, p.local_box)
        assert torch.equal(region_view(part, region), full[sub.slices()])
    # a write through a piece's view lands in the partition: the partition is the piece, not a copy of it
    for p in pieces:
        region_view(part, p.local_box).fill_(-2)
    assert (part[:stop - start] == -2).all() and (buffer[:2] == -1).all() and (part[stop - start:] == -1).all()


@settings(max_examples=100, deadline=None)
@given(shapes, st.data())
def test_local_region_of_a_box_piece_is_torch_slicing(shape, data) -> None:
    """A piece held at another place of its local tensor (global box moved by a delta): the region of any sub-box
    reads what torch's slice of the global tensor holds."""
    full = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    gbox = data.draw(box_in(shape))
    pad = tuple(data.draw(st.integers(0, 2)) for _ in shape)
    local = torch.full(tuple(s + 2 * p for s, p in zip(gbox.shape, pad)), -1, dtype=torch.int64)
    lbox = Box(pad, gbox.shape)
    local[lbox.slices()] = full[gbox.slices()]
    sub = data.draw(box_in(gbox.shape)).translate(gbox.offsets)
    assert torch.equal(region_view(local, local_region(sub, gbox, lbox)), full[sub.slices()])


def test_local_region_refuses_a_box_outside_the_piece() -> None:
    with pytest.raises(ValueError, match=r"Box\[3:5, 0:1\] is not inside the piece Box\[0:4, 0:3\]"):
        local_region(Box((3, 0), (2, 1)), Box((0, 0), (4, 3)), Box((0, 0), (4, 3)))
    with pytest.raises(ValueError, match="does not fit run"):
        FlatRun(0, (2, 3), (1, 0), (2, 3))
    with pytest.raises(ValueError, match="flat"):
        region_strides((3, 1), FlatRun(0, (2, 3)))
    assert not region_fits((5,), FlatRun(0, (2, 3)))  # the run needs 6 elements
    assert not region_fits((6, 1), FlatRun(0, (2, 3)))  # a run lives in a 1-D tensor


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("shape, ranks", [((5, 3), 2), ((7, 5, 3), 3), ((4,), 3), ((2, 9), 4)])
def test_pack_and_unpack_read_and_write_the_flat_partition(backend, shape, ranks) -> None:
    """The kernels take flat-run regions: pack from each rank's partition gives torch's bytes of the global boxes,
    and unpack into a zeroed partition writes exactly the range (padding untouched)."""
    n = math.prod(shape)
    full = torch.randn(shape, dtype=torch.float32)
    lay = FlatRangeLayout(shape, torch.float32, flat_partition(n, ranks))
    for rank in range(ranks):
        start, stop = lay.ranges[rank]
        ps = -(-n // ranks)
        part = torch.full((ps,), float("nan"))
        part[:stop - start] = full.reshape(-1)[start:stop]
        pieces = lay.flat_pieces(rank)
        regions = [p.local_box for p in pieces]
        want = torch.cat([full[p.global_box.slices()].reshape(-1) for p in pieces] + [torch.empty(0)])
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += p.global_box.numel * 4
        buf = torch.zeros(at, dtype=torch.uint8)
        pack(part, regions, buf, offsets, backend=backend)
        assert torch.equal(buf.view(torch.float32), want)
        back = torch.full((ps,), -3.0)
        unpack(buf, offsets, back, regions, backend=backend)
        assert torch.equal(back[:stop - start], full.reshape(-1)[start:stop])
        assert (back[stop - start:] == -3.0).all()


def test_layouts_meet_the_layout_protocol_and_is_dtensor() -> None:
    mesh = Mesh((0, 1))
    layouts = [Layout((4, 2), mesh, (Shard(0),), torch.float32),
               ExplicitLayout((4, 2), torch.float32, {0: [Piece(Box((0, 0), (4, 2)), Box((0, 0), (4, 2)))]},
                              {0: (4, 2)}),
               FlatRangeLayout((4, 2), torch.float32, flat_partition(8, 2))]
    assert all(isinstance(lay, LayoutLike) for lay in layouts)
    assert not isinstance([("w", layouts[0])], LayoutLike)
    assert not is_dtensor(torch.zeros(2))

    class LooksLikeDTensor:  # the check is by attributes: nothing imports DTensor for a plain tensor
        placements = ()

        def to_local(self) -> torch.Tensor:
            return torch.zeros(1)

    assert is_dtensor(LooksLikeDTensor())


def test_one_transfer_record_from_rank_part_to_the_moved_bytes() -> None:
    """A rank part's transfers (`plan_rank`) and the scheduled ones (`plan_local`) are the same `Transfer` records
    (scheduling only sets `chunk` and the tensor indices), and those records, read through `region_view`, move a
    flat-range source (odd sizes: rows split mid-row over 3 ranks) into `Shard(1)` destinations exactly as torch
    chunks the global tensor (DTensor's `Shard` rule)."""
    shape = (7, 5)
    full = torch.arange(35, dtype=torch.float32).reshape(shape)
    src = FlatRangeLayout(shape, torch.float32, flat_partition(35, 3))
    dst = Layout(shape, Mesh((3, 4)), (Shard(1),), torch.float32)
    items = [(src, dst)]
    windows = {}
    for r in range(3):
        start, stop = src.ranges[r]
        w = torch.full(src.local_shape(r), float("nan"))  # outside the range: never read
        w.view(-1)[start - src.window_start(r):stop - src.window_start(r)] = full.reshape(-1)[start:stop]
        windows[r] = w
    dsts = {r: torch.full(dst.local_shape(r), -1.0) for r in (3, 4)}
    moved: set[Transfer] = set()
    for r in range(5):
        part = plan_rank(items, None, r)
        scheduled = plan_local(items, None, r).for_rank(r).transfers
        assert all(type(t) is Transfer for t in (*part.transfers, *scheduled))
        assert {t._replace(chunk=0, src_tensor=0, dst_tensor=0) for t in scheduled} == set(part.transfers)
        moved.update(t for t in part.transfers if t.src == r)
    assert moved
    for t in moved:
        region_view(dsts[t.dst], t.dst_box).copy_(region_view(windows[t.src], t.src_box))
    for r, want in zip((3, 4), full.chunk(2, dim=1)):
        assert torch.equal(dsts[r], want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), st.integers(1, 4), st.data())
def test_a_program_on_flat_sources_reads_in_the_partition_what_it_reads_in_the_window(shape, ranks, data) -> None:
    """`on_flat_sources`: every box a rank's program reads from its source (pack lists, local copies, sends), moved
    into the rank's partition, is the very box it reads in the window (torch's view of the window), and nothing else
    of the program changes."""
    n = math.prod(shape)
    full = torch.arange(n, dtype=torch.int64).reshape(shape)
    src = FlatRangeLayout(shape, torch.int64, flat_partition(n, ranks))
    dim = data.draw(st.integers(0, len(shape) - 1))
    dst = Layout(shape, Mesh(tuple(range(ranks, ranks + 2))), (Shard(dim),), torch.int64)
    p = plan_many([(src, dst)], None, staging_bytes=data.draw(st.sampled_from([64, 1 << 12])), min_split_bytes=8)
    read = 0
    for r in range(ranks):
        start, stop = src.ranges[r]
        first = src.window_start(r)
        window = torch.full(src.local_shape(r), -1, dtype=torch.int64)
        window.view(-1)[start - first:stop - first] = full.reshape(-1)[start:stop]
        part = torch.full((-(-n // ranks),), -1, dtype=torch.int64)
        part[:stop - start] = full.reshape(-1)[start:stop]
        prog = p.for_rank(r)
        moved = on_flat_sources(prog, {0: src.flat_frame(r)})
        assert on_flat_sources(prog, {}) is prog
        for c, m in zip(prog.chunks, moved.chunks):
            assert (c.index, c.recvs, c.unpack, c.send_bytes) == (m.index, m.recvs, m.unpack, m.send_bytes)
            assert [x.offsets for x in c.sends] == [x.offsets for x in m.sends]
            reads = [(a, b) for d, a, b in zip(c.pack.from_dst, c.pack.boxes, m.pack.boxes) if not d]
            reads += [(a.src_box, b.src_box) for a, b in zip(c.local, m.local) if not a.stage]
            reads += [(a.src_box, b.src_box) for x, y in zip(c.sends, m.sends) for a, b in zip(x.transfers,
                                                                                                y.transfers)]
            for old, new in reads:
                assert isinstance(new, FlatRun) and region_fits(tuple(part.shape), new)
                assert torch.equal(region_view(part, new), region_view(window, old))
                read += old.numel
    assert read >= n  # every element is read from some partition (twice when packed and sent)
