"""Triton device code for delta encoding: the comparison (per-tile changed counts) and the compaction.

Only `@triton.jit` functions; `_delta.py` loads this file twice (interpreted for CPU tensors, compiled for CUDA
tensors), as `_pack.py` loads `_triton.py`. Tiles and the descriptor table are those of the pack kernels
(`_triton._locate_tile`, table columns in `_triton.py`'s docstring), built over elements (never widened words):
the "tensor" side is the box's strided view, the "buffer" side its row-major slot in the snapshot, so
`buffer_off - table[b, 1]` is an element's row-major index in its box. Tiles of a box cover it in row-major order
and the lanes of a tile are in row-major order too, so an exclusive scan over tiles then over lanes gives each
changed element its rank in the box.
"""

import triton
import triton.language as tl
from triton import knobs

from reshard.kernels._pack import _kernels

_INTERPRETED = knobs.runtime.interpret
_locate_tile = _kernels(_INTERPRETED)._locate_tile
_ROW_HEAD = tl.constexpr(5)
_NO_SPECIALIZE = ["num_boxes", "num_search_steps"]


@triton.jit
def _add_combine(a, b):
    return a + b


# The interpreter reduces and scans with numpy only for `tl.standard._sum_combine`; a compiled kernel needs a
# combine function of its own mode (see `_quant.py`).
_ADD = tl.standard._sum_combine if _INTERPRETED else _add_combine


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _delta_count_kernel(
    tensor_ptr,  # current elements as same-width ints; box bases are offsets from here
    snap_ptr,  # snapshot elements as the same ints
    starts_ptr,  # [num_boxes] first tile of each box
    table_ptr,  # [num_boxes, 5 + 2 * NUM_DIMS] descriptor rows
    tile_counts_ptr,  # [num_tiles] int32 out: changed elements per tile
    num_boxes,
    num_search_steps,
    NUM_DIMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """tile_counts[pid] = number of lanes of tile `pid` whose bits differ from the snapshot.

    Grid: `(num_tiles,)`, one program per tile as in `_pack_kernel`. Example: a box of 5 int16 elements
    `[1, 2, 3, 4, 5]` against a snapshot `[1, 0, 3, 0, 0]` with BLOCK 8: one program, lanes 5..7 masked, stores 3.
    """
    pid = tl.program_id(0)
    tensor_off, snap_off, mask = _locate_tile(pid, starts_ptr, table_ptr, num_boxes, num_search_steps, NUM_DIMS, 0,
                                              1, BLOCK)
    cur = tl.load(tensor_ptr + tensor_off, mask=mask, other=0)
    old = tl.load(snap_ptr + snap_off, mask=mask, other=0)
    changed = ((cur != old) & mask).to(tl.int32)
    tl.store(tile_counts_ptr + pid, tl.reduce(changed, 0, _ADD))


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _delta_compact_kernel(
    tensor_ptr,  # current elements as same-width ints
    snap_ptr,  # snapshot elements as the same ints (updated where changed when UPDATE)
    starts_ptr,  # [num_boxes] first tile of each box
    table_ptr,  # [num_boxes, 5 + 2 * NUM_DIMS] descriptor rows
    tile_base_ptr,  # [num_tiles] int64: changed elements of the box before this tile
    out_table_ptr,  # [num_boxes, 4] int64: format, values base (elements), indices base, mask base (int32 words)
    values_ptr,  # the encoded buffer as same-width ints
    words_ptr,  # the encoded buffer as int32 (indices and mask words)
    num_boxes,
    num_search_steps,
    NUM_DIMS: tl.constexpr,
    UPDATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write each changed element's value at its rank in the box; INDICES boxes also write its row-major index,
    BITMASK boxes OR its bit into the (zeroed) mask; with UPDATE the snapshot takes the value.

    Grid as in `_delta_count_kernel`. The rank of a changed lane is `tile_base[pid]` plus the number of changed
    lanes before it in the tile (an exclusive scan). Example: a box of 6 elements, changed at row-major 1 and 4,
    INDICES: values[vb + 0] = x[1], values[vb + 1] = x[4], words[ib + 0] = 1, words[ib + 1] = 4.
    """
    pid = tl.program_id(0)
    tensor_off, snap_off, mask = _locate_tile(pid, starts_ptr, table_ptr, num_boxes, num_search_steps, NUM_DIMS, 0,
                                              1, BLOCK)
    lo = num_boxes * 0
    hi = num_boxes - 1
    for _ in range(num_search_steps):  # the box of this tile, as in _locate_tile
        mid = (lo + hi + 1) // 2
        go_right = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    box = lo.to(tl.int64)
    snap_base = tl.load(table_ptr + box * (_ROW_HEAD + 2 * NUM_DIMS) + 1)
    fmt = tl.load(out_table_ptr + box * 4)
    values_base = tl.load(out_table_ptr + box * 4 + 1)
    index_base = tl.load(out_table_ptr + box * 4 + 2)
    mask_base = tl.load(out_table_ptr + box * 4 + 3)

    cur = tl.load(tensor_ptr + tensor_off, mask=mask, other=0)
    old = tl.load(snap_ptr + snap_off, mask=mask, other=0)
    changed = (cur != old) & mask
    flags = changed.to(tl.int32)
    rank = tl.associative_scan(flags, 0, _ADD) - flags
    pos = tl.load(tile_base_ptr + pid) + rank.to(tl.int64)
    tl.store(values_ptr + values_base + pos, cur, mask=changed)
    index = snap_off - snap_base  # row-major index in the box
    # per-box format as a lane mask (a scalar comparison AND-ed into a block mask is refused by the interpreter)
    as_indices = (flags * (fmt == 2).to(tl.int32)) != 0
    as_bitmask = (flags * (fmt == 1).to(tl.int32)) != 0
    tl.store(words_ptr + index_base + pos, index.to(tl.int32), mask=as_indices)
    tl.atomic_or(words_ptr + mask_base + (index >> 5), (1 << (index & 31)).to(tl.int32), mask=as_bitmask)
    if UPDATE:
        tl.store(snap_ptr + snap_off, cur, mask=changed)
