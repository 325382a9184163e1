"""quantize_fp8_block: the Triton kernel bit for bit against `quantize_fp8_block_reference`, and both against an
independent numpy computation of the DeepSeek-V3 formula (its own amax loop and its own round-to-nearest-even onto a
table of the 256 e4m3fn codes, no torch casts).

Triton runs under its interpreter on CPU tensors; `RESHARD_TEST_DEVICE=cuda` runs the same tests compiled on a GPU
(`perf/gpu_check.sh` does). Comparisons are of bits: shape, then dtype, then every byte of `q` and every word of
`scale_inv`, with the first differences printed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.kernels import (
    block_aligned,
    dequantize_fp8_block,
    quantize_fp8_block,
    quantize_fp8_block_reference,
    scale_box,
)
from reshard.kernels import _quant as quant_module
from reshard.kernels._backend import BACKEND_ENV
from reshard.testing import device_under_test

FP8 = torch.float8_e4m3fn
DEVICE = device_under_test()
ON_GPU = DEVICE.type == "cuda"
BACKENDS = ["torch", "triton"]
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
GiB = 2**30


# ---------------------------------------------------------------------------------------------------------------
# Helpers: bit patterns, the independent oracle, bit-exact comparison
# ---------------------------------------------------------------------------------------------------------------


def from_bits(bits: np.ndarray, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A `dtype` tensor on the test device holding exactly these bit patterns (uint32 / uint16 values)."""
    unsigned, signed = (np.uint32, np.int32) if dtype == torch.float32 else (np.uint16, np.int16)
    raw = np.asarray(bits, dtype=np.uint64).astype(unsigned).view(signed)
    return torch.from_numpy(raw).to(DEVICE).view(dtype)


def e4m3_values() -> np.ndarray:
    """float64 value of each positive code 0x00..0x7E, decoded from the format's definition (not by torch)."""
    codes = np.arange(0x7F)
    exp, mant = codes >> 3, codes & 7
    return np.where(exp == 0, mant * 2.0**-9, (1 + mant / 8) * 2.0 ** (exp - 7))


E4M3 = e4m3_values()


def oracle(x: torch.Tensor, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`(q bits as uint8, scale_inv as float32)` of the DeepSeek-V3 formula, computed block by block in numpy.

    amax over finite |x| (floor 1e-4), scale_inv = amax / 448 and y = x / scale_inv in float32, y clamped to +-448
    and rounded to the nearest e4m3fn value (ties to the even code), NaN -> 0x7F | sign.
    """
    xf = x.detach().float().cpu().numpy()
    lead, (m, n) = xf.shape[:-2], xf.shape[-2:]
    xf = xf.reshape(-1, m, n)
    nbr, nbc = -(-m // block[0]), -(-n // block[1])
    scales = np.zeros((xf.shape[0], nbr, nbc), dtype=np.float32)
    y = np.zeros_like(xf)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(xf.shape[0]):
            for i in range(nbr):
                for j in range(nbc):
                    rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
                    tile = xf[b, rows, cols]
                    finite = np.abs(tile[np.isfinite(tile)])
                    amax = max(finite.max(initial=np.float32(0)), np.float32(1e-4))
                    scales[b, i, j] = np.float32(amax) / np.float32(448)
                    y[b, rows, cols] = tile / scales[b, i, j]
        mag = np.minimum(np.abs(y.astype(np.float64)), 448.0)
        hi = np.minimum(np.searchsorted(E4M3, mag), len(E4M3) - 1)
        lo = np.maximum(hi - 1, 0)
        d_lo, d_hi = mag - E4M3[lo], E4M3[hi] - mag
        code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    sign = np.signbit(xf).astype(np.int64) << 7
    q = np.where(np.isnan(xf), 0x7F, code) | sign
    return q.astype(np.uint8).reshape(*lead, m, n), scales.reshape(*lead, nbr, nbc)


def np_bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype == FP8:
        return t.contiguous().view(torch.uint8).cpu().numpy()
    assert t.dtype == torch.float32
    return t.contiguous().view(torch.int32).cpu().numpy().view(np.uint32)


def assert_bits(got: torch.Tensor, want: torch.Tensor | np.ndarray, what: str, x: torch.Tensor | None = None) -> None:
    """Same shape, dtype and bits; the first differences are listed with their inputs."""
    if isinstance(want, torch.Tensor):
        assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype)
        want = np_bits(want)
    assert tuple(got.shape) == want.shape, (what, got.shape, want.shape)
    g = np_bits(got)
    bad = np.argwhere(g != want)
    if bad.size:
        def show(idx: tuple[int, ...]) -> str:
            src = f" x={x[idx].item()!r}" if x is not None and x.shape == got.shape else ""
            return f"{idx}:{src} got {g[idx]:#x}, want {want[idx]:#x}"
        rows = [show(tuple(int(v) for v in idx)) for idx in bad[:8]]
        raise AssertionError(f"{what}: {len(bad)} of {g.size} differ:\n" + "\n".join(rows))


def check_all(x: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton == reference == oracle, bit for bit; returns the reference's `(q, scale_inv)`."""
    q_ref, s_ref = quantize_fp8_block_reference(x, block=block)
    assert q_ref.dtype == FP8 and s_ref.dtype == torch.float32 and q_ref.shape == x.shape
    q_want, s_want = oracle(x, block)
    assert_bits(s_ref, s_want.view(np.uint32), "reference scale_inv vs oracle")
    assert_bits(q_ref, q_want, "reference q vs oracle", x)
    q_tri, s_tri = quantize_fp8_block(x, block=block, backend="triton")
    assert_bits(s_tri, s_ref, "triton scale_inv vs reference")
    assert_bits(q_tri, q_ref, "triton q vs reference", x)
    return q_ref, s_ref


def varied(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal values times 10**k with k uniform in [-7, 5] per row and per column, so blocks differ in scale by many
    orders of magnitude, some blocks stay below the amax floor (1e-4), and no block is made of equal values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    rows = torch.empty(*shape[:-1], 1, dtype=torch.float64).uniform_(-7, 5, generator=g)
    cols = torch.empty(shape[-1], dtype=torch.float64).uniform_(-7, 5, generator=g)
    return (x * 10.0 ** ((rows + cols) / 2)).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------------------------
# Geometry: shapes, dtypes, strides, stacked experts
# ---------------------------------------------------------------------------------------------------------------

SHAPES = [
    (130, 257),  # partial last block row (2 rows) and column (1 column)
    (1, 1),  # one partial block of one element
    (128, 128),  # exactly one block
    (256, 129),  # two full block rows, a 1-column last block
    (3, 130, 129),  # stacked experts: blocks never span two experts
    (2, 2, 5, 7),  # two leading dims
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shapes_float32(shape: tuple[int, ...]) -> None:
    check_all(varied(shape, seed=len(shape) * 1000 + shape[-1]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_inputs(dtype: torch.dtype) -> None:
    check_all(varied((130, 257), seed=1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_16_bit_input(dtype: torch.dtype) -> None:
    # all 65,536 patterns (subnormals, Inf, NaN with payloads), one block per 2,048 consecutive patterns (so a block
    # spans a narrow range of magnitudes), then one 256 x 256 block with all of them (huge amax: most q are 0)
    x = from_bits(np.arange(1 << 16), dtype).view(256, 256)
    check_all(x, block=(8, 256))
    check_all(x, block=(256, 256))


@pytest.mark.parametrize("block", [(64, 32), (3, 5), (1, 1), (200, 7)], ids=str)
def test_other_blocks(block: tuple[int, int]) -> None:
    # non-square, non-power-of-two (the kernel masks its power-of-two tile), 1 x 1 (every element its own scale)
    shape = {(64, 32): (130, 67), (3, 5): (10, 11), (1, 1): (5, 7), (200, 7): (401, 15)}[block]  # few programs
    check_all(varied(shape, seed=block[0] * 7 + block[1]), block=block)


@pytest.mark.parametrize("kind", ["transposed", "strided", "expert_slice", "stride_0"])
def test_strided_inputs(kind: str) -> None:
    base = varied((3, 300, 260), seed=7)
    x = {"transposed": base[1].t(), "strided": base[:, ::2, 1::3], "expert_slice": base[:, 5:140, 3:200],
         "stride_0": base[0, 0].expand(130, 260)}[kind]
    q, s = check_all(x)
    q_contig, s_contig = quantize_fp8_block_reference(x.contiguous())
    assert_bits(q, q_contig, "strided vs contiguous")
    assert_bits(s, s_contig, "strided vs contiguous scales")


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0), (2, 0, 7), (0, 130, 130)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(shape: tuple[int, ...], backend: str) -> None:
    x = torch.zeros(shape, device=DEVICE)
    q, s = quantize_fp8_block(x, backend=backend)
    nbr, nbc = -(-shape[-2] // 128), -(-shape[-1] // 128)
    assert (q.shape, q.dtype, s.shape, s.dtype) == (x.shape, FP8, (*shape[:-2], nbr, nbc), torch.float32)


def test_experts_are_independent_matrices() -> None:
    x = varied((4, 130, 257), seed=11)
    q, s = quantize_fp8_block(x, backend="triton")
    for e in range(4):
        q_e, s_e = quantize_fp8_block_reference(x[e])
        assert_bits(q[e], q_e, f"expert {e} q")
        assert_bits(s[e], s_e, f"expert {e} scale_inv")


# ---------------------------------------------------------------------------------------------------------------
# Special values and the cast to e4m3fn
# ---------------------------------------------------------------------------------------------------------------


def special_blocks() -> torch.Tensor:
    """`[8, 16, 16]`: one 16 x 16 block per case (quantized with block (16, 16))."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, 16, generator=g)
    x[0] = 0.0  # all zero: scale_inv = 1e-4 / 448, q = 0
    x[1] = -0.0  # all negative zero: q = 0x80
    x[2, 3, 4], x[2, 5, 6] = float("nan"), -float("nan")  # NaN stays NaN and does not change the scale
    x[3] = float("nan")  # all NaN: scale from the floor
    x[4, 0, 0], x[4, 0, 1] = float("inf"), -float("inf")  # Inf saturates to +-448, scale from the finite values
    x[5] *= 1e37  # amax near float32's max: scale_inv ~ 1e35, huge values saturate
    x[5, 0, 0] = 3.4028234663852886e38
    x[6] = from_bits(np.arange(1, 257) * 4099 % (1 << 23)).view(16, 16).cpu()  # float32 subnormals only: floor
    x[7] *= 1e-6  # amax below the floor: every value lands in the e4m3 subnormals or 0
    return x.to(DEVICE)


def test_special_values() -> None:
    x = special_blocks()
    q, s = check_all(x, block=(16, 16))
    qb, floor_scale = np_bits(q), np.float32(np.float32(1e-4) / np.float32(448))
    assert (s[0].item(), s[1].item(), s[3].item(), s[6].item()) == (floor_scale,) * 4
    assert (qb[0] == 0).all() and (qb[1] == 0x80).all() and (qb[3] == 0x7F).all() and (qb[6] == 0).all()
    assert (qb[2, 3, 4], qb[2, 5, 6]) == (0x7F, 0xFF)
    without_nan = x[2].clone()
    without_nan[3, 4] = without_nan[5, 6] = 0.0
    assert s[2].item() == quantize_fp8_block_reference(without_nan, block=(16, 16))[1].item()
    assert (qb[4, 0, 0], qb[4, 0, 1]) == (0x7E, 0xFE)
    finite = x[4][torch.isfinite(x[4])].abs().max()
    assert s[4].item() == (finite / torch.full_like(finite, 448.0)).item()
    assert qb[5, 0, 0] == 0x7E and 0 < s[5].item() < math.inf


def cast_patterns(seed: int = 0) -> np.ndarray:
    """float32 patterns with |x| <= 448 for the e4m3fn rounding: the bits below each rounding position at 0, half-1,
    half, half+1 and all ones (exponents 100..135: e4m3fn normals drop 20 bits, subnormals 21 and more), random
    patterns, and every e4m3fn value itself."""

    def lows(shift: int) -> np.ndarray:
        half = 1 << (shift - 1)
        return np.array([0, half - 1, half, half + 1, 2 * half - 1], dtype=np.uint64)

    rng = np.random.default_rng(seed)
    parts = []
    for exponent in range(100, 136):
        shift = max(141 - exponent, 20)
        mant = rng.integers(0, 1 << 23, size=256, dtype=np.uint64) >> np.uint64(shift) << np.uint64(shift)
        parts.append((np.uint64(exponent) << np.uint64(23)) | (mant[:, None] | lows(min(shift, 23))[None, :]).ravel())
    rand = rng.integers(0, 0x43E00001, size=1 << 15, dtype=np.uint64)
    exact = np.float32(E4M3).view(np.uint32).astype(np.uint64)
    edges = np.array([0x43E00000, 0x3C800000, 0x3C7FFFFF, 0x3B000000, 0x3A800000], dtype=np.uint64)  # 448, 2**-6 ..
    pats = np.concatenate([*parts, rand, exact, edges])
    pats = pats[pats <= 0x43E00000]  # exponent 135 with a large mantissa is above 448
    return np.concatenate([pats, pats | np.uint64(0x80000000)])


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # NaN / scale in numpy
def test_cast_matches_torch() -> None:
    # Each 128 x 128 block holds 448 once, so amax = 448 and scale_inv = 448 / 448 = 1 exactly: q is then the
    # kernel's integer e4m3fn rounding of x itself, compared with torch's `.to(float8_e4m3fn)` (after the clamp of
    # the formula; NaN and Inf included as blocks of their own below)
    pats = cast_patterns()
    per_block = 128 * 128 - 1
    num_blocks = -(-len(pats) // per_block)
    flat = np.zeros(num_blocks * per_block, dtype=np.uint64)
    flat[: len(pats)] = pats
    x = torch.cat([from_bits(flat).view(num_blocks, per_block), torch.full((num_blocks, 1), 448.0, device=DEVICE)],
                  dim=1).view(num_blocks, 128, 128)
    special = from_bits(np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF812345,
                                  0x43E00000, 0xC3E00000, 0x00000001, 0x80000001, 0x80000000]))
    x = torch.cat([x.view(-1, 128), torch.cat([special, torch.zeros(128 - len(special), device=DEVICE)])[None]])
    x[-1, -1] = 448.0
    q, s = quantize_fp8_block(x, backend="triton")
    assert (s == 1.0).all() and s.numel() == num_blocks + 1
    want = x.clamp(-448, 448).to(FP8)
    nan = torch.isnan(x)
    assert_bits(q[~nan], want[~nan], "kernel e4m3fn rounding vs torch .to()")
    assert np_bits(q[nan]).tolist() == [0x7F, 0xFF, 0x7F, 0xFF]  # NaN keeps its sign, as torch's CPU cast does
    check_all(x[:-1].view(num_blocks, 128, 128)[:3])  # and the oracle agrees (a few blocks: it is slow)


# ---------------------------------------------------------------------------------------------------------------
# Blocks are local: a block-aligned slice quantizes to the slice of the full quantization
# ---------------------------------------------------------------------------------------------------------------


ALIGNED = [  # (offsets, shape) in a (3, 300, 400) tensor
    ((0, 128, 0), (3, 172, 128)),  # rows to the edge (300), one block column
    ((1, 0, 256), (2, 256, 144)),  # two experts, columns to the edge (400)
    ((2, 128, 128), (1, 128, 128)),  # one interior block
    ((0, 0, 0), (3, 300, 400)),  # everything
]


@functools.cache
def full_quantization(backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(x, q, scale_inv)` of a (3, 300, 400) tensor with a NaN and an Inf, computed once per backend."""
    full = varied((3, 300, 400), seed=5)
    full[0, 200, 300] = float("nan")
    full[1, 10, 10] = float("inf")
    return full, *quantize_fp8_block(full, backend=backend)


@pytest.mark.parametrize("offsets,shape", ALIGNED, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_aligned_slices_are_local(offsets: tuple[int, ...], shape: tuple[int, ...], backend: str) -> None:
    full, q_full, s_full = full_quantization(backend)
    assert block_aligned(offsets, shape, full.shape)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, shape))
    q, s = quantize_fp8_block(full[index], backend=backend)  # a non-contiguous view
    s_off, s_shape = scale_box(offsets, shape)
    assert_bits(q, q_full[index], "slice of q")
    assert_bits(s, s_full[tuple(slice(o, o + n) for o, n in zip(s_off, s_shape))], "slice of scale_inv")


def test_unaligned_slice_differs() -> None:
    # rows 0..100 cut the first block row: its amax (here at row 120) is not in the slice, so the scales differ
    full = varied((300, 200), seed=6)
    full[120, 3] = 1e6
    assert not block_aligned((0, 0), (100, 200), full.shape)
    s_full = quantize_fp8_block_reference(full)[1]
    _, s = quantize_fp8_block_reference(full[:100])
    assert s[0, 0] != s_full[0, 0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_aligned_slices_hypothesis(data: st.DataObject) -> None:
    # any block-aligned box of any shape, small blocks so that boxes have several; the torch backend (the kernel
    # equals it, above)
    block = (data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6)))
    shape = tuple(data.draw(st.integers(1, 20)) for _ in range(2))

    def cut(size: int, b: int) -> tuple[int, int]:
        bounds = sorted({*range(0, size, b), size})
        lo = data.draw(st.sampled_from(bounds[:-1]))
        return lo, data.draw(st.sampled_from([v for v in bounds if v > lo])) - lo

    (r0, nr), (c0, nc) = cut(shape[0], block[0]), cut(shape[1], block[1])
    assert block_aligned((r0, c0), (nr, nc), shape, block)
    full = varied(shape, seed=data.draw(st.integers(0, 2**16)))
    q_full, s_full = quantize_fp8_block_reference(full, block=block)
    q, s = quantize_fp8_block_reference(full[r0: r0 + nr, c0: c0 + nc], block=block)
    (sr, sc), (snr, snc) = scale_box((r0, c0), (nr, nc), block)
    assert_bits(q, q_full[r0: r0 + nr, c0: c0 + nc], "slice of q")
    assert_bits(s, s_full[sr: sr + snr, sc: sc + snc], "slice of scale_inv")


def test_block_aligned_and_scale_box() -> None:
    assert block_aligned((128, 0), (172, 128), (300, 200))
    assert not block_aligned((0, 0), (100, 200), (300, 200))  # stop 100: not a multiple, not the edge
    assert not block_aligned((64, 0), (64, 200), (300, 200))  # start 64
    assert block_aligned((0, 0), (0, 7), (300, 200))  # empty
    assert block_aligned((5, 0, 0), (1, 128, 200), (8, 300, 200))  # leading dims never matter
    assert block_aligned((0, 4), (3, 4), (3, 9), block=(2, 4))  # rows stop at the edge (3)
    assert scale_box((128, 0), (172, 200)) == ((1, 0), (2, 2))
    assert scale_box((5, 100, 0), (2, 1, 129)) == ((5, 0, 0), (2, 1, 2))  # unaligned: the blocks it touches
    assert scale_box((0, 0), (0, 300)) == ((0, 0), (0, 3))
    with pytest.raises(ValueError, match="one equal length >= 2"):
        block_aligned((0,), (5,), (5,))
    with pytest.raises(ValueError, match="block must be two positive ints"):
        scale_box((0, 0), (4, 4), block=(0, 128))


# ---------------------------------------------------------------------------------------------------------------
# Outputs, dequantization, backends, errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_views(backend: str) -> None:
    # q into columns 3..260 of a wider buffer, scales into a strided view: the rest of both stays untouched
    x = varied((2, 130, 257), seed=8)
    q_buf = torch.full((2, 130, 300), 0x55, dtype=torch.uint8, device=DEVICE).view(FP8)
    s_buf = torch.full((2, 2, 9), -1.0, device=DEVICE)
    q_view, s_view = q_buf[:, :, 3:260], s_buf[:, :, 1:7:2]
    q, s = quantize_fp8_block(x, out=q_view, scale_out=s_view, backend=backend)
    assert q is q_view and s is s_view
    q_ref, s_ref = quantize_fp8_block_reference(x)
    assert_bits(q, q_ref, "q in a view")
    assert_bits(s, s_ref, "scale_inv in a view")
    rest = torch.ones(300, dtype=torch.bool)
    rest[3:260] = False
    assert (q_buf.view(torch.uint8)[:, :, rest] == 0x55).all()
    s_rest = torch.ones(9, dtype=torch.bool)
    s_rest[1:7:2] = False
    assert (s_buf[:, :, s_rest] == -1.0).all()


def test_dequantize() -> None:
    x = varied((2, 130, 257), seed=9)
    q, s = quantize_fp8_block(x)
    dq = dequantize_fp8_block(q, s)
    expanded = s.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :130, :257]
    assert torch.equal(dq, q.float() * expanded)
    # e4m3fn keeps 3 mantissa bits: half an ulp is at most |y| / 16 for normals and 2**-10 for subnormals (times
    # the scale), plus the float32 roundings of the two divisions and the product
    bound = (x.abs() / 16 + expanded * 2.0**-10) * (1 + 2.0**-20) + x.abs() * 2.0**-22
    assert ((dq - x).abs() <= bound).all()
    assert dequantize_fp8_block(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"must have shape \(2, 2, 3\); got \(2, 3, 3\)"):
        dequantize_fp8_block(q, torch.ones(2, 3, 3, device=DEVICE))
    with pytest.raises(ValueError, match="q must be torch.float8_e4m3fn"):
        dequantize_fp8_block(x, s)


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    launched = []
    real = quant_module._launch
    monkeypatch.setattr(quant_module, "_launch", lambda *a: launched.append(1) or real(*a))
    x = varied((5, 7), seed=10)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    quantize_fp8_block(x)
    assert launched == ([1] if ON_GPU else [])  # None: Triton for CUDA tensors, torch for CPU tensors
    monkeypatch.setenv(BACKEND_ENV, "triton")
    quantize_fp8_block(x)
    assert len(launched) == (2 if ON_GPU else 1)
    quantize_fp8_block(x, backend="torch")  # an explicit argument wins over the variable
    assert len(launched) == (2 if ON_GPU else 1)
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=r"\$RESHARD_KERNEL_BACKEND must be one of"):
        quantize_fp8_block(x)


@pytest.mark.parametrize("fn", [quantize_fp8_block, quantize_fp8_block_reference], ids=lambda f: f.__name__)
def test_bad_input(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
    x = torch.ones(4, 4, device=DEVICE)
    cases = [
        ({"x": torch.ones(4, 4, dtype=torch.int32, device=DEVICE)}, "x must be a .* got torch.int32"),
        ({"x": torch.ones(4, device=DEVICE)}, r"x must be a \[..., M, N\] tensor .* shape \(4,\)"),
        ({"x": torch.ones(4, 4, dtype=torch.float64, device=DEVICE)}, "got torch.float64"),
        ({"x": x, "block": (128,)}, "block must be two positive ints"),
        ({"x": x, "block": (128, -1)}, "block must be two positive ints"),
        ({"x": x, "out": torch.empty(4, 4, device=DEVICE)}, r"out must be torch.float8_e4m3fn of shape \(4, 4\)"),
        ({"x": x, "out": torch.empty(4, 5, dtype=FP8, device=DEVICE)}, r"got torch.float8_e4m3fn of shape \(4, 5\)"),
        ({"x": x, "scale_out": torch.empty(2, 1, device=DEVICE)}, r"scale_out must be torch.float32 of shape \(1, 1\)"),
        ({"x": torch.ones(2, 3, 4, 4, device=DEVICE),  # leading dims of `out` swapped: they do not merge
          "out": torch.empty(3, 2, 4, 4, dtype=FP8, device=DEVICE).transpose(0, 1)}, "cannot be viewed as"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(**kwargs)
    with pytest.raises(ValueError, match="backend must be"):
        fn(x, backend="cuda")


def test_reference_refuses_triton() -> None:
    with pytest.raises(ValueError, match="backend must be None or 'torch', got 'triton'"):
        quantize_fp8_block_reference(torch.ones(2, 2), backend="triton")


# ---------------------------------------------------------------------------------------------------------------
# Offsets past 2**31 elements, and the compiled kernel (no GPU needed)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_past_2_31(backend: str) -> None:
    # Views whose expert stride is 2**31 + 5 elements, so expert 1 starts past element 2**31 of the input (bfloat16,
    # 4 GiB) and of the output (1 byte per element, 2 GiB). On CPU the untouched pages of `torch.empty` take no
    # memory; a GPU needs it all.
    if ON_GPU and torch.cuda.mem_get_info(DEVICE)[0] < 7 * GiB:
        pytest.skip("needs 7 GiB free on the GPU")
    stride = 2**31 + 5
    shape, strides = (2, 130, 129), (stride, 200, 1)
    numel = stride + 130 * 200
    try:
        x_store = torch.empty(numel, dtype=torch.bfloat16, device=DEVICE)
        q_store = torch.empty(numel, dtype=torch.uint8, device=DEVICE)
    except RuntimeError as e:  # out of memory, or no address space for it
        pytest.skip(f"cannot allocate 6 GiB on {DEVICE.type}: {e}")
    x = x_store.as_strided(shape, strides)
    x.copy_(varied(shape, seed=12, dtype=torch.bfloat16))
    q = q_store.view(FP8).as_strided(shape, strides)
    quantize_fp8_block(x, out=q, backend=backend)
    q_ref = quantize_fp8_block_reference(x.contiguous())[0]
    assert_bits(q, q_ref, "q past 2**31")


def test_kernel_compiles_for_gpu() -> None:
    # Compile (no GPU needed) for sm_90: GPU-only compile errors show up on CPU-only CI, and the divisions must be
    # IEEE (`div.rn.f32`), not Triton's default approximate `div.full.f32`
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = quant_module._device_code(interpret=False)._quant_block_kernel
    ints = [f"stride_{t}{d}" for t in "xqs" for d in "bmn"] + ["M", "N", "num_block_rows", "num_block_cols"]
    for x_ty, in_bits, bf16 in [("*i32", 32, False), ("*i16", 16, True), ("*i16", 16, False)]:
        tile_m, tile_n, num_warps = quant_module._launch_config((128, 128), "cuda")
        constexprs = {"IN_BITS": in_bits, "IN_BF16": bf16, "BLOCK_M": 128, "BLOCK_N": 128, "TILE_M": tile_m,
                      "TILE_N": tile_n, "NUM_TILES": 128 // tile_m}
        signature = {"x_ptr": x_ty, "q_ptr": "*u8", "s_ptr": "*fp32", **dict.fromkeys(ints, "i64"),
                     **dict.fromkeys(constexprs, "constexpr")}
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": num_warps, "enable_fp_fusion": False})
        except RuntimeError as e:  # e.g. no ptxas in this triton build
            if "ptxas" in str(e).lower():
                pytest.skip(f"cannot compile for CUDA here: {e}")
            raise
        ptx = compiled.asm["ptx"]
        assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx.f32" not in ptx, constexprs
