"""Delta execution (`execute(..., delta=DeltaSession())`) on 8 gloo ranks, against DTensor as ground truth.

Every case runs a sequence of updates through one session: the first run (full), an unchanged source (0%), a few
changed elements, every element changed (100%), a destination overwritten between runs (it must get full boxes),
and a few changes again. After every run each destination local tensor must equal, bit for bit, DTensor's
`distribute_tensor(full_i).to_local()` of that step's global tensor. A negative control shows that the overwrite
check is what keeps the overwritten destination right: with `check="none"` the same sequence leaves it wrong.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from comm_cases import B2, S0, S1, A, B, R, as_bytes, dtensor_local, full_tensor
from torch.distributed.tensor.placement_types import _StridedShard

pytestmark = pytest.mark.distributed

WORLD = 8
A2 = [[0, 1], [2, 3]]
M3 = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]

# (id, shape, src dtype, src mesh, src placements, dst mesh, dst placements, dst dtype, options)
CASES = [
    ("relay-S0-to-R-domain4", (64, 32), torch.float32, A, (S0,), B, (R,), None,
     {"domain_size": 4, "staging_bytes": 4096, "min_split_bytes": 256}),
    ("relay-R-to-R-domain2", (40, 20), torch.bfloat16, A2, (R, S0), B2, (S1, R), None,
     {"domain_size": 2, "staging_bytes": 2048, "min_split_bytes": 128}),
    ("strided-fsdp-tp-to-tp", (48, 64), torch.bfloat16, A2, (_StridedShard(0, split_factor=2), S0), B, (S0,), None,
     {}),
    ("tp-to-strided", (40, 40), torch.float32, A, (S0,), B2, (_StridedShard(1, split_factor=2), S1), None, {}),
    ("uneven-rows-cols", (37, 29), torch.float32, A, (S0,), B2, (S1, S0), None, {}),
    ("m2m-tiny-chunks", (64, 64), torch.float32, list(range(8)), (S0,), [3, 6, 1, 4, 7, 2, 5, 0], (S1,), None,
     {"staging_bytes": 2048, "min_split_bytes": 64}),
    ("overlap-local-copies", (24, 40), torch.float32, [0, 1, 2, 3, 4, 5], (S0,), [2, 3, 4, 5, 6, 7], (S1,), None, {}),
    ("3dmesh-nested", (32, 24), torch.bfloat16, M3, (R, S0, S0), [[[7, 6], [5, 4]], [[3, 2], [1, 0]]], (S1, R, S0),
     None, {}),
    ("cast-f32-to-bf16", (64, 48), torch.float32, A, (S0,), B2, (R, S1), torch.bfloat16, {}),
]
# rank-local plans (`plan_local(..., single_batch_chunks=True)`): each rank schedules its own part
CASES += [(f"{c[0]}[local]", *c[1:8], {**c[8], "local": True}) for c in CASES
          if c[0] in ("relay-S0-to-R-domain4", "m2m-tiny-chunks", "overlap-local-copies", "cast-f32-to-bf16")]
STEPS = ("first", "same", "few", "all", "overwritten", "few-after")
OVERWRITTEN_RANK = 5  # a destination rank of every case


def _values(case, step: int) -> torch.Tensor:
    """The global tensor at `step` (the same on every rank): a few changed elements, or all, per `STEPS`."""
    cid, shape, dtype = case[0], case[1], case[2]
    if dtype == torch.float32 and case[7] is not None:  # cast: finite values (NaN payloads are not what is tested)
        g = torch.Generator().manual_seed(len(cid))
        x = torch.randn(shape, generator=g)
    else:
        x = full_tensor(shape, dtype, cid)
    for k, name in enumerate(STEPS[: step + 1]):
        if name == "all":
            x = (full_tensor(shape, dtype, cid + "-all") if case[7] is None
                 else torch.randn(shape, generator=torch.Generator().manual_seed(99)))
        elif name in ("few", "few-after"):
            flat = x.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                       8: torch.int64}[x.element_size()])
            g = torch.Generator().manual_seed(1000 + k)
            pick = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]
            flat[pick] ^= 1 << (8 * x.element_size() - 10)  # a high mantissa bit: survives a cast to bf16
    return x


def on_rank(w, cases: list, check: str) -> list:
    from reshard import Layout, Mesh, PlanItem, Topology, plan
    from reshard.comm import DeltaSession, execute
    from reshard.planner import plan_local

    out = []
    for case in cases:
        _cid, shape, sdt, sm, sp, dm, dp, ddt, opts = case
        try:
            opts = dict(opts)
            topo = Topology(domain_size=opts.pop("domain_size", None))
            src = Layout(shape, Mesh(torch.as_tensor(sm)), list(sp), sdt)
            dst = Layout(shape, Mesh(torch.as_tensor(dm)), list(dp), ddt or sdt)
            if opts.pop("local", False):
                item = PlanItem(src, dst, precision="cast" if ddt else "same")
                p = plan_local([item], topo, w.rank, single_batch_chunks=True, **opts)
            else:
                p = plan(src, dst, topo, precision="cast" if ddt else "same", **opts)
            session = DeltaSession(check=check)
            d = torch.zeros(dst.local_shape(w.rank), dtype=dst.dtype) if w.rank in dst.ranks else None
            steps = []
            for i, name in enumerate(STEPS):
                full = _values(case, i)
                s = dtensor_local(full, src).clone() if w.rank in src.ranks else None
                if name == "overwritten" and d is not None and w.rank == OVERWRITTEN_RANK:
                    as_bytes(d).fill_(0x3C)  # in place: the engine's tensor now holds other bytes
                rep = execute(p, w.rank, None if s is None else [s], None if d is None else [d], w.group,
                              delta=session, timeout=60)
                ok = True
                if d is not None:
                    expected = dtensor_local(full.to(dst.dtype), dst)
                    ok = torch.equal(as_bytes(d), as_bytes(expected))
                links = {k: (v.elements, v.changed, v.dense_bytes, v.encoded_bytes, v.sparse_boxes)
                         for k, v in getattr(rep, "links", {}).items()}
                steps.append((name, ok, links, rep.stale_boxes, rep.raw_messages, rep.bytes_sent,
                              rep.snapshot_bytes, rep.forwarded_boxes))
            w.group.cache.clear()
            out.append((True, steps))
        except Exception as e:  # noqa: BLE001 - reported per case
            out.append((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    return out


RANK_POOL = WORLD  # the `pool` fixture's ranks (tests/conftest.py)


@pytest.fixture(scope="module")
def results(pool):
    outs = pool.run_ok(on_rank, CASES, "sum", timeout=600)
    return {c[0]: [outs[r][i] for r in range(WORLD)] for i, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_delta_runs_equal_dtensor(case, results) -> None:
    per_rank = results[case[0]]
    errors = [f"rank {r}: {res}" for r, (ok, res) in enumerate(per_rank) if not ok]
    assert not errors, "\n".join(errors)
    for r, (_, steps) in enumerate(per_rank):
        for name, ok, *_ in steps:
            assert ok, f"rank {r}: destination differs from DTensor after step {name!r}"
    by_step = {name: [dict(zip(("links", "stale", "raw", "sent", "snap", "forwarded"), steps[i][2:]))
                      for _, steps in per_rank] for i, name in enumerate(STEPS)}

    def total(step: str, k: int) -> int:
        return sum(v[k] for rr in by_step[step] for v in rr["links"].values())

    # the first run sends every element; an unchanged source sends no changed element, and fewer bytes
    assert total("first", 0) > 0 and total("first", 1) == total("first", 0)
    assert total("same", 1) == 0, by_step["same"]
    assert total("same", 4) > 0 and total("few", 4) > 0, by_step["same"]  # sparse boxes were sent
    assert sum(rr["sent"] for rr in by_step["same"]) < sum(rr["sent"] for rr in by_step["first"])
    assert 0 < total("few", 1) < total("few", 0)
    # the overwritten destination found its boxes stale; no other rank did
    stale = [rr["stale"] for rr in by_step["overwritten"]]
    assert stale[OVERWRITTEN_RANK] > 0 and sum(stale) == stale[OVERWRITTEN_RANK], stale
    # every other step finds every box as it was applied (the fingerprints kept across sparse applies are right)
    for step in STEPS:
        if step != "overwritten":
            assert all(rr["stale"] == 0 for rr in by_step[step]), (step, [rr["stale"] for rr in by_step[step]])
    assert all(rr["snap"] >= 0 for rr in by_step["first"])
    # relays forward sparse boxes in the form they arrived in (not when every element changed: those go DENSE)
    forwarded = {step: sum(rr["forwarded"] for rr in by_step[step]) for step in STEPS}
    if case[0].startswith("relay"):
        assert forwarded["same"] > 0 and forwarded["few"] > 0 and forwarded["few-after"] > 0, forwarded
        assert forwarded["first"] == 0 and forwarded["all"] == 0, forwarded
    else:
        assert not any(forwarded.values()), forwarded


def test_overwrite_check_is_what_keeps_the_destination_right(pool) -> None:
    """Negative control: without the destination check, the overwritten destination keeps wrong bytes (the sender
    cannot know), so the check above is what makes the delta exact there; also where the overwritten rank is a
    relay and the destination of forwarded boxes (the relay case): a forwarded sparse box is applied onto the
    overwritten bytes, and the DTensor comparison sees it."""
    cases = [CASES[4], CASES[0]]
    outs = pool.run_ok(on_rank, cases, "none", timeout=300)
    for i, case in enumerate(cases):
        steps = outs[OVERWRITTEN_RANK][i][1]
        oks = {name: ok for name, ok, *_ in steps}
        assert oks["first"] and oks["same"] and oks["few"] and oks["all"], case[0]
        assert not oks["overwritten"], f"{case[0]}: with check='none' the overwritten destination should stay wrong"


def on_rank_mismatch(w) -> tuple[str, str, bool]:
    """Ranks plan with different staging budgets: every rank must raise before any byte moves."""
    from reshard import Layout, Mesh, plan

    src = Layout((16, 8), Mesh(A), [S0], torch.float32)
    dst = Layout((16, 8), Mesh(B), [S1], torch.float32)
    p = plan(src, dst, staging_bytes=4096 if w.rank != 6 else 2048)
    return _delta_run_16x8(w, p, src, dst, "mismatch")


def _delta_run_16x8(w, p, src, dst, seed: str) -> tuple[str, str, bool]:
    """One delta run of plan `p` of a `(16, 8)` float32 tensor into destinations filled with 7.0: `(error type,
    message, whether this rank's destination is untouched)`, empty strings when it returned."""
    from reshard.comm import DeltaSession, execute

    full = full_tensor((16, 8), torch.float32, seed)
    s = [dtensor_local(full, src)] if w.rank in src.ranks else None
    d = torch.full(dst.local_shape(w.rank), 7.0) if w.rank in dst.ranks else None
    try:
        execute(p, w.rank, s, None if d is None else [d], w.group, delta=DeltaSession(), timeout=30)
    except Exception as e:  # noqa: BLE001 - reported to the test process
        return type(e).__name__, str(e), d is None or bool((d == 7.0).all())
    return "", "", d is None or bool((d == 7.0).all())


def on_rank_local_without_single_batches(w) -> tuple[str, str, bool]:
    """A rank-local plan scheduled with several peers per chunk: a delta run must refuse it on every rank."""
    from reshard import Layout, Mesh
    from reshard.planner import plan_local

    src = Layout((16, 8), Mesh(A), [S0], torch.float32)
    dst = Layout((16, 8), Mesh(B), [S1], torch.float32)
    p = plan_local([(src, dst)], None, w.rank, staging_bytes=4096)
    return _delta_run_16x8(w, p, src, dst, "local")


def test_a_rank_local_plan_without_single_batch_chunks_is_refused_on_every_rank(pool) -> None:
    for r, (kind, msg, untouched) in enumerate(pool.run_ok(on_rank_local_without_single_batches)):
        assert kind == "ValueError" and "single_batch_chunks=True" in msg, (r, kind, msg[:500])
        assert untouched, r


def test_mismatched_plans_raise_on_every_rank_and_leave_destinations(pool) -> None:
    for r, (kind, msg, untouched) in enumerate(pool.run_ok(on_rank_mismatch)):
        assert kind == "ValueError" and "staging_bytes" in msg, (r, kind, msg[:500])
        assert untouched, r


def on_rank_corrupt_count(w) -> tuple[str, str, bool]:
    """A sender (rank 0) whose encoded box's header counts no changed element while its announced size is that of
    the real encoding: the receiver must refuse it (it would otherwise apply nothing and keep stale values), every
    rank must raise, and the refused box keeps its old values."""
    from reshard import Layout, Mesh, plan
    from reshard.comm import DeltaSession, _delta, execute

    src = Layout((32, 16), Mesh(A), [S0], torch.float32)
    dst = Layout((32, 16), Mesh(B), [S1], torch.float32)
    p = plan(src, dst)
    session = DeltaSession()
    old = full_tensor((32, 16), torch.float32, "corrupt")
    new = old.clone()
    new.view(-1)[::10] += 1.0  # every source shard has changed elements: sparse boxes
    d = torch.zeros(dst.local_shape(w.rank)) if w.rank in dst.ranks else None
    dd = None if d is None else [d]
    execute(p, w.rank, [dtensor_local(old, src)] if w.rank in src.ranks else None, dd, w.group, delta=session,
            timeout=60)
    original = _delta._Run.encode

    def corrupt(self, k, step, area):
        out = original(self, k, step, area)
        for words, payload in out:
            if words[0] > 0:
                payload.view(torch.int64)[2] = 0  # the first box's count word
        return out

    if w.rank == 0:
        _delta._Run.encode = corrupt
    try:
        execute(p, w.rank, [dtensor_local(new, src)] if w.rank in src.ranks else None, dd, w.group, delta=session,
                timeout=60)
    except Exception as e:  # noqa: BLE001 - reported to the test process
        kind, msg = type(e).__name__, str(e)
    else:
        kind, msg = "", ""
    finally:
        _delta._Run.encode = original
    kept = True
    if d is not None:  # the rows rank 0 sends keep their old values; no element of the box took a new one
        rows = slice(0, 8)
        kept = torch.equal(as_bytes(d[rows]), as_bytes(dtensor_local(old, dst)[rows]))
    w.group.cache.clear()
    return kind, msg, kept


def test_a_box_that_does_not_take_its_announced_bytes_is_refused_on_every_rank(pool) -> None:
    for r, (kind, msg, kept) in enumerate(pool.run_ok(on_rank_corrupt_count)):
        assert kind == "ValueError" and "bytes announced" in msg, (r, kind, msg[:500])
        assert kept, r
