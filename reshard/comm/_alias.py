"""Memory overlap between one rank's local tensors: a destination may share no byte with a source or another
destination (two sources may share memory: they are only read).

Why: the executor reads sources while it writes destinations, chunk by chunk and in several copies at once; a
destination that aliases a source (`dst = src.view(...)`) is overwritten before every box of it was read, and two
destinations that share bytes are written in an order nobody chose. Either way the result is wrong on every rank,
with no error, so `execute` refuses such tensors before any byte moves.

The test, per pair of tensors on one device:

1. Spans: a tensor with `numel > 0` touches bytes `[data_ptr, data_ptr + ((sizes - 1) . strides + 1) * itemsize)`
   (torch strides are never negative). Disjoint spans cannot overlap: the common case (separate allocations, or
   disjoint slices of one flat buffer) costs one sort of the spans.
2. Runs, where spans intersect: each tensor is a set of contiguous byte runs (its innermost dims merged, in stride
   order). When both have at most `EXACT_RUNS` runs, the runs are intersected exactly, so interleaved views (the even
   and odd columns of one matrix) are accepted; above that, intersecting spans count as an overlap (sound, and
   conservative).

Addresses are compared, not storages, so two storages over one memory (`torch.from_blob`, DLPack) are caught too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from reshard.planner import Plan

EXACT_RUNS = 1 << 16
"""Most contiguous runs per tensor for the exact test (step 2); above it intersecting spans are an overlap."""


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """`[start, end)` byte addresses `t` touches, or None when it touches none (empty, or a meta tensor)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def _runs(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """`(starts, run_bytes)`: the byte addresses (`int64`, sorted) of `t`'s contiguous runs and their common length,
    or None when `t` has more than `EXACT_RUNS` runs."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)  # innermost (smallest stride) first
    run = 1
    while dims and dims[0][0] == run:  # merge the dense inner dims into one run
        run *= dims.pop(0)[1]
    if math.prod(n for _, n in dims) > EXACT_RUNS:
        return None
    item = t.element_size()
    starts = torch.tensor([t.data_ptr()], dtype=torch.int64)
    for s, n in dims:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * (s * item)).reshape(-1)
    return starts.sort().values, run * item


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b`, whose spans intersect, share a byte (True when too strided to tell exactly)."""
    ra, rb = _runs(a), _runs(b)
    if ra is None or rb is None:
        return True
    (sa, la), (sb, lb) = ra, rb
    # a run of b at [x, x + lb) meets a run of a iff some a-run starts before x + lb and ends after x; a's runs all
    # have length la, so the last a-run starting before x + lb has the largest end among them
    last = torch.searchsorted(sa, sb + lb, right=False) - 1
    ok = last >= 0
    return bool((sa[last.clamp(min=0)] + la > sb)[ok].any())


def overlap_errors(plan: Plan, rank: int, src: Sequence[torch.Tensor | None] | None,
                   dst: Sequence[torch.Tensor | None] | None) -> list[str]:
    """Messages, one per pair, for each destination local tensor of `rank` that shares memory with one of its source
    local tensors or with another destination local tensor; `[]` when none does.

    Only the tensors `plan` uses on `rank` are looked at, and only those that are tensors (other defects are
    `_check_tensors`' to report). The same index used by several items is one tensor, not an overlap.
    """
    names: dict[tuple[str, int], list[str]] = {}
    for i, item in enumerate(plan.items):
        for side, layout, idx in (("source", item.src, item.src_tensor), ("destination", item.dst, item.dst_tensor)):
            if rank in layout.ranks:
                names.setdefault((side, idx), []).append(f"{item.label!r} (item {i})")
    spans = []
    for side, idx in names:
        tensors = src if side == "source" else dst
        t = tensors[idx] if tensors is not None and 0 <= idx < len(tensors) else None
        span = _span(t) if isinstance(t, torch.Tensor) else None
        if span is not None:
            spans.append((str(t.device), span[0], span[1], side, idx, t))
    spans.sort(key=lambda e: (e[0], e[1]))
    errors = []
    for k, (dev, start, end, side, idx, t) in enumerate(spans):
        for dev2, start2, end2, side2, idx2, t2 in spans[k + 1:]:
            if dev2 != dev or start2 >= end:
                break
            if side == side2 == "source" or not _overlap(t, t2):
                continue
            (s1, i1, a1, b1), (s2, i2, a2, b2) = sorted([(side, idx, start, end), (side2, idx2, start2, end2)],
                                                        key=lambda e: (e[0] != "destination", e[1]))
            errors.append(
                f"rank {rank}: {s1} local tensor {i1} (tensor {', '.join(names[s1, i1])}) shares memory with {s2} "
                f"local tensor {i2} (tensor {', '.join(names[s2, i2])}) on {dev}: bytes [{a1:#x}, {b1:#x}) and "
                f"[{a2:#x}, {b2:#x}) overlap; a destination must not share memory with a source or another "
                f"destination (pass separate tensors, e.g. `.clone()` the source)")
    return errors
