"""Fingerprints of destination boxes for delta runs: how a receiver finds its box changed since it applied it.

`fingerprint(view, check)` gives a tuple that changes when the bytes of `view` change:

- `"checksum"` (the default of `DeltaSession` and `Refit`): `reshard.kernels.checksum`, a 64-bit hash in which
  every word is hashed non-linearly with its position mixed in. Any change of the bytes (an element changed, two
  elements or rows swapped, any permutation, paired `+1` / `-1` ulp moves anywhere) changes it with probability
  about `1 - 2**-64`. On CPU it is computed with numpy (`reshard.kernels.cpu_checksum`, the same bits as
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

from reshard.kernels import checksum, cpu_checksum

CHECKS = ("checksum", "sum", "none")
"""What `DeltaSession(check=...)` accepts, the default first."""

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
