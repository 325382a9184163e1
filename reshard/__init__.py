"""reshard: move model weights between GPU groups that shard them differently, each byte once.

The public API:
- layouts: `Box`, `Mesh`, `Layout`, `Topology`, and the placements `Shard`, `Replicate` (DTensor's own classes);
- planning: `plan`, `plan_many`, `Plan`, `PlanItem`, `PlanLimits`, `clear_plan_cache`, `gather_broadcast_bytes`;
- the data-path primitives: `pack`, `unpack` (Triton kernels on CUDA, torch on CPU), `transfer`, and `Group`;
- execution: `reshard` (a planned tensor), `reshard_dtensor` (DTensors on their own meshes);
- model refit: `Refit`, `RefitReport`.
"""

from torch.distributed.tensor import Replicate, Shard

from reshard.comm import CommError, Group, reshard, reshard_dtensor, transfer
from reshard.kernels import pack, unpack
from reshard.planner import (
    Box,
    Layout,
    Mesh,
    Piece,
    Plan,
    PlanItem,
    PlanLimits,
    Topology,
    Transfer,
    clear_plan_cache,
    gather_broadcast_bytes,
    plan,
    plan_many,
)

__all__ = [
    "Box",
    "Layout",
    "Mesh",
    "Piece",
    "Plan",
    "PlanItem",
    "PlanLimits",
    "Replicate",
    "Shard",
    "Topology",
    "Transfer",
    "clear_plan_cache",
    "gather_broadcast_bytes",
    "pack",
    "reshard",
    "reshard_dtensor",
    "transfer",
    "Group",
    "CommError",
    "Refit",
    "RefitReport",
    "unpack",
    "plan",
    "plan_many",
]

from reshard.refit import Refit, RefitReport  # noqa: E402  (refit builds on everything above)
