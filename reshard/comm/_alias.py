"""Memory overlap between one rank's local tensors: a destination may share no byte with a source or another
destination (two sources may share memory: they are only read).

Why: the executor reads sources while it writes destinations, chunk by chunk and in several copies at once; a
destination that aliases a source (`dst = src.view(...)`) is overwritten before every box of it was read, and two
destinations that share bytes are written in an order nobody chose. Either way the result is wrong on every rank,
with no error, so `execute` refuses such tensors before any byte moves.

The test, per pair of tensors on one device:

1. Spans: a tensor with `numel > 0` touches bytes `[data_ptr, data_ptr + ((sizes - 1) . strides + 1) * itemsize)`
   (torch strides are never negative). Disjoint spans cannot overlap: the common case (separate allocations, or
   disjoint slices of one flat buffer) costs one sort of the spans; at most `_MAX_MESSAGES` pairs are named.
2. Runs, within each cluster of intersecting spans: each tensor is a set of contiguous byte runs (its innermost dims
   merged, in stride order). When every tensor of the cluster has at most `EXACT_RUNS` runs, all the runs are
   sorted once and intersected exactly (destination runs among themselves, then source runs against them), so
   interleaved views (the even and odd columns of one matrix) are accepted; otherwise intersecting spans count as
   an overlap (sound, and conservative).

Addresses are compared, not storages, so two storages over one memory (`torch.from_blob`, DLPack) are caught too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from reshard.planner import Plan

EXACT_RUNS = 1 << 16
"""Most contiguous runs per tensor for the exact test (step 2); above it intersecting spans are an overlap."""


_MAX_MESSAGES = 20  # pairs named in full; the rest are counted


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """`[start, end)` byte addresses `t` touches, or None when it touches none (empty, or a meta tensor)."""
    if t.numel() == 0 or t.device.type == "meta":
        return None
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def _runs(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`(starts, run_bytes)`: the byte addresses (`int64`) of `t`'s contiguous runs and their common length."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)  # innermost (smallest stride) first
    run = 1
    while dims and dims[0][0] == run:  # merge the dense inner dims into one run
        run *= dims.pop(0)[1]
    item = t.element_size()
    starts = torch.tensor([t.data_ptr()], dtype=torch.int64)
    for s, n in dims:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * (s * item)).reshape(-1)
    return starts, run * item


def _num_runs(t: torch.Tensor) -> int:
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    run = 1
    while dims and dims[0][0] == run:
        run *= dims.pop(0)[1]
    return math.prod(n for _, n in dims)


def _cluster_pairs(members: list[tuple[str, int, torch.Tensor]]) -> list[tuple[int, int]]:
    """Pairs `(a, b)` of indices into `members` (`(side, index, tensor)`, spans connected) that share a byte, at
    least one a destination. Exact when the members have at most `EXACT_RUNS` runs each; otherwise every pair of
    intersecting spans with a destination counts (conservative)."""
    if any(_num_runs(t) > EXACT_RUNS for _, _, t in members):
        spans = [_span(t) for _, _, t in members]
        return [(a, b) for a in range(len(members)) for b in range(a + 1, len(members))
                if "destination" in (members[a][0], members[b][0])
                and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]]  # type: ignore[index]
    starts, ends, owner, is_dst = [], [], [], []
    for m, (side, _, t) in enumerate(members):
        st, length = _runs(t)
        starts.append(st)
        ends.append(st + length)
        owner.append(torch.full_like(st, m))
        is_dst.append(torch.full(st.shape, side == "destination"))
    start, end, own, dst = (torch.cat(x) for x in (starts, ends, owner, is_dst))
    pairs: set[tuple[int, int]] = set()
    # destination runs against each other: sorted by start, a run overlaps an earlier one iff it starts before the
    # largest end so far (a destination's own runs never overlap: stride-0 destinations are refused earlier)
    d_start, order = start[dst].sort()
    d_end, d_own = end[dst][order], own[dst][order]
    if d_start.numel() > 1:
        best_end, best_at = torch.cummax(d_end, 0)
        hit = torch.nonzero(d_start[1:] < best_end[:-1]).flatten()
        for k in hit.tolist():
            a, b = int(d_own[best_at[k]]), int(d_own[k + 1])
            if a != b:
                pairs.add((min(a, b), max(a, b)))
        if hit.numel():
            return sorted(pairs)  # destinations overlap: the disjointness the next test relies on does not hold
    # source runs against the (now disjoint, so sorted by start and by end) destination runs
    s_start, s_end, s_own = start[~dst], end[~dst], own[~dst]
    if d_start.numel() and s_start.numel():
        # a source run meets the destination runs first..last: those ending after it starts and starting before it ends
        first = torch.searchsorted(d_end, s_start, right=True)
        last = torch.searchsorted(d_start, s_end) - 1
        for k in torch.nonzero(first <= last).flatten().tolist():
            b = int(s_own[k])
            for a in d_own[int(first[k]): int(last[k]) + 1].unique().tolist():
                pairs.add((min(a, b), max(a, b)))
            if len(pairs) > _MAX_MESSAGES:
                break
    return sorted(pairs)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` share a byte (as two destinations; True when too strided to tell exactly)."""
    return bool(_cluster_pairs([("destination", 0, a), ("destination", 1, b)]))


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
    # clusters: runs of spans (one device) each of which intersects the union of the ones before it
    clusters: list[tuple[str, int, list[tuple]]] = []  # (device, end of the union, members)
    for e in spans:
        if clusters and clusters[-1][0] == e[0] and e[1] < clusters[-1][1]:
            dev, end, members = clusters[-1]
            members.append(e)
            clusters[-1] = (dev, max(end, e[2]), members)
        else:
            clusters.append((e[0], e[2], [e]))
    errors = []
    for _, _, members in clusters:
        if len(members) < 2 or all(m[3] == "source" for m in members):
            continue
        for a, b in _cluster_pairs([(m[3], m[4], m[5]) for m in members]):
            (dev, a1, b1, s1, i1, _), (_, a2, b2, s2, i2, _) = sorted(
                [members[a], members[b]], key=lambda e: (e[3] != "destination", e[4]))
            errors.append(
                f"rank {rank}: {s1} local tensor {i1} (tensor {', '.join(names[s1, i1])}) shares memory with {s2} "
                f"local tensor {i2} (tensor {', '.join(names[s2, i2])}) on {dev}: bytes [{a1:#x}, {b1:#x}) and "
                f"[{a2:#x}, {b2:#x}) overlap; a destination must not share memory with a source or another "
                f"destination (pass separate tensors, e.g. `.clone()` the source)")
    if len(errors) > _MAX_MESSAGES:
        more = len(errors) - _MAX_MESSAGES
        errors[_MAX_MESSAGES:] = [f"rank {rank}: and {more} more pairs of local tensors that share memory"]
    return errors
