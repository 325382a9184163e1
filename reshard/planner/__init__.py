"""The planner: layouts, box arithmetic and plans. Pure Python on plain values; no device, no process group.

Exports `Box`, `Mesh`, `Layout`, `Piece`, `Topology`, `plan`, `plan_many`, `PlanItem`, `Plan` (and `PlanData`, what
`Plan` validates and is built from), the plan's value types (a rank's program, `Plan.for_rank`, is a `RankPlan` of
`RankChunk`s of `Message`s and `BoxList`s), `PIPELINE_DEPTH` (chunks in flight, the contract between planner and
executor), the report formatting (`format_bytes`, `format_stats`) and `clear_plan_cache`.
"""

from reshard.planner._box import Box, intersect, split_box, split_to_fit, subtract
from reshard.planner._layout import Layout, Piece, placement_str
from reshard.planner._mesh import Mesh
from reshard.planner._format import format_bytes, format_stats
from reshard.planner._plan import (
    DEFAULT_MIN_SPLIT_BYTES,
    DEFAULT_STAGING_BYTES,
    RELAY_CHUNK_LAG,
    Plan,
    PlanData,
    PlanItem,
    clear_plan_cache,
    gather_broadcast_bytes,
    plan,
    plan_many,
)
from reshard.planner._topology import Topology
from reshard.planner._types import (
    PIPELINE_DEPTH,
    BoxList,
    Message,
    PlanStats,
    RankBytes,
    RankChunk,
    RankPlan,
    Transfer,
)

__all__ = [
    "Box",
    "BoxList",
    "DEFAULT_MIN_SPLIT_BYTES",
    "DEFAULT_STAGING_BYTES",
    "Layout",
    "Mesh",
    "Message",
    "PIPELINE_DEPTH",
    "Piece",
    "Plan",
    "PlanData",
    "PlanItem",
    "PlanStats",
    "RELAY_CHUNK_LAG",
    "RankBytes",
    "RankChunk",
    "RankPlan",
    "Topology",
    "Transfer",
    "clear_plan_cache",
    "format_bytes",
    "format_stats",
    "gather_broadcast_bytes",
    "intersect",
    "placement_str",
    "plan",
    "plan_many",
    "split_box",
    "split_to_fit",
    "subtract",
]

from reshard.planner._explicit import ExplicitLayout, fuse, relabel, vocab_parallel_layout  # noqa: E402

__all__ += ["ExplicitLayout", "fuse", "relabel", "vocab_parallel_layout"]
