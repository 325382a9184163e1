"""Layouts derived for block-quantized weights (DeepSeek-V3 style FP8: one scale per 128 x 128 block).

A quantized weight `W` of shape `[..., M, N]` comes with `weight_scale_inv` of shape `[..., ceil(M/bm), ceil(N/bn)]`:
element `(i, j)` of the scale belongs to block `(i // bm, j // bn)`; leading dims (stacked experts) map one to
one. These functions derive, from a weight's layout, the layouts of its scales and of the block-aligned regions
a rank needs to quantize on its own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from reshard.planner._box import Box
from reshard.planner._checks import bounded_cache
from reshard.planner._explicit import ExplicitLayout, relabel
from reshard.planner._layout import Piece, _geometry_id

Block = tuple[int, int]

_DERIVED = bounded_cache("derived block layouts", 1024)
"""Derived layouts per (kind, weight geometry, block, dtype): every layer of a model has the same geometry, so its
scale and halo layouts are built (and checked) once and relabelled per weight."""


def _check(layout: Any, block: Block, what: str) -> None:
    if len(layout.shape) < 2:
        raise ValueError(f"{what}: tensor {layout.name!r} of shape {tuple(layout.shape)} has fewer than 2 dims; "
                         "block quantization needs a matrix or a stack of matrices")
    if block[0] < 1 or block[1] < 1:
        raise ValueError(f"{what}: block {block} must be positive")


def scale_shape(shape: tuple[int, ...], block: Block) -> tuple[int, ...]:
    """`[..., M, N]` -> `[..., ceil(M / bm), ceil(N / bn)]`."""
    return tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def _block_box(box: Box, block: Block) -> Box:
    """The box of scale elements (blocks) a weight box touches."""
    lead_o, lead_s = box.offsets[:-2], box.shape[:-2]
    (r0, c0), (nr, nc) = box.offsets[-2:], box.shape[-2:]
    br0, bc0 = r0 // block[0], c0 // block[1]
    br1, bc1 = -(-(r0 + nr) // block[0]), -(-(c0 + nc) // block[1])
    return Box(tuple(lead_o) + (br0, bc0), tuple(lead_s) + (br1 - br0, bc1 - bc0))


def _single_piece(layout: Any, rank: int, what: str) -> Piece | None:
    pieces = layout.pieces(rank)
    if len(pieces) > 1:
        raise NotImplementedError(
            f"{what}: tensor {layout.name!r} has {len(pieces)} pieces on rank {rank} (a strided or fused layout); "
            "block quantization supports one piece per rank"
        )
    return pieces[0] if pieces else None


def is_block_aligned(layout: Any, block: Block) -> bool:
    """Whether every rank's piece covers whole blocks: it starts on a block boundary and ends on one or at the
    tensor's edge, in the last two dims. Then each rank can quantize its own shard exactly as the full tensor."""
    _check(layout, block, "is_block_aligned")
    m, n = layout.shape[-2:]
    for r in layout.ranks:
        for p in layout.pieces(r):
            (r0, c0), (nr, nc) = p.global_box.offsets[-2:], p.global_box.shape[-2:]
            if r0 % block[0] or c0 % block[1]:
                return False
            if (r0 + nr) % block[0] and r0 + nr != m:
                return False
            if (c0 + nc) % block[1] and c0 + nc != n:
                return False
    return True


def scale_layout(layout: Any, block: Block = (128, 128), *, name: str | None = None) -> ExplicitLayout:
    """The layout of the weight's `weight_scale_inv`: each rank holds the scales of every block its shard touches.

    When a shard cut falls inside a block, both ranks hold that block's scale (the same value).

    Returns:
        An `ExplicitLayout` of the scale tensor (float32), one piece per rank; its local tensor is the blocks'
        scales in order, so a rank's local scale shape is `[..., blocks touched along M, blocks touched along N]`.
    """
    _check(layout, block, "scale_layout")
    nm = name or (f"{layout.name}.scale_inv" if layout.name else None)
    shape = scale_shape(tuple(layout.shape), block)
    return _derived("scale_layout", layout, block, torch.float32, nm, shape, lambda gb: _block_box(gb, block))


def block_halo_layout(layout: Any, block: Block = (128, 128), *, dtype: torch.dtype | None = None) -> ExplicitLayout:
    """Each rank's shard grown to whole blocks (in the last two dims), as a layout of the same global tensor.

    A rank that receives its halo in high precision can quantize it exactly as the full tensor would be, then keep
    its own shard. Halos of neighbouring ranks overlap where a cut splits a block.
    """
    _check(layout, block, "block_halo_layout")
    m, n = layout.shape[-2:]

    def halo(gb: Box) -> Box:
        bb = _block_box(gb, block)
        r0, c0 = bb.offsets[-2] * block[0], bb.offsets[-1] * block[1]
        r1 = min((bb.offsets[-2] + bb.shape[-2]) * block[0], m)
        c1 = min((bb.offsets[-1] + bb.shape[-1]) * block[1], n)
        return Box(gb.offsets[:-2] + (r0, c0), gb.shape[:-2] + (r1 - r0, c1 - c0))

    return _derived("block_halo_layout", layout, block, dtype or layout.dtype, layout.name, tuple(layout.shape), halo)


def _derived(kind: str, layout: Any, block: Block, dtype: torch.dtype, name: str | None, shape: tuple[int, ...],
             box_of: Callable[[Box], Box]) -> ExplicitLayout:
    """The layout where each rank holds `box_of(its piece's global box)` of a tensor of `shape`, as one local
    tensor: built once per (kind, weight geometry, block, dtype), then relabelled `name`."""
    key = (kind, _geometry_id(layout), tuple(block), dtype)
    cached = _DERIVED.get(key)
    if cached is None:
        pieces: dict[int, list[Piece]] = {}
        shapes: dict[int, tuple[int, ...]] = {}
        for r in layout.ranks:
            p = _single_piece(layout, r, kind)
            if p is None:
                shapes[r] = tuple(0 for _ in layout.shape)
                continue
            g = box_of(p.global_box)
            pieces[r] = [Piece(g, Box((0,) * g.ndim, g.shape))]
            shapes[r] = g.shape
        cached = _DERIVED[key] = ExplicitLayout(shape, dtype, pieces, shapes, name=name)
    return relabel(cached, name=name)
