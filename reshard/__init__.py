"""reshard: move model weights between GPU groups that shard them differently, each byte once.

The public API:
- layouts: `Box`, `Mesh`, `Layout`, `Piece`, `Topology`, the placements `Shard` and `Replicate` (DTensor's own
  classes), and layouts given piece by piece: `ExplicitLayout`, `fuse`, `relabel`, `vocab_parallel_layout`;
- planning: `plan`, `plan_many`, `Plan`, `PlanItem`, `PlanLimits`, `PlanStats`, `Transfer`, `clear_plan_cache`,
  `DEFAULT_STAGING_BYTES`, `DEFAULT_MIN_SPLIT_BYTES`; the baseline's bytes: `gather_broadcast_bytes`;
- the data-path primitives: `pack`, `unpack` (Triton kernels on CUDA, torch on CPU), `transfer` and its
  `TransferHandle`, and `Group` (with `DEFAULT_TIMEOUT`);
- execution: `reshard` (a planned tensor), `execute` (one rank's part of a plan of many tensors, with its
  `ExecutionReport`), `reshard_dtensor` and `exchange_layouts` (DTensors on their own meshes);
  errors `CommError`, `ChecksumError`;
- model refit: `Refit`, `RefitReport`.

Subpackages: `reshard.planner`, `reshard.cost`, `reshard.kernels`, `reshard.comm`, `reshard.refit`, `reshard.sim`
(imported on use), `reshard.models`.
"""

# first: refuses a torch older than reshard supports (ImportError naming the version), before DTensor is touched
import reshard._compat  # noqa: F401, I001

from torch.distributed.tensor import Replicate, Shard

from reshard.comm import (
    DEFAULT_TIMEOUT,
    ChecksumError,
    CommError,
    ExecutionReport,
    Group,
    TransferHandle,
    exchange_layouts,
    execute,
    reshard,
    reshard_dtensor,
    transfer,
)
from reshard.cost import gather_broadcast_bytes
from reshard.kernels import pack, unpack
from reshard.planner import (
    DEFAULT_MIN_SPLIT_BYTES,
    DEFAULT_STAGING_BYTES,
    Box,
    ExplicitLayout,
    Layout,
    Mesh,
    Piece,
    Plan,
    PlanItem,
    PlanLimits,
    PlanStats,
    Topology,
    Transfer,
    clear_plan_cache,
    fuse,
    plan,
    plan_many,
    relabel,
    vocab_parallel_layout,
)
from reshard.refit import Refit, RefitReport

__all__ = [
    "DEFAULT_MIN_SPLIT_BYTES",
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_TIMEOUT",
    "Box",
    "ChecksumError",
    "CommError",
    "ExecutionReport",
    "ExplicitLayout",
    "Group",
    "Layout",
    "Mesh",
    "Piece",
    "Plan",
    "PlanItem",
    "PlanLimits",
    "PlanStats",
    "Refit",
    "RefitReport",
    "Replicate",
    "Shard",
    "Topology",
    "Transfer",
    "TransferHandle",
    "clear_plan_cache",
    "exchange_layouts",
    "execute",
    "fuse",
    "gather_broadcast_bytes",
    "pack",
    "plan",
    "plan_many",
    "relabel",
    "reshard",
    "reshard_dtensor",
    "transfer",
    "unpack",
    "vocab_parallel_layout",
]
