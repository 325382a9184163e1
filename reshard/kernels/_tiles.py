"""The tile geometry of the pack / unpack kernels: BLOCK and warps (`launch_config`), boxes with their dims merged
(`merge_dims`), and the descriptor table of their tiles (`tile_table`, columns in `_triton.py`). Pure numpy on box
sizes and strides; the launcher (`_pack.py`, `_delta_launch.py`) uploads what it returns.
"""

from __future__ import annotations

import numpy as np
import torch

from reshard.kernels._cast import Cast

_TABLE_HEAD = 5  # columns before the sizes in a descriptor row (see _triton.py)


INTERPRETED_MAX_BLOCK = 1 << 16
"""The largest BLOCK under Triton's interpreter (CPU tensors); a box of up to this many tile lanes is one program."""
_INTERPRETED_MIN_BLOCK = 256


def launch_config(word_bytes: int, device_type: str, lanes: int | None = None, *, vec: int | None = None,
                  cast: Cast = Cast.NONE) -> tuple[int, int]:
    """`(BLOCK, num_warps)` for kernels moving `word_bytes`-byte elements: the one place these are chosen.

    On CUDA a program moves about 16 KiB (BLOCK elements), so the grid is large enough to fill the GPU and each
    thread has several independent loads in flight. Not autotuned: no GPU measurement has been made yet. Where each
    lane costs more, the tile is cut until ptxas (`-v`, sm_90 and sm_100) reports no spills (`perf/bench_compile.py`):
    a copy without 16-byte accesses (`vec` 1: int64 offsets and the dims' divisions for every lane; 1- and 2-byte
    words at 3-4 dims used up to 3.4 KB of stack a thread at 8192) takes at most 4096 lanes, and a fused `cast`
    without them, or float16 -> float32 (its subnormal path), at most 2048 on 8 warps (8 lanes a thread). `vec`
    `None` is a vectorized copy (the delta kernels' interpreter tiles).

    The interpreter (any other device) runs programs one after another in Python, and a program costs about the same
    (6 to 8 ms on the 2-core dev VM) whatever its tile holds up to about 16,384 lanes; past that numpy's work on the
    lanes adds up (about +6 ms at 65,536). So there BLOCK is the smallest power of two >= `lanes`, the most lanes one
    box's tile needs (`tile_lanes`), between 256 and `INTERPRETED_MAX_BLOCK`: most boxes are one program, and a
    large box is few (measured: 2**20 float32 elements in 1.26 s with BLOCK 1024, 0.33 s with 4096, 0.09 s with
    2**18). Without `lanes`, `INTERPRETED_MAX_BLOCK`.

    Example: `launch_config(4, "cpu", 10)` is `(256, 1)`; `launch_config(4, "cuda")` is `(4096, 8)`;
    `launch_config(2, "cuda", vec=1)` is `(4096, 8)`; `launch_config(4, "cuda", vec=1, cast=Cast.F32_TO_BF16)` is
    `(2048, 8)`.
    """
    if device_type != "cuda":
        if lanes is None:
            return INTERPRETED_MAX_BLOCK, 1
        return min(INTERPRETED_MAX_BLOCK, max(_INTERPRETED_MIN_BLOCK, 1 << max(int(lanes) - 1, 0).bit_length())), 1
    block = min(8192, max(1024, 16384 // word_bytes))
    vectorized = vec is None or vec > 1
    if cast != Cast.NONE and (not vectorized or cast == Cast.F16_TO_F32):
        return min(block, 2048), 8
    if not vectorized:
        block = min(block, 4096)
    return block, 8 if block >= 4096 else 4


def max_vec(tensor_unit: int, buffer_unit: int) -> int:
    """The widest VEC for elements of `tensor_unit` and `buffer_unit` bytes: 16-byte accesses on the wider side.

    Example: `max_vec(4, 2)` is 4 (four float32 read as one 16-byte load); `max_vec(8, 8)` is 2.
    """
    return 16 // max(tensor_unit, buffer_unit)


def tile_lanes(sizes: np.ndarray) -> int:
    """The lanes a tile needs to hold the largest of these boxes whole (`sizes`: `[num_boxes, D]` from
    `merge_dims`): its rows times the power of two >= its row length, as `tile_table` lays rows out. 0 for none.

    Example: sizes `[[1497, 5], [1, 10]]` -> 1497 rows of 8 columns, 11,976 lanes.
    """
    if not sizes.size:
        return 0
    return int(((np.int64(1) << _ceil_log2(sizes[:, -1])) * _num_rows(sizes)).max())


def _ceil_log2(n: np.ndarray) -> np.ndarray:
    """Per entry of `n` (int64, each >= 1) the smallest `k` with `2**k >= n`: the bit length of `n - 1`, which
    `frexp` gives exactly below 2**53 (larger entries give 53)."""
    return np.frexp(np.minimum(n - 1, 1 << 52).astype(np.float64))[1].astype(np.int64)


def _num_rows(sizes: np.ndarray) -> np.ndarray:
    """Per box of `sizes` (`[num_boxes, D]`) its rows: the product of every size but the last."""
    return np.prod(sizes[:, :-1], axis=1) if sizes.shape[1] > 1 else np.ones(len(sizes), dtype=np.int64)


def merge_dims(sizes: np.ndarray, strides: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop size-1 dims and merge each dim into the next inner one where `stride[d] == stride[d+1] * size[d+1]`.

    Args:
        sizes, strides: `[num_boxes, D]` int64, outermost dim first; every size >= 1.

    Returns:
        `(sizes, strides)` of shape `[num_boxes, D']`, outermost first, left-padded with size 1 / stride 0. Row-major
        order of the elements is unchanged, so the buffer side of each box stays contiguous.

    Example: sizes (4, 3, 2), strides (6, 2, 1) -> sizes (24,), strides (1,); with strides (12, 2, 1) -> sizes
    (4, 6), strides (12, 1).
    """
    num, dims = sizes.shape
    out_sizes = np.ones((num, dims), dtype=np.int64)  # innermost first while building
    out_strides = np.zeros((num, dims), dtype=np.int64)
    cur = np.full(num, -1, dtype=np.int64)
    rows = np.arange(num)
    for d in range(dims - 1, -1, -1):
        size, stride = sizes[:, d], strides[:, d]
        at = np.maximum(cur, 0)
        merge = (size != 1) & (cur >= 0) & (out_strides[rows, at] * out_sizes[rows, at] == stride)
        new = (size != 1) & ~merge
        out_sizes[rows[merge], at[merge]] *= size[merge]
        cur = cur + new
        out_sizes[rows[new], cur[new]] = size[new]
        out_strides[rows[new], cur[new]] = stride[new]
    out_strides[cur < 0, 0] = 1  # a single element: one dim of size 1
    used = int(max(cur.max(initial=0), 0)) + 1
    return out_sizes[:, :used][:, ::-1].copy(), out_strides[:, :used][:, ::-1].copy()


def lowest_bit(values: np.ndarray, cap: int) -> int:
    """The largest power of two <= cap dividing every value (the OR's lowest set bit)."""
    acc = int(np.bitwise_or.reduce(values)) if values.size else 0
    return cap if acc == 0 else min(cap, acc & -acc)


def tile_table(sizes: np.ndarray, strides: np.ndarray, tensor_base: np.ndarray, buffer_base: np.ndarray, block: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, np.ndarray]:
    """The tiles of merged boxes and their descriptor table (columns in `_triton.py`), uploaded to `device`.

    Args:
        sizes, strides: `[num_boxes, D]` int64 from `merge_dims` (every size >= 1).
        tensor_base, buffer_base: `[num_boxes]` int64, table columns 0 and 1.
        block: the kernels' BLOCK.

    Returns:
        `(starts, table, num_tiles, tiles)`: the first tile of each box and the table as device tensors (one
        upload), the total number of tiles and the tiles per box (numpy).
    """
    num = sizes.shape[0]
    log_block = block.bit_length() - 1
    row_len = sizes[:, -1]
    num_rows = _num_rows(sizes)
    log2_cols = np.minimum(_ceil_log2(row_len), log_block)  # smallest power of two >= row_len, capped at BLOCK
    num_col_tiles = -(-row_len // (np.int64(1) << log2_cols))
    rows_per_tile = np.int64(block) >> log2_cols
    tiles = num_col_tiles * -(-num_rows // rows_per_tile)
    starts = np.concatenate([[0], np.cumsum(tiles)[:-1]]).astype(np.int64)

    num_dims = sizes.shape[1]
    table = np.empty((num, _TABLE_HEAD + 2 * num_dims), dtype=np.int64)
    table[:, 0] = tensor_base
    table[:, 1] = buffer_base
    table[:, 2] = log2_cols
    table[:, 3] = num_col_tiles
    table[:, 4] = num_rows
    table[:, _TABLE_HEAD: _TABLE_HEAD + num_dims] = sizes
    table[:, _TABLE_HEAD + num_dims:] = strides
    # one upload; `starts` padded to an even length keeps the table 16-byte aligned, so the pointer's alignment
    # never adds a compiled variant
    pad = num % 2
    packed = torch.from_numpy(np.concatenate([starts, np.zeros(pad, dtype=np.int64), table.ravel()])).to(device)
    return packed[:num], packed[num + pad:], int(tiles.sum()), tiles
