"""A 64-bit checksum of a tensor's bytes: position-sensitive, non-linear, the same bits on every device.

`checksum(x)` hashes the bytes of `x` in row-major (logical) order, whatever its strides. The bytes are read as
little-endian 64-bit words `w_0, w_1, ...` (the last word zero-padded), and

    h_i   = fmix64(w_i ^ ((i + 1) * INDEX_MULT))        each word hashed with its index mixed in
    total = sum_i h_i  (mod 2**64)
    sum   = total ^ (nbytes * LENGTH_MULT)              the length told apart from zero padding

where `fmix64` is MurmurHash3's 64-bit finalizer (`x ^= x >>> 33; x *= M1; x ^= x >>> 33; x *= M2; x ^= x >>> 33`,
`>>>` a logical shift), a bijection of 64-bit words in which every input bit flips about half the output bits. As
each word's term is a non-linear function of the word and its position, changes that cancel in a weighted sum
(`+1, -2, +1` on adjacent bytes, two words swapped) change the result with probability about `1 - 2**-64`.

Integer arithmetic only, written so its bits are fixed: `int64` multiplication wraps modulo 2**64 in torch (and in
CUDA, and in Triton); torch's `>>` on `int64` is arithmetic, so the logical shift is a shift and a mask; the sum is
taken over the two 32-bit halves of each `h_i` separately, so the half-sums stay below 2**63 (carries are folded in
explicitly after every `_FOLD_WORDS` words and at the end). Addition modulo 2**64 does not depend on the order of
terms, so any reduction order or slicing gives the same value.

Memory: the bytes are read in slices of at most `step` bytes (default `CHECKSUM_STEP`), each made contiguous and
hashed on its own with the global word index; the temporaries of one slice are a few times `step` bytes, never the
size of `x`. No host synchronization: the result stays on `x`'s device.

There is no Triton kernel for it yet: the torch implementation runs on CPU and CUDA alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

CHECKSUM_STEP = 1 << 22
"""Bytes per slice: bounds the temporaries of one `checksum` call."""

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_FOLD_WORDS = 1 << 30
"""Most words between carry folds: their halves (< 2**32 each) add < 2**62 to a half-sum, which stays < 2**63."""
_MAX_STEP = 1 << 30  # bytes: a slice, even cast to a dtype 8 times as wide, has at most `_FOLD_WORDS` words


def _signed(v: int) -> int:
    """The `int64` with the bits of `v` modulo 2**64."""
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


_M1 = _signed(0xFF51AFD7ED558CCD)  # MurmurHash3 fmix64 multipliers
_M2 = _signed(0xC4CEB9FE1A85EC53)
INDEX_MULT = _signed(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: word indices spread over all 64 bits
LENGTH_MULT = _signed(0xD6E8FEB86659FD93)


def _srl_(x: torch.Tensor, k: int) -> torch.Tensor:
    """`x >>> k` (logical) of `int64` values, as a new tensor."""
    return (x >> k).bitwise_and_((1 << (64 - k)) - 1)


def _fmix64_(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer on `int64` values, in place (multiplications wrap modulo 2**64)."""
    x.bitwise_xor_(_srl_(x, 33))
    x.mul_(_M1)
    x.bitwise_xor_(_srl_(x, 33))
    x.mul_(_M2)
    x.bitwise_xor_(_srl_(x, 33))
    return x


def _pieces(x: torch.Tensor, step: int) -> Iterator[torch.Tensor]:
    """Views of `x` that together hold its elements once, in row-major order, each of at most `step` bytes (or one
    element). A contiguous `x` is sliced flat; otherwise along dim 0, a row at a time when a row exceeds `step`."""
    if x.is_contiguous():
        x = x.view(-1)
    itemsize = x.element_size()
    if x.dim() == 0 or x.numel() * itemsize <= step:
        yield x
        return
    if x.dim() == 1:
        per = max(1, step // itemsize)
        for start in range(0, x.shape[0], per):
            yield x[start:start + per]
        return
    row = x[0].numel() * itemsize
    if row <= step:
        per = step // row
        for start in range(0, x.shape[0], per):
            yield x[start:start + per]
        return
    for r in range(x.shape[0]):
        yield from _pieces(x[r], step)


def _as_bytes(piece: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`piece` (cast to `dtype` if given) as a contiguous 1-D `uint8` tensor whose data is 8-byte aligned."""
    if dtype is not None and piece.dtype != dtype:
        piece = piece.to(dtype)
    flat = piece.contiguous().view(-1)
    if flat.numel() <= 1:
        flat = flat.as_strided((flat.numel(),), (1,))  # contiguous, but may carry any stride `view(uint8)` refuses
    flat = flat.view(torch.uint8)
    return flat if flat.data_ptr() % 8 == 0 else flat.clone()


def _add_words(words: torch.Tensor, first: int, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Add `h_i` of the little-endian words in `words` (`uint8`, length a multiple of 8, aligned), the first having
    index `first`, to the half-sums `lo` / `hi` (0-D `int64`; `_fold` them before they could overflow)."""
    w = words.view(torch.int64)
    x = torch.arange(first + 1, first + 1 + w.numel(), dtype=torch.int64, device=w.device)
    x.mul_(INDEX_MULT).bitwise_xor_(w)
    _fmix64_(x)
    lo.add_(torch.bitwise_and(x, _MASK32).sum())
    hi.add_(_srl_(x, 32).sum())


def _fold(lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Carry `lo`'s high bits into `hi`, and keep both below 2**32 (the sum is modulo 2**64)."""
    hi.add_(lo >> 32).bitwise_and_(_MASK32)
    lo.bitwise_and_(_MASK32)


@torch.no_grad()
def checksum(
    x: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    step: int = CHECKSUM_STEP,
) -> torch.Tensor:
    """The 64-bit checksum of `x`'s bytes in row-major order (formula in the module docstring).

    Args:
        x: any dtype, shape and strides (non-contiguous views hash like their contiguous copy), any device.
        out: optional 0-D `int64` tensor on `x`'s device (e.g. one entry of a buffer of checksums) to write into.
        dtype: hash `x.to(dtype)` instead of `x` (cast one slice at a time, never all of `x` at once).
        step: bytes of `x` per slice (1 to 2**30); the result does not depend on it.

    Returns:
        A 0-D `int64` tensor on `x`'s device (`out` when given). No host synchronization.

    Raises:
        TypeError: `x` not a tensor.
        ValueError: `step` out of range; `out` not a 0-D `int64` tensor on `x`'s device.

    Example:
        >>> a = torch.tensor([1, 2, 3], dtype=torch.uint8)
        >>> int(checksum(a)) == int(checksum(torch.tensor([[1, 2, 3]], dtype=torch.uint8).t()))
        True
        >>> int(checksum(a)) == int(checksum(torch.tensor([1, 3, 2], dtype=torch.uint8)))
        False
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"checksum: x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= _MAX_STEP:
        raise ValueError(f"checksum: step must be an int in [1, 2**30] (bytes per slice), got {step!r}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dim() != 0 or out.dtype != torch.int64
                            or out.device != x.device):
        what = (f"{out.dtype} tensor of shape {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor)
                else type(out).__name__)
        raise ValueError(f"checksum: out must be a 0-D torch.int64 tensor on {x.device}, got {what}")
    device = x.device
    lo = torch.zeros((), dtype=torch.int64, device=device)
    hi = torch.zeros((), dtype=torch.int64, device=device)
    nbytes = 0
    word = 0
    carry: torch.Tensor | None = None  # the < 8 bytes of an unfinished word
    pending = 0  # words added since the last carry fold
    for piece in _pieces(x, step):
        b = _as_bytes(piece, dtype)
        nbytes += b.numel()
        if carry is not None:
            b = torch.cat([carry, b])
        whole = b.numel() - b.numel() % 8
        if whole:
            if pending + whole // 8 > _FOLD_WORDS:
                _fold(lo, hi)
                pending = 0
            pending += whole // 8
            _add_words(b[:whole], word, lo, hi)
            word += whole // 8
        carry = b[whole:].clone() if whole < b.numel() else None
    if carry is not None:
        tail = torch.zeros(8, dtype=torch.uint8, device=device)
        tail[:carry.numel()] = carry
        _add_words(tail, word, lo, hi)
    _fold(lo, hi)
    result = hi.mul_(1 << 32).add_(lo)  # hi * 2**32 wraps into the sign bit; adding lo < 2**32 carries nothing
    result.bitwise_xor_(_signed(nbytes * LENGTH_MULT))
    if out is None:
        return result
    out.copy_(result)
    return out
