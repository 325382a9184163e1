"""Delta encoding of boxes: send only the elements whose bits changed since a snapshot, and apply them on arrival.

A source keeps a *snapshot* of what it last sent for each box: a pack buffer (`packed_offsets` layout, raw bits of
the tensor's dtype) holding each box row-major. Three steps move a box's changes:

    counts  = scan_changes(tensors, boxes, snapshot, snapshot_offsets)           # per box, on the source
    offsets, end = delta_offsets(boxes, dtypes, counts)                          # sizes known from the counts
    headers = delta_encode(tensors, boxes, snapshot, snapshot_offsets, buffer, offsets, counts=counts,
                           base_version=v, version=v + 1)                        # writes buffer, updates snapshot
    ... buffer[:end] travels ...
    headers = delta_decode(buffer, offsets, tensors, boxes, versions=v)          # on the destination

Elements are compared as raw bits (the same-width integer of the dtype), so `-0.0` vs `0.0` and two NaNs with
different payloads are changes, and any 1-, 2-, 4- or 8-byte dtype works (bool, float8, bfloat16, int64, ...).

Encoded box (little-endian, every part a multiple of 8 bytes, so a box at an 8-aligned offset keeps its values
aligned for any element size):

    bytes [0, 40)   header: five int64 words (`DeltaHeader`)
        word 0      magic 0x4C44 ("DL") | format << 16 | itemsize << 24   (bits 32..63 are zero)
        word 1      numel of the box
        word 2      count: number of values that follow (numel for DENSE)
        word 3      base_version: the version the destination must hold for a sparse format to apply
        word 4      version: the version the destination holds after applying this box
    DENSE           all numel values, row-major
    BITMASK         ceil(numel / 8) bytes, bit `i % 8` of byte `i // 8` set where row-major element `i` changed
                    (padding bits 0), padded to 8 bytes; then the `count` changed values in row-major order
    INDICES         `count` int32 row-major element indices, ascending, padded to 8 bytes; then the values
    (values padded to 8 bytes)

`delta_nbytes(numel, count, itemsize)` is the exact size of a box (the format chosen by `choose_delta_format`: the
smallest, DENSE above `threshold` changed); `delta_max_nbytes(numel, itemsize)` the worst case (DENSE plus header).

Versions: a DENSE box applies to any destination. A BITMASK or INDICES box is relative to `base_version`, and
`delta_decode` refuses it (`DeltaVersionError`, before writing anything) unless the destination's version equals
it: a stale destination (reloaded engine, failed run) can never take a wrong delta. A sender that knows a
destination is stale forces `formats=DeltaFormat.DENSE` for it.

(`count_changed` returns only the counts; `delta_encode` then compares again and checks them.)

Every op has a pure-torch reference of the same signature (`count_changed_reference`, `scan_changes_reference`,
`delta_encode_reference`, `delta_decode_reference`): the CPU production path. `backend` picks as `pack` does
(`_backend.choose_backend`: Triton for CUDA tensors, torch for CPU tensors, `$RESHARD_KERNEL_BACKEND` or an
explicit argument otherwise; Triton on CPU tensors runs under its interpreter). The Triton kernels
(`_delta_triton.py`) count (per-tile comparison) and encode (comparison, compaction by an exclusive scan over tiles
and lanes, bitmask bits by atomic OR, snapshot update) and decode (scatter-apply: INDICES values to the storage offsets
of their row-major indices; BITMASK elements whose bit is set take their value by an exclusive scan over blocks,
after a per-block popcount that also checks the header's count), bit for bit as the references; DENSE boxes go
through the pack and unpack kernels. `scan_changes` on Triton returns counts only (the encode compares again). The
header checks of `delta_decode` read the headers on the host on both backends.

Layout of this file: constants and the header type, sizes and format choice, argument checks, the Triton launcher,
the public functions, then the pure-torch references.
"""

from __future__ import annotations

import enum
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from reshard.kernels._backend import choose_backend
from reshard.kernels._loader import launch_in_mode, load_device_module
from reshard.kernels._pack import _merge_dims, _storage_view, launch_config, pack, tile_lanes, tile_table, unpack
from reshard.kernels._spec import INT_DTYPE_BY_SIZE, OffsetArg, TensorArg, check_copy_args
from reshard.planner._box import Box

DELTA_MAGIC = 0x4C44  # "DL", little-endian
DELTA_HEADER_BYTES = 40  # five int64 words
DELTA_ALIGN = 8  # every encoded box starts at a multiple of this (buffer address + offset)
DELTA_DENSE_FRACTION = 0.5
"""Default `threshold`: above this fraction of changed elements a box goes DENSE even when a sparse format is a bit
smaller; past half changed a sparse format saves under 2x (bfloat16 bitmask: 1.56x at 50%) and costs a compaction
and a scatter. `threshold=1.0` always takes the smallest."""
_MAX_INDEX = 2**31 - 1  # INDICES holds int32 row-major indices: only boxes of at most 2**31 elements
_HEADER_WORDS = 5


class DeltaFormat(enum.IntEnum):
    """How a box's values travel (the `format` field of its header)."""

    DENSE = 0  # every value
    BITMASK = 1  # one bit per element, then the changed values
    INDICES = 2  # int32 index per changed element, then the changed values


class DeltaVersionError(ValueError):
    """A sparse box's base version is not the version the destination holds: applying it would be wrong."""


@dataclass(frozen=True, slots=True)
class DeltaHeader:
    """The header of one encoded box (see the module docstring for its byte layout).

    Attributes:
        format: the payload's format.
        itemsize: bytes per element (1, 2, 4 or 8).
        numel: elements in the box.
        count: values in the payload (`numel` for DENSE, the changed count otherwise).
        base_version: the destination version a sparse payload applies to.
        version: the destination's version after applying it.
    """

    format: DeltaFormat
    itemsize: int
    numel: int
    count: int
    base_version: int
    version: int

    @property
    def nbytes(self) -> int:
        """Encoded size of the box, header included."""
        return delta_nbytes(self.numel, self.count, self.itemsize, format=self.format)

    def words(self) -> list[int]:
        """The five int64 header words."""
        return [DELTA_MAGIC | int(self.format) << 16 | self.itemsize << 24, self.numel, self.count,
                self.base_version, self.version]


# ---------------------------------------------------------------------------------------------------------------
# Sizes and the format choice (host-side integers only)
# ---------------------------------------------------------------------------------------------------------------


def _round8(n: int) -> int:
    return (n + 7) & -8


def _check_itemsize(itemsize: int, what: str) -> None:
    if itemsize not in INT_DTYPE_BY_SIZE:
        raise ValueError(f"{what}: itemsize must be 1, 2, 4 or 8 bytes, got {itemsize}")


def _format_nbytes(numel: int, count: int, itemsize: int, fmt: DeltaFormat) -> int:
    if fmt == DeltaFormat.DENSE:
        return DELTA_HEADER_BYTES + _round8(numel * itemsize)
    values = _round8(count * itemsize)
    if fmt == DeltaFormat.BITMASK:
        return DELTA_HEADER_BYTES + _round8((numel + 7) // 8) + values
    return DELTA_HEADER_BYTES + _round8(4 * count) + values


def choose_delta_format(numel: int, count: int, itemsize: int, *,
                        threshold: float = DELTA_DENSE_FRACTION) -> DeltaFormat:
    """The format of a box with `count` of its `numel` elements changed: the smallest, or DENSE above `threshold`.

    Ties go to the simpler format (DENSE, then BITMASK). INDICES only for boxes of at most 2**31 - 1 elements.

    Example (bfloat16, 1000 elements): 0 changed -> INDICES (header only, 40 bytes); 20 changed -> INDICES
    (40 + 80 + 40 = 160 bytes; BITMASK is 40 + 128 + 40 = 208, DENSE 2040); 400 changed -> BITMASK
    (40 + 128 + 800 = 968 < INDICES 2440); 600 changed (> 0.5) -> DENSE.
    """
    if numel < 0 or not 0 <= count <= numel:
        raise ValueError(f"choose_delta_format: need 0 <= count <= numel, got count={count}, numel={numel}")
    _check_itemsize(itemsize, "choose_delta_format")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"choose_delta_format: threshold must be in [0, 1], got {threshold}")
    if numel == 0 or count > threshold * numel:
        return DeltaFormat.DENSE
    candidates = [DeltaFormat.DENSE, DeltaFormat.BITMASK]
    if numel <= _MAX_INDEX:
        candidates.append(DeltaFormat.INDICES)
    return min(candidates, key=lambda f: (_format_nbytes(numel, count, itemsize, f), int(f)))


def delta_nbytes(numel: int, count: int, itemsize: int, *, format: DeltaFormat | None = None,
                 threshold: float = DELTA_DENSE_FRACTION) -> int:
    """Exact encoded size in bytes (header included, a multiple of 8) of a box with `count` changed elements.

    Args:
        numel: elements in the box.
        count: changed elements (ignored for DENSE).
        itemsize: bytes per element.
        format: the format; None for the one `choose_delta_format(numel, count, itemsize, threshold=threshold)`
            picks.

    Example: `delta_nbytes(1000, 20, 2)` is 160 (INDICES: 40 header + 80 indices + 40 values).
    """
    fmt = choose_delta_format(numel, count, itemsize, threshold=threshold) if format is None else DeltaFormat(format)
    if not 0 <= count <= numel:
        raise ValueError(f"delta_nbytes: need 0 <= count <= numel, got count={count}, numel={numel}")
    _check_itemsize(itemsize, "delta_nbytes")
    if fmt == DeltaFormat.INDICES and numel > _MAX_INDEX:
        raise ValueError(f"delta_nbytes: INDICES holds int32 indices, a box of {numel} elements is too large")
    return _format_nbytes(numel, count, itemsize, fmt)


def delta_max_nbytes(numel: int, itemsize: int) -> int:
    """The largest size `delta_nbytes` gives a box with the chosen format: DENSE plus the header.

    Example: `delta_max_nbytes(1000, 2)` is 2040.
    """
    _check_itemsize(itemsize, "delta_max_nbytes")
    return _format_nbytes(numel, numel, itemsize, DeltaFormat.DENSE)


FormatArg = DeltaFormat | Sequence[DeltaFormat | None] | None


def _per_box(value: object, num: int, what: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != num:
            raise ValueError(f"{what}: got {len(value)} values for {num} boxes; pass one per box or one for all")
        return list(value)
    return [value] * num


def resolve_delta_formats(boxes: Sequence[Box], itemsizes: Sequence[int], counts: Sequence[int],
                          formats: FormatArg = None, *,
                          threshold: float = DELTA_DENSE_FRACTION) -> list[DeltaFormat]:
    """The format of every box: `formats[i]` where given (a `DeltaFormat` for all, or one per box, None meaning
    chosen), else `choose_delta_format` from `counts[i]`."""
    fmts = _per_box(formats, len(boxes), "formats")
    out = []
    for i, (box, size, count, fmt) in enumerate(zip(boxes, itemsizes, counts, fmts)):
        if fmt is None:
            out.append(choose_delta_format(box.numel, int(count), size, threshold=threshold))
            continue
        fmt = DeltaFormat(fmt)
        if fmt == DeltaFormat.INDICES and box.numel > _MAX_INDEX:
            raise ValueError(f"formats[{i}]: INDICES holds int32 indices; box {i} {box!r} has {box.numel} elements")
        out.append(fmt)
    return out


def delta_offsets(boxes: Sequence[Box], dtype: torch.dtype | Sequence[torch.dtype],
                  counts: Sequence[int] | torch.Tensor | ChangeScan | None = None, formats: FormatArg = None, *,
                  threshold: float = DELTA_DENSE_FRACTION, start: int = 0) -> tuple[list[int], int]:
    """Byte offsets laying the encoded boxes out back to back (each a multiple of 8 bytes), and the end.

    Args:
        boxes: the boxes, in buffer order.
        dtype: the tensors' dtype, one for all boxes or one per box.
        counts: changed elements per box (`count_changed`, or a `ChangeScan`); None reserves the worst case
            (`delta_max_nbytes`).
        formats: as in `resolve_delta_formats` (with `counts`).
        start: the first offset (rounded up to 8).

    Example:
        >>> delta_offsets([Box((0,), (1000,)), Box((0,), (3,))], torch.bfloat16, [20, 3])
        ([0, 160], 208)
    """
    dtypes = _per_box(dtype, len(boxes), "dtype")
    sizes = [d.itemsize for d in dtypes]
    if isinstance(counts, ChangeScan):
        counts = list(counts.counts)
    if counts is None:
        nbytes = [delta_max_nbytes(b.numel, s) for b, s in zip(boxes, sizes)]
    else:
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
        if len(counts) != len(boxes):
            raise ValueError(f"delta_offsets: got {len(counts)} counts for {len(boxes)} boxes")
        fmts = resolve_delta_formats(boxes, sizes, counts, formats, threshold=threshold)
        nbytes = [delta_nbytes(b.numel, c, s, format=f) for b, c, s, f in zip(boxes, counts, sizes, fmts)]
    offsets = []
    pos = _round8(start)
    for n in nbytes:
        offsets.append(pos)
        pos += n
    return offsets, pos


# ---------------------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------------------


def _check_buffer(op: str, buffer: object) -> torch.Tensor:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{op}: buffer must be a torch.Tensor, got {type(buffer)}")
    if buffer.dtype != torch.uint8 or buffer.ndim != 1 or (buffer.numel() > 1 and buffer.stride(0) != 1):
        raise ValueError(f"{op}: buffer must be a 1-D contiguous torch.uint8 tensor, got shape "
                         f"{tuple(buffer.shape)}, dtype {buffer.dtype}")
    return buffer


def _check_aligned(op: str, what: str, buffer: torch.Tensor, offsets: list[int], align: Sequence[int]) -> None:
    base = buffer.data_ptr()
    for i, (off, a) in enumerate(zip(offsets, align)):
        if off < 0 or (base + off) % a:
            raise ValueError(f"{op}: {what} offset {off} of box {i} must be >= 0 and put the box at an address that "
                             f"is a multiple of {a} bytes (buffer address % {a} = {base % a}); use delta_offsets / "
                             f"packed_offsets(..., align=8) and a buffer from torch.empty")


def _check_destinations(op: str, tensors: TensorArg, boxes: Sequence[Box], device: torch.device) -> list[torch.Tensor]:
    """The destination tensor of each box, checked as `unpack` checks them (type, device, dtype, rank, bounds,
    no stride 0 along a dim of size > 1)."""
    boxes = list(boxes)
    out = [tensors] * len(boxes) if isinstance(tensors, torch.Tensor) else list(tensors)
    if len(out) != len(boxes):
        raise ValueError(f"{op}: got {len(out)} tensors for {len(boxes)} boxes; pass one per box or one for all")
    for i, (t, box) in enumerate(zip(out, boxes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors[{i}] must be a torch.Tensor, got {type(t)}")
        if not isinstance(box, Box):
            raise TypeError(f"{op}: boxes[{i}] must be a Box, got {type(box)}")
        if t.device != device:
            raise ValueError(f"{op}: tensors[{i}] is on {t.device} but the buffer is on {device}")
        _check_itemsize(t.element_size(), f"{op}: tensors[{i}] ({t.dtype})")
        shape = tuple(t.shape)
        if box.ndim != t.ndim or any(o + s > n for o, s, n in zip(box.offsets, box.shape, shape)):
            raise ValueError(f"{op}: box {i} {box!r} does not fit in tensor {i} of shape {shape}")
        if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), shape)):
            raise ValueError(f"{op}: tensors[{i}] of shape {shape} has strides {t.stride()}; a destination with "
                             "stride 0 along a dim of size > 1 would receive several elements in one location")
    return out


def _snapshot_args(op: str, tensors: TensorArg, boxes: Sequence[Box], snapshot: torch.Tensor,
                   snapshot_offsets: OffsetArg):
    """Check the tensors, boxes and the snapshot (a pack buffer of the boxes, raw, each box aligned to its itemsize)."""
    args = check_copy_args(op, tensors, boxes, snapshot, snapshot_offsets, None)
    _check_aligned(op, "snapshot", snapshot, args.offsets, [t.element_size() for t in args.tensors])
    return args


def _as_counts(op: str, counts: Sequence[int] | torch.Tensor | ChangeScan, num: int) -> list[int]:
    if isinstance(counts, ChangeScan):
        counts = counts.counts
    out = counts.tolist() if isinstance(counts, torch.Tensor) else [int(c) for c in counts]
    if len(out) != num:
        raise ValueError(f"{op}: got {len(out)} counts for {num} boxes; pass count_changed's result")
    return out


def _versions(op: str, value: int | Sequence[int] | None, num: int, what: str) -> list[int | None]:
    vals = _per_box(value, num, f"{op}: {what}")
    for i, v in enumerate(vals):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not -2**63 <= v < 2**63):
            raise TypeError(f"{op}: {what}[{i}] must be an int64 version, got {v!r}")
    return vals


def _resolve(op: str, backend: str | None, device: torch.device) -> str:
    """`"triton"` or `"torch"` (see `_backend.choose_backend`)."""
    return choose_backend(op, device, backend)[0]


# ---------------------------------------------------------------------------------------------------------------
# Triton launcher (the device code is in `_delta_triton.py`)
# ---------------------------------------------------------------------------------------------------------------


def _device_code(interpret: bool) -> ModuleType:
    """`_delta_triton.py` loaded with Triton's interpreter on (CPU tensors) or off (CUDA tensors), once per process."""
    name = f"reshard.kernels._delta_triton_{'interpreted' if interpret else 'compiled'}"
    return load_device_module(os.path.join(os.path.dirname(__file__), "_delta_triton.py"), name, interpret)


@dataclass
class _TileGroup:
    """Boxes of one element size, tiled as the pack kernels tile them (in elements), ready to launch."""

    idx: list[int]  # box indices in the call
    word: torch.dtype  # same-width int of the elements
    tensor_ptr: torch.Tensor
    snap_ptr: torch.Tensor
    starts: torch.Tensor
    table: torch.Tensor
    num_tiles: int
    box_of_tile: torch.Tensor  # [num_tiles] int64: position in `idx` of each tile's box
    first_tile: torch.Tensor  # [len(idx)] int64: first tile of each box
    num_dims: int
    block: int
    num_warps: int

    def launch(self, kernel_name: str, *params: object, **constexprs: object) -> None:
        interpret = self.tensor_ptr.device.type != "cuda"
        kernel = getattr(_device_code(interpret), kernel_name)[(self.num_tiles,)]
        args = (self.tensor_ptr, self.snap_ptr, self.starts, self.table, *params, len(self.idx),
                max(len(self.idx) - 1, 0).bit_length())
        kwargs = {"NUM_DIMS": self.num_dims, "BLOCK": self.block, "num_warps": self.num_warps, **constexprs}
        launch_in_mode(kernel, interpret, *args, **kwargs)

    def tile_counts(self) -> torch.Tensor:
        """Changed elements per tile (`int32 [num_tiles]`)."""
        out = torch.empty(self.num_tiles, dtype=torch.int32, device=self.starts.device)
        self.launch("_delta_count_kernel", out)
        return out

    def box_counts(self, tile_counts: torch.Tensor) -> torch.Tensor:
        """Changed elements per box (`int64 [len(idx)]`) from the tile counts."""
        out = torch.zeros(len(self.idx), dtype=torch.int64, device=tile_counts.device)
        return out.index_add_(0, self.box_of_tile, tile_counts.to(torch.int64))


def _tile_groups(args, which: list[int]) -> list[_TileGroup]:
    """One `_TileGroup` per element size over the non-empty boxes `which` of a checked call."""
    by_size: dict[int, list[int]] = {}
    for i in which:
        if args.numels[i]:
            by_size.setdefault(args.tensors[i].element_size(), []).append(i)
    groups = []
    device = args.device
    for itemsize, idx in by_size.items():
        tensors = [args.tensors[i] for i in idx]
        boxes = [args.boxes[i] for i in idx]
        ndim = max(1, max(b.ndim for b in boxes))
        sizes = np.ones((len(idx), ndim), dtype=np.int64)
        strides = np.zeros((len(idx), ndim), dtype=np.int64)
        start = np.zeros(len(idx), dtype=np.int64)
        for k, (t, box) in enumerate(zip(tensors, boxes)):
            if box.ndim:
                sizes[k, ndim - box.ndim:] = box.shape
                strides[k, ndim - box.ndim:] = t.stride()
                start[k] = sum(o * st for o, st in zip(box.offsets, t.stride()))
        tensor_abs = np.array([t.data_ptr() for t in tensors], dtype=np.int64) + start * itemsize
        tensor_storage = tensors[0].untyped_storage().data_ptr()
        snap_abs = args.buffer.data_ptr() + np.array([args.offsets[i] for i in idx], dtype=np.int64)
        snap_storage = args.buffer.untyped_storage().data_ptr()
        if ((tensor_abs - tensor_storage) % itemsize).any() or tensor_storage % itemsize or snap_storage % itemsize:
            raise NotImplementedError("delta kernels: a tensor's storage is not aligned to its elements; the Triton "
                                      "backend cannot address it, use backend='torch'")
        sizes, strides = _merge_dims(sizes, strides)
        block, num_warps = launch_config(itemsize, device.type, tile_lanes(sizes))
        starts, table, num_tiles, tiles = tile_table(sizes, strides, (tensor_abs - tensor_storage) // itemsize,
                                                     (snap_abs - snap_storage) // itemsize, block, device)
        word = INT_DTYPE_BY_SIZE[itemsize]
        tiles_t = torch.from_numpy(tiles)
        groups.append(_TileGroup(
            idx=idx, word=word, tensor_ptr=_storage_view(tensors[0], word), snap_ptr=_storage_view(args.buffer, word),
            starts=starts, table=table, num_tiles=num_tiles,
            box_of_tile=torch.repeat_interleave(torch.arange(len(idx)), tiles_t).to(device),
            first_tile=(torch.cumsum(tiles_t, 0) - tiles_t).to(device),
            num_dims=sizes.shape[1], block=block, num_warps=num_warps))
    return groups


def _count_triton(args) -> list[int]:
    counts = [0] * len(args.boxes)
    for g in _tile_groups(args, list(range(len(args.boxes)))):
        for i, c in zip(g.idx, g.box_counts(g.tile_counts()).tolist()):
            counts[i] = c
    return counts


def _encode_triton(args, buffer: torch.Tensor, offs: list[int], headers: list[DeltaHeader], count_list: list[int],
                   update_snapshot: bool) -> None:
    """The Triton half of `delta_encode` after the shared checks: compare, check counts, then write."""
    sparse = [i for i, h in enumerate(headers) if h.format != DeltaFormat.DENSE]
    groups = _tile_groups(args, sparse)
    tile_counts = [g.tile_counts() for g in groups]
    for g, tc in zip(groups, tile_counts):
        for i, actual in zip(g.idx, g.box_counts(tc).tolist()):
            if actual != count_list[i]:
                raise ValueError(f"delta_encode: counts[{i}] = {count_list[i]} but box {i} {args.boxes[i]!r} has "
                                 f"{actual} changed elements now: the tensor changed after count_changed; count again")
    _write_headers(buffer, offs, headers)
    dense = [i for i, h in enumerate(headers) if h.format == DeltaFormat.DENSE and h.numel]
    if dense:
        tensors, boxes = [args.tensors[i] for i in dense], [args.boxes[i] for i in dense]
        pack(tensors, boxes, buffer, [offs[i] + DELTA_HEADER_BYTES for i in dense], backend="triton")
        if update_snapshot:
            pack(tensors, boxes, args.buffer, [args.offsets[i] for i in dense], backend="triton")
    storage = buffer.untyped_storage().data_ptr()
    for g, tc in zip(groups, tile_counts):
        itemsize = g.word.itemsize
        out = np.zeros((len(g.idx), 4), dtype=np.int64)
        for k, i in enumerate(g.idx):
            h, start = headers[i], buffer.data_ptr() + offs[i] - storage
            out[k] = (int(h.format), (start + encoded_values_offset(h)) // itemsize,
                      (start + DELTA_HEADER_BYTES) // 4, (start + DELTA_HEADER_BYTES) // 4)
        tc64 = tc.to(torch.int64)
        before = torch.cumsum(tc64, 0) - tc64
        tile_base = before - before[g.first_tile][g.box_of_tile]
        g.launch("_delta_compact_kernel", tile_base, torch.from_numpy(out).to(buffer.device),
                 _storage_view(buffer, g.word), _storage_view(buffer, torch.int32), UPDATE=update_snapshot)


def _decode_triton(buffer: torch.Tensor, offs: list[int], dests: list[torch.Tensor], boxes: list[Box],
                   headers: list[DeltaHeader]) -> None:
    """The Triton half of `delta_decode` after the shared header checks: check the sparse payloads (mask bits,
    index range) before any write, then DENSE boxes by the unpack kernel and sparse boxes by one scatter launch per
    element size."""
    op = "delta_decode"
    sparse = [i for i, h in enumerate(headers) if h.format != DeltaFormat.DENSE and h.count]
    storage = buffer.untyped_storage().data_ptr()
    launches = []
    by_size: dict[int, list[int]] = {}
    for i in sparse:
        by_size.setdefault(headers[i].itemsize, []).append(i)
    interpret = buffer.device.type != "cuda"
    code = _device_code(interpret)
    for itemsize, idx in by_size.items():
        word = INT_DTYPE_BY_SIZE[itemsize]
        block = launch_config(itemsize, buffer.device.type, max(
            headers[i].count if headers[i].format == DeltaFormat.INDICES else headers[i].numel for i in idx))[0]
        ndim = max(1, max(boxes[i].ndim for i in idx))
        base = dests[idx[0]]
        base_ptr = base.untyped_storage().data_ptr()
        rows, nblocks = [], []
        for i in idx:
            h, t, box, o = headers[i], dests[i], boxes[i], offs[i]
            if t.untyped_storage().data_ptr() != base_ptr and (t.data_ptr() - base_ptr) % itemsize:
                raise NotImplementedError(f"{op}: destination storages are not aligned to each other; use "
                                          "backend='torch'")
            start = (t.data_ptr() - base_ptr) // itemsize + sum(a * st for a, st in zip(box.offsets, t.stride()))
            sizes = [1] * (ndim - box.ndim) + list(box.shape)
            strides = [0] * (ndim - box.ndim) + list(t.stride())
            at = buffer.data_ptr() - storage + o
            n = h.count if h.format == DeltaFormat.INDICES else h.numel
            rows.append([n, (at + encoded_values_offset(h)) // itemsize, (at + DELTA_HEADER_BYTES) // 4, int(h.format),
                         start, *sizes, *strides])
            nblocks.append(-(-n // block))
        table = torch.tensor(rows, dtype=torch.int64).to(buffer.device)
        counts = torch.tensor(nblocks, dtype=torch.int64)
        block_box = torch.repeat_interleave(torch.arange(len(idx)), counts).to(buffer.device)
        first = (torch.cumsum(counts, 0) - counts).to(buffer.device)
        words = _storage_view(buffer, torch.int32)
        grid = (int(counts.sum()),)
        bits = torch.zeros(grid[0], dtype=torch.int32, device=buffer.device)
        launch_in_mode(code._delta_bits_kernel[grid], interpret, table, block_box, first, words, bits,
                       NUM_DIMS=ndim, BLOCK=block)
        per_box = torch.zeros(len(idx), dtype=torch.int64, device=buffer.device).index_add_(
            0, block_box, bits.to(torch.int64)).tolist()
        for k, i in enumerate(idx):
            h = headers[i]
            if h.format == DeltaFormat.BITMASK:
                last = buffer[offs[i] + DELTA_HEADER_BYTES + (h.numel - 1) // 8] if h.numel % 8 else None
                pad = int(last) >> (h.numel % 8) if last is not None else 0
                if per_box[k] != h.count or pad:
                    raise ValueError(f"{op}: box {i}: the bitmask has {per_box[k]} bits set (padding bits "
                                     f"{pad:#x}) but the header counts {h.count}: a corrupt box")
            else:
                idx_t = _slot(buffer, offs[i] + DELTA_HEADER_BYTES, h.count, torch.int32)
                low, high = (int(v) for v in torch.aminmax(idx_t))
                if low < 0 or high >= h.numel:
                    raise ValueError(f"{op}: box {i}: indices must lie in [0, {h.numel}), got [{low}, {high}]: a "
                                     "corrupt box")
        tc64 = bits.to(torch.int64)
        before = torch.cumsum(tc64, 0) - tc64
        block_base = before - before[first][block_box]
        launches.append((word, base, table, block_box, first, block_base, grid, ndim, block))
    dense = [i for i, h in enumerate(headers) if h.format == DeltaFormat.DENSE and h.numel]
    if dense:
        unpack(buffer, [offs[i] + DELTA_HEADER_BYTES for i in dense], [dests[i] for i in dense],
               [boxes[i] for i in dense], backend="triton")
    for word, base, table, block_box, first, block_base, grid, ndim, block in launches:
        launch_in_mode(code._delta_scatter_kernel[grid], interpret, _storage_view(base, word), table, block_box,
                       first, block_base, _storage_view(buffer, word), _storage_view(buffer, torch.int32),
                       NUM_DIMS=ndim, BLOCK=block)


# ---------------------------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ChangeScan:
    """What `scan_changes` found: per box the changed count and, for boxes at most `keep_fraction` changed, the
    changed row-major positions, so `delta_encode(counts=scan)` compares nothing again.

    Attributes:
        counts: changed elements per box (what `count_changed` returns); pass `scan.counts` to `delta_offsets`.
        positions: per box an int32 (int64 above 2**31 elements) tensor of ascending row-major indices, or None
            where the box had more than `keep_fraction` changed (`delta_encode` compares again if such a box is not
            DENSE).
        key: the tensors, boxes and snapshot it describes; `delta_encode` refuses a scan of others.

    The tensors must not change between the scan and the encode: an element changed in between is not sent now
    (the snapshot then still holds its old value, as the destination does, so the next step sends it).
    """

    counts: tuple[int, ...]
    positions: tuple[torch.Tensor | None, ...]
    key: tuple
    values: tuple[torch.Tensor | None, ...] | None = None
    """Per box the changed values (same-width ints, in `positions` order) where the scan kept them, else None."""


def scan_changes(tensors: TensorArg, boxes: Sequence[Box], snapshot: torch.Tensor, snapshot_offsets: OffsetArg, *,
                 keep_fraction: float = DELTA_DENSE_FRACTION, backend: str | None = None) -> ChangeScan:
    """`count_changed` that also keeps the changed positions of boxes at most `keep_fraction` changed, for
    `delta_encode(..., counts=scan)`: one comparison per box instead of two. Arguments as in `count_changed`."""
    device = snapshot.device if isinstance(snapshot, torch.Tensor) else torch.device("cpu")
    if _resolve("scan_changes", backend, device) == "triton":  # counts only: the Triton encode compares anyway
        args = _snapshot_args("scan_changes", tensors, boxes, snapshot, snapshot_offsets)
        return ChangeScan(tuple(_count_triton(args)), (None,) * len(args.boxes), _scan_key(args))
    return scan_changes_reference(tensors, boxes, snapshot, snapshot_offsets, keep_fraction=keep_fraction)


def count_changed(tensors: TensorArg, boxes: Sequence[Box], snapshot: torch.Tensor, snapshot_offsets: OffsetArg, *,
                  backend: str | None = None) -> list[int]:
    """Number of elements of each box whose bits differ from the box's snapshot.

    Args:
        tensors: one tensor per box (or one for all), any strided view, dtypes of 1, 2, 4 or 8 bytes.
        boxes: `Box` per tensor, inside its shape.
        snapshot: 1-D contiguous `uint8` on the tensors' device: box `i` row-major, raw bits of `tensors[i].dtype`,
            at byte `snapshot_offsets[i]` (aligned to the element size), as `pack` without `dtype` writes it.
        snapshot_offsets: byte offset of each box in `snapshot` (`packed_offsets(boxes, dtypes, align=8)`).
        backend: "triton", "torch" or None (see the module docstring).

    Returns:
        One int per box, `0 <= count <= boxes[i].numel`.

    Example:
        >>> t = torch.tensor([1.0, -0.0, 3.0])
        >>> snap = torch.tensor([1.0, 0.0, 2.0]).view(torch.uint8)
        >>> count_changed([t], [Box((0,), (3,))], snap, [0])
        [2]
    """
    device = snapshot.device if isinstance(snapshot, torch.Tensor) else torch.device("cpu")
    if _resolve("count_changed", backend, device) == "triton":
        return _count_triton(_snapshot_args("count_changed", tensors, boxes, snapshot, snapshot_offsets))
    return count_changed_reference(tensors, boxes, snapshot, snapshot_offsets)


def delta_encode(tensors: TensorArg, boxes: Sequence[Box], snapshot: torch.Tensor, snapshot_offsets: OffsetArg,
                 buffer: torch.Tensor, offsets: OffsetArg, *, counts: Sequence[int] | torch.Tensor | ChangeScan,
                 base_version: int | Sequence[int], version: int | Sequence[int], formats: FormatArg = None,
                 threshold: float = DELTA_DENSE_FRACTION, update_snapshot: bool = True,
                 backend: str | None = None) -> list[DeltaHeader]:
    """Encode each box's changes against its snapshot into `buffer` at byte `offsets[i]`, then refresh the snapshot.

    Args:
        tensors, boxes, snapshot, snapshot_offsets: as in `count_changed`.
        buffer: 1-D contiguous `uint8` on the tensors' device; box `i` takes `delta_nbytes(numel, counts[i],
            itemsize, format=formats[i])` bytes from `offsets[i]` (8-aligned address; `delta_offsets` gives them).
            Ranges must not overlap. Bytes outside them are not touched.
        counts: `count_changed`'s result for these tensors and this snapshot (then each sparse box is compared
            again, and a box whose count differs, the tensor having changed in between, is a ValueError raised
            before anything is written), or `scan_changes`'s `ChangeScan` (no second comparison).
        base_version: the version the destination holds (what the snapshot holds), one or one per box.
        version: the version the destination holds after applying, one or one per box.
        formats: None (chosen per box, `choose_delta_format`), a `DeltaFormat` for all, or one per box (None
            entries chosen). `DeltaFormat.DENSE` sends a full box, for a destination known to be stale.
        threshold: the DENSE fallback fraction of `choose_delta_format`.
        update_snapshot: copy each box's current values into its snapshot (only the changed elements move).
        backend: "triton", "torch" or None (see the module docstring).

    Returns:
        The header written for each box (its `nbytes` is the box's encoded size).

    Raises:
        ValueError: bad input (shapes, offsets, sizes, counts), naming the box; TypeError for non-int versions.
    """
    device = buffer.device if isinstance(buffer, torch.Tensor) else torch.device("cpu")
    if _resolve("delta_encode", backend, device) == "triton":
        args, buffer, offs, count_list, headers = _check_encode(tensors, boxes, snapshot, snapshot_offsets, buffer,
                                                                offsets, counts, base_version, version, formats,
                                                                threshold)
        if isinstance(counts, ChangeScan) and counts.key != _scan_key(args):
            raise ValueError("delta_encode: counts is a ChangeScan of other tensors, boxes or snapshot; scan these")
        _encode_triton(args, buffer, offs, headers, count_list, update_snapshot)
        return headers
    return delta_encode_reference(tensors, boxes, snapshot, snapshot_offsets, buffer, offsets, counts=counts,
                                  base_version=base_version, version=version, formats=formats, threshold=threshold,
                                  update_snapshot=update_snapshot)


def delta_encode_dense(tensors: TensorArg, boxes: Sequence[Box], buffer: torch.Tensor, offsets: OffsetArg, *,
                       version: int | Sequence[int], backend: str | None = None) -> list[DeltaHeader]:
    """DENSE-encode each box into `buffer` at byte `offsets[i]`: header (base version 0, `version`) and every
    value row-major, the bytes `delta_encode(..., formats=DeltaFormat.DENSE)` writes, with no snapshot (for a
    sender that holds none, e.g. a relay forwarding a box it applied).

    Args:
        tensors, boxes: as in `pack` (any strided views, dtypes of 1, 2, 4 or 8 bytes).
        buffer: 1-D contiguous `uint8`; box `i` takes `delta_max_nbytes(numel, itemsize)` bytes from `offsets[i]`
            (8-aligned addresses, ranges not overlapping).
        version: the version each destination holds after applying (one, or one per box).
        backend: as in `pack`.

    Returns:
        The header written for each box.
    """
    op = "delta_encode_dense"
    buffer = _check_buffer(op, buffer)
    boxes = list(boxes)
    dests = _check_destinations(op, tensors, boxes, buffer.device)
    offs = [int(o) for o in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]
    if len(offs) != len(boxes):
        raise ValueError(f"{op}: got {len(offs)} offsets for {len(boxes)} boxes")
    _check_aligned(op, "buffer", buffer, offs, [DELTA_ALIGN] * len(offs))
    versions = _versions(op, version, len(boxes), "version")
    if any(v is None for v in versions):
        raise TypeError(f"{op}: version must be ints")
    headers = [DeltaHeader(DeltaFormat.DENSE, t.element_size(), b.numel, b.numel, 0, v)
               for t, b, v in zip(dests, boxes, versions)]
    ranges = sorted((o, o + h.nbytes, i) for i, (o, h) in enumerate(zip(offs, headers)))
    for (_, stop, i), (begin, _, j) in itertools.pairwise(ranges):
        if begin < stop:
            raise ValueError(f"{op}: encoded boxes {i} and {j} overlap in the buffer")
    if ranges and ranges[-1][1] > buffer.numel():
        raise ValueError(f"{op}: box {ranges[-1][2]} ends at byte {ranges[-1][1]} but the buffer has "
                         f"{buffer.numel()} bytes")
    _write_headers(buffer, offs, headers)
    full = [i for i, h in enumerate(headers) if h.numel]
    if full:
        pack([dests[i] for i in full], [boxes[i] for i in full], buffer, [offs[i] + DELTA_HEADER_BYTES for i in full],
             backend=backend)
    return headers


def read_delta_headers(buffer: torch.Tensor, offsets: OffsetArg) -> list[DeltaHeader]:
    """The header of each encoded box of `buffer` at byte `offsets[i]` (one device-to-host copy).

    Raises:
        ValueError: a header that is out of range, has the wrong magic, an unknown format or itemsize, or counts
            that do not fit the box, naming the box index and the offending word.
    """
    op = "read_delta_headers"
    buffer = _check_buffer(op, buffer)
    offs = [int(o) for o in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]
    _check_aligned(op, "buffer", buffer, offs, [DELTA_ALIGN] * len(offs))
    for i, off in enumerate(offs):
        if off + DELTA_HEADER_BYTES > buffer.numel():
            raise ValueError(f"{op}: the header of box {i} at byte {off} ends past the buffer ({buffer.numel()} bytes)")
    if not offs:
        return []
    words_view = buffer.view(torch.int64) if buffer.data_ptr() % 8 == 0 and buffer.numel() % 8 == 0 else None
    if buffer.device.type == "cpu":  # numpy slices: no index tensors, no copies
        raw = buffer.numpy()
        words = [raw[o: o + DELTA_HEADER_BYTES].view(np.int64).tolist() for o in offs]
    elif words_view is not None:
        idx = torch.tensor(offs, dtype=torch.int64, device=buffer.device)[:, None] // 8 + torch.arange(
            _HEADER_WORDS, device=buffer.device)
        words = words_view[idx].cpu().tolist()
    else:
        words = torch.stack([buffer[o: o + DELTA_HEADER_BYTES] for o in offs]).cpu().contiguous().view(
            torch.int64).tolist()
    out = []
    for i, (w0, numel, count, base_version, version) in enumerate(words):
        if w0 & 0xFFFF != DELTA_MAGIC or w0 >> 32:
            raise ValueError(f"{op}: box {i} at byte {offs[i]} has no delta header (word 0 is {w0:#x}, expected magic "
                             f"{DELTA_MAGIC:#x} in its low 16 bits): not an encoded box, or a wrong offset")
        fmt, itemsize = (w0 >> 16) & 0xFF, (w0 >> 24) & 0xFF
        if fmt not in DeltaFormat.__members__.values() or itemsize not in INT_DTYPE_BY_SIZE:
            raise ValueError(f"{op}: box {i} has format {fmt} and itemsize {itemsize}; formats are "
                             f"{[int(f) for f in DeltaFormat]} and itemsizes 1, 2, 4, 8")
        fmt = DeltaFormat(fmt)
        if numel < 0 or not 0 <= count <= numel or (fmt == DeltaFormat.DENSE and count != numel):
            raise ValueError(f"{op}: box {i} ({fmt.name}) has count {count} for numel {numel}")
        out.append(DeltaHeader(fmt, itemsize, numel, count, base_version, version))
    return out


def walk_delta_offsets(buffer: torch.Tensor, num_boxes: int, *, start: int = 0) -> tuple[list[int], int]:
    """Offsets of `num_boxes` encoded boxes laid back to back in `buffer` from byte `start` (as `delta_offsets`
    lays them out), found by reading each header: a receiver needs no sizes from the sender.

    One device-to-host read per box; with many boxes on a GPU, send the counts and use `delta_offsets` instead.

    Returns:
        `(offsets, end)`.

    Raises:
        ValueError: a malformed header (see `read_delta_headers`) or a box that ends past the buffer.
    """
    if num_boxes < 0:
        raise ValueError(f"walk_delta_offsets: num_boxes must be >= 0, got {num_boxes}")
    offsets, pos = [], _round8(start)
    for i in range(num_boxes):
        (h,) = read_delta_headers(buffer, [pos])
        if pos + h.nbytes > buffer.numel():
            raise ValueError(f"walk_delta_offsets: box {i} at byte {pos} ({h.format.name}, {h.count} values) needs "
                             f"{h.nbytes} bytes but the buffer has {buffer.numel()}")
        offsets.append(pos)
        pos += h.nbytes
    return offsets, pos


def delta_decode(buffer: torch.Tensor, offsets: OffsetArg, tensors: TensorArg, boxes: Sequence[Box], *,
                 versions: int | Sequence[int | None] | None, backend: str | None = None) -> list[DeltaHeader]:
    """Apply the encoded boxes of `buffer` to box `i` of `tensors[i]`: the inverse of `delta_encode`.

    Every header is read and checked before anything is written; then DENSE boxes overwrite the whole box and
    sparse boxes write only their changed elements (the rest of the box must hold the base version's values).

    Args:
        buffer: 1-D contiguous `uint8`, as `delta_encode` wrote it (on the tensors' device).
        offsets: byte offset of each encoded box (8-aligned addresses).
        tensors: destination per box (or one for all), any strided view without stride 0 along a dim of size > 1;
            the dtype's itemsize must match the header's.
        boxes: `Box` per tensor, inside its shape; `numel` must match the header's.
        versions: the version each destination box holds now (one for all or one per box); None (or a None entry)
            for unknown, which accepts only DENSE boxes.
        backend: "triton", "torch" or None (see the module docstring).

    Returns:
        The header of each box; the caller records `header.version` as the destination's new version.

    Raises:
        DeltaVersionError: a BITMASK / INDICES box whose `base_version` is not `versions[i]` (a ValueError).
        ValueError: malformed or mismatched headers, buffers or boxes, naming the box.
    """
    device = buffer.device if isinstance(buffer, torch.Tensor) else torch.device("cpu")
    if _resolve("delta_decode", backend, device) == "triton":
        buffer, offs, dests, boxes, headers = _check_decode(buffer, offsets, tensors, boxes, versions)
        _decode_triton(buffer, offs, dests, boxes, headers)
        return headers
    return delta_decode_reference(buffer, offsets, tensors, boxes, versions=versions)


# ---------------------------------------------------------------------------------------------------------------
# Pure-torch references (also the production path)
# ---------------------------------------------------------------------------------------------------------------


def _box_view(t: torch.Tensor, box: Box) -> torch.Tensor:
    """Box `box` of `t` as the same-width int dtype (a strided view: writes go to `t`), at least 1-D."""
    base = t.view(INT_DTYPE_BY_SIZE[t.element_size()]) if t.dtype != INT_DTYPE_BY_SIZE[t.element_size()] else t
    stride = base.stride()
    start = base.storage_offset() + sum(o * s for o, s in zip(box.offsets, stride))
    view = base.as_strided(box.shape, stride, start)
    return view.unsqueeze(0) if view.ndim == 0 else view


def _slot(buffer: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` elements of `dtype` at byte `offset` of `buffer` (aligned), 1-D contiguous."""
    return buffer.narrow(0, offset, numel * dtype.itemsize).view(dtype)


_PACK_MUL = 0x0102040810204080  # eight 0/1 bytes of an int64 times this: bit i of the top byte is byte i
_SPREAD_MUL = 0x0101010101010101  # a byte times this: the byte in all eight bytes
_BIT_OF_BYTE = 0x8040201008040201 - 2**64  # byte i keeps bit i (as a signed int64)


def _pack_bits(changed: torch.Tensor) -> torch.Tensor:
    """Flat bool `[n]` -> `uint8 [ceil(n / 8)]`, bit `i % 8` of byte `i // 8` is element `i` (padding bits 0).

    Eight bools are one little-endian int64 of 0/1 bytes; one multiply gathers them into its top byte.
    """
    n = changed.numel()
    if n % 8:
        padded = torch.zeros(n + 8 - n % 8, dtype=torch.bool, device=changed.device)
        padded[:n] = changed
        changed = padded
    words = changed.view(torch.uint8).view(-1, 8).view(torch.int64).view(-1)
    return ((words * _PACK_MUL) >> 56).to(torch.uint8)


def _unpack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Inverse of `_pack_bits`: `uint8 [m]` -> flat bool `[8 * m]` (padding bits included)."""
    words = mask.to(torch.int64) * _SPREAD_MUL
    words &= _BIT_OF_BYTE
    return words.view(torch.uint8) != 0


def _changed_positions(changed: torch.Tensor) -> torch.Tensor:
    """Row-major indices (int32 when they fit) of the True elements of `changed` (box-shaped bool).

    On CPU numpy's `flatnonzero` (about 2.5x faster than `torch.nonzero` on the 2-core dev VM, same result)."""
    flat = changed.reshape(-1)
    if flat.device.type == "cpu":
        idx = torch.from_numpy(np.flatnonzero(flat.numpy()))
    else:
        idx = flat.nonzero().view(-1)
    return idx.to(torch.int32) if changed.numel() <= _MAX_INDEX else idx


def _word_changes(view: torch.Tensor, snap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`(positions, values)`: the row-major indices of the elements of `view` whose bits differ from `snap` (the
    box row-major) and their current values, compared 8 bytes at a time on CPU; None where the words do not line
    up (not CPU, unaligned, or a strided box whose rows are not whole aligned int64 words).

    Works for a contiguous box whose bytes are whole words, and for a strided box whose last dim is contiguous and
    whose rows (and every other stride) are whole words: the words are compared first (a quarter of the comparisons
    for 2-byte elements, one pass, no per-element mask), then only the elements of the changed words; the positions
    come out ascending as `_changed_positions` gives them, the values in the same order."""
    size = view.element_size()
    n = view.numel()
    if (view.device.type != "cpu" or not n or n > _MAX_INDEX or view.data_ptr() % 8 or snap.data_ptr() % 8):
        return None
    per = 8 // size
    if view.is_contiguous():
        if (n * size) % 8:
            return None
        cur = view.reshape(-1).numpy()
    elif (view.stride(-1) == 1 and (view.shape[-1] * size) % 8 == 0
          and all((st * size) % 8 == 0 for st, sz in zip(view.stride()[:-1], view.shape[:-1]) if sz > 1)):
        cur = view.numpy()
    else:
        return None
    wdt = cur.dtype  # the view's same-width int
    cur64 = cur.view(np.int64)  # numpy: its small gathers beat torch's on a busy CPU
    old64 = snap.numpy().view(np.int64).reshape(cur64.shape)
    words = np.flatnonzero(cur64 != old64)
    if cur64.ndim == 1:
        new_words = np.take(cur64, words)
    else:  # the changed words' offsets in the storage the view spans, then one 1-D gather
        where = np.zeros_like(words)
        rest = words
        for size_d, stride_d in zip(reversed(cur64.shape), reversed(cur64.strides)):
            rest, idx_d = np.divmod(rest, size_d)
            where += idx_d * (stride_d // 8)
        span = sum((sz - 1) * (st // 8) for sz, st in zip(cur64.shape, cur64.strides)) + 1
        new_words = np.take(np.lib.stride_tricks.as_strided(cur64, (span,), (8,)), where)
    if per == 1:
        return torch.from_numpy(words.astype(np.int32)), torch.from_numpy(new_words.view(wdt))
    new_el = new_words.view(wdt).reshape(-1, per)
    old_el = np.take(old64.reshape(-1), words).view(wdt).reshape(-1, per)
    hit = np.flatnonzero(new_el != old_el)
    positions = (words[hit // per] * per + hit % per).astype(np.int32)
    return torch.from_numpy(positions), torch.from_numpy(np.take(new_el.reshape(-1), hit))


def _word_positions(view: torch.Tensor, snap: torch.Tensor) -> torch.Tensor | None:
    """The positions of `_word_changes`, or None."""
    got = _word_changes(view, snap)
    return None if got is None else got[0]


def _scatter(flat: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
    """`flat[where] = values` (`where` unique): numpy's fancy assignment on CPU (tens of times faster there than
    `index_put_` on the 2-core dev VM), `index_put_` elsewhere."""
    if flat.device.type == "cpu" and where.numel():
        flat.numpy()[where.numpy()] = values.numpy()
    elif where.numel():
        flat.index_put_((where,), values)


def _positions(view: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(flat, offsets)`: a 1-D view of all of `view`'s storage and the element offsets in it of the row-major
    indices `idx` of `view`, so `flat[offsets]` gathers and `flat.index_put_((offsets,), v)` scatters."""
    storage = view.untyped_storage()
    flat = view.as_strided((storage.nbytes() // view.element_size(),), (1,), 0)
    if view.is_contiguous():
        if not view.storage_offset():
            return flat, idx
        wide = view.storage_offset() + view.numel() > _MAX_INDEX
        return flat, (idx.to(torch.int64) if wide else idx) + view.storage_offset()
    offsets = torch.full_like(idx, view.storage_offset(), dtype=torch.int64)
    rest = idx.to(torch.int64)
    for size, stride in zip(reversed(view.shape), reversed(view.stride())):
        offsets += (rest % size) * stride
        rest = rest // size
    return flat, offsets


def _scan_key(args) -> tuple:
    """What a `ChangeScan` was computed from: every box's tensor (address, geometry, dtype), the boxes, the snapshot
    and its offsets."""
    return (tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in args.tensors), tuple(args.boxes),
            args.buffer.data_ptr(), tuple(args.offsets))


@torch.no_grad()
def scan_changes_reference(tensors: TensorArg, boxes: Sequence[Box], snapshot: torch.Tensor,
                           snapshot_offsets: OffsetArg, *, keep_fraction: float = DELTA_DENSE_FRACTION,
                           backend: str | None = None) -> ChangeScan:
    """Pure-torch `scan_changes`, same signature; `backend` must be None or "torch"."""
    if backend not in (None, "torch"):
        raise ValueError(f"scan_changes_reference: backend must be None or 'torch', got {backend!r}")
    args = _snapshot_args("scan_changes", tensors, boxes, snapshot, snapshot_offsets)
    counts, positions, values = [], [], []
    for t, box, off, numel in zip(args.tensors, args.boxes, args.offsets, args.numels):
        view = _box_view(t, box)
        snap = _slot(snapshot, off, numel, view.dtype)
        if not numel:
            counts.append(0)
            positions.append(torch.zeros(0, dtype=torch.int32, device=snapshot.device))
            values.append(None)
            continue
        fast = _word_changes(view, snap)
        if fast is not None:
            count = fast[0].numel()
            counts.append(count)
            keep = count <= keep_fraction * numel
            positions.append(fast[0] if keep else None)
            values.append(fast[1] if keep else None)
            continue
        changed = view != snap.view(view.shape)
        count = int(torch.count_nonzero(changed))
        counts.append(count)
        keep = count <= keep_fraction * numel
        positions.append(_changed_positions(changed) if keep and count else (
            torch.zeros(0, dtype=torch.int32, device=snapshot.device) if keep else None))
        values.append(None)
    return ChangeScan(tuple(counts), tuple(positions), _scan_key(args), tuple(values))


@torch.no_grad()
def count_changed_reference(tensors: TensorArg, boxes: Sequence[Box], snapshot: torch.Tensor,
                            snapshot_offsets: OffsetArg, *, backend: str | None = None) -> list[int]:
    """Pure-torch `count_changed`, same signature; `backend` must be None or "torch"."""
    if backend not in (None, "torch"):
        raise ValueError(f"count_changed_reference: backend must be None or 'torch', got {backend!r}")
    args = _snapshot_args("count_changed", tensors, boxes, snapshot, snapshot_offsets)
    counts = []
    for t, box, off, numel in zip(args.tensors, args.boxes, args.offsets, args.numels):
        if not numel:
            counts.append(torch.zeros((), dtype=torch.int64, device=snapshot.device))
            continue
        view = _box_view(t, box)
        counts.append(torch.count_nonzero(view != _slot(snapshot, off, numel, view.dtype).view(view.shape)))
    return torch.stack(counts).tolist() if counts else []


def _check_encode(tensors, boxes, snapshot, snapshot_offsets, buffer, offsets, counts, base_version, version,
                  formats, threshold):
    """The checks of `delta_encode`, shared by both backends: `(args, buffer, offsets, counts, headers)`."""
    op = "delta_encode"
    args = _snapshot_args(op, tensors, boxes, snapshot, snapshot_offsets)
    buffer = _check_buffer(op, buffer)
    if buffer.device != args.device:
        raise ValueError(f"{op}: buffer is on {buffer.device} but the snapshot on {args.device}; use one device")
    num = len(args.boxes)
    offs = [int(o) for o in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]
    if len(offs) != num:
        raise ValueError(f"{op}: got {len(offs)} offsets for {num} boxes")
    _check_aligned(op, "buffer", buffer, offs, [DELTA_ALIGN] * num)
    count_list = _as_counts(op, counts, num)
    base_versions = _versions(op, base_version, num, "base_version")
    new_versions = _versions(op, version, num, "version")
    if any(v is None for v in base_versions + new_versions):
        raise TypeError(f"{op}: base_version and version must be ints")
    itemsizes = [t.element_size() for t in args.tensors]
    for i, (c, numel) in enumerate(zip(count_list, args.numels)):
        if not 0 <= c <= numel:
            raise ValueError(f"{op}: counts[{i}] = {c} is outside [0, {numel}] for box {i} {args.boxes[i]!r}")
    fmts = resolve_delta_formats(args.boxes, itemsizes, count_list, formats, threshold=threshold)
    headers = [DeltaHeader(f, s, n, n if f == DeltaFormat.DENSE else c, b, v)
               for f, s, n, c, b, v in zip(fmts, itemsizes, args.numels, count_list, base_versions, new_versions)]
    ranges = sorted((o, o + h.nbytes, i) for i, (o, h) in enumerate(zip(offs, headers)))
    for (_, stop, i), (begin, _, j) in itertools.pairwise(ranges):
        if begin < stop:
            raise ValueError(f"{op}: encoded boxes {i} and {j} overlap in the buffer (box {i} ends at byte {stop}, "
                             f"box {j} starts at {begin})")
    for i, (o, h) in enumerate(zip(offs, headers)):
        if o + h.nbytes > buffer.numel():
            raise ValueError(f"{op}: box {i} {args.boxes[i]!r} needs bytes [{o}, {o + h.nbytes}) ({h.format.name}, "
                             f"{h.count} values) but the buffer has {buffer.numel()} bytes")

    return args, buffer, offs, count_list, headers


def _write_headers(buffer: torch.Tensor, offs: list[int], headers: list[DeltaHeader]) -> None:
    """Every box's five header words (one host-to-device copy) and zeros in its padding bytes, so an encoded box's
    bytes depend only on its contents. The mask of a BITMASK box is zeroed whole (the kernels OR bits into it)."""
    if not headers:
        return
    words = torch.tensor([h.words() for h in headers], dtype=torch.int64, device=buffer.device)
    for o, w, h in zip(offs, words, headers):
        _slot(buffer, o, _HEADER_WORDS, torch.int64).copy_(w)
        values_at = o + encoded_values_offset(h)
        if h.format == DeltaFormat.BITMASK:
            buffer.narrow(0, o + DELTA_HEADER_BYTES, values_at - o - DELTA_HEADER_BYTES).zero_()
        elif h.format == DeltaFormat.INDICES and h.count % 2:
            buffer.narrow(0, values_at - 4, 4).zero_()
        values_end = values_at + h.count * h.itemsize
        if values_end % 8:
            buffer.narrow(0, values_end, 8 - values_end % 8).zero_()


@torch.no_grad()
def delta_encode_reference(tensors: TensorArg, boxes: Sequence[Box], snapshot: torch.Tensor,
                           snapshot_offsets: OffsetArg, buffer: torch.Tensor, offsets: OffsetArg, *,
                           counts: Sequence[int] | torch.Tensor | ChangeScan, base_version: int | Sequence[int],
                           version: int | Sequence[int], formats: FormatArg = None,
                           threshold: float = DELTA_DENSE_FRACTION, update_snapshot: bool = True,
                           backend: str | None = None) -> list[DeltaHeader]:
    """Pure-torch `delta_encode`, same signature and semantics; `backend` must be None or "torch".

    Per box: the changed mask is `box_view != snapshot_slot` on same-width ints (row-major, flattened); the
    sparse payloads are `mask.nonzero()` (INDICES) or the packed mask (BITMASK), then the values gathered in
    row-major order.
    """
    op = "delta_encode"
    if backend not in (None, "torch"):
        raise ValueError(f"delta_encode_reference: backend must be None or 'torch', got {backend!r}")
    args, buffer, offs, count_list, headers = _check_encode(tensors, boxes, snapshot, snapshot_offsets, buffer,
                                                            offsets, counts, base_version, version, formats,
                                                            threshold)

    # Phase 1: the changed positions of every sparse box, checked against `counts` before anything is written.
    scan = counts if isinstance(counts, ChangeScan) else None
    if scan is not None and scan.key != _scan_key(args):
        raise ValueError(f"{op}: counts is a ChangeScan of other tensors, boxes or snapshot; scan these")
    views, positions, known = [], [], []
    for i, (t, box, soff, numel, h) in enumerate(zip(args.tensors, args.boxes, args.offsets, args.numels, headers)):
        view = _box_view(t, box)
        views.append(view)
        known.append(None)
        if h.format == DeltaFormat.DENSE:
            positions.append(None)
        elif scan is not None and scan.positions[i] is not None:
            positions.append(scan.positions[i])
            known[-1] = scan.values[i] if scan.values is not None else None
        else:
            snap_slot = _slot(snapshot, soff, numel, view.dtype)
            got = _word_changes(view, snap_slot)
            if got is not None:
                idx, known[-1] = got
            else:
                idx = _changed_positions(view != snap_slot.view(view.shape))
            if idx.numel() != count_list[i]:
                raise ValueError(f"{op}: counts[{i}] = {count_list[i]} but box {i} {box!r} has {idx.numel()} changed "
                                 "elements now: the tensor changed after count_changed; count again")
            positions.append(idx)

    # Phase 2: headers, payloads, snapshot.
    _write_headers(buffer, offs, headers)
    for view, idx, h, o, soff, vals in zip(views, positions, headers, offs, args.offsets, known):
        pos = o + DELTA_HEADER_BYTES
        snap = _slot(snapshot, soff, h.numel, view.dtype)
        if h.format == DeltaFormat.DENSE:
            _slot(buffer, pos, h.numel, view.dtype).view(view.shape).copy_(view)
            if update_snapshot and h.numel:
                snap.view(view.shape).copy_(view)
            continue
        if h.format == DeltaFormat.BITMASK:
            mask_bytes = (h.numel + 7) // 8
            flags = torch.zeros(h.numel, dtype=torch.bool, device=buffer.device)
            flags[idx] = True
            _slot(buffer, pos, mask_bytes, torch.uint8).copy_(_pack_bits(flags))
            pos += _round8(mask_bytes)
        else:
            _slot(buffer, pos, h.count, torch.int32).copy_(idx)
            pos += _round8(4 * h.count)
        values = _slot(buffer, pos, h.count, view.dtype)
        if vals is not None:  # the scan kept them: no gather
            values.copy_(vals)
        else:
            flat, where = _positions(view, idx)
            torch.index_select(flat, 0, where, out=values)
        if update_snapshot and h.count:
            _scatter(snap, idx, values)
    return headers


def _check_decode(buffer, offsets, tensors, boxes, versions):
    """The header checks of `delta_decode`, shared by both backends: `(buffer, offs, dests, boxes, headers)`."""
    op = "delta_decode"
    buffer = _check_buffer(op, buffer)
    boxes = list(boxes)
    offs = [int(o) for o in (offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets)]
    if len(offs) != len(boxes):
        raise ValueError(f"{op}: got {len(offs)} offsets for {len(boxes)} boxes")
    dests = _check_destinations(op, tensors, boxes, buffer.device)
    held = _versions(op, versions, len(boxes), "versions")
    headers = read_delta_headers(buffer, offs)
    for i, (h, t, box, o) in enumerate(zip(headers, dests, boxes, offs)):
        if h.itemsize != t.element_size() or h.numel != box.numel:
            raise ValueError(f"{op}: box {i} {box!r} of a {t.dtype} tensor ({box.numel} elements of "
                             f"{t.element_size()} bytes) got a header for {h.numel} elements of {h.itemsize} bytes")
        if o + h.nbytes > buffer.numel():
            raise ValueError(f"{op}: box {i} ({h.format.name}, {h.count} values) needs bytes [{o}, {o + h.nbytes}) "
                             f"but the buffer has {buffer.numel()} bytes")
        if h.format != DeltaFormat.DENSE and held[i] != h.base_version:
            raise DeltaVersionError(f"{op}: box {i} {box!r} is a {h.format.name} delta from version {h.base_version} "
                                    f"but the destination holds version {held[i]}; it needs a full (DENSE) box")
    return buffer, offs, dests, boxes, headers


@torch.no_grad()
def delta_decode_reference(buffer: torch.Tensor, offsets: OffsetArg, tensors: TensorArg, boxes: Sequence[Box], *,
                           versions: int | Sequence[int | None] | None,
                           backend: str | None = None) -> list[DeltaHeader]:
    """Pure-torch `delta_decode`, same signature and semantics; `backend` must be None or "torch".

    Sparse boxes scatter with one `index_put_` into the destination's storage, at the storage offsets of the
    row-major positions from the mask (BITMASK) or from the indices (INDICES; checked to lie inside the box, not to
    be ascending: a corrupt buffer cannot write outside the box, but is not otherwise detected).
    """
    if backend not in (None, "torch"):
        raise ValueError(f"delta_decode_reference: backend must be None or 'torch', got {backend!r}")
    op = "delta_decode"
    buffer, offs, dests, boxes, headers = _check_decode(buffer, offsets, tensors, boxes, versions)

    # Sparse positions, checked before any write.
    positions: list[torch.Tensor | None] = []
    for i, (h, o) in enumerate(zip(headers, offs)):
        pos = o + DELTA_HEADER_BYTES
        if h.format == DeltaFormat.DENSE or not h.count:
            positions.append(None)
        elif h.format == DeltaFormat.BITMASK:
            mask_bytes = (h.numel + 7) // 8
            bits = _unpack_bits(_slot(buffer, pos, mask_bytes, torch.uint8))
            num_set = int(torch.count_nonzero(bits))
            if num_set != h.count or bits[h.numel:].any():
                raise ValueError(f"{op}: box {i}: the bitmask has {num_set} bits set (padding included) but the header "
                                 f"counts {h.count}: a corrupt box")
            positions.append(_changed_positions(bits[: h.numel]))
        else:
            idx = _slot(buffer, pos, h.count, torch.int32)
            low, high = (int(v) for v in torch.aminmax(idx))
            if low < 0 or high >= h.numel:
                raise ValueError(f"{op}: box {i}: indices must lie in [0, {h.numel}), got [{low}, {high}]: a corrupt "
                                 "box")
            positions.append(idx)

    for h, t, box, o, idx in zip(headers, dests, boxes, offs, positions):
        view = _box_view(t, box)
        pos = o + DELTA_HEADER_BYTES
        if h.format == DeltaFormat.DENSE:
            if h.numel:
                view.copy_(_slot(buffer, pos, h.numel, view.dtype).view(view.shape))
            continue
        if idx is None:
            continue
        pos += _round8((h.numel + 7) // 8) if h.format == DeltaFormat.BITMASK else _round8(4 * h.count)
        flat, where = _positions(view, idx)
        _scatter(flat, where, _slot(buffer, pos, h.count, view.dtype))
    return headers


def encoded_values_offset(header: DeltaHeader) -> int:
    """Byte offset of a box's values from the start of its encoded box (after header and mask or indices)."""
    if header.format == DeltaFormat.DENSE:
        return DELTA_HEADER_BYTES
    if header.format == DeltaFormat.BITMASK:
        return DELTA_HEADER_BYTES + _round8((header.numel + 7) // 8)
    return DELTA_HEADER_BYTES + _round8(4 * header.count)
