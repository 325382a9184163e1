"""Host side of the casts fused into the Triton kernels: which casts exist, and the NaN bit patterns they produce.

The kernels round float32 to bfloat16 / float16 with integer arithmetic on the bit patterns (see `_triton.py`), so
finite values, infinities, subnormals and overflow follow IEEE round-to-nearest-even exactly, on every device and
under the interpreter. NaN is different: IEEE leaves the bits of a converted NaN open, and torch's `.to(dtype)`
differs by device and even by code path. Measured with torch 2.13 on an AVX-512 CPU: a contiguous float32 -> bfloat16
`.to()` gives `0xFFFF` for every NaN, a strided one gives `0x7FC0`; float32 -> float16 keeps the sign and the top
payload bits and sets the quiet bit (`sign | 0x7E00 | mantissa >> 13`). CUDA gives `0x7FFF` for both.

So the kernels take their NaN output as three runtime integers, fitted once per (cast, device type) from what
torch's contiguous `.to()` returns for a set of probe NaNs:

    nan_out = (sign_bits & sign_mask) | base | ((mantissa shifted to the output's width) & payload_mask)

The quiet bit is either forced into `base` or carried with the payload. The fit is checked against every probe.
The torch reference casts only contiguous tensors, so it produces the same bits as the kernels.
"""

from __future__ import annotations

import enum
import functools
import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)


class Cast(enum.IntEnum):
    """Casts the Triton kernels fuse; the values are the kernels' `CAST` constexpr."""

    NONE = 0
    F32_TO_BF16 = 1
    F32_TO_F16 = 2
    BF16_TO_F32 = 3
    F16_TO_F32 = 4


_CASTS: dict[tuple[torch.dtype, torch.dtype], Cast] = {
    (torch.float32, torch.bfloat16): Cast.F32_TO_BF16,
    (torch.float32, torch.float16): Cast.F32_TO_F16,
    (torch.bfloat16, torch.float32): Cast.BF16_TO_F32,
    (torch.float16, torch.float32): Cast.F16_TO_F32,
}

SUPPORTED_CASTS = tuple(f"{a} -> {b}" for a, b in _CASTS)


def cast_code(src: torch.dtype, dst: torch.dtype) -> Cast | None:
    """The kernel cast for `src -> dst`: `Cast.NONE` when equal, `None` when the kernels cannot fuse it."""
    if src == dst:
        return Cast.NONE
    return _CASTS.get((src, dst))


# Probe NaNs (bit patterns of the source dtype): quiet and signalling, both signs, with and without payload.
_PROBES_F32 = [0x7FC00000, 0xFFC00000, 0x7FC12345, 0xFF812345, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
               0x7FA00000, 0x7F80FFFF, 0x7FFFE000]
_PROBES_BF16 = [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFD3]
_PROBES_F16 = [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7FFF, 0xFFFF, 0x7D55, 0xFEAA]

# (source bits, result bits, source mantissa mask, mantissa shift to the result, result mantissa mask, the source's
# default quiet NaN, probes)
_GEOMETRY = {
    Cast.F32_TO_BF16: (32, 16, 0x7FFFFF, -16, 0x7F, 0x7FC00000, _PROBES_F32),
    Cast.F32_TO_F16: (32, 16, 0x7FFFFF, -13, 0x3FF, 0x7FC00000, _PROBES_F32),
    Cast.BF16_TO_F32: (16, 32, 0x7F, 16, 0x7FFFFF, 0x7FC0, _PROBES_BF16),
    Cast.F16_TO_F32: (16, 32, 0x3FF, 13, 0x7FFFFF, 0x7E00, _PROBES_F16),
}

GEOMETRY_BITS: dict[Cast, tuple[int, int]] = {cast: g[:2] for cast, g in _GEOMETRY.items()}
"""`(source bits, result bits)` of each fused cast."""


def _to_signed(value: int, bits: int) -> int:
    """Two's-complement reinterpretation, so masks like `0x80000000` fit an int32 kernel argument."""
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def _torch_nan_bits(cast: Cast, device: torch.device, probes: list[int]) -> list[int]:
    src_bits, dst_bits = _GEOMETRY[cast][:2]
    src_dtype, dst_dtype = next(k for k, v in _CASTS.items() if v == cast)
    np_int = {16: (np.uint16, np.int16), 32: (np.uint32, np.int32)}
    raw = np.array(probes, dtype=np_int[src_bits][0]).view(np_int[src_bits][1])
    src = torch.from_numpy(raw).to(device).view(src_dtype)
    out = src.to(dst_dtype).view({16: torch.int16, 32: torch.int32}[dst_bits]).cpu().numpy()
    return [int(v) for v in out.view(np_int[dst_bits][0])]


@functools.cache
def nan_policy(cast: Cast, device_type: str) -> tuple[int, int, int]:
    """`(sign_mask, base, payload_mask)` that reproduce torch's NaN bits for `cast` on `device_type`.

    Returns signed int32 values, ready to pass to the kernels. `Cast.NONE` returns zeros.

    Raises:
        NotImplementedError: torch's NaN bits on this device follow no rule of the form in the module docstring.
    """
    if cast == Cast.NONE:
        return 0, 0, 0
    src_bits, dst_bits, src_mant_mask, shift, mant_mask, quiet, probes = _GEOMETRY[cast]
    got = _torch_nan_bits(cast, torch.device(device_type), probes)
    src_sign, dst_sign = 1 << (src_bits - 1), 1 << (dst_bits - 1)
    by_probe = dict(zip(probes, got))
    sign_mask = dst_sign if (by_probe[quiet] ^ by_probe[quiet | src_sign]) & dst_sign else 0

    def payload_of(bits: int, payload_mask: int) -> int:
        mant = bits & src_mant_mask
        return (mant << shift if shift > 0 else mant >> -shift) & payload_mask

    def predict(bits: int, base: int, payload_mask: int) -> int:
        sign = dst_sign if bits & src_sign else 0
        return (sign & sign_mask) | base | payload_of(bits, payload_mask)

    # Either a constant NaN, or the payload carried over; the quiet bit is either forced (hardware that quiets
    # signalling NaNs) or carried with the payload (a plain shift, as bfloat16 -> float32 is).
    for payload_mask in (0, mant_mask):
        for base in (by_probe[quiet] & ~sign_mask, by_probe[quiet] & ~sign_mask & ~payload_of(quiet, payload_mask)):
            if all(predict(p, base, payload_mask) == g for p, g in zip(probes, got)):
                logger.debug("NaN policy for %s on %s: sign_mask=%#x base=%#x payload_mask=%#x", cast.name,
                             device_type, sign_mask, base, payload_mask)
                return _to_signed(sign_mask, 32), _to_signed(base, 32), _to_signed(payload_mask, 32)
    raise NotImplementedError(
        f"torch's NaN bits for {cast.name} on {device_type} follow no rule the kernels implement: probes "
        f"{[hex(p) for p in probes]} gave {[hex(g) for g in got]}; use backend='torch' for this cast")
