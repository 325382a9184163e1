"""Argument checking shared by both backends of `pack` / `unpack`, and the packed-size helpers.

Everything here is host-side Python on tensor metadata; no data is read. Both backends call `check_copy_args` first,
so they accept and refuse exactly the same inputs with the same messages.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reshard.planner import Box, FlatRun, LocalRegion, region_fits

# Same-width integer dtype per element size: a raw (no-cast) copy moves every dtype as these bits.
INT_DTYPE_BY_SIZE: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

TensorArg = torch.Tensor | Sequence[torch.Tensor]
OffsetArg = Sequence[int] | torch.Tensor


def _dtype_itemsize(dtype: torch.dtype, what: str) -> int:
    size = dtype.itemsize
    if size not in INT_DTYPE_BY_SIZE or dtype.is_complex:
        raise ValueError(f"{what}: dtype {dtype} is not supported; element sizes 1, 2, 4 and 8 bytes are (bool, "
                         f"int8/uint8, float8 types, float16, bfloat16, int16, int32, float32, int64, float64)")
    return size


def packed_nbytes(boxes: Sequence[Box], dtype: torch.dtype | Sequence[torch.dtype]) -> int:
    """Bytes that `boxes` occupy when packed back to back, with no padding.

    Args:
        boxes: the boxes, in any order.
        dtype: the dtype of the packed elements: one for all boxes, or one per box. With `pack(..., dtype=d)` this
            is `d`; without, it is each source tensor's dtype.

    Example:
        >>> packed_nbytes([Box((0, 0), (2, 3)), Box((5,), (4,))], torch.bfloat16)
        20
    """
    if isinstance(dtype, torch.dtype):
        return sum(b.numel for b in boxes) * _dtype_itemsize(dtype, "packed_nbytes")
    if len(dtype) != len(boxes):
        raise ValueError(f"packed_nbytes: got {len(boxes)} boxes but {len(dtype)} dtypes; pass one dtype per box")
    return sum(b.numel * _dtype_itemsize(d, "packed_nbytes") for b, d in zip(boxes, dtype))


def packed_offsets(
    boxes: Sequence[Box], dtype: torch.dtype | Sequence[torch.dtype], *, align: int = 1, start: int = 0
) -> tuple[list[int], int]:
    """Byte offsets that lay `boxes` out back to back in a buffer, each aligned to `align` bytes.

    Aligned offsets are not required by `pack`/`unpack`, but with `align=16` (and 16-byte aligned buffers) the Triton
    kernels move whole 8-byte words instead of single elements or bytes.

    Args:
        boxes: the boxes, in buffer order.
        dtype: the packed dtype, one for all boxes or one per box (see `packed_nbytes`).
        align: a power of two; every offset is a multiple of it.
        start: the first offset (rounded up to `align`).

    Returns:
        `(offsets, end)`: one byte offset per box and the end of the last box (the buffer size needed).

    Example:
        >>> packed_offsets([Box((0,), (3,)), Box((0,), (2,))], torch.float16, align=8)
        ([0, 8], 12)
    """
    if align < 1 or align & (align - 1):
        raise ValueError(f"packed_offsets: align must be a power of two >= 1, got {align}")
    dtypes = [dtype] * len(boxes) if isinstance(dtype, torch.dtype) else list(dtype)
    if len(dtypes) != len(boxes):
        raise ValueError(f"packed_offsets: got {len(boxes)} boxes but {len(dtypes)} dtypes; pass one dtype per box")
    offsets = []
    pos = start
    for box, d in zip(boxes, dtypes):
        pos = (pos + align - 1) & -align
        offsets.append(pos)
        pos += box.numel * _dtype_itemsize(d, "packed_offsets")
    return offsets, pos


@dataclass(frozen=True, slots=True)
class CopyArgs:
    """Checked, normalised arguments of one `pack` or `unpack` call.

    Attributes (one entry per box, in call order):
        tensors: the source (pack) or destination (unpack) tensor of each box.
        boxes: the boxes, each with `ndim == tensors[i].ndim` and inside `tensors[i].shape`.
        offsets: byte offset of each box in `buffer`.
        numels: element count of each box.
        buffer_dtypes: dtype of each box's elements in the buffer (`dtype` if given, else the tensor's dtype).
        buffer: the 1-D contiguous `uint8` buffer.
    """

    tensors: list[torch.Tensor]
    boxes: list[LocalRegion]
    offsets: list[int]
    numels: list[int]
    buffer_dtypes: list[torch.dtype]
    buffer: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.buffer.device


def _as_offsets(offsets: OffsetArg, op: str) -> list[int]:
    if isinstance(offsets, torch.Tensor):
        if offsets.ndim != 1 or offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
            raise ValueError(f"{op}: offsets must be a 1-D integer tensor or a sequence of ints, got a tensor of "
                             f"shape {tuple(offsets.shape)} and dtype {offsets.dtype}")
        return offsets.tolist()
    return [int(o) for o in offsets]


def check_copy_args(
    op: str,
    tensors: TensorArg,
    boxes: Sequence[LocalRegion],
    buffer: torch.Tensor,
    offsets: OffsetArg,
    dtype: torch.dtype | None,
) -> CopyArgs:
    """Validate the arguments of `pack` (`op == "pack"`) or `unpack` and normalise them.

    Raises:
        TypeError: a tensor that is not a `torch.Tensor` or a box that is not a `Box`.
        ValueError: naming the box index, the tensor shape and the box, for: lengths that differ, a box whose rank
            differs from its tensor's or that leaves the tensor, a buffer that is not a 1-D contiguous `uint8`
            tensor or is too small, a negative offset, boxes whose buffer ranges overlap (pack), tensors on another
            device than the buffer, an unsupported dtype, or (unpack) a destination with stride 0 along a dim of
            size > 1, where one memory location would receive several elements.
    """
    boxes = list(boxes)
    if isinstance(tensors, torch.Tensor):
        tensor_list = [tensors] * len(boxes)
    else:
        tensor_list = list(tensors)
    offset_list = _as_offsets(offsets, op)
    if not (len(tensor_list) == len(boxes) == len(offset_list)):
        raise ValueError(f"{op}: tensors, boxes and offsets must have the same length (one per box), got "
                         f"{len(tensor_list)} tensors, {len(boxes)} boxes and {len(offset_list)} offsets")
    if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.ndim != 1:
        got = f"shape {tuple(buffer.shape)} and dtype {buffer.dtype}" if isinstance(buffer, torch.Tensor) else repr(
            type(buffer))
        raise ValueError(f"{op}: buffer must be a 1-D torch.uint8 tensor, got {got}")
    if buffer.numel() > 1 and buffer.stride(0) != 1:
        raise ValueError(f"{op}: buffer must be contiguous, got stride {buffer.stride(0)}")
    if dtype is not None:
        _dtype_itemsize(dtype, f"{op}: dtype")
    device = buffer.device
    capacity = buffer.numel()
    numels: list[int] = []
    buffer_dtypes: list[torch.dtype] = []
    # per tensor, checked once: (shape, dtype of its elements in the buffer, that dtype's itemsize)
    known: dict[int, tuple[tuple[int, ...], torch.dtype, int]] = {}
    for i, (t, box, off) in enumerate(zip(tensor_list, boxes, offset_list)):
        meta = known.get(id(t))
        if meta is None:
            meta = known[id(t)] = _check_tensor(op, i, t, device, dtype)
        shape, bdtype, itemsize = meta
        if type(box) is not Box and not isinstance(box, (Box, FlatRun)):
            raise TypeError(f"{op}: boxes[{i}] must be a Box or a FlatRun, got {type(box)}")
        box_shape = box.shape
        if not region_fits(shape, box):
            raise ValueError(f"{op}: box {i} {box!r} does not fit in tensor {i} of shape {shape}; a box needs the "
                             "tensor's rank and offsets + shape <= the tensor's shape along every dim (a FlatRun: a "
                             "1-D tensor holding its whole run)")
        numel = math.prod(box_shape)
        if off < 0 or off + numel * itemsize > capacity:
            raise ValueError(f"{op}: buffer too small or offset out of range for box {i} {box!r} of tensor {i} of "
                             f"shape {shape}: it needs bytes [{off}, {off + numel * itemsize}) as {bdtype} but the "
                             f"buffer has {capacity} bytes")
        numels.append(numel)
        buffer_dtypes.append(bdtype)
    if op == "pack":
        _check_disjoint(op, offset_list, numels, buffer_dtypes)
    return CopyArgs(tensor_list, boxes, offset_list, numels, buffer_dtypes, buffer)


def _check_tensor(
    op: str, i: int, t: object, device: torch.device, dtype: torch.dtype | None
) -> tuple[tuple[int, ...], torch.dtype, int]:
    """Check `tensors[i]` once per call; return its shape and the dtype (and itemsize) of its buffer elements."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: tensors[{i}] must be a torch.Tensor, got {type(t)}")
    if t.device != device:
        raise ValueError(f"{op}: tensors[{i}] is on {t.device} but the buffer is on {device}; all tensors must be on "
                         "the buffer's device")
    _dtype_itemsize(t.dtype, f"{op}: tensors[{i}]")
    shape = tuple(t.shape)
    if op == "unpack" and any(st == 0 and sz > 1 for st, sz in zip(t.stride(), shape)):
        raise ValueError(f"{op}: tensors[{i}] of shape {shape} has strides {t.stride()}; a destination with stride 0 "
                         "along a dim of size > 1 would receive several elements in one memory location")
    bdtype = t.dtype if dtype is None else dtype
    return shape, bdtype, bdtype.itemsize


def _check_disjoint(op: str, offsets: list[int], numels: list[int], dtypes: list[torch.dtype]) -> None:
    """Refuse boxes whose buffer byte ranges overlap: the result would depend on the write order."""
    ranges = sorted((off, off + n * d.itemsize, i) for i, (off, n, d) in enumerate(zip(offsets, numels, dtypes)) if n)
    for (_, stop, i), (start, _, j) in itertools.pairwise(ranges):
        if start < stop:
            raise ValueError(f"{op}: boxes {i} and {j} overlap in the buffer: box {i} ends at byte {stop} but box {j} "
                             f"starts at byte {start}; buffer ranges must be disjoint")
