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

The bytes of an encoded box (a header, then DENSE, BITMASK or INDICES values, every part padded to 8 bytes) and
their exact sizes are described in `_delta_format.py`.

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

Where each part lives: the wire format (the encoded box's bytes, `DeltaHeader`, sizes, offsets, the headers'
reading and writing) and the argument checks in `_delta_format.py`; the torch references in `_delta_reference.py`;
the Triton launcher in `_delta_launch.py`, beside the Triton kernels in `_delta_triton.py`. This file holds the
public ops, which pick a backend (`reshard.kernels` exports them with the format's and the references' names).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from reshard.kernels._backend import choose_backend
from reshard.kernels._delta_format import (
    DELTA_ALIGN,
    DELTA_DENSE_FRACTION,
    DELTA_HEADER_BYTES,
    ChangeScan,
    DeltaFormat,
    DeltaHeader,
    FormatArg,
    _check_aligned,
    _check_buffer,
    _check_decode,
    _check_destinations,
    _check_encode,
    _scan_key,
    _snapshot_args,
    _versions,
    _write_headers,
)
from reshard.kernels._delta_launch import _count_triton, _decode_triton, _encode_triton
from reshard.kernels._delta_reference import (
    count_changed_reference,
    delta_decode_reference,
    delta_encode_reference,
    scan_changes_reference,
)
from reshard.kernels._pack import pack
from reshard.kernels._spec import OffsetArg, TensorArg
from reshard.planner import Box


def _resolve(op: str, backend: str | None, device: torch.device) -> str:
    """`"triton"` or `"torch"` (see `_backend.choose_backend`)."""
    return choose_backend(op, device, backend)[0]


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
