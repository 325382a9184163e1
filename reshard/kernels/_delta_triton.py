"""Triton device code for delta encoding and decoding: the comparison (per-tile changed counts), the compaction,
and the scatter-apply of sparse boxes (`_delta_bits_kernel`, `_delta_scatter_kernel`).

Only `@triton.jit` functions; `_delta_launch.py` loads this file twice (interpreted for CPU tensors, compiled for CUDA
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
    tensor_off, snap_off, mask, _ = _locate_tile(pid, starts_ptr, table_ptr, num_boxes, num_search_steps, NUM_DIMS,
                                                 0, 1, BLOCK)
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
    tensor_off, snap_off, mask, box = _locate_tile(pid, starts_ptr, table_ptr, num_boxes, num_search_steps,
                                                   NUM_DIMS, 0, 1, BLOCK)
    box = box.to(tl.int64)
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


_DECODE_HEAD = tl.constexpr(5)  # count (INDICES) or numel (BITMASK), values base, words base, format, tensor start


@triton.jit
def _decode_locate(pid, block_box_ptr, block_first_ptr, table_ptr, NUM_DIMS: tl.constexpr, BLOCK: tl.constexpr):
    """The box of program `pid` of a decode launch, its descriptor row and the block's first element."""
    box = tl.load(block_box_ptr + pid)
    j0 = (pid - tl.load(block_first_ptr + box)) * BLOCK
    row = table_ptr + box * (_DECODE_HEAD + 2 * NUM_DIMS)
    return row, j0


@triton.jit
def _decode_offsets(row, index, NUM_DIMS: tl.constexpr):
    """Element offsets in the tensor's storage of the row-major indices `index` of the box of descriptor `row`."""
    off = tl.load(row + 4) + index * 0
    rest = index
    for k in tl.static_range(NUM_DIMS):
        d = NUM_DIMS - 1 - k
        size = tl.load(row + _DECODE_HEAD + d)
        stride = tl.load(row + _DECODE_HEAD + NUM_DIMS + d)
        off += (rest % size) * stride
        rest = rest // size
    return off


@triton.jit
def _delta_bits_kernel(
    table_ptr,  # [num_boxes, 5 + 2 * NUM_DIMS] int64 descriptor rows (see `_DECODE_HEAD`), then sizes, strides
    block_box_ptr,  # [num_blocks] int64: the box of each program
    block_first_ptr,  # [num_boxes] int64: the first program of each box
    words_ptr,  # the encoded buffer as int32
    block_counts_ptr,  # [num_blocks] int32 out: mask bits set in the block's elements
    NUM_DIMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """block_counts[pid] = bits set in the BITMASK of block `pid`'s BLOCK row-major elements (inside the box).

    Example: a box of 10 elements with mask bits 0b1000000101 and BLOCK 8: block 0 counts 2, block 1 counts 1.
    """
    pid = tl.program_id(0)
    row, j0 = _decode_locate(pid, block_box_ptr, block_first_ptr, table_ptr, NUM_DIMS, BLOCK)
    numel = tl.load(row)
    j = j0 + tl.arange(0, BLOCK).to(tl.int64)
    inside = j < numel
    word = tl.load(words_ptr + tl.load(row + 2) + (j >> 5), mask=inside, other=0)
    bits = ((word >> (j & 31).to(tl.int32)) & 1) * inside.to(tl.int32)
    tl.store(block_counts_ptr + pid, tl.reduce(bits, 0, _ADD))


@triton.jit
def _delta_scatter_kernel(
    tensor_ptr,  # destination elements as same-width ints; box starts are offsets from here
    table_ptr,  # [num_boxes, 5 + 2 * NUM_DIMS] int64 descriptor rows (see `_DECODE_HEAD`)
    block_box_ptr,  # [num_blocks] int64
    block_first_ptr,  # [num_boxes] int64
    block_base_ptr,  # [num_blocks] int64: BITMASK: set bits of the box before this block; INDICES: unused
    values_ptr,  # the encoded buffer as same-width ints
    words_ptr,  # the encoded buffer as int32 (indices, mask words)
    NUM_DIMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Scatter-apply the changed values of sparse boxes into their destination boxes.

    INDICES box: block `pid` takes values `j0 .. j0 + BLOCK` (of `count`), each to the storage offset of its
    row-major index. BITMASK box: block `pid` takes row-major elements `j0 .. j0 + BLOCK` (of `numel`); an element
    whose bit is set takes value number `block_base[pid]` + (set bits before it in the block).
    Example: INDICES `[1, 4]`, values `[a, b]` into a 2 x 3 box of a tensor with row stride 8 at offset 0:
    `t[1] = a`, `t[9] = b`.
    """
    pid = tl.program_id(0)
    row, j0 = _decode_locate(pid, block_box_ptr, block_first_ptr, table_ptr, NUM_DIMS, BLOCK)
    n = tl.load(row)
    values_base = tl.load(row + 1)
    words_base = tl.load(row + 2)
    fmt = tl.load(row + 3)
    j = j0 + tl.arange(0, BLOCK).to(tl.int64)
    inside = j < n
    if fmt == 2:
        index = tl.load(words_ptr + words_base + j, mask=inside, other=0).to(tl.int64)
        v = tl.load(values_ptr + values_base + j, mask=inside, other=0)
        tl.store(tensor_ptr + _decode_offsets(row, index, NUM_DIMS), v, mask=inside)
    else:
        word = tl.load(words_ptr + words_base + (j >> 5), mask=inside, other=0)
        flags = ((word >> (j & 31).to(tl.int32)) & 1) * inside.to(tl.int32)
        rank = tl.associative_scan(flags, 0, _ADD) - flags
        pos = tl.load(block_base_ptr + pid) + rank.to(tl.int64)
        hit = flags != 0
        v = tl.load(values_ptr + values_base + pos, mask=hit, other=0)
        tl.store(tensor_ptr + _decode_offsets(row, j, NUM_DIMS), v, mask=hit)
