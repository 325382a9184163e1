"""reshard: move model weights between GPU groups that shard them differently, each byte once.

The public API:
- layouts: `Box`, `Mesh`, `Layout`, `Topology`, and the placements `Shard`, `Replicate` (DTensor's own classes);
- planning: `plan`, `plan_many`, `Plan`, `PlanItem`, `clear_plan_cache`, `gather_broadcast_bytes`;
- the data-path primitives: `pack`, `unpack` (Triton kernels on CUDA, torch on CPU).
"""

from torch.distributed.tensor import Replicate, Shard

from reshard.kernels import pack, unpack
from reshard.planner import (
    Box,
    Layout,
    Mesh,
    Piece,
    Plan,
    PlanItem,
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
    "Replicate",
    "Shard",
    "Topology",
    "Transfer",
    "clear_plan_cache",
    "gather_broadcast_bytes",
    "pack",
    "unpack",
    "plan",
    "plan_many",
]
