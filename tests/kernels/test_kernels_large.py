"""pack / unpack past 2**31 elements: int64 offsets in the tables and in the kernels' address arithmetic.

One 2 GiB + 1 MiB `uint8` arena holds a `(2**16 + 3, 2**15 + 1)` tensor (2**31 + 163,843 elements) and, past its
end, a packed region. 1-byte elements make element offsets equal byte offsets, so every offset that crosses 2**31
really is past 2**31 elements. Skipped, with the reason, where the memory is not there.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from reshard.kernels import pack, unpack
from reshard.planner._box import Box
from reshard.testing import device_under_test

DEVICE = device_under_test()
ON_GPU = DEVICE.type == "cuda"

ROWS, COLS = 2**16 + 3, 2**15 + 1  # odd row length: no dims merge and no word wider than a byte fits
NUMEL = ROWS * COLS
ARENA = 2**31 + 2**20
TAIL = 2**31 + 2**19  # a byte offset past the tensor, inside the arena
GiB = 2**30


def available_bytes() -> int:
    if ON_GPU:
        return torch.cuda.mem_get_info(DEVICE)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


def need(nbytes: int) -> None:
    have = available_bytes()
    if have < nbytes:
        pytest.skip(f"needs {nbytes / GiB:.1f} GiB free on {DEVICE.type}, has {have / GiB:.1f} GiB")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`torch.equal` for two `uint8` tensors of one shape; two contiguous CPU tensors are compared with `memcmp`
    (`torch.equal` reads 4 GiB of bytes at ~2 GB/s on CPU, `memcmp` at memory speed: ~2 s -> ~0.25 s here)."""
    assert a.dtype == b.dtype == torch.uint8 and a.shape == b.shape
    if a.device.type == "cpu" and b.device.type == "cpu" and a.is_contiguous() and b.is_contiguous():
        libc = ctypes.CDLL(None)
        libc.memcmp.restype = ctypes.c_int
        libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        return libc.memcmp(a.data_ptr(), b.data_ptr(), a.numel()) == 0
    return torch.equal(a, b)


@pytest.fixture(scope="module")
def arena() -> torch.Tensor:
    need(3 * GiB)
    # a prime period, so a wrong offset reads different bytes
    period = torch.randint(0, 256, (65521,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return period.to(DEVICE).repeat(ARENA // 65521 + 1)[:ARENA]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_offsets_past_2_31(arena: torch.Tensor, backend: str) -> None:
    # a strided box whose rows straddle element 2**31, packed to byte offset 2**31 + 2**19 of a 2 GiB buffer, then
    # unpacked into rows past 2**31; only a few hundred elements move, so the interpreter handles it too
    t = arena[:NUMEL].view(ROWS, COLS)
    box = Box((2**16 - 5, 100), (7, 37))
    assert (box.offsets[0] * COLS < 2**31 < (box.stops[0] - 1) * COLS)
    before = arena[TAIL - 64: TAIL + 64 + box.numel].clone()
    pack(t, [box], arena, [TAIL], backend=backend)
    packed = arena[TAIL: TAIL + box.numel]
    assert torch.equal(packed, t[box.slices()].reshape(-1))
    assert torch.equal(arena[TAIL - 64: TAIL], before[:64])
    assert torch.equal(arena[TAIL + box.numel: TAIL + box.numel + 64], before[64 + box.numel:])

    dst = Box((2**16 - 1, 5), (3, 37))  # rows 65535..65537 straddle element 2**31 too
    region = t[dst.offsets[0] - 1: dst.stops[0] + 1]
    want = region.clone()
    want[1:-1, 5:42] = packed[: dst.numel].view(3, 37)
    unpack(arena, [TAIL], t, [dst], backend=backend)
    assert torch.equal(region, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_box_of_more_than_2_31_elements(arena: torch.Tensor, backend: str) -> None:
    # one box of 2**31 + 163,843 elements, packed and unpacked whole
    if backend == "triton" and not ON_GPU:
        pytest.skip("Triton's interpreter would run about 65,000 programs of 65,536 lanes (tens of minutes); "
                    "test_offsets_past_2_31 covers offsets past 2**31 under it, and perf/gpu_check.sh runs this on a "
                    "GPU")
    need(3 * GiB)
    t = arena[:NUMEL].view(ROWS, COLS)
    box = Box((0, 0), (ROWS, COLS))
    buf = torch.empty(NUMEL + 5, dtype=torch.uint8, device=DEVICE)
    torch.bitwise_not(arena[:NUMEL], out=buf[5:])  # every byte differs from what pack must write there
    pack(t, [box], buf, [5], backend=backend)
    assert same_bytes(buf[5:], arena[:NUMEL])
    saved = (t[0].clone(), t[-1].clone())
    t[0].zero_()
    t[-1].zero_()
    unpack(buf, [5], t, [box], backend=backend)
    assert torch.equal(t[0], saved[0]) and torch.equal(t[-1], saved[1])
