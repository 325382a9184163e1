"""Quick start: move one DTensor between two groups of ranks, on CPU with gloo.

Run: `torchrun --nproc-per-node 4 examples/dtensor_two_groups.py`.

Ranks 0-1 are the trainer: they hold a (8, 6) weight sharded by rows, `Shard(0)`, on their mesh. Ranks 2-3 are
the engine: they want it sharded by columns, `Shard(1)`, on theirs. Each side builds its own `DeviceMesh` in
default-world ranks; every rank calls `reshard_dtensor`, the trainer with `(src, None)`, the engine with
`(None, dst)`, and the engine's local tensors are written in place. The engine checks its shards, and the whole
weight gathered from them, against the weight.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from reshard import reshard_dtensor


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 4, "run under torchrun --nproc-per-node 4"
    weight = torch.arange(48, dtype=torch.float32).reshape(8, 6)  # what the trainer holds, known here to check

    # Building a DeviceMesh creates its process groups, which every rank of the world takes part in: so every rank
    # builds both meshes, in the same order, and uses the one of its side.
    trainer_mesh = DeviceMesh("cpu", [0, 1])
    engine_mesh = DeviceMesh("cpu", [2, 3])

    if rank < 2:  # trainer: its shard of the weight (here cut from the full tensor; in training, the parameter)
        src = distribute_tensor(weight, trainer_mesh, [Shard(0)], src_data_rank=None)
        reshard_dtensor(src, None)
    else:  # engine: an empty DTensor of the right layout, filled in place
        local = torch.zeros(8, 3)
        dst = DTensor.from_local(local, engine_mesh, [Shard(1)], run_check=False, shape=(8, 6), stride=(6, 1))
        reshard_dtensor(None, dst)
        assert torch.equal(dst.to_local(), weight[:, 3 * (rank - 2):3 * (rank - 1)])
        # the whole weight back from the engine's shards: an all-gather on the engine's mesh (plain c10d here:
        # `dst.full_tensor()` gives the same, but its functional collective can abort the process at exit, under load)
        shards = [torch.empty_like(dst.to_local()) for _ in range(2)]
        dist.all_gather(shards, dst.to_local(), group=engine_mesh.get_group())
        assert torch.equal(torch.cat(shards, dim=1), weight)
        print(f"rank {rank}: local {tuple(dst.to_local().shape)} of {tuple(dst.shape)} verified against full_tensor")

    ok = torch.ones(1)
    dist.all_reduce(ok)
    if rank == 0:
        print(f"dtensor_two_groups verified on {int(ok)} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
