"""Chunk assignment (`reshard.planner._chunks._assign_chunks`) against a slow, direct statement of its rule.

The planner finds each transfer's chunk with per-rank bit sets (so a whole-model plan of ~1M transfers places in
about a second); here the same first-fit rule is written as plainly as possible, chunk by chunk, and the two must
agree on every transfer. Random plans reach thousands of chunks, so the bit sets grow.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.planner._chunks import _CHUNK_GROW, RELAY_CHUNK_LAG, _assign_chunks, _Columns
from reshard.planner._types import LINKS

LOCAL, NVLINK, NETWORK = (LINKS.index(k) for k in ("local", "nvlink", "network"))


def reference_chunks(src, dst, nbytes, link, dep, cap: int, *, skip_runs: bool = False) -> list[int]:
    """The rule, spelled out: stage 0 (no dependency) then stage 1; within a stage, largest first, then plan order.
    Each transfer takes the first chunk >= its earliest (arrival + lag for a forward) that is open on both ends and
    where both ends have room (an empty chunk always has room). A chunk closes for a rank when the transfer does not
    fit there, or when, after placing, another of the same size would not fit. Local copies take no room.

    The search steps one chunk at a time; with `skip_runs` (for plans of thousands of chunks) it jumps over runs of
    chunks closed for a rank through per-rank pointers instead (`skip[r, k]`: every chunk in `[k, skip[r, k])` is
    closed for `r`; chunks never reopen, so a pointer stays true). The property test checks both searches agree."""
    n = len(src)
    chunks = [0] * n
    used: dict[tuple[int, int], int] = defaultdict(int)
    closed: set[tuple[int, int]] = set()
    skip: dict[tuple[int, int], int] = {}

    def open_from(r: int, c: int) -> int:
        """The first chunk >= c open for rank r."""
        passed = []
        while (r, c) in closed:
            passed.append(c)
            c = skip.get((r, c), c + 1)
        for k in passed:
            skip[r, k] = c
        return c

    for stage in (0, 1):
        idx = [i for i in range(n) if (dep[i] >= 0) == bool(stage)]
        idx.sort(key=lambda i: (-nbytes[i], i))
        for i in idx:
            earliest = chunks[dep[i]] + RELAY_CHUNK_LAG if dep[i] >= 0 else 0
            if link[i] == LOCAL:
                chunks[i] = earliest
                continue
            s, d, b = src[i], dst[i], nbytes[i]
            c = earliest
            while True:
                if skip_runs:
                    c = open_from(d, open_from(s, c))
                    if (s, c) in closed:
                        continue
                elif (s, c) in closed or (d, c) in closed:
                    c += 1
                    continue
                fit_s = used[s, c] == 0 or used[s, c] + b <= cap
                fit_d = used[d, c] == 0 or used[d, c] + b <= cap
                if fit_s and fit_d:
                    break
                if not fit_s:
                    closed.add((s, c))
                if not fit_d:
                    closed.add((d, c))
            used[s, c] += b
            used[d, c] += b
            for r in (s, d):
                if used[r, c] + b > cap:
                    closed.add((r, c))
            chunks[i] = c
    return chunks


@st.composite
def transfers(draw: st.DrawFn) -> tuple[list, list, list, list, list, int]:
    """Hypothesis draws the sizes (ranks, chunk budget, how many arrivals and forwards) and a seed; the transfers
    themselves come from the seed (drawing ~400 transfers of five fields one value at a time cost seconds per test).
    Box sizes include 0 and run past a chunk (single elements larger than the budget)."""
    num_ranks = draw(st.integers(2, 12))
    cap = draw(st.integers(1, 64))
    n0 = draw(st.integers(1, 200))
    n1 = draw(st.integers(0, 200))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ranks = rng.choice(5001, num_ranks, replace=False)
    src = ranks[rng.integers(0, num_ranks, n0 + n1)]
    dst = ranks[rng.integers(0, num_ranks, n0 + n1)]
    link = np.where(src == dst, LOCAL, rng.choice([NVLINK, NETWORK], n0 + n1))
    nbytes = rng.integers(0, cap + 9, n0 + n1)
    dep = np.concatenate([np.full(n0, -1), rng.integers(0, n0, n1)])
    return src.tolist(), dst.tolist(), nbytes.tolist(), link.tolist(), dep.tolist(), cap


def columns(src, dst, nbytes, link, dep) -> _Columns:
    return _Columns.make(*(np.asarray(x, dtype=np.int64) for x in (src, dst, nbytes)),
                         np.asarray(link, dtype=np.int8), np.asarray(dep, dtype=np.int64), np.ones(len(src), np.int64))


@settings(max_examples=200, deadline=None)
@given(transfers())
def test_bit_set_first_fit_equals_the_plain_rule(case) -> None:
    src, dst, nbytes, link, dep, cap = case
    got = _assign_chunks(columns(src, dst, nbytes, link, dep), cap).tolist()
    assert got == reference_chunks(src, dst, nbytes, link, dep, cap)
    assert got == reference_chunks(src, dst, nbytes, link, dep, cap, skip_runs=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_thousands_of_chunks_keep_budget_and_relay_lag(seed: int) -> None:
    """Enough transfers that the open-chunk bit sets grow past their first allocation."""
    rng = np.random.default_rng(seed)
    n0, n1, cap = 3000, 6000, 100
    src = rng.integers(0, 6, n0 + n1)
    dst = (src + rng.integers(1, 6, n0 + n1)) % 6  # never equal: no local copies
    nbytes = rng.choice([10, 45, 60, 100], n0 + n1)
    dep = np.concatenate([np.full(n0, -1), rng.integers(0, n0, n1)])
    link = np.full(n0 + n1, NVLINK)
    cols = columns(src, dst, nbytes, link, dep)
    chunks = _assign_chunks(cols, cap)
    assert chunks.max() > _CHUNK_GROW + 100  # grown at least once
    fwd = dep >= 0
    assert (chunks[fwd] >= chunks[dep[fwd]] + RELAY_CHUNK_LAG).all()
    load: dict[tuple[int, int], int] = defaultdict(int)
    for s, d, b, c in zip(src.tolist(), dst.tolist(), nbytes.tolist(), chunks.tolist()):
        load[s, c] += b
        load[d, c] += b
    assert max(load.values()) <= cap
    assert chunks.tolist() == reference_chunks(src.tolist(), dst.tolist(), nbytes.tolist(), link.tolist(),
                                               dep.tolist(), cap, skip_runs=True)


def test_forward_past_the_allocated_chunks() -> None:
    """Arrivals fill every allocated chunk but one, so a forward's earliest chunk lies past the allocation: the bit
    sets grow before the search and the forward still takes its earliest chunk."""
    n0 = _CHUNK_GROW - 1
    src = [0] * n0 + [1]
    dst = [1] * n0 + [0]
    nbytes = [1] * (n0 + 1)
    link = [NVLINK] * (n0 + 1)
    dep = [-1] * n0 + [n0 - 1]
    chunks = _assign_chunks(columns(src, dst, nbytes, link, dep), 1).tolist()
    assert chunks[:n0] == list(range(n0))
    assert chunks[n0] == n0 - 1 + RELAY_CHUNK_LAG
    assert chunks == reference_chunks(src, dst, nbytes, link, dep, 1)


def test_message_count_past_65536_chunks() -> None:
    """One element per chunk between two ranks: every transfer is its own message, however many chunks there are
    (a message key packing chunk and ranks into one int64 must not overflow)."""
    import torch

    from reshard import Layout, Mesh, Replicate, plan

    n = 70_000
    src = Layout((n,), Mesh([0]), [Replicate()], torch.float32)
    dst = Layout((n,), Mesh([1]), [Replicate()], torch.float32)
    p = plan(src, dst, staging_bytes=8)
    assert p.stats.num_chunks == n
    assert p.stats.messages == p.stats.num_transfers == n
    assert p.stats.per_rank[0].messages_sent == p.stats.per_rank[1].messages_received == n


@pytest.mark.parametrize("a_max", [10, 1 << 50])  # the packed int64 key, and the lexsort fallback past it
def test_unique_triples_against_a_set(a_max: int) -> None:
    from reshard.planner._chunks import _unique_triples

    rng = np.random.default_rng(a_max % 97)
    a = rng.integers(0, a_max, 5000)
    a[::7] = a_max - 1
    b, c = rng.integers(0, 40, 5000), rng.integers(0, 30, 5000)
    got = list(zip(*(x.tolist() for x in _unique_triples(a, b, c, 40, 30))))
    assert len(got) == len(set(got)) == len(set(zip(a.tolist(), b.tolist(), c.tolist())))
