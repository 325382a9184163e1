"""Layouts against DTensor itself: every rank's pieces must rebuild exactly the local tensor DTensor gives.

Random meshes (1-4 dims), tensors (0-6 dims, uneven and empty sizes), placements (`Shard`, `Replicate`,
`_StridedShard`, several axes on one dim), and ranks outside the mesh.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard import Layout, Mesh
from reshard.testing import dtensor_local, index_tensor, use_fake_rank


def rebuild_local(layout: Layout, rank: int, full: torch.Tensor) -> torch.Tensor:
    """The local tensor our pieces describe, filled from `full`; -1 where no piece writes."""
    out = torch.full(layout.local_shape(rank), -1, dtype=full.dtype)
    for p in layout.pieces(rank):
        assert p.global_box.shape == p.local_box.shape
        out[p.local_box.slices()] = full[p.global_box.slices()]
    return out


@st.composite
def layout_cases(draw: st.DrawFn):
    ndim = draw(st.integers(0, 6))
    max_size = 7 if ndim <= 3 else 3
    shape = tuple(draw(st.integers(0, max_size)) for _ in range(ndim))
    mesh_ndim = draw(st.integers(1, 4))
    mesh_shape = tuple(draw(st.integers(1, 4 if mesh_ndim <= 2 else 2)) for _ in range(mesh_ndim))
    size = 1
    for s in mesh_shape:
        size *= s
    world_size = size + draw(st.integers(0, 3))  # some ranks outside the mesh
    ranks = draw(st.permutations(list(range(world_size))))[:size]
    placements = []
    for _ in range(mesh_ndim):
        kinds = ["R"] + (["S", "SS"] if ndim else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "R":
            placements.append(Replicate())
        else:
            dim = draw(st.integers(-ndim, ndim - 1))
            if kind == "S":
                placements.append(Shard(dim))
            else:
                placements.append(_StridedShard(dim, split_factor=draw(st.integers(1, 3))))
    return shape, mesh_shape, ranks, world_size, placements


pytestmark = pytest.mark.usefixtures("fake_world")  # the fake default group of dtensor_local, closed after


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_cases())
def test_pieces_match_dtensor(case) -> None:
    shape, mesh_shape, ranks, world_size, placements = case
    full = index_tensor(shape)
    mesh_ranks = torch.tensor(ranks, dtype=torch.int64).reshape(mesh_shape)
    layout = Layout(shape, Mesh(mesh_ranks), placements, torch.int64)
    for rank in range(world_size):
        expected = dtensor_local(full, mesh_ranks, placements, rank, world_size)
        assert layout.local_shape(rank) == tuple(expected.shape), (rank, layout)
        got = rebuild_local(layout, rank, full)
        assert torch.equal(got, expected), (rank, layout, got, expected)
        if rank not in ranks:
            assert layout.pieces(rank) == ()


def test_strided_shard_fsdp2_tp_example() -> None:
    """The docstring example of `_StridedShard`: rows 0-1, 4-5, 2-3, 6-7 on ranks 0..3 (right-to-left order)."""
    layout = Layout((8, 8), Mesh([[0, 1], [2, 3]]), [_StridedShard(0, split_factor=2), Shard(0)])
    rows = [[(p.global_box.offsets[0], p.global_box.stops[0]) for p in layout.pieces(r)] for r in range(4)]
    assert rows == [[(0, 2)], [(4, 6)], [(2, 4)], [(6, 8)]]


def test_uneven_strided_shard_gives_several_pieces() -> None:
    """9 rows, `_S(0, 2)` over 2 then `S(0)` over 1: rank 0 holds rows 0-2 and 5-6, two pieces in local order."""
    layout = Layout((9,), Mesh([[0], [1]]), [_StridedShard(0, split_factor=2), Shard(0)])
    pieces = layout.pieces(0)
    assert [(p.global_box.offsets, p.local_box.offsets, p.global_box.shape) for p in pieces] == [
        ((0,), (0,), (3,)),
        ((5,), (3,), (2,)),
    ]


def test_mesh_from_device_mesh_and_layout_from_dtensor() -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    use_fake_rank(3, 6)
    dm = DeviceMesh("cpu", torch.arange(6).reshape(2, 3), mesh_dim_names=("dp", "tp"))
    mesh = Mesh.from_device_mesh(dm)
    assert mesh.shape == (2, 3) and mesh.axis_names == ("dp", "tp") and mesh.coordinate(3) == (1, 0)
    dt = distribute_tensor(torch.zeros(5, 4, dtype=torch.bfloat16), dm, [Shard(1), Shard(0)], src_data_rank=None)
    layout = Layout.from_dtensor(dt)
    assert layout.shape == (5, 4) and layout.dtype == torch.bfloat16
    assert layout.local_shape(3) == tuple(dt.to_local().shape)


def test_mesh_accepts_numpy_and_tensor() -> None:
    np = pytest.importorskip("numpy")
    a = Mesh(np.arange(6).reshape(2, 3))
    b = Mesh(torch.arange(6).reshape(2, 3))
    c = Mesh([[0, 1, 2], [3, 4, 5]])
    assert a == b == c and a.shape == (2, 3) and a.ranks == tuple(range(6))
