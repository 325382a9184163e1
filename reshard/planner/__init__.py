"""The planner: layouts, box arithmetic and plans. Pure Python on plain values; no device, no process group.

Exports `Box`, `Mesh`, `Layout`, `Piece`, `Topology`, `plan`, `plan_many`, `PlanItem`, `PlanLimits`, `Plan`, the
plan's value types, and `clear_plan_cache`.
"""

from reshard.planner._box import Box, intersect, split_box, split_to_fit, subtract
from reshard.planner._checks import PlanLimits
from reshard.planner._layout import Layout, Piece, placement_str
from reshard.planner._mesh import Mesh
from reshard.planner._plan import (
    RELAY_CHUNK_LAG,
    DEFAULT_MIN_SPLIT_BYTES,
    DEFAULT_STAGING_BYTES,
    Plan,
    PlanItem,
    clear_plan_cache,
    format_bytes,
    gather_broadcast_bytes,
    plan,
    plan_many,
)
from reshard.planner._topology import Topology
from reshard.planner._types import Message, PlanStats, RankBytes, RankChunk, RankPlan, Transfer

__all__ = [
    "RELAY_CHUNK_LAG",
    "Box",
    "DEFAULT_MIN_SPLIT_BYTES",
    "DEFAULT_STAGING_BYTES",
    "Layout",
    "Mesh",
    "Message",
    "Piece",
    "Plan",
    "PlanItem",
    "PlanLimits",
    "PlanStats",
    "RankBytes",
    "RankChunk",
    "RankPlan",
    "Topology",
    "Transfer",
    "clear_plan_cache",
    "format_bytes",
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
