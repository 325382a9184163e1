"""The delta wire format: formats, the box header, exact sizes, offsets and the headers' reading and writing
(with `ChangeScan`, the counts a scan gives, which the sizes are computed from); and the argument checks both
backends of the delta ops share (as `_spec.py` is for `pack` / `unpack`).

Host-side Python on integers and tensor metadata (the headers are the only bytes read or written here). The ops
themselves are in `_delta.py`, their torch reference in `_delta_reference.py`, the Triton launcher in
`_delta_launch.py` beside the Triton kernels (`_delta_triton.py`).

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
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from reshard.kernels._spec import INT_DTYPE_BY_SIZE, OffsetArg, TensorArg, check_copy_args
from reshard.planner import Box

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


def encoded_values_offset(header: DeltaHeader) -> int:
    """Byte offset of a box's values from the start of its encoded box (after header and mask or indices)."""
    if header.format == DeltaFormat.DENSE:
        return DELTA_HEADER_BYTES
    if header.format == DeltaFormat.BITMASK:
        return DELTA_HEADER_BYTES + _round8((header.numel + 7) // 8)
    return DELTA_HEADER_BYTES + _round8(4 * header.count)


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
# Headers: written and read on the host
# ---------------------------------------------------------------------------------------------------------------


def _slot(buffer: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` elements of `dtype` at byte `offset` of `buffer` (aligned), 1-D contiguous."""
    return buffer.narrow(0, offset, numel * dtype.itemsize).view(dtype)


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


# ---------------------------------------------------------------------------------------------------------------
# Argument checks (shared by both backends)
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


def _scan_key(args) -> tuple:
    """What a `ChangeScan` was computed from: every box's tensor (address, geometry, dtype), the boxes, the snapshot
    and its offsets."""
    return (tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in args.tensors), tuple(args.boxes),
            args.buffer.data_ptr(), tuple(args.offsets))


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
