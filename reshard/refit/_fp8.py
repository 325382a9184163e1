"""FP8 block-quantized refit of one weight, exactly equal to quantizing the full high-precision tensor and slicing
it: the quantization steps around the plan items of `reshard.planner._fp8` (which says where each weight is
quantized and why).
"""

from __future__ import annotations

from typing import Any

import torch

from reshard.kernels import quantize_fp8_block
from reshard.planner import DEFAULT_BLOCK as BLOCK
from reshard.planner import FP8, plan_many, region_view
from reshard.planner._contract import Fp8Items


def quantize(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """Block-quantize `x` (`[..., M, N]`, whole blocks from its origin) into `q_out` (FP8) and `s_out` (scales)."""
    if x.numel() == 0:
        return
    quantize_fp8_block(x, block=BLOCK, out=q_out, scale_out=s_out)


class Fp8Weight(Fp8Items):
    """Plan items (see `Fp8Items`, same arguments) and the quantization steps of one FP8 weight."""

    def __init__(self, name: str, src: Any, dst: Any, src_index: int, q_index: int, s_index: int,
                 extra_src: int, extra_dst: int) -> None:
        super().__init__(name, src, dst, src_index, q_index, s_index, extra_src, extra_dst)
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
        region_view(dst[self.q_index], piece.local_box).copy_(hq[own])
        dst[self.s_index].copy_(hs)

    @property
    def wire_bytes(self) -> int:
        return plan_many(self.items).stats.total_bytes
