"""The delta runs' destination check (`reshard.comm._fingerprint`): the default catches every engine-side change
of a box's bytes that the sums miss (rows swapped, permutations inside a box, paired ulp moves), and its CPU form
has exactly the bits of `reshard.kernels.checksum`.

Each pattern is checked both ways: the default check sees the change, and `check="sum"` does not (the negative
control: the pattern really is one the sums miss, so the test could fail).
"""

from __future__ import annotations

import pytest
import torch

from reshard.comm import DeltaSession
from reshard.comm._fingerprint import CHECKS, fingerprint
from reshard.kernels import checksum, cpu_checksum


def _base(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(64, 48, generator=g).to(dtype)  # a (64, 48) box: 48 bf16 = 12 words per row


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _swap_rows(t: torch.Tensor) -> None:
    """Rows 3 and 5 swapped: each row is a whole number of words, rows 2 apart keep both parity sums."""
    t[[3, 5]] = t[[5, 3]].clone()


def _permute_even_words(t: torch.Tensor) -> None:
    """A random permutation of the even-index 64-bit words of the box (odd ones stay)."""
    w = t.view(-1).view(torch.int64)
    even = w[::2].clone()
    w[::2] = even[torch.randperm(even.numel(), generator=torch.Generator().manual_seed(3))]


def _paired_ulp(t: torch.Tensor) -> None:
    """+1 ulp on one element and -1 ulp on another at the same place of two words of the same parity."""
    per_word = 8 // t.element_size()
    i, j = 5 * per_word, 9 * per_word  # words 5 and 9: both odd, same slot inside the word
    flat = _ints(t.view(-1))
    flat[i] += 1
    flat[j] -= 1


PATTERNS = [("swap-rows", _swap_rows), ("permute-even-words", _permute_even_words), ("paired-ulp", _paired_ulp)]


def test_the_default_check_is_the_hash() -> None:
    assert DeltaSession().check == "checksum" == CHECKS[0]
    import inspect

    from reshard import Refit
    assert inspect.signature(Refit).parameters["delta_check"].default == "checksum"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("name,change", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_the_default_check_sees_what_the_sums_miss(name, change, dtype) -> None:
    box = _base(dtype)
    changed = box.clone()
    change(changed)
    assert not torch.equal(_ints(changed), _ints(box)), "the pattern changed nothing"
    default = DeltaSession().check
    assert fingerprint(changed, default) != fingerprint(box, default), name
    # negative control: the sums really miss this change
    assert fingerprint(changed, "sum") == fingerprint(box, "sum"), name


@pytest.mark.parametrize("name,change", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_the_default_check_sees_the_change_in_a_strided_box(name, change) -> None:
    """The box as a receiver reads it: a column block of a wider destination (non-contiguous)."""
    full = torch.randn(64, 80, generator=torch.Generator().manual_seed(1)).bfloat16()
    view = full[:, 16:64]
    before = fingerprint(view, "checksum")
    block = view.clone()
    change(block)
    view.copy_(block)
    assert fingerprint(view, "checksum") != before, name


@pytest.mark.parametrize("shape,dtype,cut", [
    ((0,), torch.float32, None), ((1,), torch.uint8, None), ((7,), torch.int8, None), ((13, 5), torch.bfloat16, None),
    ((3, 1 << 20), torch.uint8, (slice(None), slice(1, None))),  # rows over the slice size, odd byte offsets
    ((97, 61), torch.float64, (slice(2, 90), slice(3, 59))), ((40, 24), torch.int16, (slice(None), slice(5, 19))),
], ids=["empty", "one-byte", "7-bytes", "bf16-odd", "big-rows", "f64-strided", "i16-strided"])
def test_the_cpu_checksum_has_the_bits_of_kernels_checksum(shape, dtype, cut) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-100, 100, shape, generator=g).to(dtype) if dtype != torch.bfloat16 \
        else torch.randn(shape, generator=g).bfloat16()
    if cut is not None:
        x = x[cut]
    assert cpu_checksum(x) == int(checksum(x))
