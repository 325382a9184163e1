"""FP8 block-quantized refit of one weight (DeepSeek-V3 style: e4m3 values, one float32 `weight_scale_inv` per
128 x 128 block), exactly equal to quantizing the full high-precision tensor and slicing it.

Where quantization happens, per weight:
- **On the source**, when every trainer shard covers whole blocks (cuts on multiples of 128, which Megatron's TP and
  EP splits of real models are). Each trainer rank quantizes its own shard, whose blocks are exactly the full
  tensor's, and the plan moves FP8 bytes (1 per element, half of bfloat16's) plus the scales, each with its own
  layout: the scale layout is derived from the weight's (a rank holds the scale of every block its shard
  touches, so an inference TP cut inside a block gives both ranks that block's scale).
- **On the destination**, otherwise (uneven FSDP-style cuts through blocks). Each inference rank receives its shard
  grown to whole blocks (its *halo*) in high precision, quantizes it, and keeps its own part. Exact, at 2-4 bytes
  per element plus the halo overlap.
"""

from __future__ import annotations

from typing import Any

import torch

from reshard.planner import PlanItem
from reshard.planner import relabel
from reshard.planner._blocks import block_halo_layout, is_block_aligned, scale_layout

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn


def quantize(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """Block-quantize `x` (`[..., M, N]`, whole blocks from its origin) into `q_out` (FP8) and `s_out` (scales)."""
    from reshard.kernels import quantize_fp8_block

    if x.numel() == 0:
        return
    quantize_fp8_block(x, block=BLOCK, out=q_out, scale_out=s_out)


class Fp8Weight:
    """Plan items and the quantization steps of one FP8 weight.

    Args:
        name: the destination global tensor's name.
        src: trainer layout (float32 / bfloat16 / float16).
        dst: the engine's FP8 weight layout.
        src_index: index of the trainer's local tensor in the refit's source list.
        q_index, s_index: indices of the engine's FP8 and scale tensors in the destination list.
        extra_src, extra_dst: first free indices for this weight's own staging tensors.
    """

    def __init__(self, name: str, src: Any, dst: Any, src_index: int, q_index: int, s_index: int,
                 extra_src: int, extra_dst: int) -> None:
        self.name = name
        self.src, self.dst = src, dst
        self.src_index, self.q_index, self.s_index = src_index, q_index, s_index
        self.on_source = is_block_aligned(src, BLOCK)
        dst_scales = scale_layout(dst, BLOCK, name=f"{name}.weight_scale_inv")
        if self.on_source:
            self.q_src, self.s_src = extra_src, extra_src + 1
            self.src_scales = scale_layout(src, BLOCK, name=dst_scales.name)
            self.items = [
                PlanItem(relabel(src, dtype=FP8), dst, self.q_src, q_index, name=name),
                PlanItem(self.src_scales, dst_scales, self.s_src, s_index, name=dst_scales.name),
            ]
            self.num_extra_src, self.num_extra_dst = 2, 0
        else:
            self.halo = block_halo_layout(dst, BLOCK, dtype=src.dtype)
            self.halo_dst = extra_dst
            self.items = [PlanItem(src, self.halo, src_index, self.halo_dst, name=name, precision="same")]
            self.num_extra_src, self.num_extra_dst = 0, 1
        self._staging: dict[str, torch.Tensor] = {}

    def _buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = self._staging.get(key)
        if t is None:
            t = self._staging[key] = torch.empty(shape, dtype=dtype, device=device)
        return t

    def before(self, rank: int, src: list, dst: list) -> None:
        """On trainer ranks (source-side path): quantize this rank's shard into its staging FP8 and scale tensors.
        On inference ranks (destination-side path): provide the halo staging tensor."""
        if self.on_source and rank in self.src.ranks:
            x = src[self.src_index]
            q = self._buffer("q", tuple(x.shape), FP8, x.device)
            s = self._buffer("s", tuple(self.src_scales.local_shape(rank)), torch.float32, x.device)
            quantize(x, q, s)
            src[self.q_src], src[self.s_src] = q, s
        if not self.on_source and rank in self.dst.ranks:
            device = dst[self.q_index].device
            dst[self.halo_dst] = self._buffer("halo", tuple(self.halo.local_shape(rank)), self.src.dtype, device)

    def after(self, rank: int, dst: list) -> None:
        """Destination-side path: quantize the received halo and keep this rank's part of weight and scales."""
        if self.on_source or rank not in self.dst.ranks:
            return
        halo = dst[self.halo_dst]
        (piece,) = self.dst.pieces(rank) or (None,)
        if piece is None:
            return
        hq = self._buffer("hq", tuple(halo.shape), FP8, halo.device)
        hs = self._buffer("hs", tuple(dst[self.s_index].shape), torch.float32, halo.device)
        quantize(halo, hq, hs)
        (hp,) = self.halo.pieces(rank)
        own = tuple(slice(g - h, g - h + n) for g, h, n in
                    zip(piece.global_box.offsets, hp.global_box.offsets, piece.global_box.shape))
        dst[self.q_index][piece.local_box.slices()] = hq[own]
        dst[self.s_index].copy_(hs)

    @property
    def wire_bytes(self) -> int:
        from reshard.planner import plan_many

        return plan_many(self.items).stats.total_bytes
