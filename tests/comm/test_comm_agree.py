"""The agreement round (`reshard.comm._handshake.agree`) over its binomial tree: the tree's shape, then on 8 gloo
ranks (indices 0-7: rank 0 the root with children 1, 2 and 4; 4 with children 5 and 6; 6 with child 7, the deepest)
verdicts that depend on ranks deep in the tree, a summary naming ranks outside its sender's subtree, and a rank that
never joins.

Functions named `on_rank_*` run on the ranks of the shared pool (see `reshard.testing.RankPool`).
"""

from __future__ import annotations

import datetime
import time

import pytest
from comm_cases import expect_all_raise

from reshard.comm._handshake import _tree

pytestmark = pytest.mark.distributed

RANK_POOL = 8  # the `pool` fixture's ranks (tests/conftest.py)


@pytest.mark.parametrize("n", list(range(1, 41)) + [257, 1000])
def test_tree_is_a_spanning_tree_of_contiguous_subtrees_and_log_depth(n: int) -> None:
    ranks = [3 * i + 1 for i in range(n)]  # any sorted, distinct ranks
    parent: dict[int, int | None] = {}
    for i, r in enumerate(ranks):
        p, children, first, end = _tree(ranks, r)
        assert first == i and ranks[first:end][0] == r
        parent[r] = p
        if p is None:
            assert i == 0 and end == n
        else:
            pp, _, pfirst, pend = _tree(ranks, p)
            assert pfirst < first and end <= pend, "a subtree lies inside its parent's"
            assert r in _tree(ranks, p)[1]
        # the children's subtrees split this subtree (less this rank) into contiguous runs, in order
        at = first + 1
        for c in children:
            _, _, cfirst, cend = _tree(ranks, c)
            assert cfirst == at
            at = cend
        assert at == end
        assert len(children) <= max(n - 1, 1).bit_length()
    depth = 0
    for r in ranks:
        d, q = 0, r
        while parent[q] is not None:
            q, d = parent[q], d + 1
        depth = max(depth, d)
    assert depth <= max(n - 1, 1).bit_length()


def _agree(w, fingerprint: str, errors: list[str], timeout: float = 30.0, tag: str = "agree"):
    from reshard.comm._handshake import agree

    group = w.scratch.get(tag)
    if group is None:
        group = w.scratch[tag] = w.new_group(tag, timeout=60)
    agree(group, list(range(w.world_size)), fingerprint, errors,
          lambda: [("layouts", f"layouts of rank {w.rank}" if fingerprint != "f" * 32 else "same"),
                   ("staging_bytes", "1024")],
          timeout=datetime.timedelta(seconds=timeout), what="test agreement")
    return "agreed"


def on_rank_agree(w, differ: list[int], erring: list[int]) -> str:
    fp = "e" * 32 if w.rank in differ else "f" * 32
    return _agree(w, fp, [f"rank {w.rank}: its input is bad"] if w.rank in erring else [])


def test_all_agree_then_deep_differences_and_errors_reach_every_rank(pool) -> None:
    assert pool.run_ok(on_rank_agree, [], []) == ["agreed"] * 8
    # rank 7 (the deepest leaf) and rank 5 hold another plan: every rank raises the root's verdict, which names
    # both fingerprints with their ranks and what differs on the first differing ranks
    outs = pool.run(on_rank_agree, [5, 7], [])
    expect_all_raise(outs, "ValueError", "ranks hold different plans", "ffffffffffff on ranks [0, 1, 2, 3, 4, 6]",
                     "eeeeeeeeeeee on ranks [5, 7]", "rank 0 has same, rank 5 has layouts of rank 5",
                     "rank 0 has same, rank 7 has layouts of rank 7")
    assert len({o.error for o in outs}) == 1
    # errors on ranks 6 and 7 (an inner rank and its leaf) travel up as one summary
    outs = pool.run(on_rank_agree, [], [6, 7])
    expect_all_raise(outs, "ValueError", "2 error(s) on rank(s) [6, 7]", "rank 6: its input is bad",
                     "rank 7: its input is bad")
    # and the round still works after refusals
    assert pool.run_ok(on_rank_agree, [], []) == ["agreed"] * 8


@pytest.mark.parametrize("differ, shown, more", [
    ([4], [4], None),  # a child of the root that forwards for ranks 5-7, describing itself
    ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4], "... and 2 more ranks differ from rank 0"),
], ids=["inner-child", "more-than-shown"])
def test_differing_inner_ranks_and_more_than_shown(pool, differ, shown, more) -> None:
    outs = pool.run(on_rank_agree, differ, [])
    same = [r for r in range(8) if r not in differ]
    expect_all_raise(outs, "ValueError", f"ffffffffffff on ranks {same}", f"eeeeeeeeeeee on ranks {differ}",
                     *[f"rank 0 has same, rank {r} has layouts of rank {r}" for r in shown], *([more] if more else []))
    assert len({o.error for o in outs}) == 1
    if more:
        assert "rank 5 has layouts" not in outs[0].error  # only the first differing ranks are described
    assert pool.run_ok(on_rank_agree, [], []) == ["agreed"] * 8


def on_rank_forges(w, forger: int, summary: dict, tag: str) -> str:
    """Rank `forger` sends a summary that claims ranks outside its subtree (or is malformed otherwise)."""
    import reshard.comm._handshake as hs

    original = hs.PendingAgreement._summary
    if w.rank == forger:
        hs.PendingAgreement._summary = lambda self, fps, errors: hs.encode("agreement", summary)
    try:
        return _agree(w, "f" * 32, [], timeout=20, tag=tag)
    finally:
        hs.PendingAgreement._summary = original
        group = w.scratch.pop(tag, None)
        if group is not None:
            group.close()


@pytest.mark.parametrize("summary, why", [
    ({"fps": [["f" * 32, [[0, 8]]]], "errors": []}, "a run outside its subtree"),
    ({"fps": [["f" * 32, [[7, 8]]]], "errors": [[2, ["rank 2: forged"]]]}, "an error entry is not"),
    ({"fps": [["f" * 32, [[7, 8], [7, 8]]]], "errors": []}, "do not cover its subtree exactly once"),
    ({"fps": "x", "errors": []}, "not {fps, errors} lists"),
], ids=["claims-the-cluster", "error-of-another-rank", "twice", "malformed"])
def test_a_summary_beyond_its_subtree_is_refused_naming_its_sender(pool, summary, why) -> None:
    outs = pool.run(on_rank_forges, 7, summary, f"agree-forged-{why}", timeout=120)
    expect_all_raise(outs, "CommError", "rank 7 sent a malformed agreement summary", why)


def on_rank_hides_errors(w, tag: str) -> str:
    """Rank 6 tells the root its subtree is clean although its child, rank 7, reported an error."""
    import reshard.comm._handshake as hs

    original = hs.PendingAgreement._summary
    if w.rank == 6:
        hs.PendingAgreement._summary = lambda self, fps, errors: b""
    try:
        return _agree(w, "f" * 32, ["rank 7: its input is bad"] if w.rank == 7 else [], timeout=20, tag=tag)
    finally:
        hs.PendingAgreement._summary = original
        group = w.scratch.pop(tag, None)
        if group is not None:
            group.close()


def test_a_rank_acts_on_its_own_error_whatever_the_verdict_says(pool) -> None:
    """The verdict that reaches rank 7 says every rank agreed (its parent dropped rank 7's error): rank 7 raises its
    own error anyway instead of moving data; the others, told all is well, return."""
    outs = pool.run(on_rank_hides_errors, "agree-hidden", timeout=120)
    for o in outs[:7]:
        assert o.ok and o.value == "agreed", (o.rank, o.error)
    assert not outs[7].ok and outs[7].error_type == "ValueError", outs[7]
    assert "rank 7: its input is bad" in outs[7].error and "every rank agreed" in outs[7].error, outs[7].error


def on_rank_absent(w, absent: int, timeout: float) -> dict:
    group = w.new_group(f"agree-absent-{absent}", timeout=60)
    try:
        if w.rank == absent:
            time.sleep(timeout + 12)  # never joins the round; leaves after every other rank raised
            return {"error": None}
        start = time.monotonic()
        try:
            _from_group(group, w, timeout)
            return {"error": None}
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"error": f"{type(e).__name__}: {e}", "after": time.monotonic() - start}
    finally:
        group.close()


def _from_group(group, w, timeout: float) -> None:
    from reshard.comm._handshake import agree

    agree(group, list(range(w.world_size)), "f" * 32, [], lambda: [], timeout=datetime.timedelta(seconds=timeout),
          what="test agreement")


@pytest.mark.slow  # waits out a 6 s timeout
def test_a_rank_that_never_joins_is_named_by_every_rank(pool) -> None:
    """Rank 5 (a leaf under rank 4) never joins: rank 4, the lowest rank waiting, names it when its wait ends; its
    ancestors and every other rank learn that verdict instead of naming a live rank on the path."""
    timeout = 6.0
    outs = pool.run_ok(on_rank_absent, 5, timeout, timeout=120)
    for r, o in enumerate(outs):
        if r == 5:
            continue
        assert o["error"] is not None and o["error"].startswith("CommError"), (r, o)
        assert "rank 5" in o["error"], (r, o["error"])
        assert o["after"] < timeout + 12, (r, o["after"])  # not the group's 60 s
