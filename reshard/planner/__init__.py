"""The planner: layouts, box arithmetic and plans. Pure Python on plain values; no device, no process group.

Exports:
    Box, intersect, split_box, split_to_fit, subtract: n-D index boxes and their arithmetic.
    Mesh, Layout, Piece: DTensor-exact layouts and their local pieces; `parse_layout` reads the command-line
        notation (`"ranks=0-7 mesh=2x4 R,S(0)"`).
    ExplicitLayout, fuse, relabel, vocab_parallel_layout: layouts given piece by piece (fused and padded tensors).
    FlatRangeLayout, flat_boxes, flat_window, flat_partition: flat-sharded tensors (ZeRO-3, FSDP1 flat parameters,
        distributed-optimizer buffers): each rank's contiguous range of the flattened tensor as boxes, its local
        window, ZeRO-3's even partition.
    LocalRegion, FlatRun, local_region, region_view, region_strides, region_fits: where a piece lies in its local
        tensor (a box of it, or a run of a flat 1-D one) and the one translation and view of it that the kernels and
        the runtime use; is_dtensor, LayoutLike: the one DTensor check and the layout protocol; on_flat_sources:
        a rank's program reading flat partitions in place of their windows.
    scale_layout, block_halo_layout: the layouts of block-quantized (FP8) weights' scales and halos.
    DEFAULT_BLOCK, block_aligned, scale_box: the FP8 block geometry: the default `(128, 128)` block, whether a box
        of a weight covers whole blocks, the box of `scale_inv` a box touches.
    FP8: the FP8 dtype (`torch.float8_e4m3fn`).
    dtype_name, dtype_from_name: torch dtype <-> its name.
    Topology: ranks -> NVLink domains.
    plan, plan_many, PlanItem, Plan, PlanData, clear_plan_cache, DEFAULT_STAGING_BYTES, DEFAULT_MIN_SPLIT_BYTES:
        planning; `Plan` validates the `PlanData` it is built from; `PlanLimits` bounds what a plan may cost.
    plan_rank, RankPart, LocalTransfer: rank-local planning: one rank's part (what it sends, receives, forwards)
        computed from the layouts, topology and rank alone, each end of a transfer computing the same one.
    plan_local, LocalPlan: that part scheduled into chunks, for `execute` (each rank plans and runs its own).
    PIPELINE_DEPTH, RELAY_CHUNK_LAG: chunks in flight, the contract between planner and executor, and the relay
        lag derived from it.
    Transfer, Message, BoxList, PlanStats, RankBytes, RankChunk, RankPlan: what a plan holds; a rank's program
        (`Plan.for_rank`) is a `RankPlan` of `RankChunk`s of `Message`s and `BoxList`s.
    TransferColumns, LINKS: every transfer of a plan as numeric columns (`Plan.transfer_columns`), link kinds by
        their code there.
    format_bytes: a byte count for reports (`"1.5 MiB"`).

What only sibling packages use is in `reshard.planner._contract`.
"""

from reshard.planner._blocks import (
    DEFAULT_BLOCK,
    block_aligned,
    block_halo_layout,
    scale_box,
    scale_layout,
)
from reshard.planner._box import Box, intersect, split_box, split_to_fit, subtract
from reshard.planner._checks import PlanLimits
from reshard.planner._chunks import TransferColumns
from reshard.planner._dtypes import dtype_from_name, dtype_name
from reshard.planner._explicit import ExplicitLayout, fuse, relabel, vocab_parallel_layout
from reshard.planner._flat import FlatRangeLayout, flat_boxes, flat_partition, flat_window
from reshard.planner._format import format_bytes
from reshard.planner._fp8 import FP8
from reshard.planner._layout import Layout, Piece
from reshard.planner._local import LocalTransfer, RankPart, plan_rank
from reshard.planner._local_plan import LocalPlan, plan_local
from reshard.planner._mesh import Mesh
from reshard.planner._notation import parse_layout
from reshard.planner._plan import (
    DEFAULT_MIN_SPLIT_BYTES,
    DEFAULT_STAGING_BYTES,
    RELAY_CHUNK_LAG,
    Plan,
    PlanData,
    PlanItem,
    clear_plan_cache,
    plan,
    plan_many,
)
from reshard.planner._reframe import on_flat_sources
from reshard.planner._region import (
    FlatRun, LayoutLike, LocalRegion, is_dtensor, local_region, region_fits, region_strides, region_view,
)
from reshard.planner._topology import Topology
from reshard.planner._types import (
    LINKS,
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
    "DEFAULT_BLOCK",
    "DEFAULT_MIN_SPLIT_BYTES",
    "DEFAULT_STAGING_BYTES",
    "FP8",
    "LINKS",
    "PIPELINE_DEPTH",
    "RELAY_CHUNK_LAG",
    "Box",
    "BoxList",
    "ExplicitLayout",
    "FlatRangeLayout",
    "FlatRun",
    "Layout",
    "LayoutLike",
    "LocalPlan",
    "LocalRegion",
    "LocalTransfer",
    "Mesh",
    "Message",
    "Piece",
    "Plan",
    "PlanData",
    "PlanItem",
    "PlanLimits",
    "PlanStats",
    "RankBytes",
    "RankChunk",
    "RankPart",
    "RankPlan",
    "Topology",
    "Transfer",
    "TransferColumns",
    "block_aligned",
    "block_halo_layout",
    "clear_plan_cache",
    "dtype_from_name",
    "dtype_name",
    "flat_boxes",
    "flat_partition",
    "flat_window",
    "format_bytes",
    "fuse",
    "intersect",
    "is_dtensor",
    "local_region",
    "on_flat_sources",
    "parse_layout",
    "plan",
    "plan_local",
    "plan_many",
    "plan_rank",
    "region_fits",
    "region_strides",
    "region_view",
    "relabel",
    "scale_box",
    "scale_layout",
    "split_box",
    "split_to_fit",
    "subtract",
    "vocab_parallel_layout",
]
