"""The planner's names for its sibling packages (not for users; `reshard.planner`'s `__all__` is the user face).

Each name here is used by another package of `reshard/` and by no user: the layering test allows this module, and
only it, across rooms.
    Fp8Items: the plan items of one FP8 block-quantized weight (refit's FP8 path, the simulator).
    check_block: an FP8 block size checked (the quantize kernel).
    encode_layout, decode_layout: a layout as JSON values and back, checked (refit's metadata and plan wire).
    encode_placements, decode_placements, placement_str: DTensor placements as JSON strings (`"S(0)"`, `"R"`) and
        back, checked (the DTensor entry points of comm).
    flat_index: a mesh coordinate's row-major position (comm's DTensor entry points, refit's sources).
    format_stats: a plan's statistics as report lines (the cost report).
"""

from reshard.planner._blocks import check_block
from reshard.planner._format import format_stats
from reshard.planner._fp8 import Fp8Items
from reshard.planner._layout import placement_str
from reshard.planner._mesh import flat_index
from reshard.planner._wire import decode_layout, decode_placements, encode_layout, encode_placements

__all__ = [
    "Fp8Items",
    "check_block",
    "decode_layout",
    "decode_placements",
    "encode_layout",
    "encode_placements",
    "flat_index",
    "format_stats",
    "placement_str",
]
