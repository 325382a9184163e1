"""`reshard.testing.dtensor_local`, the DTensor oracle of the planner tests, against `distribute_tensor` run as the
rank of a fake default world (the way a real rank would build its `DeviceMesh`, process groups and all)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from reshard.testing import dtensor_local, index_tensor, use_fake_rank

CASES = [
    ((7, 5, 3), [[3, 0], [2, 5]], [_StridedShard(0, split_factor=2), Shard(0)]),
    ((9, 4), [1, 4, 2], [Shard(1)]),
    ((5,), [[0, 1], [2, 3]], [Replicate(), Shard(0)]),
    ((6, 0), [[0], [2]], [Shard(0), Shard(1)]),
    ((), [0, 1], [Replicate()]),
]
WORLD = 7  # ranks 6 and some others hold nothing


pytestmark = pytest.mark.usefixtures("fake_world")  # the fake default group of dtensor_local, closed after


@pytest.mark.parametrize(("shape", "mesh", "placements"), CASES, ids=[str(c[0]) for c in CASES])
def test_matches_distribute_tensor_in_a_fake_world(shape, mesh, placements) -> None:
    full = index_tensor(shape)
    mesh_ranks = torch.tensor(mesh)
    for rank in range(WORLD):
        got = dtensor_local(full, mesh_ranks, placements, rank, WORLD)
        use_fake_rank(rank, WORLD)
        want = distribute_tensor(full, DeviceMesh("cpu", mesh_ranks), placements, src_data_rank=None).to_local()
        assert got.shape == want.shape and torch.equal(got, want), (rank, got, want)


def test_ranks_outside_the_world_are_refused() -> None:
    with pytest.raises(ValueError, match=r"rank 7 and mesh ranks \[0, 1\] must lie in \[0, 7\)"):
        dtensor_local(index_tensor((4,)), torch.tensor([0, 1]), [Shard(0)], 7, 7)
    with pytest.raises(ValueError, match=r"mesh ranks \[0, 9\]"):
        dtensor_local(index_tensor((4,)), torch.tensor([0, 9]), [Shard(0)], 0, 7)
