"""Triton device code for `pack` / `unpack`: the tile locator, the bit-exact casts and the two kernels.

This module holds only `@triton.jit` functions. `_pack.py` loads it twice, once with Triton's interpreter switched on
(for CPU tensors) and once compiled (for CUDA tensors), so one process can use both, whatever `TRITON_INTERPRET`
said when triton was imported. For the same reason the kernels call only core builtins, never the `@jit` helpers of
`triton.language.standard` (`tl.sum`, `tl.cdiv`, ...), which exist in the one mode triton was imported in.

Descriptor table (built by `_tiles.tile_table`), one row of int64 per non-empty box:

    starts[b]                        first program (tile) of box b; tiles of box b are starts[b] .. starts[b+1]-1
    table[b, 0]  tensor_base         element (or word) offset of the box's first element from the tensor pointer
    table[b, 1]  buffer_base         element offset in the buffer, or byte offset when the buffer is addressed in bytes
    table[b, 2]  log2_tile_cols      a tile is 2**log2_tile_cols columns by BLOCK >> log2_tile_cols rows
    table[b, 3]  num_col_tiles       tiles along the innermost dim
    table[b, 4]  num_rows            product of the box's sizes except the innermost
    table[b, 5 : 5+D]                sizes, outermost first, after merging contiguous dims; sizes[D-1] is the row length
    table[b, 5+D : 5+2D]             the tensor's strides for those dims, in elements (or words)

The buffer side of a box is always contiguous and row-major, so it needs only its base.
"""

import triton
import triton.language as tl

from reshard.kernels._cast import Cast

_F32_TO_BF16 = tl.constexpr(int(Cast.F32_TO_BF16))
_F32_TO_F16 = tl.constexpr(int(Cast.F32_TO_F16))
_BF16_TO_F32 = tl.constexpr(int(Cast.BF16_TO_F32))
_F16_TO_F32 = tl.constexpr(int(Cast.F16_TO_F32))
_ROW_HEAD = tl.constexpr(5)  # table columns before the sizes
# Runtime ints that must not multiply compiled variants (Triton specializes ints equal to 1 or divisible by 16).
_NO_SPECIALIZE = ["num_boxes", "num_search_steps", "nan_sign_mask", "nan_base", "nan_payload_mask"]


@triton.jit
def _locate_tile(pid, starts_ptr, table_ptr, num_boxes, num_search_steps, NUM_DIMS: tl.constexpr,
                 BUFFER_BYTES: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
    """Map program `pid` to its box and tile; return `(tensor_offsets, buffer_offsets, mask, box)` (`box`: the box's
    row in the table, for kernels that read more per-box data; those that do not drop it).

    The box is found by binary search over `starts` (`num_search_steps = ceil(log2(num_boxes))` steps). Within the
    box, tile `t` covers rows `[(t // num_col_tiles) * R, +R)` and columns `[(t % num_col_tiles) * C, +C)` with
    `C = 2**log2_tile_cols` and `R = BLOCK // C`, so lane `k` of the tile is row `k >> log2_tile_cols`, column
    `k & (C - 1)`. A buffer offset is the box's base plus the element's row-major index inside the box, in buffer
    elements, or in bytes (index * BUFFER_BYTES) when the buffer is addressed in bytes. All offsets are int64.

    Example: BLOCK = 8, a box of sizes (3, 2) with strides (5, 1): C = 2, R = 4, one tile. Lanes 0..7 are
    (row, col) = (0,0) (0,1) (1,0) (1,1) (2,0) (2,1) (3,0) (3,1); lanes 6 and 7 are masked (row 3 >= 3 rows).
    Their tensor offsets are base + 0, 1, 5, 6, 10, 11 and their buffer offsets buffer_base + 0..5.
    """
    lo = num_boxes * 0
    hi = num_boxes - 1
    for _ in range(num_search_steps):
        mid = (lo + hi + 1) // 2
        go_right = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    row_ptr = table_ptr + lo.to(tl.int64) * (_ROW_HEAD + 2 * NUM_DIMS)
    tile = pid - tl.load(starts_ptr + lo)
    tensor_base = tl.load(row_ptr + 0)
    buffer_base = tl.load(row_ptr + 1)
    log2_cols = tl.load(row_ptr + 2)
    num_col_tiles = tl.load(row_ptr + 3)
    num_rows = tl.load(row_ptr + 4)
    row_len = tl.load(row_ptr + _ROW_HEAD + NUM_DIMS - 1)
    inner_stride = tl.load(row_ptr + _ROW_HEAD + 2 * NUM_DIMS - 1)

    row_tile = tile // num_col_tiles
    col_tile = tile - row_tile * num_col_tiles
    lane = tl.arange(0, BLOCK)
    cols = 1 << log2_cols
    row = row_tile * (BLOCK >> log2_cols) + (lane >> log2_cols)
    col = col_tile * cols + (lane & (cols - 1))
    mask = (row < num_rows) & (col < row_len)

    tensor_off = tensor_base + col * inner_stride
    rest = row
    # Dims NUM_DIMS-2 .. 1 peel off the row index; dim 0 takes what is left, so 1- and 2-dim boxes divide nothing.
    for d in tl.static_range(NUM_DIMS - 2, 0, -1):
        size = tl.load(row_ptr + _ROW_HEAD + d)
        tensor_off += (rest % size) * tl.load(row_ptr + _ROW_HEAD + NUM_DIMS + d)
        rest = rest // size
    if NUM_DIMS > 1:
        tensor_off += rest * tl.load(row_ptr + _ROW_HEAD + NUM_DIMS)
    buffer_off = buffer_base + (row * row_len + col) * max(BUFFER_BYTES, 1)
    if VEC > 1:
        # The launcher sets VEC only when the inner stride is 1 and every base, stride and row length is a multiple of
        # VEC, so each aligned group of VEC lanes is VEC consecutive elements, all in or all out: one wide access.
        tensor_off = tl.max_contiguous(tl.multiple_of(tensor_off, VEC), VEC)
        buffer_off = tl.max_contiguous(tl.multiple_of(buffer_off, VEC), VEC)
        mask = tl.max_constancy(mask, VEC)
    return tensor_off, buffer_off, mask, lo


@triton.jit
def _f32_to_16_bits(bits, nan_sign_mask, nan_base, nan_payload_mask, TO_BF16: tl.constexpr):
    """Round float32 bit patterns (`int32`) to bfloat16 or float16 bits (in the low 16 bits of an `int32`).

    Round-to-nearest-even in integer arithmetic, so it is exact under the interpreter too, whose own float cast
    truncates. bfloat16: add `0x7FFF` plus the lowest kept bit, then drop 16 bits; this also rounds subnormals and
    overflows to Inf. float16: rebias the exponent for normal results, shift the mantissa with its hidden bit for
    subnormal results (`|x| < 2**-14`), flush `|x| < 2**-25` to zero and everything from `65520` up to Inf.
    NaN becomes `(sign & nan_sign_mask) | nan_base | (payload & nan_payload_mask)` (see `_cast.nan_policy`).

    Example (bfloat16): 1 + 2**-8 is `0x3F808000`, a tie between `0x3F80` and `0x3F81`; the kept bit is 0, so
    `(0x3F808000 + 0x7FFF) >> 16 = 0x3F80` (round to even). 1 + 3 * 2**-8 (`0x3F818000`) gives `0x3F82`.
    """
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    if TO_BF16:
        finite = tl.where(is_nan, 0, mag)
        out = (finite + 0x7FFF + ((finite >> 16) & 1)) >> 16
        payload = (mag >> 16) & nan_payload_mask
    else:
        rebased = mag - 0x38000000  # exponent bias 127 -> 15
        normal = (rebased + 0xFFF + ((rebased >> 13) & 1)) >> 13
        # subnormal result: value / 2**-24 = mantissa_with_hidden_bit >> (126 - exponent), shift in [14, 24]
        shift = tl.minimum(tl.maximum(126 - (mag >> 23), 14), 24)
        mant = (mag & 0x7FFFFF) | 0x800000
        kept = mant >> shift
        rest = mant & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
        out = tl.where(mag >= 0x38800000, normal, tl.where(mag < 0x33000000, 0, kept))
        out = tl.where(mag >= 0x477FF000, 0x7C00, out)
        payload = (mag >> 13) & nan_payload_mask
    return tl.where(is_nan, (sign & nan_sign_mask) | nan_base | payload, out | sign)


@triton.jit
def _16_to_f32_bits(h, nan_sign_mask, nan_base, nan_payload_mask, FROM_BF16: tl.constexpr):
    """Widen bfloat16 or float16 bit patterns (`int16`) to float32 bits (`int32`); exact, NaN as in `_f32_to_16`.

    Example (float16): `0x0001` (2**-24, subnormal) becomes `1.0 * 2**-24`, i.e. `0x33800000`.
    """
    h = h.to(tl.int32) & 0xFFFF
    sign = (h & 0x8000) << 16
    if FROM_BF16:
        out = h << 16
        is_nan = (h & 0x7FFF) > 0x7F80
        payload = ((h & 0x7F) << 16) & nan_payload_mask
    else:
        mag = h & 0x7FFF
        exponent = mag >> 10
        mant = mag & 0x3FF
        normal = (mag << 13) + 0x38000000
        subnormal = (mant.to(tl.float32) * 5.9604644775390625e-08).to(tl.int32, bitcast=True)  # exact: mant < 2**10
        out = sign | tl.where(exponent == 0, subnormal, tl.where(exponent == 31, 0x7F800000 | (mant << 13), normal))
        is_nan = mag > 0x7C00
        payload = (mant << 13) & nan_payload_mask
    return tl.where(is_nan, (sign & nan_sign_mask) | nan_base | payload, out)


@triton.jit
def _convert(vals, nan_sign_mask, nan_base, nan_payload_mask, CAST: tl.constexpr):
    """Apply cast `CAST` (a `_cast.Cast`) to bit patterns; `Cast.NONE` returns them unchanged."""
    if CAST == _F32_TO_BF16:
        return _f32_to_16_bits(vals, nan_sign_mask, nan_base, nan_payload_mask, True).to(tl.int16)
    elif CAST == _F32_TO_F16:
        return _f32_to_16_bits(vals, nan_sign_mask, nan_base, nan_payload_mask, False).to(tl.int16)
    elif CAST == _BF16_TO_F32:
        return _16_to_f32_bits(vals, nan_sign_mask, nan_base, nan_payload_mask, True)
    elif CAST == _F16_TO_F32:
        return _16_to_f32_bits(vals, nan_sign_mask, nan_base, nan_payload_mask, False)
    else:
        return vals


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _pack_kernel(
    tensor_ptr,  # source elements as same-width ints (or words); every box's base is an offset from here
    buffer_ptr,  # packed elements as same-width ints (or words), or bytes when BUFFER_BYTES > 0
    starts_ptr,  # [num_boxes] first tile of each box
    table_ptr,  # [num_boxes, 5 + 2 * NUM_DIMS] descriptor rows (module docstring)
    num_boxes,
    num_search_steps,
    nan_sign_mask,
    nan_base,
    nan_payload_mask,
    NUM_DIMS: tl.constexpr,
    CAST: tl.constexpr,
    BUFFER_BYTES: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Gather: buffer[box b, element i] = cast(tensor[box b, element i]) for every box in one launch.

    Grid: `(total_tiles,)`; program `pid` handles tile `pid - starts[b]` of the box `b` with
    `starts[b] <= pid < starts[b + 1]`, so a 1-element box and a 64 MiB box share one launch. `BUFFER_BYTES > 0`
    writes each element as that many little-endian bytes, for buffer offsets not aligned to the element size.
    `VEC > 1` promises groups of VEC contiguous, aligned elements on both sides, for 16-byte accesses.

    Example: two boxes with 3 and 9000 elements and BLOCK = 4096 give starts = [0, 1] and 4 programs: program 0
    copies box 0, programs 1..3 copy elements [0, 4096), [4096, 8192) and [8192, 9000) of box 1.
    """
    pid = tl.program_id(0)
    tensor_off, buffer_off, mask, _ = _locate_tile(pid, starts_ptr, table_ptr, num_boxes, num_search_steps,
                                                   NUM_DIMS, BUFFER_BYTES, VEC, BLOCK)
    vals = _convert(tl.load(tensor_ptr + tensor_off, mask=mask), nan_sign_mask, nan_base, nan_payload_mask, CAST)
    if BUFFER_BYTES > 0:
        for k in tl.static_range(BUFFER_BYTES):
            tl.store(buffer_ptr + buffer_off + k, ((vals.to(tl.int32) >> (8 * k)) & 0xFF).to(tl.uint8), mask=mask)
    else:
        tl.store(buffer_ptr + buffer_off, vals, mask=mask)


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _unpack_kernel(
    tensor_ptr,  # destination elements as same-width ints (or words); every box's base is an offset from here
    buffer_ptr,  # packed elements as same-width ints (or words), or bytes when BUFFER_BYTES > 0
    starts_ptr,  # [num_boxes] first tile of each box
    table_ptr,  # [num_boxes, 5 + 2 * NUM_DIMS] descriptor rows (module docstring)
    num_boxes,
    num_search_steps,
    nan_sign_mask,
    nan_base,
    nan_payload_mask,
    NUM_DIMS: tl.constexpr,
    CAST: tl.constexpr,
    BUFFER_BYTES: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Scatter: tensor[box b, element i] = cast(buffer[box b, element i]); nothing outside the boxes is written.

    Grid and tiles as in `_pack_kernel`. `BUFFER_BYTES > 0` reads each element as that many little-endian bytes.

    Example: one box of sizes (2, 3) with strides (10, 1) and buffer base 0: program 0 reads buffer elements 0..5
    and writes tensor offsets base + 0, 1, 2, 10, 11, 12.
    """
    pid = tl.program_id(0)
    tensor_off, buffer_off, mask, _ = _locate_tile(pid, starts_ptr, table_ptr, num_boxes, num_search_steps,
                                                   NUM_DIMS, BUFFER_BYTES, VEC, BLOCK)
    if BUFFER_BYTES > 0:
        vals = tl.load(buffer_ptr + buffer_off, mask=mask, other=0).to(tl.int32)
        for k in tl.static_range(1, BUFFER_BYTES):
            vals |= tl.load(buffer_ptr + buffer_off + k, mask=mask, other=0).to(tl.int32) << (8 * k)
        if BUFFER_BYTES == 2:
            vals = vals.to(tl.int16)
    else:
        vals = tl.load(buffer_ptr + buffer_off, mask=mask)
    tl.store(tensor_ptr + tensor_off, _convert(vals, nan_sign_mask, nan_base, nan_payload_mask, CAST), mask=mask)
