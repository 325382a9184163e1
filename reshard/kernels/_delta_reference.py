"""The pure-torch delta ops: `scan_changes_reference`, `count_changed_reference`, `delta_encode_reference`,
`delta_decode_reference`, the same signatures as the public ops of `_delta.py`, and the bit tricks they are built on.

They are the CPU production path and the oracle of the Triton kernels' tests. Elements are compared as raw bits
(the same-width integer of the dtype); on CPU 8 bytes at a time where the words line up, with numpy gathers and
scatters (see `_word_changes`, `_scatter`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from reshard.kernels._delta_format import (
    _MAX_INDEX,
    DELTA_DENSE_FRACTION,
    DELTA_HEADER_BYTES,
    ChangeScan,
    DeltaFormat,
    DeltaHeader,
    FormatArg,
    _check_decode,
    _check_encode,
    _round8,
    _scan_key,
    _slot,
    _snapshot_args,
    _write_headers,
)
from reshard.kernels._spec import INT_DTYPE_BY_SIZE, OffsetArg, TensorArg
from reshard.planner import Box, region_view


def _box_view(t: torch.Tensor, box: Box) -> torch.Tensor:
    """Box `box` of `t` as the same-width int dtype (a strided view: writes go to `t`), at least 1-D."""
    base = t.view(INT_DTYPE_BY_SIZE[t.element_size()]) if t.dtype != INT_DTYPE_BY_SIZE[t.element_size()] else t
    view = region_view(base, box)
    return view.unsqueeze(0) if view.ndim == 0 else view


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
