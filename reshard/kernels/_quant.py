"""Blockwise FP8 quantization, DeepSeek-V3 style: one `float8_e4m3fn` weight and one float32 `scale_inv` per block.

`quantize_fp8_block(x)` splits the last two dims of `x` (`[..., M, N]`, float32, bfloat16 or float16) into blocks of
`128 x 128` (the last block row / column may be partial) and returns `(q, scale_inv)`: `q` is `float8_e4m3fn` of
`x`'s shape, `scale_inv` is float32 `[..., ceil(M / 128), ceil(N / 128)]`, and `q.float() * scale_inv` (each scale
broadcast over its block) approximates `x`. Leading dims (stacked experts `[E, M, N]`) are independent matrices.

The exact formula, per block (`quantize_fp8_block_reference` is its definition; the Triton kernel equals it bit for
bit, under the interpreter and compiled):

    xf        = x.float()                                    exact for every input dtype
    amax      = max(|xf|) over the block's finite elements   NaN and +-Inf do not count; 0 for a block without any
    scale_inv = max(amax, 1e-4) / 448                        float32 division, round to nearest even
    q         = e4m3fn(clamp(xf / scale_inv, -448, 448))     float32 division (not a multiply by 448 / amax), then
                                                             round to nearest even; +-Inf saturate to +-448
    q         = 0x7F | sign(x)                               where x is NaN (NaN stays NaN, with its sign)

The floor `1e-4` (float32 `0x38D1B717`) is DeepSeek-V3.2's `act_quant`: an all-zero block gets `scale_inv = 1e-4 / 448`
and `q = 0`, and no block's scale underflows to 0 or to a float32 subnormal. Leaving NaN and Inf out of `amax` keeps one
bad element from zeroing its whole block; where a block has neither, this is the plain `amax(|x|) / 448` formula.

Blocks are local: quantizing a box whose start is a multiple of the block on both dims, and whose stop is a multiple
or the matrix's edge, gives exactly that box of the full quantization and the matching box of the scales
(`block_aligned`, `scale_box`: the planner's block geometry, `reshard.planner._blocks`, re-exported by
`reshard.kernels`). A refit can therefore quantize shards that hold whole blocks on the source.

Layout of this file: constants; the Triton device code (`_quant_block_kernel` and its cast helper), which is defined
only in the two copies of this file that `_device_code` loads, once with Triton's interpreter on (CPU tensors) and
once compiled (CUDA tensors), as `_pack._kernels` does for `_triton.py`, so importing this module never imports
triton; the launcher; the public functions; then the pure-torch reference, which is also the CPU production path.
"""

import math
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from reshard.kernels._backend import choose_backend
from reshard.kernels._loader import launch_in_mode, load_device_module
from reshard.kernels._pack import _kernels
from reshard.kernels._spec import INT_DTYPE_BY_SIZE
from reshard.planner import DEFAULT_BLOCK, scale_box
from reshard.planner._contract import check_block

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4  # as float32: 0x38D1B717; the smallest amax a scale is computed from
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEVICE_COPIES = ("reshard.kernels._quant_interpreted", "reshard.kernels._quant_compiled")

# ---------------------------------------------------------------------------------------------------------------
# Triton device code (only in the copies loaded by `_device_code`)
# ---------------------------------------------------------------------------------------------------------------

if __name__ in _DEVICE_COPIES:
    import triton
    import triton.language as tl
    from triton import knobs

    _FP8_MAX_BITS = tl.constexpr(0x43E00000)  # 448.0
    _AMAX_FLOOR_BITS = tl.constexpr(0x38D1B717)  # float32(1e-4)
    _F32_INF_BITS = tl.constexpr(0x7F800000)
    _INTERPRETED = knobs.runtime.interpret
    # The exact float16 / bfloat16 -> float32 widening of the pack kernels, from the `_triton.py` copy of this mode.
    _16_to_f32_bits = _kernels(_INTERPRETED)._16_to_f32_bits

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    # The interpreter reduces with numpy only for `tl.standard._elementwise_max` (it never calls it), and element by
    # element in Python for any other function; a compiled kernel needs a combine function of its own mode.
    _MAX_COMBINE = tl.standard._elementwise_max if _INTERPRETED else _max_combine

    @triton.jit
    def _f32_to_e4m3fn_saturated(y_bits, sign):
        """Round float32 bit patterns (`int32`) to float8_e4m3fn bits (`int32` in 0..255), saturating at +-448.

        Round-to-nearest-even in integer arithmetic, so it is exact under the interpreter too. Normal results
        (`|y| >= 2**-6`): rebias the exponent 127 -> 7 and drop 20 mantissa bits, adding `0x7FFFF` plus the lowest
        kept bit. Subnormal results: `|y| / 2**-9` is the mantissa with its hidden bit shifted right by
        `141 - exponent` (21 and more; 25 already rounds everything to 0), rounded to even. `|y| >= 448` (Inf too)
        gives 448 (`0x7E`), NaN gives `0x7F`. `sign` (`0` or `0x80`) is OR-ed in, so -0.0 gives `0x80`.

        Example: 1.0625 (`0x3F880000`) is a tie between 1.0 (`0x38`) and 1.125 (`0x39`): rebased `0x03880000`, the
        kept bit is 0, so `(0x03880000 + 0x7FFFF) >> 20 = 0x38`. 1.5 * 2**-9 (`0x3B400000`, exponent 118) is a tie
        between the subnormals 1 and 2 (times 2**-9): `0xC00000 >> 23 = 1` with the rest exactly half, so code 2.
        """
        mag = y_bits & 0x7FFFFFFF
        rebased = mag - 0x3C000000  # exponent bias 127 -> 7
        normal = (rebased + 0x7FFFF + ((rebased >> 20) & 1)) >> 20
        shift = tl.minimum(tl.maximum(141 - (mag >> 23), 21), 25)
        mant = (mag & 0x7FFFFF) | 0x800000
        kept = mant >> shift
        rest = mant & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
        out = tl.where(mag >= 0x3C800000, normal, kept)
        out = tl.where(mag >= _FP8_MAX_BITS, 0x7E, out)
        out = tl.where(mag > _F32_INF_BITS, 0x7F, out)
        return out | sign

    @triton.jit
    def _load_f32_bits(ptrs, mask, IN_BITS: tl.constexpr, IN_BF16: tl.constexpr):
        """float32 bit patterns (`int32`) of the elements at `ptrs` (same-width ints); masked lanes read 0."""
        if IN_BITS == 32:
            return tl.load(ptrs, mask=mask, other=0)
        else:
            # NaN keeps only its sign (sign mask 0x80000000, quiet NaN base, no payload): the rest is not used
            return _16_to_f32_bits(tl.load(ptrs, mask=mask, other=0), -2147483648, 0x7FC00000, 0, IN_BF16)

    @triton.jit(do_not_specialize=["M", "N", "num_block_rows", "num_block_cols"])
    def _quant_block_kernel(
        x_ptr, stride_xb, stride_xm, stride_xn,  # input [B, M, N] as same-width ints (float32 / 16-bit float bits)
        q_ptr, stride_qb, stride_qm, stride_qn,  # output [B, M, N] float8_e4m3fn bits as uint8
        s_ptr, stride_sb, stride_sm, stride_sn,  # output [B, num_block_rows, num_block_cols] float32 scale_inv
        M, N, num_block_rows, num_block_cols,
        IN_BITS: tl.constexpr,
        IN_BF16: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TILE_M: tl.constexpr,
        TILE_N: tl.constexpr,
        NUM_TILES: tl.constexpr,
    ):
        """Quantize one block per program: amax over the block, its scale_inv, then its float8 values.

        Grid: `(B * num_block_rows * num_block_cols,)`; program `pid` is block `(i, j)` of matrix `b`, with
        `pid = (b * num_block_rows + i) * num_block_cols + j`. The block (rows `i * BLOCK_M + [0, BLOCK_M)`, columns
        `j * BLOCK_N + [0, BLOCK_N)`, cut at `M` and `N`) is read as `NUM_TILES` tiles of `TILE_M` rows by `TILE_N`
        columns (`TILE_N` the power of two >= `BLOCK_N`) twice: once for the amax, once to quantize. Every lane past
        the block or the matrix is masked. Offsets are int64.

        Example: `x` of shape (1, 130, 257), block 128 x 128: 2 x 3 blocks, 6 programs. Program 5 is block (1, 2):
        rows 128..129 and column 256 only, so 2 of its 128 x 128 lanes are live; it writes `scale_inv[0, 1, 2]` and
        `q[0, 128:130, 256]`.
        """
        pid = tl.program_id(0)
        blocks_per_matrix = num_block_rows * num_block_cols  # < 2**31: the launcher checks the grid
        b = pid // blocks_per_matrix
        rest = pid - b * blocks_per_matrix
        i = rest // num_block_cols
        j = rest - i * num_block_cols
        b, i, j = b.to(tl.int64), i.to(tl.int64), j.to(tl.int64)  # every offset below is int64
        in_row = tl.arange(0, TILE_M)[:, None]
        in_col = tl.arange(0, TILE_N)[None, :]
        cols = j * BLOCK_N + in_col
        col_ok = (in_col < BLOCK_N) & (cols < N)
        x_base = x_ptr + b * stride_xb + cols * stride_xn
        q_base = q_ptr + b * stride_qb + cols * stride_qn

        amax = tl.full([TILE_M, TILE_N], 0, tl.int32)  # tl.zeros is a @jit helper of one mode only
        for t in tl.static_range(NUM_TILES):
            rows = i * BLOCK_M + t * TILE_M + in_row
            mask = (t * TILE_M + in_row < BLOCK_M) & (rows < M) & col_ok
            mag = _load_f32_bits(x_base + rows * stride_xm, mask, IN_BITS, IN_BF16) & 0x7FFFFFFF
            # non-negative float32 bits order like their values; NaN and Inf (>= 0x7F800000) do not count
            amax = tl.maximum(amax, tl.where(mag < _F32_INF_BITS, mag, 0))
        amax_bits = tl.maximum(tl.reduce(amax, None, _MAX_COMBINE), _AMAX_FLOOR_BITS)
        scale_inv = tl.div_rn(amax_bits.to(tl.float32, bitcast=True), 448.0)
        tl.store(s_ptr + b * stride_sb + i * stride_sm + j * stride_sn, scale_inv)

        for t in tl.static_range(NUM_TILES):
            rows = i * BLOCK_M + t * TILE_M + in_row
            mask = (t * TILE_M + in_row < BLOCK_M) & (rows < M) & col_ok
            bits = _load_f32_bits(x_base + rows * stride_xm, mask, IN_BITS, IN_BF16)
            y = tl.div_rn(bits.to(tl.float32, bitcast=True), scale_inv)
            # the sign comes from x: a NaN's sign after a division differs between devices, x's does not
            q = _f32_to_e4m3fn_saturated(y.to(tl.int32, bitcast=True), (bits >> 24) & 0x80)
            tl.store(q_base + rows * stride_qm, q.to(tl.uint8), mask=mask)


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------

def _device_code(interpret: bool) -> ModuleType:
    """This file loaded again with Triton's interpreter on (CPU tensors) or off (CUDA tensors), once per process, so
    its kernel exists in both modes whatever `TRITON_INTERPRET` said."""
    return load_device_module(os.path.abspath(__file__), _DEVICE_COPIES[0 if interpret else 1], interpret)


def _launch_config(block: tuple[int, int], device_type: str) -> tuple[int, int, int]:
    """`(TILE_M, TILE_N, num_warps)` for a block: the one place these are chosen.

    On CUDA a program walks its block in tiles of about 4096 elements (16 per thread with 8 warps), so a 128 x 128
    block never sits in registers whole. Not tuned: no GPU measurement has been made. The interpreter runs each
    operation once per tile in Python, so there a tile is the whole block.
    """
    tile_n = _next_power_of_2(block[1])
    tile_m_whole = _next_power_of_2(block[0])
    if device_type != "cuda":
        return tile_m_whole, tile_n, 1
    return min(tile_m_whole, max(1, 4096 // tile_n)), tile_n, 8


def _next_power_of_2(n: int) -> int:
    """Smallest power of two >= `n` (>= 1); `tl.arange` needs power-of-two lengths."""
    return 1 << max(n - 1, 0).bit_length()


def _launch(x3: torch.Tensor, q3: torch.Tensor, s3: torch.Tensor, block: tuple[int, int]) -> None:
    """One launch of `_quant_block_kernel` over all blocks of the `[B, M, N]` views; nothing to do when empty."""
    if x3.numel() == 0:
        return
    interpret = x3.device.type != "cuda"
    kernel = _device_code(interpret)._quant_block_kernel
    tile_m, tile_n, num_warps = _launch_config(block, x3.device.type)
    num_b, m, n = x3.shape
    x_int = x3.view(INT_DTYPE_BY_SIZE[x3.element_size()])
    q_int = q3.view(torch.uint8)
    params = (x_int, *x_int.stride(), q_int, *q_int.stride(), s3, *s3.stride(), m, n, s3.shape[1], s3.shape[2])
    constexprs = {"IN_BITS": 8 * x3.element_size(), "IN_BF16": x3.dtype == torch.bfloat16, "BLOCK_M": block[0],
                  "BLOCK_N": block[1], "TILE_M": tile_m, "TILE_N": tile_n, "NUM_TILES": -(-block[0] // tile_m),
                  "num_warps": num_warps, "enable_fp_fusion": False}
    if x3.device.type == "cuda" and tile_n > 4096:
        raise NotImplementedError(f"quantize_fp8_block: the Triton kernel takes blocks of at most 4096 columns, got "
                                  f"{block}; use backend='torch'")
    num_programs = num_b * s3.shape[1] * s3.shape[2]
    if num_programs >= 2**31:
        raise NotImplementedError(f"quantize_fp8_block: {num_programs} blocks do not fit one launch (< 2**31); "
                                  "split the leading dims")
    launch = kernel[(num_programs,)]
    launch_in_mode(launch, interpret, *params, **constexprs)


# ---------------------------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------------------------


def _as_3d(name: str, what: str, t: torch.Tensor) -> torch.Tensor:
    """`t` (`[..., M, N]`) as a `[B, M, N]` view; `ValueError` when its leading dims do not merge into one stride."""
    try:
        return t.view(math.prod(t.shape[:-2]), *t.shape[-2:])
    except RuntimeError as e:
        raise ValueError(f"{name}: {what} of shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
                         f"[B, M, N] (its leading dims do not merge); pass a tensor whose leading dims do") from e


def _prepare(
    name: str, x: torch.Tensor, block: Sequence[int], out: torch.Tensor | None, scale_out: torch.Tensor | None
) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the arguments shared by both backends; return `(block, x3, q3, s3, q, scale_inv)`, allocating the
    outputs that were not given. `x3`, `q3`, `s3` are `[B, M, N]` / `[B, nbr, nbc]` views (`x3` may be a copy)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.dtype not in INPUT_DTYPES:
        what = f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: x must be a [..., M, N] tensor of {', '.join(map(str, INPUT_DTYPES))}; got {what}")
    block = check_block(name, block)
    s_shape = scale_box((0,) * x.dim(), tuple(x.shape), block)[1]
    for what, t, dtype, shape in (("out", out, FP8_DTYPE, tuple(x.shape)), ("scale_out", scale_out, torch.float32,
                                                                             s_shape)):
        if t is not None and (t.dtype != dtype or tuple(t.shape) != shape or t.device != x.device):
            raise ValueError(f"{name}: {what} must be {dtype} of shape {shape} on {x.device}; got {t.dtype} of shape "
                             f"{tuple(t.shape)} on {t.device}")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device) if out is None else out
    scale = torch.empty(s_shape, dtype=torch.float32, device=x.device) if scale_out is None else scale_out
    x3 = x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:])
    return block, x3, _as_3d(name, "out", q), _as_3d(name, "scale_out", scale), q, scale


@torch.no_grad()
def quantize_fp8_block(
    x: torch.Tensor,
    *,
    block: Sequence[int] = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` to float8_e4m3fn with one float32 `scale_inv` per block (formula in the module docstring).

    Args:
        x: `[..., M, N]` float32, bfloat16 or float16, any strides; leading dims (stacked experts) are independent
            matrices. `M` and `N` need not be multiples of the block: the last block row / column is partial.
        block: `(rows, cols)` of a block, `(128, 128)` for DeepSeek-V3 checkpoints.
        out: optional `float8_e4m3fn` `[..., M, N]` to write `q` into (any strides whose leading dims merge).
        scale_out: optional float32 `[..., ceil(M / rows), ceil(N / cols)]` to write `scale_inv` into.
        backend: `"triton"` (one launch for all blocks; CPU tensors run under Triton's interpreter), `"torch"`
            (`quantize_fp8_block_reference`) or `None` (`$RESHARD_KERNEL_BACKEND`, else Triton for CUDA tensors and
            torch for CPU tensors). Both give the same bits.

    Returns:
        `(q, scale_inv)`: `out` and `scale_out` when given. Dequantize with `dequantize_fp8_block`.

    Raises:
        ValueError: `x` not 2-D or more, or of another dtype; a bad block; `out` / `scale_out` of the wrong dtype,
            shape or device; an unknown backend.

    Example:
        >>> q, s = quantize_fp8_block(torch.tensor([[1.0, -2.0], [0.5, 448.0]]), block=(2, 2))
        >>> s.tolist(), q.float().tolist()
        ([[1.0]], [[1.0, -2.0], [0.5, 448.0]])
    """
    block, x3, q3, s3, q, scale = _prepare("quantize_fp8_block", x, block, out, scale_out)
    if choose_backend("quantize_fp8_block", x.device, backend)[0] == "torch":
        _quantize_torch(x3, q3, s3, block)
    elif x.device.type == "cuda":
        with torch.cuda.device(x.device):
            _launch(x3, q3, s3, block)
    else:
        _launch(x3, q3, s3, block)
    return q, scale


def _expand_scale(scale_inv: torch.Tensor, shape: Sequence[int], block: tuple[int, int]) -> torch.Tensor:
    """`scale_inv` (`[..., nbr, nbc]`) repeated over its blocks and cut to `shape` (`[..., M, N]`)."""
    full = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., : shape[-2], : shape[-1]]


@torch.no_grad()
def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, *, block: Sequence[int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`q.float() * scale_inv` with each scale over its block, in float32, then cast to `dtype`.

    Args:
        q: `float8_e4m3fn` `[..., M, N]`.
        scale_inv: float32 `[..., ceil(M / rows), ceil(N / cols)]`, as `quantize_fp8_block` returns it.
        block: `(rows, cols)` of a block.
        dtype: dtype of the result.

    Returns:
        `[..., M, N]` tensor of `dtype` on `q`'s device. NaN codes give NaN.

    Raises:
        ValueError: wrong dtypes, or a `scale_inv` shape that does not match `q`'s shape and `block`.
    """
    block = check_block("dequantize_fp8_block", block)
    if q.dtype != FP8_DTYPE or q.dim() < 2 or scale_inv.dtype != torch.float32:
        raise ValueError(f"dequantize_fp8_block: q must be {FP8_DTYPE} [..., M, N] and scale_inv float32; got q "
                         f"{q.dtype} of shape {tuple(q.shape)}, scale_inv {scale_inv.dtype}")
    want = scale_box((0,) * q.dim(), tuple(q.shape), block)[1]
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"dequantize_fp8_block: scale_inv for q of shape {tuple(q.shape)} and block {block} must "
                         f"have shape {want}; got {tuple(scale_inv.shape)}")
    return (q.float() * _expand_scale(scale_inv, q.shape, block)).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Pure-torch reference (also the CPU production path)
# ---------------------------------------------------------------------------------------------------------------


def _quantize_torch(x3: torch.Tensor, q3: torch.Tensor, s3: torch.Tensor, block: tuple[int, int]) -> None:
    """The formula of the module docstring in torch ops, on `[B, M, N]` views; writes `q3` and `s3`.

    Every division is tensor by tensor: CUDA turns a division by a Python scalar into a multiplication by its
    reciprocal, which rounds differently.
    """
    if x3.numel() == 0:
        return
    num_b, m, n = x3.shape
    nbr, nbc = s3.shape[1:]
    pad = (0, nbc * block[1] - n, 0, nbr * block[0] - m)
    xf = torch.nn.functional.pad(x3.float(), pad).view(num_b, nbr, block[0], nbc, block[1])
    mag = torch.where(torch.isfinite(xf), xf.abs(), 0.0)
    amax = mag.amax(dim=(2, 4), keepdim=True)
    floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=x3.device)
    scale = torch.maximum(amax, floor) / torch.full_like(amax, FP8_MAX)
    y = (xf / scale).clamp(-FP8_MAX, FP8_MAX)
    bits = y.to(FP8_DTYPE).view(torch.uint8)
    nan_bits = torch.where(torch.signbit(xf), 0xFF, 0x7F).to(torch.uint8)
    bits = torch.where(torch.isnan(xf), nan_bits, bits)
    q3.view(torch.uint8).copy_(bits.view(num_b, nbr * block[0], nbc * block[1])[:, :m, :n])
    s3.copy_(scale.view(num_b, nbr, nbc))


@torch.no_grad()
def quantize_fp8_block_reference(
    x: torch.Tensor,
    *,
    block: Sequence[int] = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `quantize_fp8_block`, same signature; the definition of its bits and the CPU production path.

    `backend` must be None or "torch". Pads `x` to whole blocks with zeros (which leave every amax unchanged), views
    it as `[B, rows of blocks, block rows, cols of blocks, block cols]`, and applies the module docstring's formula:
    amax over the finite magnitudes, the floor, the divisions by tensors, `clamp`, torch's `.to(float8_e4m3fn)`,
    then `0x7F | sign` where `x` is NaN. It holds a few float32 copies of `x` at once.
    """
    if backend not in (None, "torch"):
        raise ValueError(f"quantize_fp8_block_reference: backend must be None or 'torch', got {backend!r}")
    block, x3, q3, s3, q, scale = _prepare("quantize_fp8_block_reference", x, block, out, scale_out)
    _quantize_torch(x3, q3, s3, block)
    return q, scale
