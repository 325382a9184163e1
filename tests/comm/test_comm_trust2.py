"""Trust, second round (4 gloo ranks, one pool for the module): no peer-announced size unchecked, the default delta
check catches an engine that reorders a box, two refits never swap, bounded control metadata, blame on the culprit.

Each test has a negative control (the same case with the guard switched off, or the old setting) where that is
cheap, so it can be seen to fail.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from comm_cases import as_bytes, dtensor_local, full_tensor
from torch.distributed.tensor import Shard

from reshard import Layout, Mesh, plan

pytestmark = pytest.mark.distributed

WORLD = 4
FAULT_S = 20.0  # bound on time-to-error, below the groups' 30 s timeout (10 s was overrun at 10.1 s on 2 loaded cores)


RANK_POOL = {"world_size": WORLD}  # the `pool` fixture's ranks (tests/conftest.py)


def _all_comm_error(outs, *fragments: str, within: float = FAULT_S, ranks=None) -> None:
    for o in outs if ranks is None else [outs[r] for r in ranks]:
        assert o.error_type == "CommError", f"rank {o.rank}: {o.error}\n{o.trace}"
        for f in fragments:
            assert f in o.error, f"rank {o.rank}: {f!r} not in {o.error!r}"
        assert o.seconds < within, (o.rank, o.seconds, o.error)


def _two_by_two(dtype=torch.float32, shape=(16, 8)):
    """Ranks 0, 1 hold `S(0)` of `shape`; ranks 2, 3 receive `S(0)`: rank r sends its whole shard to r + 2."""
    src = Layout(shape, Mesh([0, 1]), [Shard(0)], dtype)
    dst = Layout(shape, Mesh([2, 3]), [Shard(0)], dtype)
    return src, dst, plan(src, dst)


# -------------------------------------------------------------------------------------------------------------
# 1. Every size a peer announces is checked against the plan before anything is allocated
# -------------------------------------------------------------------------------------------------------------


def on_rank_announces_huge_delta(w, tag: str) -> str:
    """Rank 0's delta size message announces 2**40 bytes for its message to rank 2."""
    from reshard.comm import DeltaSession, _delta, execute

    group = w.new_group(tag, timeout=30)
    src, dst, p = _two_by_two()
    full = full_tensor(src.shape, src.dtype, "huge")
    s = [dtensor_local(full, src)] if w.rank in src.ranks else None
    d = [torch.zeros(dst.local_shape(w.rank))] if w.rank in dst.ranks else None
    original = _delta._Run.encode

    def announce_huge(self, k, step, area):
        out = original(self, k, step, area)
        return [([1 << 40, words[1], 1 << 40, *([0] * (len(words) - 3))], payload) for words, payload in out]

    if w.rank == 0:
        _delta._Run.encode = announce_huge
    try:
        execute(p, w.rank, s, d, group, delta=DeltaSession(), timeout=30)
    finally:
        _delta._Run.encode = original
        group.close()
    return "returned"


def test_a_delta_size_beyond_the_plan_is_refused_on_every_rank_naming_the_sender(pool) -> None:
    outs = pool.run(on_rank_announces_huge_delta, "huge-delta", timeout=120)
    _all_comm_error(outs, f"rank 0 announced {1 << 40} bytes", "refused before anything was allocated")
    assert all("rank 0 failed, seen by rank 2" in o.error for o in outs if o.rank != 2), [o.error for o in outs]


# -------------------------------------------------------------------------------------------------------------
# 2. The default delta check catches an engine that reorders a box
# -------------------------------------------------------------------------------------------------------------


def on_rank_engine_swaps_rows(w, check: str | None) -> dict:
    """Two delta runs of one plan with the same source; between them rank 2's engine swaps rows 1 and 3 of its
    destination in place (each row is 4 words, rows 2 apart: both parity sums stay). `check=None`: the default."""
    from reshard.comm import DeltaSession, execute

    src, dst, p = _two_by_two()
    full = full_tensor(src.shape, src.dtype, "swap")
    s = [dtensor_local(full, src)] if w.rank in src.ranks else None
    d = torch.zeros(dst.local_shape(w.rank)) if w.rank in dst.ranks else None
    session = DeltaSession() if check is None else DeltaSession(check=check)
    execute(p, w.rank, s, None if d is None else [d], w.group, delta=session, timeout=30)
    if w.rank == 2:
        d[[1, 3]] = d[[3, 1]].clone()
    rep = execute(p, w.rank, s, None if d is None else [d], w.group, delta=session, timeout=30)
    w.group.cache.clear()
    ok = d is None or torch.equal(as_bytes(d), as_bytes(dtensor_local(full, dst)))
    return {"ok": ok, "stale": rep.stale_boxes}


def test_the_default_delta_check_repairs_rows_swapped_by_the_engine(pool) -> None:
    outs = pool.run_ok(on_rank_engine_swaps_rows, None, timeout=120)
    assert all(o["ok"] for o in outs), outs
    assert [o["stale"] for o in outs] == [0, 0, 1, 0], outs


def test_with_the_sum_check_swapped_rows_stay_wrong(pool) -> None:
    """Negative control: the old default misses the swap, so rank 2 keeps the wrong rows."""
    outs = pool.run_ok(on_rank_engine_swaps_rows, "sum", timeout=120)
    assert not outs[2]["ok"] and outs[2]["stale"] == 0, outs


# -------------------------------------------------------------------------------------------------------------
# 3. Two refits of the same layouts on one group never swap
# -------------------------------------------------------------------------------------------------------------


def on_rank_two_refits(w, swap_first: bool, named: bool, identity: bool = True) -> dict:
    """A policy and a reference refit of identical names and layouts (trainer ranks 0, 1 -> engine ranks 2, 3).
    Every rank runs policy then reference once (unless `swap_first`); then the engine runs them in the other order.
    `identity=False` switches the refits' identity off (the negative control)."""
    from reshard import Refit

    src = Layout((16, 8), Mesh([0, 1]), [Shard(0)], torch.float32)
    dst = Layout((16, 8), Mesh([2, 3]), [Shard(1)], torch.float32)
    values = {"policy": full_tensor(src.shape, src.dtype, "policy"),
              "reference": full_tensor(src.shape, src.dtype, "reference")}
    refits, engine = {}, {}
    for k in ("policy", "reference"):
        r = refits[k] = Refit(w.group, name=k if named else None, timeout=30)
        if w.rank in src.ranks:
            r.add_source("w", dtensor_local(values[k], src).clone(), src)
        else:
            engine[k] = torch.zeros(dst.local_shape(w.rank))
            r.add_destination("w", engine[k], dst)
    original = Refit._agreed_fingerprint
    if not identity:
        Refit._agreed_fingerprint = lambda self, b: b.plan.fingerprint
    errors = []
    engine_side = w.rank in dst.ranks
    try:
        rounds = [("policy", "reference"), ("policy", "reference")]
        if swap_first:
            rounds = rounds[:1]
        for i, order in enumerate(rounds):
            if engine_side and (i == 1 or swap_first):
                order = order[::-1]
            for k in order:
                try:
                    refits[k].run()
                except (ValueError, RuntimeError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
    finally:
        Refit._agreed_fingerprint = original
    holds = {}
    for k, t in engine.items():
        holds[k] = [n for n, v in values.items() if torch.equal(as_bytes(t), as_bytes(dtensor_local(v, dst)))]
    w.group.cache.clear()
    return {"errors": errors, "holds": holds}


def test_two_refits_run_in_another_order_refuse_naming_both(pool) -> None:
    outs = pool.run_ok(on_rank_two_refits, False, False, timeout=120)
    for r, o in enumerate(outs):
        assert len(o["errors"]) == 2, (r, o["errors"])
        for e in o["errors"]:
            assert e.startswith("ValueError") and "refit live check" in e, (r, e)
            assert "the 1st Refit made on this group" in e and "the 2nd Refit made on this group" in e, (r, e)
        if r >= 2:  # the first run's values stay: nothing crossed
            assert o["holds"] == {"policy": ["policy"], "reference": ["reference"]}, (r, o["holds"])


def test_named_refits_in_another_order_refuse_at_the_first_run(pool) -> None:
    outs = pool.run_ok(on_rank_two_refits, True, True, timeout=120)
    for r, o in enumerate(outs):
        assert len(o["errors"]) == 2, (r, o["errors"])
        for e in o["errors"]:
            assert "ranks run different refits" in e and "'policy'" in e and "'reference'" in e, (r, e)
        if r >= 2:
            assert o["holds"] == {"policy": [], "reference": []}, (r, o["holds"])


def test_without_the_identity_two_refits_swap_weights(pool) -> None:
    """Negative control: with the identity switched off, the engine's models silently hold each other's weights."""
    outs = pool.run_ok(on_rank_two_refits, False, False, False, timeout=120)
    for r, o in enumerate(outs):
        assert o["errors"] == [], (r, o["errors"])
        if r >= 2:
            assert o["holds"] == {"policy": ["reference"], "reference": ["policy"]}, (r, o["holds"])


# -------------------------------------------------------------------------------------------------------------
# 6. Control metadata is bounded per call, by what the call's other ranks need
# -------------------------------------------------------------------------------------------------------------


def on_rank_pads_metadata(w, pad: int) -> dict:
    """Rank 2 pads its (valid JSON) payload of an all-gather with `pad` bytes of whitespace: under the 64 MiB
    message limit, far over what the other ranks send. Returns what came back and this rank's peak RSS growth."""
    import datetime
    import resource

    import reshard.comm._handshake as hs

    group = w.new_group(f"pad-{pad}", timeout=30)
    original = hs.encode
    if w.rank == 2:
        hs.encode = lambda kind, value: original(kind, value)[:-1] + b" " * pad + b"}"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        got = hs.all_gather_json(group, {"rank": w.rank, "layouts": ["x" * 100] * 20},
                                 timeout=datetime.timedelta(seconds=30), what="refit metadata exchange")
    finally:
        hs.encode = original
        group.close()
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return {"ranks": [g["rank"] for g in got], "peak_rss_growth_mib": grew}


def test_a_padded_metadata_payload_is_refused_naming_the_sender(pool) -> None:
    outs = pool.run(on_rank_pads_metadata, 20 << 20, timeout=120)
    _all_comm_error(outs, "rank 2 announced a refit metadata exchange message of", "bounded per call")


def test_honest_payloads_of_different_sizes_pass(pool) -> None:
    """The bound follows the call: a payload 3x the next-largest passes (and the padding test above is refused
    only for its size, not its form)."""
    outs = pool.run_ok(on_rank_pads_metadata, 4000, timeout=120)
    assert all(o["ranks"] == [0, 1, 2, 3] for o in outs), outs


# -------------------------------------------------------------------------------------------------------------
# 4. Blame lands on the culprit: signed verdicts, absent ranks named, a dead store host named (kills rank 0: last)
# -------------------------------------------------------------------------------------------------------------

FORGED = "forged: rank 1 is evil"


def on_rank_forges_verdicts(w, tag: str) -> None:
    """Rank 3, as any process that can write to the store, writes two forged verdicts for group `rv/<tag>`: one in
    the old unsigned form, one with a wrong MAC."""
    import datetime
    import json

    import torch.distributed as dist

    if w.rank == 3:
        store = dist.PrefixStore(f"rv/{tag}/", dist.TCPStore(w.host, w.port, is_master=False,
                                                             timeout=datetime.timedelta(seconds=10)))
        store.set("abort", json.dumps({"failed": 1, "observer": 2, "message": FORGED}))
        store.set("abort/1", json.dumps({"failed": 1, "observer": 2, "message": FORGED, "mac": "0" * 64}))


def on_rank_reshards_on_a_token_group(w, tag: str, real_fault: bool) -> str:
    """Every rank joins `rv/<tag>` with the job token and reshards; with `real_fault`, rank 0 also announces a
    delta size beyond the plan."""
    from reshard.comm import DeltaSession, Group, _delta, execute

    group = Group.rendezvous(w.host, w.port, w.rank, WORLD, prefix=f"rv/{tag}", is_master=False, timeout=30,
                             token="job-secret")
    src, dst, p = _two_by_two()
    full = full_tensor(src.shape, src.dtype, "forged")
    s = [dtensor_local(full, src)] if w.rank in src.ranks else None
    d = [torch.zeros(dst.local_shape(w.rank))] if w.rank in dst.ranks else None
    original = _delta._Run.encode
    if real_fault and w.rank == 0:
        _delta._Run.encode = lambda self, k, step, area: [([1 << 40, words[1], 1 << 40, *([0] * (len(words) - 3))],
                                                           payload) for words, payload in original(self, k, step, area)]
    try:
        execute(p, w.rank, s, d, group, delta=DeltaSession(), timeout=30)
        time.sleep(0.3)  # a few fault polls after the run
        group.raise_if_aborted("a later call")
    finally:
        _delta._Run.encode = original
        group.close()
    return "ok" if d is None or torch.equal(as_bytes(d[0]), as_bytes(dtensor_local(full, dst))) else "WRONG BYTES"


def test_a_forged_abort_key_makes_no_rank_raise(pool) -> None:
    pool.run_ok(on_rank_forges_verdicts, "forged-quiet", timeout=60)
    outs = pool.run(on_rank_reshards_on_a_token_group, "forged-quiet", False, timeout=120)
    assert all(o.ok and o.value == "ok" for o in outs), [o.error or o.value for o in outs]


def test_a_forged_abort_key_does_not_hide_the_real_verdict(pool) -> None:
    pool.run_ok(on_rank_forges_verdicts, "forged-real", timeout=60)
    outs = pool.run(on_rank_reshards_on_a_token_group, "forged-real", True, timeout=120)
    _all_comm_error(outs, f"rank 0 announced {1 << 40} bytes")
    assert not any(FORGED in o.error for o in outs), [o.error for o in outs]


def on_rank_skips_a_run(w, tag: str, skip_first: bool, timeout: float) -> dict:
    """Rank 3 builds its Refit but does not call `run()` (its first, or its second); it stays alive, its group open,
    until the others had time to time out. Rank 0, the root of the refit's agreement round, comes to the run 1 s
    after the others (as a loaded root does), so their waits end before its own."""
    from reshard import Refit

    group = w.new_group(tag, timeout=30.0)  # joining is not what is tested: ranks of a loaded machine join late
    src, dst, _ = _two_by_two()
    refit = Refit(group, timeout=timeout)
    full = full_tensor(src.shape, src.dtype, "skip")
    if w.rank in src.ranks:
        refit.add_source("w", dtensor_local(full, src), src)
    else:
        refit.add_destination("w", torch.zeros(dst.local_shape(w.rank)), dst)
    start = time.monotonic()
    try:
        if not skip_first:
            refit.run()
            start = time.monotonic()
        if w.rank == 3:
            time.sleep(timeout + 5.0)
            return {"error": None, "seconds": 0.0}
        if w.rank == 0:
            time.sleep(1.0)
        refit.run()
    except Exception as e:  # noqa: BLE001 - reported to the test process
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    finally:
        if w.rank != 3:
            time.sleep(1.0)  # rank 3 still skips: its group stays open, as the others' do
        group.close()
    return {"error": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("skip_first", [False, True], ids=["later-run", "first-run"])
def test_a_rank_that_never_calls_run_is_named_on_every_rank(pool, skip_first) -> None:
    timeout = 4.0
    outs = pool.run_ok(on_rank_skips_a_run, f"skip-{skip_first}", skip_first, timeout, timeout=120)
    for r, o in enumerate(outs[:3]):
        assert o["error"] is not None and o["error"].startswith("CommError"), (r, o)
        assert "rank 3 failed" in o["error"] or "ranks [3] never reached it" in o["error"], (r, o["error"])
        verdict = o["error"].split("\n  (here:")[0]  # what the rank blames (its own observation may follow)
        assert "rank 0 failed" not in verdict, (r, o["error"])
        assert o["seconds"] < timeout + 8.0, (r, o)


def on_rank_store_host_dies(w, port: int, timeout: float) -> dict:
    """Rank 0 hosts the group's store and exits when posting its first chunk; rank r sends to r + 1 (a ring), so
    rank 2 and 3 wait on live peers that stopped (rank 1 raised, rank 2 raised or waits)."""
    import os

    import reshard.comm._executor as ex
    from reshard.comm import Group, reshard
    from reshard.comm._executor import ZERO_COPY_ENV

    os.environ[ZERO_COPY_ENV] = "0"  # staged: one chunk at a time, so rank 1 stops sending to rank 2 when it raises
    group = Group.rendezvous(w.host, port, w.rank, WORLD, prefix="store-dies", is_master=w.rank == 0,
                             timeout=timeout, token="job-secret")
    src = Layout((128, 64), Mesh([0, 1, 2, 3]), [Shard(0)], torch.float32)
    dst = Layout((128, 64), Mesh([1, 2, 3, 0]), [Shard(0)], torch.float32)
    p = plan(src, dst, staging_bytes=2048, min_split_bytes=256)
    full = full_tensor(src.shape, src.dtype, "store-dies")
    s, d = dtensor_local(full, src), torch.zeros(dst.local_shape(w.rank))
    original = ex._post_tagged

    def dying_post(*args, **kw):
        os._exit(17)

    if w.rank == 0:
        ex._post_tagged = dying_post
    start = time.monotonic()
    try:
        reshard(s, d, p, group, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - reported to the test process
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    finally:
        ex._post_tagged = original
        os.environ.pop(ZERO_COPY_ENV)
    return {"error": None, "seconds": time.monotonic() - start}


def test_a_dead_store_host_is_named_on_every_rank(pool) -> None:
    from reshard.testing import free_port

    timeout = 20.0
    outs = pool.run(on_rank_store_host_dies, free_port(), timeout, timeout=120)
    assert outs[0].died, outs[0]
    for o in outs[1:]:
        assert o.ok and o.value["error"] is not None, (o.rank, o.error, o.value)
        e = o.value["error"]
        assert e.startswith("CommError") and re.search(r"rank 0 failed|cannot post (receive from|send to) rank 0", e), \
            (o.rank, e)
        assert not re.search(r"rank [123] failed", e), (o.rank, e)  # no live rank is blamed
        assert o.value["seconds"] < FAULT_S, (o.rank, o.value)
    # rank 2 only ever waits on rank 1 (alive, stopped): it names rank 0 from the store's silence, not its timeout
    assert "(hosted by rank 0) stopped answering" in outs[2].value["error"], outs[2].value
