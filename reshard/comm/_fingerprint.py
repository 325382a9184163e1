"""Fingerprints of destination boxes for delta runs: how a receiver finds its box changed since it applied it.

`fingerprint(view, check)` gives a tuple that changes when the bytes of `view` change:

- `"checksum"` (the default of `DeltaSession` and `Refit`): `reshard.kernels.checksum`, a 64-bit hash in which
  every word is hashed non-linearly with its position mixed in. Any change of the bytes (an element changed, two
  elements or rows swapped, any permutation, paired `+1` / `-1` ulp moves anywhere) changes it with probability
  about `1 - 2**-64`. On CPU it is computed here with numpy, in blocks of `_BLOCK` words (the same bits as
  `reshard.kernels.checksum`, about 5 times faster than its torch form); elsewhere by `checksum` itself.
- `"sum"`: the wrapping 64-bit sums of the box's bytes as 64-bit words (all, and every other one). Several times
  cheaper, but linear and blind to position: it catches a changed element, a reload of other weights, and a
  change of the sum of either word parity class; it misses any change that keeps both sums, such as two words of
  the same parity swapped (rows swapped inside a box), a permutation within each parity class, and `+d` on one
  word with `-d` on another of the same parity (paired ulp moves).
- `"none"`: the empty tuple (versions only).
"""

from __future__ import annotations

import numpy as np
import torch

from reshard.kernels import checksum
from reshard.kernels._checksum import _M1, _M2, CHECKSUM_STEP, INDEX_MULT, LENGTH_MULT, _as_bytes, _pieces

CHECKS = ("checksum", "sum", "none")
"""What `DeltaSession(check=...)` accepts, the default first."""

_BLOCK = 1 << 15  # words hashed per numpy pass: 256 KiB temporaries, in cache
_U64 = (1 << 64) - 1
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_index_table: np.ndarray | None = None


def _u64(v: int) -> np.uint64:
    return np.uint64(v & _U64)


def _table() -> np.ndarray:
    """`(j + 1) * INDEX_MULT` for `j < _BLOCK`, modulo 2**64 (built once)."""
    global _index_table
    if _index_table is None:
        with np.errstate(over="ignore"):
            _index_table = np.arange(1, _BLOCK + 1, dtype=np.uint64) * _u64(INDEX_MULT)
    return _index_table


def _hash_words(words: np.ndarray, first: int) -> int:
    """`sum_i fmix64(w_i ^ ((i + 1) * INDEX_MULT))` modulo 2**64 over `words` (`uint64`), whose first word has
    index `first`: `reshard.kernels.checksum`'s sum, in numpy's wrapping `uint64` arithmetic."""
    table, m1, m2, shift = _table(), _u64(_M1), _u64(_M2), np.uint64(33)
    x = np.empty(min(_BLOCK, words.size), dtype=np.uint64)
    t = np.empty_like(x)
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        for s in range(0, words.size, _BLOCK):
            n = min(_BLOCK, words.size - s)
            xs, ts = x[:n], t[:n]
            np.add(table[:n], _u64((first + s) * INDEX_MULT), out=xs)
            np.bitwise_xor(xs, words[s:s + n], out=xs)
            for m in (m1, m2):
                np.right_shift(xs, shift, out=ts)
                np.bitwise_xor(xs, ts, out=xs)
                np.multiply(xs, m, out=xs)
            np.right_shift(xs, shift, out=ts)
            np.bitwise_xor(xs, ts, out=xs)
            total = total + xs.sum(dtype=np.uint64)
    return int(total)


def cpu_checksum(x: torch.Tensor) -> int:
    """`int(reshard.kernels.checksum(x))` for a CPU tensor `x` (any dtype, shape and strides), computed with numpy.

    The bytes are read in row-major order in slices of at most `CHECKSUM_STEP` bytes, as `checksum` reads them, so
    temporaries stay small whatever the size of `x`.
    """
    total, word, nbytes = 0, 0, 0
    carry = b""
    for piece in _pieces(x, CHECKSUM_STEP):
        b = _as_bytes(piece.detach(), None).numpy()
        nbytes += b.size
        if carry:
            b = np.concatenate([np.frombuffer(carry, dtype=np.uint8), b])
        whole = b.size - b.size % 8
        if whole:
            total += _hash_words(b[:whole].view(np.uint64), word)
            word += whole // 8
        carry = b[whole:].tobytes()
    if carry:
        total += _hash_words(np.frombuffer(carry.ljust(8, b"\0"), dtype=np.uint64), word)
    total = (total & _U64) ^ ((nbytes * LENGTH_MULT) & _U64)
    return total - (1 << 64) if total >> 63 else total


def _cpu_words(view: torch.Tensor) -> np.ndarray | None:
    """`view`'s bytes as int64 words (a numpy view, no copy) for a contiguous CPU box of whole aligned words, or
    None."""
    if (view.device.type != "cpu" or not view.is_contiguous() or (view.numel() * view.element_size()) % 8
            or view.data_ptr() % 8 or not view.numel()):
        return None
    return view.reshape(-1).view(_INTS[view.element_size()]).numpy().view(np.int64)


def _sums(view: torch.Tensor) -> tuple[int, int]:
    words = _cpu_words(view)
    if words is not None:  # numpy's int64 sums, 8 bytes at a time: far faster than widening small ints
        return int(words.sum()), int(words[::2].sum())
    ints = view.view(_INTS[view.element_size()])
    flat = ints.reshape(-1) if ints.is_contiguous() else None
    if flat is not None and flat.numel() * flat.element_size() % 8 == 0 and flat.data_ptr() % 8 == 0:
        w = flat.view(torch.int64)
        return int(w.sum()), int(w[::2].sum())
    return int(ints.sum(dtype=torch.int64)), int(ints.reshape(-1)[::2].sum(dtype=torch.int64))


def fingerprint(view: torch.Tensor, check: str) -> tuple:
    """A fingerprint of `view`'s bytes for `check` (see the module docstring); equal bytes give equal tuples."""
    if check == "none" or view.numel() == 0:
        return ()
    if check == "checksum":
        return (cpu_checksum(view) if view.device.type == "cpu" else int(checksum(view)),)
    if check == "sum":
        return _sums(view)
    raise ValueError(f"delta check must be one of {CHECKS}, got {check!r}")
