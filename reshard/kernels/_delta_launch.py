"""The Triton launcher of the delta ops: descriptor tables over tiles, the count, encode and decode launches.

Host-side: the device code it launches is in `_delta_triton.py` (only `@triton.jit` functions), which this module
loads twice, interpreted for CPU tensors and compiled for CUDA tensors, as `_pack.py` loads `_triton.py`. Called by
the public ops in `_delta.py` after the shared checks of `_delta_format.py`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from reshard.kernels._delta_format import (
    DELTA_HEADER_BYTES,
    DeltaFormat,
    DeltaHeader,
    _slot,
    _write_headers,
    encoded_values_offset,
)
from reshard.kernels._loader import launch_in_mode, load_device_module
from reshard.kernels._pack import _storage_view, pack, unpack
from reshard.kernels._spec import INT_DTYPE_BY_SIZE
from reshard.kernels._tiles import launch_config, merge_dims, tile_lanes, tile_table
from reshard.planner import Box, region_strides


DELTA_CUDA_BLOCK = 1024
"""The delta kernels' BLOCK on CUDA, for every element size (with 4 warps: 8 elements a thread)."""


def delta_launch_config(word_bytes: int, device_type: str, lanes: int | None = None) -> tuple[int, int]:
    """`(BLOCK, num_warps)` of the four delta kernels for `word_bytes`-byte elements: the one place these are chosen.

    On CUDA a tile is `DELTA_CUDA_BLOCK` elements on 4 warps whatever the element size: the count and compact kernels
    scan their tile and the decode kernels search it, so their registers grow with the elements each thread holds,
    not with bytes. With the pack kernels' 8192 lanes for 2-byte words every bf16 compact and scatter variant ran at
    255 registers and spilled (up to 3.4 KB of stack a thread at 4 dims, ptxas for sm_90); at 1024 on 4 warps none
    spills (`perf/bench_compile.py`). Not tuned by GPU measurement. Elsewhere (the interpreter) the pack kernels'
    choice (`_tiles.launch_config`), holding `lanes` whole.

    Example: `delta_launch_config(2, "cuda")` is `(1024, 4)`; `delta_launch_config(2, "cpu", 10)` is `(256, 1)`.
    """
    if device_type == "cuda":
        return DELTA_CUDA_BLOCK, 4
    return launch_config(word_bytes, device_type, lanes)


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
                start[k], box_strides = region_strides(t.stride(), box)
                sizes[k, ndim - box.ndim:] = box.shape
                strides[k, ndim - box.ndim:] = box_strides
        tensor_abs = np.array([t.data_ptr() for t in tensors], dtype=np.int64) + start * itemsize
        tensor_storage = tensors[0].untyped_storage().data_ptr()
        snap_abs = args.buffer.data_ptr() + np.array([args.offsets[i] for i in idx], dtype=np.int64)
        snap_storage = args.buffer.untyped_storage().data_ptr()
        if ((tensor_abs - tensor_storage) % itemsize).any() or tensor_storage % itemsize or snap_storage % itemsize:
            raise NotImplementedError("delta kernels: a tensor's storage is not aligned to its elements; the Triton "
                                      "backend cannot address it, use backend='torch'")
        sizes, strides = merge_dims(sizes, strides)
        block, num_warps = delta_launch_config(itemsize, device.type, tile_lanes(sizes))
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
        block, num_warps = delta_launch_config(itemsize, buffer.device.type, max(
            headers[i].count if headers[i].format == DeltaFormat.INDICES else headers[i].numel for i in idx))
        ndim = max(1, max(boxes[i].ndim for i in idx))
        base = dests[idx[0]]
        base_ptr = base.untyped_storage().data_ptr()
        rows, nblocks = [], []
        for i in idx:
            h, t, box, o = headers[i], dests[i], boxes[i], offs[i]
            if t.untyped_storage().data_ptr() != base_ptr and (t.data_ptr() - base_ptr) % itemsize:
                raise NotImplementedError(f"{op}: destination storages are not aligned to each other; use "
                                          "backend='torch'")
            first, box_strides = region_strides(t.stride(), box)
            start = (t.data_ptr() - base_ptr) // itemsize + first
            sizes = [1] * (ndim - box.ndim) + list(box.shape)
            strides = [0] * (ndim - box.ndim) + list(box_strides)
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
                       NUM_DIMS=ndim, BLOCK=block, num_warps=num_warps)
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
        launches.append((word, base, table, block_box, first, block_base, grid, ndim, block, num_warps))
    dense = [i for i, h in enumerate(headers) if h.format == DeltaFormat.DENSE and h.numel]
    if dense:
        unpack(buffer, [offs[i] + DELTA_HEADER_BYTES for i in dense], [dests[i] for i in dense],
               [boxes[i] for i in dense], backend="triton")
    for word, base, table, block_box, first, block_base, grid, ndim, block, num_warps in launches:
        launch_in_mode(code._delta_scatter_kernel[grid], interpret, _storage_view(base, word), table, block_box,
                       first, block_base, _storage_view(buffer, word), _storage_view(buffer, torch.int32),
                       NUM_DIMS=ndim, BLOCK=block, num_warps=num_warps)
