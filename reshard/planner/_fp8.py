"""The plan items of one FP8 block-quantized weight (DeepSeek-V3 style: e4m3 values, one float32
`weight_scale_inv` per 128 x 128 block): where it is quantized and which layouts move.

Where quantization happens, per weight:
- **On the source**, when every trainer shard covers whole blocks (cuts on multiples of 128, which Megatron's TP and
  EP splits of real models are). Each trainer rank quantizes its own shard, whose blocks are exactly the full
  tensor's, and the plan moves FP8 bytes (1 per element, half of bfloat16's) plus the scales, each with its own
  layout: the scale layout is derived from the weight's (a rank holds the scale of every block its shard
  touches, so an inference TP cut inside a block gives both ranks that block's scale).
- **On the destination**, otherwise (uneven FSDP-style cuts through blocks). Each inference rank receives its shard
  grown to whole blocks (its *halo*) in high precision, quantizes it, and keeps its own part. Exact, at 2-4 bytes
  per element plus the halo overlap.

Planning only: the quantization itself is `reshard.refit`'s (with `reshard.kernels.quantize_fp8_block`).
"""

from __future__ import annotations

from typing import Any

import torch

from reshard.planner._blocks import DEFAULT_BLOCK, block_halo_layout, is_block_aligned, scale_layout
from reshard.planner._explicit import relabel
from reshard.planner._item import PlanItem

FP8 = torch.float8_e4m3fn


class Fp8Items:
    """The plan items of one FP8 weight and the local tensors they use.

    Args:
        name: the destination global tensor's name.
        src: trainer layout (float32 / bfloat16 / float16).
        dst: the engine's FP8 weight layout.
        src_index: index of the trainer's local tensor in the source list.
        q_index, s_index: indices of the engine's FP8 and scale tensors in the destination list.
        extra_src, extra_dst: first free indices for this weight's own staging tensors.

    Attributes:
        on_source: whether trainer ranks quantize (their shards are block-aligned).
        items: the `PlanItem`s: FP8 values and scales (on the source), or the high-precision halo (on the
            destination).
        num_extra_src, num_extra_dst: staging tensors this weight adds to each side's list (2 and 0 on the
            source path: `q_src`, `s_src`; 0 and 1 on the destination path: `halo_dst`).
        src_scales (source path): the trainer-side scale layout. halo (destination path): the halo layout.
    """

    def __init__(self, name: str, src: Any, dst: Any, src_index: int, q_index: int, s_index: int,
                 extra_src: int, extra_dst: int) -> None:
        self.name = name
        self.src, self.dst = src, dst
        self.src_index, self.q_index, self.s_index = src_index, q_index, s_index
        self.on_source = is_block_aligned(src, DEFAULT_BLOCK)
        dst_scales = scale_layout(dst, DEFAULT_BLOCK, name=f"{name}.weight_scale_inv")
        if self.on_source:
            self.q_src, self.s_src = extra_src, extra_src + 1
            self.src_scales = scale_layout(src, DEFAULT_BLOCK, name=dst_scales.name)
            self.items = [
                PlanItem(relabel(src, dtype=FP8), dst, self.q_src, q_index, name=name),
                PlanItem(self.src_scales, dst_scales, self.s_src, s_index, name=dst_scales.name),
            ]
            self.num_extra_src, self.num_extra_dst = 2, 0
        else:
            self.halo = block_halo_layout(dst, DEFAULT_BLOCK, dtype=src.dtype)
            self.halo_dst = extra_dst
            self.items = [PlanItem(src, self.halo, src_index, self.halo_dst, name=name, precision="same")]
            self.num_extra_src, self.num_extra_dst = 0, 1
