"""Ground truth from DTensor itself, in one process, through a fake process group.

`dtensor_local(full, mesh_ranks, placements, rank, world_size)` returns what `distribute_tensor` gives `rank`, with
no communication: one process can ask as any rank of any world size. Feed it `index_tensor(shape)` (element `i`
holds `i`) to see exactly which global elements a rank holds, in its local order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore


def index_tensor(shape: Sequence[int]) -> torch.Tensor:
    """`int64` tensor of `shape` whose element at flat index `i` is `i`."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.int64).reshape(tuple(shape))


class _FakeWorld:
    """Switches the (fake) default process group to any rank, reusing it while rank and size stay the same."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.world_size: int | None = None

    def use(self, rank: int, world_size: int) -> None:
        if (rank, world_size) == (self.rank, self.world_size) and dist.is_initialized():
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        self.rank, self.world_size = rank, world_size

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.rank = self.world_size = None


_WORLD = _FakeWorld()


def use_fake_rank(rank: int, world_size: int) -> None:
    """Make this process's default process group a fake one, as `rank` of `world_size` (no communication), so
    `DeviceMesh` and `distribute_tensor` can be built as that rank. Replaces any default group."""
    _WORLD.use(rank, world_size)


def dtensor_local(
    full: torch.Tensor, mesh_ranks: torch.Tensor, placements: Sequence, rank: int, world_size: int
) -> torch.Tensor:
    """`distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()` as `rank` of `world_size` sees it.

    With `src_data_rank=None` DTensor only slices `full` at the rank's mesh coordinate, so the mesh is built as
    `rank` without process groups (`DeviceMesh(..., _init_backend=False, _rank=rank)`, the default group is left as
    it is); on a torch whose `DeviceMesh` lacks `_rank`, through the fake default group (`use_fake_rank`).

    Args:
        full: the global tensor (CPU).
        mesh_ranks: the mesh's global ranks, an n-D int tensor (like `DeviceMesh.mesh`).
        placements: one DTensor placement per mesh axis.
        rank, world_size: the rank to ask as, and the world's size (above every rank of the mesh).
    """
    mesh_ranks = torch.as_tensor(mesh_ranks)
    if not 0 <= rank < world_size or (mesh_ranks.numel() and int(mesh_ranks.max()) >= world_size):
        raise ValueError(f"dtensor_local: rank {rank} and mesh ranks {mesh_ranks.flatten().tolist()} must lie in "
                         f"[0, {world_size})")
    try:
        mesh = DeviceMesh("cpu", mesh_ranks, _init_backend=False, _rank=rank)
    except TypeError:  # no `_rank` in this torch: act as the rank in a fake world
        use_fake_rank(rank, world_size)
        mesh = DeviceMesh("cpu", mesh_ranks)
    return distribute_tensor(full, mesh, list(placements), src_data_rank=None).to_local()


def close_fake_world() -> None:
    """Destroy the fake default process group, if `dtensor_local` or `use_fake_rank` made one."""
    _WORLD.close()
