"""Layouts derived for block-quantized weights (DeepSeek-V3 style FP8: one scale per 128 x 128 block).

A quantized weight `W` of shape `[..., M, N]` comes with `weight_scale_inv` of shape `[..., ceil(M/bm), ceil(N/bn)]`:
element `(i, j)` of the scale belongs to block `(i // bm, j // bn)`; leading dims (stacked experts) map one to
one. This module is the one home of that geometry: `block_aligned` and `scale_box` on single boxes (also used by
`reshard.kernels` to check its arguments), and, from a weight's layout, the layouts of its scales and of the
block-aligned regions a rank needs to quantize on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from reshard.planner._box import Box
from reshard.planner._checks import bounded_cache
from reshard.planner._explicit import ExplicitLayout, relabel
from reshard.planner._layout import Piece, _geometry_id

Block = tuple[int, int]

DEFAULT_BLOCK: Block = (128, 128)
"""The block of DeepSeek-V3 style FP8 checkpoints: 128 rows by 128 columns."""

_DERIVED = bounded_cache("derived block layouts", 1024)
"""Derived layouts per (kind, weight geometry, block, dtype): every layer of a model has the same geometry, so its
scale and halo layouts are built (and checked) once and relabelled per weight."""


def _check(layout: Any, block: Block, what: str) -> Block:
    if len(layout.shape) < 2:
        raise ValueError(f"{what}: tensor {layout.name!r} of shape {tuple(layout.shape)} has fewer than 2 dims; "
                         "block quantization needs a matrix or a stack of matrices")
    return check_block(what, block)


def check_block(name: str, block: Sequence[int]) -> tuple[int, int]:
    """`block` as `(rows, cols)`; `ValueError` naming `name` unless it is two positive ints."""
    if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ValueError(f"{name}: block must be two positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def block_aligned(
    box_offsets: Sequence[int], box_shape: Sequence[int], full_shape: Sequence[int],
    block: Sequence[int] = DEFAULT_BLOCK
) -> bool:
    """Whether a box of a `[..., M, N]` tensor covers whole blocks only, so it quantizes on its own.

    True when, on each of the last two dims, the box starts at a multiple of the block and stops at a multiple of
    it or at the tensor's edge; leading dims (experts) never matter. Such a box quantizes to exactly its slice of
    the full tensor's `q`, with `scale_box` of the full `scale_inv`. An empty box is aligned.

    Example: `full_shape = (300, 200)`: rows 128..300 and columns 0..128 are aligned (300 is the edge); rows
    0..100 are not (100 is neither a multiple of 128 nor the edge).

        >>> block_aligned((128, 0), (172, 128), (300, 200)), block_aligned((0, 0), (100, 200), (300, 200))
        (True, False)
    """
    block = check_block("block_aligned", block)
    if not len(box_offsets) == len(box_shape) == len(full_shape) >= 2:
        raise ValueError(f"block_aligned: box offsets {tuple(box_offsets)}, box shape {tuple(box_shape)} and full "
                         f"shape {tuple(full_shape)} must have one equal length >= 2")
    return _aligned(box_offsets, box_shape, full_shape, block)


def _aligned(box_offsets: Sequence[int], box_shape: Sequence[int], full_shape: Sequence[int], block: Block) -> bool:
    """`block_aligned` on checked arguments."""
    if math.prod(box_shape) == 0:
        return True
    for start, size, full, b in zip(box_offsets[-2:], box_shape[-2:], full_shape[-2:], block):
        stop = start + size
        if start % b or (stop % b and stop != full):
            return False
    return True


def scale_box(
    box_offsets: Sequence[int], box_shape: Sequence[int], block: Sequence[int] = DEFAULT_BLOCK
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(offsets, shape)` in `scale_inv` of the blocks that a box of the weight touches.

    Leading dims are unchanged; on the last two, blocks `start // b` to `ceil(stop / b)`. With the whole tensor as
    the box this is the shape of its `scale_inv`. For a `block_aligned` box these are exactly its scales.

    Example: rows 128..300, columns 0..200 of a (300, 200) weight, 128 x 128 blocks:

        >>> scale_box((128, 0), (172, 200))
        ((1, 0), (2, 2))
    """
    block = check_block("scale_box", block)
    if len(box_offsets) != len(box_shape) or len(box_shape) < 2:
        raise ValueError(f"scale_box: box offsets {tuple(box_offsets)} and shape {tuple(box_shape)} must have one "
                         "equal length >= 2")
    lead_o, lead_s = tuple(box_offsets[:-2]), tuple(box_shape[:-2])
    offs, sizes = [], []
    for start, size, b in zip(box_offsets[-2:], box_shape[-2:], block):
        first = start // b
        offs.append(first)
        sizes.append(-(-(start + size) // b) - first if size else 0)
    return lead_o + tuple(offs), lead_s + tuple(sizes)


def scale_shape(shape: tuple[int, ...], block: Block) -> tuple[int, ...]:
    """`[..., M, N]` -> `[..., ceil(M / bm), ceil(N / bn)]`."""
    return tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def _block_box(box: Box, block: Block) -> Box:
    """The box of scale elements (blocks) a weight box touches."""
    return Box(*scale_box(box.offsets, box.shape, block))


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
    block = _check(layout, block, "is_block_aligned")
    shape = tuple(layout.shape)
    return all(_aligned(p.global_box.offsets, p.global_box.shape, shape, block)
               for r in layout.ranks for p in layout.pieces(r))


def scale_layout(layout: Any, block: Block = DEFAULT_BLOCK, *, name: str | None = None) -> ExplicitLayout:
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


def block_halo_layout(layout: Any, block: Block = DEFAULT_BLOCK, *, dtype: torch.dtype | None = None) -> ExplicitLayout:
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
