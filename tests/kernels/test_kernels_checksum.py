"""`reshard.kernels.checksum`: its bits against a pure-Python oracle, and the corruptions it must catch.

The oracle below computes the documented formula with Python integers (arbitrary precision, reduced modulo 2**64 by
hand), so it checks the torch code's wrap-around, logical shifts and carry folding, not the code against itself.
`_linear_sum` is the position-weighted byte sum `verify=True` used before: the negative control showing which
corruptions a linear checksum lets through.
"""

from __future__ import annotations

import random

import pytest
import torch

from reshard.kernels import CHECKSUM_STEP, checksum

M64 = (1 << 64) - 1


def _fmix(v: int) -> int:
    v ^= v >> 33
    v = (v * 0xFF51AFD7ED558CCD) & M64
    v ^= v >> 33
    v = (v * 0xC4CEB9FE1A85EC53) & M64
    return v ^ (v >> 33)


def _oracle(data: bytes) -> int:
    """The module docstring's formula on `data`, in Python integers; returned as a signed int64 value."""
    padded = data + bytes(-len(data) % 8)
    total = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i: 8 * i + 8], "little")
        total += _fmix(w ^ (((i + 1) * 0x9E3779B97F4A7C15) & M64))
    v = (total & M64) ^ ((len(data) * 0xD6E8FEB86659FD93) & M64)
    return v - (1 << 64) if v >> 63 else v


def _linear_sum(t: torch.Tensor) -> int:
    """The checksum `verify=True` used before: byte `i` (value `v`) adds `v * (i + 1 + 1_000_003)`."""
    flat = t.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    return int((flat * torch.arange(1 + 1_000_003, 1 + 1_000_003 + flat.numel(), dtype=torch.int64)).sum())


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes of `shape` and `dtype` (any bit pattern, NaNs included)."""
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def _h(t: torch.Tensor, **kw) -> int:
    return int(checksum(t, **kw))


# -------------------------------------------------------------------------------------------------------------
# the bits
# -------------------------------------------------------------------------------------------------------------


# 0, 1, 7, 8, 9 bytes: empty, a lone tail, one byte short of a word, one word, a word and a tail; 35 x 3 int16: an
# odd number of bytes over many words; float64 and int32 for other word alignments
@pytest.mark.parametrize("shape, dtype", [
    ((0,), torch.uint8), ((1,), torch.uint8), ((7,), torch.uint8), ((8,), torch.uint8), ((9,), torch.uint8),
    ((35, 3), torch.int16), ((5, 3), torch.float64), ((13,), torch.int32), ((), torch.float32),
])
def test_bits_match_a_python_integer_oracle(shape, dtype) -> None:
    t = _random(shape, dtype, seed=len(shape) * 31 + dtype.itemsize)
    assert _h(t) == _oracle(_bytes_of(t))


def test_hand_worked_values() -> None:
    # 8 zero bytes: the word 0 at index 0 hashes to fmix(INDEX_MULT), then the length 8 is mixed in
    expected = _fmix(0x9E3779B97F4A7C15) ^ ((8 * 0xD6E8FEB86659FD93) & M64)
    assert _h(torch.zeros(8, dtype=torch.uint8)) == expected - (1 << 64) * (expected >> 63)
    # zero padding is told apart from real zeros by the length
    assert _h(torch.tensor([1, 2, 3], dtype=torch.uint8)) != _h(torch.tensor([1, 2, 3, 0], dtype=torch.uint8))
    assert _h(torch.empty(0)) == 0  # no words, length 0


def test_same_bytes_same_hash_across_dtypes() -> None:
    t = _random((6, 10), torch.float32, seed=3)
    assert _h(t) == _h(t.view(torch.uint8)) == _h(t.view(torch.int16))


# -------------------------------------------------------------------------------------------------------------
# corruptions
# -------------------------------------------------------------------------------------------------------------


def _swap_words(b: torch.Tensor) -> None:
    # words 3 and 9 hold equal byte sums but different bytes: a weighted byte sum changes by 8 * (9 - 3) * 0
    word3 = b[24:32].clone()
    b[24:32] = b[72:80]
    b[72:80] = word3


def _plus_minus_plus(b: torch.Tensor) -> None:
    b[101:104] += torch.tensor([1, 254, 1], dtype=torch.uint8)  # +1, -2, +1 (no byte wraps: they are all 100)


def _far_apart(b: torch.Tensor) -> None:
    b[0] += 2
    b[1_000_004] -= 1


@pytest.mark.parametrize("corrupt", [_swap_words, _plus_minus_plus, _far_apart], ids=lambda f: f.__name__)
def test_corruptions_that_a_linear_sum_misses_are_caught(corrupt) -> None:
    # 1,001 x 1,001 bytes: odd, and past byte 1,000,004; every byte 100 so the corruptions do not wrap
    box = torch.full((1001, 1001), 100, dtype=torch.uint8)
    if corrupt is _swap_words:
        box.view(-1)[24:32] = torch.tensor([0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
        box.view(-1)[72:80] = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    bad = box.clone()
    corrupt(bad.view(-1))
    assert not torch.equal(bad, box)
    # the negative control: the old linear checksum does not see these
    assert _linear_sum(bad) == _linear_sum(box)
    assert _h(bad) != _h(box)
    # nor when the box is hashed in slices smaller than it (the executor's step is 4 MiB; here 4 KiB)
    assert _h(bad, step=4096) != _h(box, step=4096)


# odd sizes on purpose: 1 x 1 int8, a prime-length uint8 row, 37 x 11 float32, 13 x 7 x 5 bfloat16, and a transposed
# (non-contiguous) float64 view
_BOXES = [((1, 1), torch.int8, False), ((1009,), torch.uint8, False), ((37, 11), torch.float32, False),
          ((13, 7, 5), torch.bfloat16, False), ((9, 23), torch.float64, True)]


def _box(shape, dtype, transpose, seed):
    t = _random(shape, dtype, seed)
    return t.t() if transpose else t


def test_random_byte_swaps_change_the_hash() -> None:
    rng = random.Random(11)
    for k, (shape, dtype, tr) in enumerate(_BOXES):
        box = _box(shape, dtype, tr, seed=100 + k).contiguous()
        n = box.numel() * box.element_size()
        if n < 2:
            continue
        ref = _h(box)
        flat = box.view(-1).view(torch.uint8)
        for _ in range(100):
            i, j = rng.sample(range(n), 2)
            if flat[i] == flat[j]:
                continue  # swapping equal bytes changes nothing
            bad = flat.clone()
            bad[i], bad[j] = flat[j], flat[i]
            assert _h(bad.view(box.dtype).view(box.shape)) != ref, (shape, dtype, i, j)


def test_a_thousand_random_bit_flips_change_the_hash() -> None:
    rng = random.Random(12)
    boxes = [_box(shape, dtype, tr, seed=200 + k) for k, (shape, dtype, tr) in enumerate(_BOXES)]
    refs = [_h(b) for b in boxes]
    hashes: dict[tuple[int, int, int], int] = {}
    for _ in range(1000):
        k = rng.randrange(len(boxes))
        box = boxes[k]
        bad = box.clone()  # keeps the transposed strides: the flip is at a logical (row-major) byte
        logical = bad.contiguous()
        n = logical.numel() * logical.element_size()
        i, bit = rng.randrange(n), rng.randrange(8)
        logical.view(-1).view(torch.uint8)[i] ^= 1 << bit
        bad.copy_(logical)
        h = _h(bad)
        assert h != refs[k], (k, i, bit)
        hashes[k, i, bit] = h
    # distinct flips give distinct hashes, none equal to an intact box's (the 1 x 1 box has only 8 flips to draw)
    assert len(set(hashes.values()) | set(refs)) == len(hashes) + len(refs)


# -------------------------------------------------------------------------------------------------------------
# strides and slices
# -------------------------------------------------------------------------------------------------------------


def _views() -> list[tuple[str, torch.Tensor]]:
    base = _random((12, 10, 6), torch.float32, seed=5)
    return [
        ("transposed", base.transpose(0, 2)),
        ("every third column", base[:, ::3]),
        ("offset box", base[3:9, 2:7, 1:4]),
        ("stride 0 (expanded)", base[0, 0, :1].expand(7, 5)),
        ("one element of a strided view", base[:, ::3][4:5, 2:3, 1:2]),
        ("uint8 columns, odd byte count", _random((21, 9), torch.uint8, seed=6)[:, 1:8:2]),
        ("bool", (_random((5, 7), torch.uint8, seed=7) > 128).t()),
        ("0-d", base[1, 2, 3]),
        ("empty", base[:, 4:4]),
    ]


@pytest.mark.parametrize("name, view", _views(), ids=[n for n, _ in _views()])
def test_strided_views_hash_like_their_contiguous_copy(name, view) -> None:
    copy = view.contiguous()
    assert _h(view) == _h(copy) == _oracle(_bytes_of(copy))


@pytest.mark.parametrize("step", [1, 3, 8, 13, 64, 1000])
def test_slices_give_the_same_hash_as_one_pass(step) -> None:
    for name, view in _views() + [("big odd uint8", _random((1013,), torch.uint8, seed=8)),
                                  ("rows over the step", _random((3, 2, 301), torch.int16, seed=9)[:, :, 1:])]:
        assert _h(view, step=step) == _h(view), (name, step)
    assert CHECKSUM_STEP >= 1 << 20  # the default hashes a typical box in one pass


def test_carry_folds_between_slices_keep_the_bits(monkeypatch) -> None:
    # a fold happens every 2**30 words (8 GiB) by default; fold every 3 words to exercise it on a small box
    import reshard.kernels._checksum as ck

    t = _random((1013,), torch.uint8, seed=14)
    monkeypatch.setattr(ck, "_FOLD_WORDS", 3)
    assert _h(t, step=24) == _h(t, step=16) == _oracle(_bytes_of(t))


def test_dtype_hashes_the_cast_slice_by_slice() -> None:
    x = torch.randn(37, 11).t()
    assert _h(x, dtype=torch.bfloat16, step=40) == _h(x.to(torch.bfloat16))
    assert _h(x, dtype=torch.bfloat16) != _h(x)


def test_out_and_bad_arguments() -> None:
    buf = torch.zeros(3, dtype=torch.int64)
    x = _random((5, 5), torch.int8, seed=10)
    assert checksum(x, out=buf[1]) is not None and int(buf[1]) == _h(x) and int(buf[0]) == int(buf[2]) == 0
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        checksum([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"step must be an int in \[1, 2\*\*30\]"):
        checksum(x, step=0)
    with pytest.raises(ValueError, match="got True"):
        checksum(x, step=True)
    with pytest.raises(ValueError, match="out must be a 0-D torch.int64 tensor on cpu, got torch.int32"):
        checksum(x, out=torch.zeros((), dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the GPU bits are compared to CPU's")
def test_cuda_gives_the_same_bits_as_cpu() -> None:
    for name, view in _views():
        assert _h(view.cuda(), step=64) == _h(view), name
    big = _random((3, 1 << 20), torch.bfloat16, seed=13)
    assert _h(big.cuda().t()) == _h(big.t())
