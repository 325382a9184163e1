"""Casts fused into pack / unpack, bit for bit against torch's `.to(dtype)` on a contiguous tensor of the device.

float32 -> bfloat16 / float16 is checked on special values (zeros, infinities, NaNs with payloads, the largest
finite values, subnormals, the overflow threshold, ties at every rounding position) and on hundreds of thousands
of patterns that put the discarded bits at, just below and just above the halfway point. bfloat16 / float16 ->
float32 is checked on all 65,536 inputs. Triton's interpreter converts float32 to bfloat16 without rounding to
nearest even, which is why the kernels round with integer arithmetic and why these tests run under it too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reshard.kernels import pack, pack_reference, prepare_pack, unpack
from reshard.kernels._backend import BACKEND_ENV
from reshard.planner._box import Box
from reshard.testing import device_under_test

DEVICE = device_under_test()
BACKENDS = ["torch", "triton"]
HALF_TYPES = [torch.bfloat16, torch.float16]
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def f32(bits: list[int] | np.ndarray) -> torch.Tensor:
    """float32 tensor on the test device holding exactly these bit patterns."""
    return torch.from_numpy(np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.int32)).to(DEVICE).view(
        torch.float32)


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(INT_OF[t.dtype]).cpu().numpy().view({2: np.uint16, 4: np.uint32}[t.element_size()])


SPECIAL_F32 = [
    0x00000000, 0x80000000,  # +-0
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFF812345, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF,  # quiet/signalling NaNs
    0x7F7FFFFF, 0xFF7FFFFF,  # largest finite float32: bfloat16 rounds it to inf, float16 overflows
    0x00800000, 0x007FFFFF, 0x00000001, 0x80000001,  # float32 min normal, largest and smallest subnormal
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # 1.0 and bfloat16 ties (even down, odd up)
    0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000,  # bfloat16 ties at the top and among subnormals
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000, 0xC77FF000,  # float16 max 65504, 65520 rounds to inf
    0x38800000, 0x387FFFFF, 0x387FF000, 0x33800000, 0x33000000, 0x33000001,  # float16 min normal / subnormal edges
    0x33C00000, 0x34200000, 0x3F801000, 0x3F803000, 0x3F800FFF, 0x3F801001,  # float16 ties at 2**-24 and at 1.0
]


def tie_patterns(seed: int = 0) -> np.ndarray:
    """float32 patterns with the bits below each rounding position at 0, half-1, half, half+1 and all ones.

    bfloat16 drops 16 bits everywhere (all 65,536 upper halves are used). float16 drops 13 bits for normal results
    and 14..24 bits for subnormal ones: exponents 100..143 with random upper bits cover both.
    """

    def lows(shift: int) -> np.ndarray:
        half = 1 << (shift - 1)
        return np.array([0, half - 1, half, half + 1, 2 * half - 1], dtype=np.uint64)

    upper = np.arange(1 << 16, dtype=np.uint64) << 16
    bf16 = (upper[:, None] | lows(16)[None, :]).ravel()
    rng = np.random.default_rng(seed)
    parts = []
    for exponent in range(100, 144):
        shift = min(max(126 - exponent, 13), 24)
        mant = rng.integers(0, 1 << 23, size=512, dtype=np.uint64) >> np.uint64(shift) << np.uint64(shift)
        pats = (np.uint64(exponent) << np.uint64(23)) | (mant[:, None] | lows(shift)[None, :]).ravel()
        parts += [pats, pats | np.uint64(0x80000000)]
    return np.concatenate([bf16, *parts, rng.integers(0, 1 << 32, size=1 << 16, dtype=np.uint64)])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, inputs: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = bits_of(got), bits_of(want)
    bad = np.nonzero(g != w)[0]
    if bad.size:
        src = bits_of(inputs.reshape(-1))
        rows = [f"in {src[i]:#x}: got {g[i]:#x}, torch {w[i]:#x}" for i in bad[:8]]
        raise AssertionError(f"{bad.size} of {g.size} casts differ from torch:\n" + "\n".join(rows))


def pack_cast(x: torch.Tensor, dtype: torch.dtype, backend: str, offset: int = 0) -> torch.Tensor:
    """`x` (any layout) packed with a cast to `dtype` at byte `offset`; returns the packed values."""
    n = x.numel()
    buf = torch.zeros(offset + n * dtype.itemsize, dtype=torch.uint8, device=DEVICE)
    pack([x], [Box((0,) * x.ndim, tuple(x.shape))], buf, [offset], dtype=dtype, backend=backend)
    return buf[offset:].clone().view(dtype)


def unpack_cast(packed: torch.Tensor, dtype: torch.dtype, backend: str, offset: int = 0) -> torch.Tensor:
    """`packed` (1-D, its own dtype) unpacked from byte `offset` into a new `dtype` tensor."""
    raw = packed.contiguous().view(torch.uint8)
    buf = torch.cat([torch.zeros(offset, dtype=torch.uint8, device=DEVICE), raw])
    out = torch.empty(packed.numel(), dtype=dtype, device=DEVICE)
    unpack(buf, [offset], [out], [Box((0,), (packed.numel(),))], dtype=packed.dtype, backend=backend)
    return out


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_special_values(backend: str, dtype: torch.dtype) -> None:
    x = f32(SPECIAL_F32)
    want = x.to(dtype)
    assert_same_bits(pack_cast(x, dtype, backend), want, x)
    assert_same_bits(unpack_cast(x, dtype, backend), want, x)
    # odd buffer offsets: the kernels write and read the elements as single bytes
    assert_same_bits(pack_cast(x, dtype, backend, offset=3), want, x)
    assert_same_bits(unpack_cast(x, dtype, backend, offset=1), want, x)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rounding_patterns(backend: str, dtype: torch.dtype) -> None:
    x = f32(tie_patterns())
    want = x.to(dtype)
    assert_same_bits(pack_cast(x, dtype, backend), want, x)
    assert_same_bits(unpack_cast(x, dtype, backend), want, x)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_widening_exhaustive(backend: str, dtype: torch.dtype) -> None:
    # every bfloat16 / float16 pattern, NaNs and subnormals included, widened to float32 both ways
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).to(DEVICE).view(dtype)
    want = x.to(torch.float32)
    assert_same_bits(pack_cast(x, torch.float32, backend), want, x)
    assert_same_bits(unpack_cast(x, torch.float32, backend), want, x)


@pytest.mark.parametrize("dtype", HALF_TYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_source_casts_like_contiguous(backend: str, dtype: torch.dtype) -> None:
    # torch's own strided `.to()` gives other NaN bits on some CPUs (0x7FC0 vs 0xFFFF for bfloat16); pack of a
    # transposed, strided source must still match the contiguous `.to()`
    values = f32(SPECIAL_F32 * 4)
    x = values[: 9 * 15].view(9, 15).t()[::2, 1:]
    assert_same_bits(pack_cast(x, dtype, backend).view(x.shape), x.contiguous().to(dtype), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_into_strided_destination(backend: str) -> None:
    # unpack a float32 buffer into a transposed bfloat16 box; elements outside the box keep their bits
    x = f32(tie_patterns()[:6 * 40]).view(6, 40)
    dst = torch.full((40, 9), 7.0, dtype=torch.bfloat16, device=DEVICE).t()
    buf = x.contiguous().view(torch.uint8).reshape(-1)
    unpack(buf, [0], [dst], [Box((2, 0), (6, 40))], dtype=torch.float32, backend=backend)
    want = torch.full((9, 40), 7.0, dtype=torch.bfloat16, device=DEVICE)
    want[2:8] = x.to(torch.bfloat16)
    assert_same_bits(dst.contiguous().reshape(-1), want.reshape(-1), want)


def test_mixed_casts_in_one_call() -> None:
    # float32 boxes cast to bfloat16, bfloat16 boxes copied raw: two launches on the triton backend
    a = f32(SPECIAL_F32).view(-1, 1).expand(-1, 3)
    b = torch.arange(10, dtype=torch.int16, device=DEVICE).view(torch.bfloat16)
    boxes = [Box((0, 0), (len(SPECIAL_F32), 3)), Box((2,), (7,)), Box((1, 1), (4, 2))]
    buf = torch.zeros(400, dtype=torch.uint8, device=DEVICE)
    got = pack([a, b, a], boxes, buf.clone(), [5, 300, 321], dtype=torch.bfloat16, backend="triton")
    want = pack_reference([a, b, a], boxes, buf.clone(), [5, 300, 321], dtype=torch.bfloat16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2",
                                                                                              None)) if d], ids=str)
def test_other_casts_use_torch(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    # the kernels fuse float32 <-> bfloat16 / float16 only: other casts need backend="torch" (or None, which
    # falls back to it even when $RESHARD_KERNEL_BACKEND says triton)
    x = f32(SPECIAL_F32)
    box = [Box((0,), (x.numel(),))]
    buf = torch.zeros(x.numel(), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(NotImplementedError, match=r"cannot cast torch.float32 -> torch.float8"):
        pack([x], box, buf, [0], dtype=dtype, backend="triton")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert prepare_pack([x], box, buf, [0], dtype=dtype).backend == "torch"
    pack([x], box, buf, [0], dtype=dtype)
    assert torch.equal(buf, x.to(dtype).view(torch.uint8))


def test_nan_bits_follow_the_contiguous_cast_on_any_layout() -> None:
    # torch's own float32 -> bfloat16 `.to()` gives a NaN other bits strided than contiguous on some processors
    # (0x7FC0 against 0xFFFF with AVX-512) and the same on others; the pack gives the contiguous cast's bits for a
    # strided source wherever this test runs. (If torch made the two agree everywhere, the NaN policy in
    # reshard/kernels/_cast.py could become a constant.)
    x = f32([0x7FC00000] * 64)
    contiguous = bits_of(x.to(torch.bfloat16))[0]
    assert bits_of(pack_cast(x[::2], torch.bfloat16, "torch"))[0] == contiguous
    assert bits_of(pack_cast(x[::2], torch.bfloat16, "triton"))[0] == contiguous
