"""Comm on 8 gloo ranks: the transfer primitive, multi-tensor plans, separate default worlds, and bad input.

Every error test checks that *every* rank raises (not only the one with the bad input), with a message that names
what is wrong, and, where the contract says so, that no byte moved. Functions named `on_rank_*` run on the ranks
of the shared pool (see `reshard.testing.RankPool`).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta

import pytest
import torch
from comm_cases import B2, S0, SENTINEL, A, B, Hooked, R, as_bytes, dtensor_local, expect_all_raise, full_tensor
from torch.distributed.tensor import Replicate, Shard

from reshard import Layout, Mesh, PlanItem, Topology, plan, plan_many
from reshard.comm import Group, reshard
from reshard.comm._handshake import tree_grace

pytestmark = pytest.mark.distributed

WORLD = 8


RANK_POOL = WORLD  # the `pool` fixture's ranks (tests/conftest.py)
RANK_POOL_BACKENDS = ("gloo", "reshard_nccl_rules")  # NCCL's rules: sizes unchecked, so reshard's checks must hold


def _layouts(dst_pl: tuple = (R, S0), shape=(64, 48), dtype=torch.float32, dst_mesh=B2):
    return (Layout(shape, Mesh(A), [Shard(0)], dtype, name="w"),
            Layout(shape, Mesh(dst_mesh), list(dst_pl), dtype, name="w"))


def _locals(rank: int, src: Layout, dst: Layout, seed: str = "w") -> tuple:
    """DTensor's source local (from the full tensor) and a sentinel-filled destination local, or None."""
    full = full_tensor(src.shape, src.dtype, seed)
    s = dtensor_local(full, src) if rank in src.ranks else None
    d = None
    if rank in dst.ranks:
        d = torch.empty(dst.local_shape(rank), dtype=dst.dtype)
        as_bytes(d).fill_(SENTINEL)
    return full, s, d


def _untouched(d: torch.Tensor | None) -> bool:
    return d is None or bool((as_bytes(d) == SENTINEL).all())


# -------------------------------------------------------------------------------------------------------------
# the transfer primitive
# -------------------------------------------------------------------------------------------------------------


def on_rank_all_to_all(w) -> list[list[int]]:
    from reshard.comm import transfer

    n = w.world_size
    sends = {p: [torch.full((3,), 100 * w.rank + p, dtype=torch.int32), torch.tensor([w.rank], dtype=torch.int64)]
             for p in range(n)}
    recvs = {p: [torch.empty(3, dtype=torch.int32), torch.empty(1, dtype=torch.int64)] for p in range(n)}
    handle = transfer(sends, recvs, w.group, timeout=30)  # peer == rank: a local copy, never a message
    handle.wait()
    assert handle.is_completed()
    with pytest.raises(ValueError, match="must be contiguous"):
        transfer({}, {(w.rank + 1) % n: torch.empty(4, 2).t()}, w.group)
    return [[int(recvs[p][0][0]), int(recvs[p][1][0])] for p in range(n)]


def test_transfer_all_to_all_with_self(pool) -> None:
    got = pool.run_ok(on_rank_all_to_all)
    for r, per_peer in enumerate(got):
        assert per_peer == [[100 * p + r, p] for p in range(WORLD)]


# -------------------------------------------------------------------------------------------------------------
# multi-tensor plans, reports and logging
# -------------------------------------------------------------------------------------------------------------


def on_rank_multi_tensor(w) -> list[dict]:
    """Three tensors of different dtypes in one plan (messages mix dtypes), executed twice on reused staging."""
    from reshard.comm import execute

    specs = [
        ("a", (37, 12), torch.float32, Mesh(A), [Shard(0)], Mesh(B), [Shard(1)]),
        ("b", (20, 9), torch.bfloat16, Mesh([0, 1]), [Replicate()], Mesh([[4, 5], [6, 7]]), [Shard(1), Shard(0)]),
        ("c", (8, 8, 5), torch.int8, Mesh([[0, 1], [2, 3]]), [Shard(2), Shard(0)], Mesh([5, 6, 7, 0]), [Shard(1)]),
    ]
    items, srcs, dsts, fulls = [], [], [], []
    for i, (name, shape, dt, sm, sp, dm, dp) in enumerate(specs):
        s, d = Layout(shape, sm, sp, dt, name=name), Layout(shape, dm, dp, dt, name=name)
        items.append(PlanItem(s, d, src_tensor=i, dst_tensor=2 - i, name=name))  # indices need not match
        full = full_tensor(shape, dt, name)
        fulls.append(full)
        srcs.append(dtensor_local(full, s) if w.rank in s.ranks else None)
        dsts.append(torch.zeros(d.local_shape(w.rank), dtype=dt) if w.rank in d.ranks else None)
    p = plan_many(items, Topology(domain_size=4), staging_bytes=512, min_split_bytes=32)
    dsts.reverse()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("reshard.comm._executor")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    reports = []
    try:
        for step in range(2):
            # the second call reuses the staging and the prepared copies; new values must still arrive
            if step:
                for i, it in enumerate(items):
                    fulls[i] = full_tensor(it.src.shape, it.src.dtype, f"{it.name}-step1")
                    if srcs[i] is not None:
                        srcs[i].copy_(dtensor_local(fulls[i], it.src))
                for d in dsts:
                    if d is not None:
                        d.zero_()
            reports.append(execute(p, w.rank, srcs, dsts, w.group, timeout=30))
            for i, it in enumerate(items):
                if w.rank in it.dst.ranks:
                    expected = dtensor_local(fulls[i], it.dst)
                    assert torch.equal(as_bytes(dsts[2 - i]), as_bytes(expected)), (step, it.name)
    finally:
        log.removeHandler(handler)
        log.setLevel(logging.NOTSET)
    assert len(w.group.cache["prepared"]) >= 1
    r = reports[1]
    return [{"sent": r.bytes_sent, "received": r.bytes_received, "local": r.bytes_copied_locally,
             "messages_sent": r.messages_sent, "chunks": r.chunks, "staging": r.staging_bytes,
             "chunk_logs": sum("chunk" in m for m in records),
             "plan": (p.stats.network_bytes + p.stats.nvlink_bytes, p.stats.local_bytes, p.stats.messages)}]


def test_multi_tensor_plan_counts_bytes_and_messages(pool) -> None:
    reports = [r[0] for r in pool.run_ok(on_rank_multi_tensor)]
    moved, local, messages = reports[0]["plan"]
    assert sum(r["sent"] for r in reports) == sum(r["received"] for r in reports) == moved
    assert sum(r["local"] for r in reports) == local
    assert sum(r["messages_sent"] for r in reports) == messages
    assert max(r["chunks"] for r in reports) > 2  # a small budget: several chunks, pipelined
    assert all(r["staging"] <= 512 for r in reports)  # two slots of at most half the budget each
    assert all(r["chunk_logs"] >= r["chunks"] for r in reports)  # one debug line per chunk at least


def on_rank_cast(w, verify: bool) -> bool:
    """`precision="cast"` items: values are cast while packing (bit-exact with `.to()`), relays forward the cast
    bytes, local copies cast too. Mixed with a raw item, so one chunk packs with several wire dtypes."""
    from reshard.comm import execute

    specs = [  # name, shape, src dtype, dst dtype, src mesh/placements, dst mesh/placements
        ("fp32->bf16 relayed", (40, 24), torch.float32, torch.bfloat16, Mesh(A), [S0], Mesh(B), [R]),
        ("bf16->fp32 overlapping", (30, 10), torch.bfloat16, torch.float32, Mesh([0, 1, 2, 3, 4, 5]), [S0],
         Mesh([2, 3, 4, 5, 6, 7]), [Shard(1)]),
        ("fp32->fp16", (17, 9), torch.float32, torch.float16, Mesh([[0, 1], [2, 3]]), [S0, Shard(1)], Mesh([5, 6]),
         [Shard(1)]),
        ("raw int8", (12, 12), torch.int8, torch.int8, Mesh(A), [Shard(1)], Mesh(B), [S0]),
    ]
    items, srcs, dsts, expected = [], [], [], []
    for i, (name, shape, sdt, ddt, sm, sp, dm, dp) in enumerate(specs):
        s, d = Layout(shape, sm, sp, sdt, name=name), Layout(shape, dm, dp, ddt, name=name)
        items.append(PlanItem(s, d, src_tensor=i, dst_tensor=i, name=name, precision="cast" if sdt != ddt else "same"))
        full = torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(sdt) if sdt.is_floating_point \
            else full_tensor(shape, sdt, name)
        srcs.append(dtensor_local(full, s) if w.rank in s.ranks else None)
        dsts.append(torch.zeros(d.local_shape(w.rank), dtype=ddt) if w.rank in d.ranks else None)
        expected.append(dtensor_local(full.to(ddt), d) if w.rank in d.ranks else None)
    p = plan_many(items, Topology(domain_size=4), staging_bytes=1024, min_split_bytes=64)
    assert any(t.stage > 0 for t in p.transfers) and any(t.link == "local" for t in p.transfers)
    execute(p, w.rank, srcs, dsts, w.group, verify=verify, timeout=30)
    return all(d is None or torch.equal(as_bytes(d), as_bytes(e)) for d, e in zip(dsts, expected))


@pytest.mark.parametrize("verify", [False, True])
def test_cast_items_pack_with_their_wire_dtype(pool, verify) -> None:
    assert all(pool.run_ok(on_rank_cast, verify))


def on_rank_identical(w) -> dict:
    lay = Layout((16, 16), Mesh([[0, 1], [2, 3]]), [Shard(0), Shard(1)], torch.float32)
    _, s, d = _locals(w.rank, lay, lay)
    from reshard.comm import execute

    r = execute(plan(lay, lay), w.rank, None if s is None else [s], None if d is None else [d], w.group)
    assert d is None or torch.equal(as_bytes(d), as_bytes(s))
    return {"messages": r.messages_sent + r.messages_received, "local": r.bytes_copied_locally}


def test_identical_layouts_send_no_message(pool) -> None:
    out = pool.run_ok(on_rank_identical)
    assert sum(o["messages"] for o in out) == 0
    assert sum(o["local"] for o in out) == 16 * 16 * 4


# -------------------------------------------------------------------------------------------------------------
# Group.rendezvous between processes that have their own default worlds
# -------------------------------------------------------------------------------------------------------------


def on_rank_two_worlds(w, run: int) -> dict:
    """Ranks 0-3 form a 'trainer' world and ranks 4-7 an 'inference' world, each with its own default group and
    DTensor meshes in its own ranks; a rendezvous group spans both. Trainer passes (src, None), inference
    (None, dst)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from reshard.comm import reshard_dtensor

    trainer = w.rank < 4
    own = w.rank if trainer else w.rank - 4
    w.init_world(f"{'trainer' if trainer else 'inference'}{run}/", own, 4)
    try:
        assert dist.get_world_size() == 4 and dist.get_rank() == own
        group = w.new_group(f"two-worlds-{run}", rank=w.rank)  # group ranks: trainer 0-3, inference 4 + own
        shape = (40, 30)
        full = full_tensor(shape, torch.bfloat16, "two-worlds")
        if trainer:
            mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), _init_backend=False)
            src = distribute_tensor(full, mesh, [Shard(1), Shard(0)], src_data_rank=None)
            reshard_dtensor(src, None, group=group, timeout=30)
            reshard_dtensor(src, None, group=group, timeout=30)  # second call: layouts come from the cache
            out = None
        else:
            mesh = DeviceMesh("cpu", torch.arange(4), _init_backend=False)
            expected = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local()
            dst = DTensor.from_local(torch.zeros_like(expected), mesh, [Shard(0)], run_check=False, shape=full.shape,
                                     stride=full.stride())
            assert reshard_dtensor(None, dst, group=group, timeout=30) is dst
            out = torch.equal(as_bytes(dst.to_local()), as_bytes(expected))
            dst.to_local().zero_()
            reshard_dtensor(None, dst, group=group, timeout=30)
            out = out and torch.equal(as_bytes(dst.to_local()), as_bytes(expected))
        # each side's own world still works, untouched
        t = torch.ones(1)
        dist.all_reduce(t)
        group.close()
        return {"ok": out, "own_world_sum": float(t), "cached": len(group.cache) == 0}
    finally:
        w.init_world(f"world-after-two-worlds{run}/", w.rank, w.world_size)


def test_rendezvous_between_separate_default_worlds(pool) -> None:
    out = pool.run_ok(on_rank_two_worlds, 1)
    assert all(o["own_world_sum"] == 4.0 for o in out)
    assert all(o["ok"] for o in out[4:]), out


def on_rank_world_group(w) -> tuple[int, int]:
    g = Group.world()
    assert Group.world() is g
    return g.rank, g.size


def test_group_world_wraps_default_world(pool) -> None:
    assert pool.run_ok(on_rank_world_group) == [(r, WORLD) for r in range(WORLD)]


# -------------------------------------------------------------------------------------------------------------
# bad input: every rank raises, before any byte moves
# -------------------------------------------------------------------------------------------------------------


def on_rank_plans_differ(w, variant: str) -> None:
    src, dst = _layouts()
    if variant == "placements" and w.rank == 3:
        src, dst = _layouts(dst_pl=(Shard(1), Replicate()))
    if variant == "ranks" and w.rank == 5:
        src, dst = _layouts(dst_pl=(Shard(0),), dst_mesh=[4, 5, 6])
    if variant == "budget" and w.rank == 6:
        w.scratch["staging"] = 1 << 16
    p = plan(src, dst, staging_bytes=w.scratch.pop("staging", 1 << 20))
    if w.rank in (0, 4):  # these ranks hold the agreed plan in every variant: on the zero-copy path
        assert all(m.direct for c in p.for_rank(w.rank).chunks for m in (*c.sends, *c.recvs))
    _, s, d = _locals(w.rank, src, dst)
    try:
        reshard(s, d, p, w.group, timeout=30)
    finally:
        assert _untouched(d), f"rank {w.rank}: bytes moved before the error"


@pytest.mark.parametrize("variant, patterns", [
    ("placements", ["ranks hold different plans", "destination layout: rank 0 has", "rank 3 has", "[S(1), R]"]),
    ("ranks", ["ranks hold different plans", "rank 5 has", "ranks=4-6"]),
    ("budget", ["staging_bytes: rank 0 has 1048576, rank 6 has 65536"]),
])
def test_plans_that_differ_between_ranks_raise_on_every_rank(pool, variant, patterns) -> None:
    outs = pool.run(on_rank_plans_differ, variant)
    expect_all_raise(outs, "ValueError", *patterns)


def on_rank_dtensor_layouts_differ(w) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    from reshard.comm import reshard_dtensor

    full = full_tensor((16, 8), torch.float32, "dt")
    smesh = DeviceMesh("cpu", torch.tensor(A), _init_backend=False)
    dmesh = DeviceMesh("cpu", torch.tensor(B), _init_backend=False)
    dpl = [Shard(1)] if w.rank == 6 else [Shard(0)]
    src = distribute_tensor(full, smesh, [Shard(0)], src_data_rank=None) if w.rank < 4 else None
    dst = distribute_tensor(torch.zeros_like(full), dmesh, dpl, src_data_rank=None) if w.rank >= 4 else None
    reshard_dtensor(src, dst, group=w.group, timeout=30)


def test_dtensor_layouts_that_differ_raise_on_every_rank(pool) -> None:
    outs = pool.run(on_rank_dtensor_layouts_differ)
    expect_all_raise(outs, "ValueError", "destination DTensors differ between ranks", "ranks [6]: [16, 8] float32",
                      "[S(1)]", "ranks [4, 5, 7]")


def on_rank_wrong_locals(w, variant: str) -> None:
    src, dst = _layouts()
    p = plan(src, dst)
    _, s, d = _locals(w.rank, src, dst)
    if variant == "shape" and w.rank == 5:
        d = torch.empty(d.shape[0] + 1, d.shape[1])
    if variant == "dtype" and w.rank == 2:
        s = s.to(torch.float64)
    if variant == "missing" and w.rank == 1:
        s = None
    try:
        reshard(s, d, p, w.group, timeout=30)
    finally:
        assert _untouched(d) or (variant == "shape" and w.rank == 5), f"rank {w.rank}: bytes moved before the error"


@pytest.mark.parametrize("variant, patterns", [
    ("shape", ["tensor 'w' (item 0): rank 5: destination local tensor 0 has shape (33, 48), expected (32, 48)"]),
    ("dtype", ["tensor 'w' (item 0): rank 2: source local tensor 0 has dtype torch.float64, expected torch.float32"]),
    ("missing", ["rank 1 holds a source shard", "got no source tensors (None)", "shape (16, 48)"]),
])
def test_wrong_local_tensors_raise_on_every_rank_before_bytes_move(pool, variant, patterns) -> None:
    outs = pool.run(on_rank_wrong_locals, variant)
    expect_all_raise(outs, "ValueError", "bad input, nothing was moved", *patterns)


def test_reshard_refuses_multi_tensor_plans() -> None:
    a = Layout((4, 4), Mesh([0, 1]), [Shard(0)])
    p = plan_many([PlanItem(a, a, 0, 0), PlanItem(a, a, 1, 1)])
    with pytest.raises(ValueError, match="use reshard.comm.execute"):
        reshard(None, None, p, object())  # type: ignore[arg-type]


def test_rendezvous_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        Group.rendezvous("127.0.0.1", 1, 3, 2)
    with pytest.raises(ValueError, match="backend must be None, 'gloo', 'nccl' or the name of a backend registered"):
        Group.rendezvous("127.0.0.1", 1, 0, 2, backend="mpi")
    with pytest.raises(ValueError, match="timeout must be positive"):
        Group.rendezvous("127.0.0.1", 1, 0, 2, timeout=0)


# -------------------------------------------------------------------------------------------------------------
# corruption and stuck peers
# -------------------------------------------------------------------------------------------------------------


class _WaitHook:
    """A transfer handle that calls `after()` once its wait returns: how these tests corrupt or stall a rank in the
    middle of a transfer, on the staged and the zero-copy path alike (the receive lands in staging or directly in
    the destination; either way the executor unpacks or checks it only after this wait)."""

    def __init__(self, inner, after) -> None:
        self.inner, self.after = inner, after

    def wait(self, timeout=None) -> None:
        self.inner.wait(timeout)
        self.after()

    def is_completed(self) -> bool:
        return self.inner.is_completed()


def _hook_post(ex, nth: int, after) -> None:
    """Make the `nth` chunk this rank posts call `after(first received tensor)` once its wait returns."""
    original = ex._post_tagged
    calls = []

    def hooked(sends, recvs, *args, **kw):
        calls.append(1)
        handle = original(sends, recvs, *args, **kw)
        if len(calls) == nth and recvs:
            return _WaitHook(handle, lambda: after(recvs[0][1]))
        return handle

    ex._post_tagged = hooked


def on_rank_corrupt(w, verify: bool, zero_copy: bool) -> bool:
    """Rank 6 flips one byte of a received message (a bit flip on the wire), in staging or in its destination."""
    import reshard.comm._executor as ex

    src, dst = _layouts(shape=(64, 48))
    p = plan(src, dst, staging_bytes=8192, min_split_bytes=256)
    full, s, d = _locals(w.rank, src, dst)
    original = ex._post_tagged

    def flip(received: torch.Tensor) -> None:
        received.view(torch.uint8)[5] ^= 0x10

    if w.rank == 6:
        _hook_post(ex, 2, flip)
    try:
        ex.execute(p, w.rank, None if s is None else [s], None if d is None else [d], w.group, verify=verify,
                   timeout=30, zero_copy=zero_copy)
    finally:
        ex._post_tagged = original
    return d is None or torch.equal(as_bytes(d), as_bytes(dtensor_local(full, dst)))


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero_copy", "staged"])
def test_corrupt_byte_with_verify_raises_on_every_rank(pool, zero_copy) -> None:
    outs = pool.run(on_rank_corrupt, True, zero_copy)
    expect_all_raise(outs, "ChecksumError", "received bytes differ from what was sent", "checksum mismatch",
                      "of tensor 'w' (item 0), sent by rank", "to rank 6 (destination box")
    # without verify the same corruption goes unnoticed: this is what verify is for
    unverified = pool.run_ok(on_rank_corrupt, False, zero_copy)
    assert unverified[6] is False and all(unverified[r] for r in range(WORLD) if r != 6)


def _linear_checksum(view: torch.Tensor, *, out: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The position-weighted byte sum `verify=True` used before (byte `i`, value `v`, adds `v * (i + 1 + 1_000_003)`):
    the negative control of `test_plus_minus_plus_with_verify_raises_on_every_rank`."""
    x = view if dtype is None else view.to(dtype)
    flat = x.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    return out.copy_((flat * torch.arange(1_000_004, 1_000_004 + flat.numel(), dtype=torch.int64)).sum())


def on_rank_plus_minus_plus(w, linear: bool) -> bool:
    """Rank 6 adds +1, -2, +1 to three adjacent bytes of its second receive buffer before unpacking (no byte wraps);
    with `linear`, every rank checksums with the old linear sum instead of `reshard.kernels.checksum`."""
    import reshard.comm._executor as ex

    src, dst = _layouts(shape=(64, 48))
    p = plan(src, dst, staging_bytes=8192, min_split_bytes=256)
    full, s, d = _locals(w.rank, src, dst)
    original_unpack, original_checksum = ex.prepare_unpack, ex.checksum
    calls = []

    def corrupting_prepare_unpack(buffer, offsets, tensors, boxes, **kw):
        calls.append(1)

        def corrupt() -> None:
            b = buffer[int(offsets[0]):].tolist()
            i = next(i for i in range(len(b) - 2) if b[i] < 255 and b[i + 1] >= 2 and b[i + 2] < 255)
            buffer[int(offsets[0]) + i: int(offsets[0]) + i + 3] += torch.tensor([1, 254, 1], dtype=torch.uint8)

        inner = original_unpack(buffer, offsets, tensors, boxes, **kw)
        return Hooked(inner, corrupt) if len(calls) == 2 else inner

    if w.rank == 6:
        ex.prepare_unpack = corrupting_prepare_unpack
    if linear:
        ex.checksum = _linear_checksum
    os.environ[ex.ZERO_COPY_ENV] = "0"  # the corruption is injected into staging: every message through it
    try:
        reshard(s, d, p, w.group, verify=True, timeout=30)
    finally:
        ex.prepare_unpack, ex.checksum = original_unpack, original_checksum
        del os.environ[ex.ZERO_COPY_ENV]
    return d is None or torch.equal(as_bytes(d), as_bytes(dtensor_local(full, dst)))


def test_plus_minus_plus_with_verify_raises_on_every_rank(pool) -> None:
    outs = pool.run(on_rank_plus_minus_plus, False)
    expect_all_raise(outs, "ChecksumError", "received bytes differ from what was sent", "checksum mismatch",
                      "to rank 6 (destination box")
    # negative control: with the old linear checksum, verify passes and rank 6 holds wrong bytes
    linear = pool.run_ok(on_rank_plus_minus_plus, True)
    assert linear[6] is False and all(linear[r] for r in range(WORLD) if r != 6)


def on_rank_stuck(w, timeout: float, tag: str = "stuck") -> float:
    """Rank 7 stops answering in its third chunk; the others must raise within `timeout` of its silence."""
    import reshard.comm._executor as ex

    group = w.new_group(tag, timeout=timeout)
    src, dst = _layouts(shape=(64, 48))
    p = plan(src, dst, staging_bytes=4096, min_split_bytes=256)
    _, s, d = _locals(w.rank, src, dst)
    original = ex._post_tagged

    def stall(_received: torch.Tensor) -> None:
        time.sleep(timeout + 15)
        raise RuntimeError("rank 7 was stuck on purpose")

    if w.rank == 7:
        _hook_post(ex, 3, stall)
    start = time.monotonic()
    try:
        reshard(s, d, p, group, timeout=timeout)
    finally:
        ex._post_tagged = original
        w.scratch["elapsed"] = time.monotonic() - start
        group.close()
    return w.scratch["elapsed"]


def on_rank_ready(w) -> int:
    w.new_group("stuck-warm-up", timeout=60).close()  # a process's first gloo group takes seconds to connect
    return w.rank


@pytest.mark.slow  # waits out a 10 s timeout, twice under load: ~30 s
def test_stuck_peer_makes_every_rank_raise_within_timeout(pool) -> None:
    # 10 s: the same timeout bounds the 8 ranks' rendezvous, which took over 5 s on a 2-core machine running another
    # module's ranks beside them; and every rank has connected a gloo group once before (the first one in a process
    # is the slow one)
    timeout = 10.0
    pool.run_ok(on_rank_ready)
    for attempt in range(3):
        outs = pool.run(on_rank_stuck, timeout, f"stuck-{attempt}")
        # the group's rendezvous, bounded by the same timeout, can still miss it on 2 cores under another module's
        # load (a rank's gloo connection took over 10 s in a fresh clone's run): that is not the case under test,
        # so it runs again on a fresh group; a failure after the rendezvous is judged below
        if not any(o.error and ("the rendezvous failed" in o.error or "did not join" in o.error) for o in outs):
            break
    assert outs[7].error_type == "RuntimeError", outs[7].error
    for o in outs[:7]:
        assert o.error_type == "CommError", f"rank {o.rank}: {o.error}"
        # the first rank to time out names rank 7 with its own limit: the data phase's `timeout`, or, for a rank
        # already in the completion round under rank 7 in its tree, `timeout` plus a level's grace
        grace = tree_grace(timedelta(seconds=timeout)).total_seconds()
        limits = {f"timeout {timeout} s", f"timeout {timeout + grace} s"}
        assert f"rank {o.rank} of" in o.error and any(t in o.error for t in limits), o.error
        # rank 7 goes silent for timeout + 15 s: a rank that waited for it, rather than for its timeout, would take
        # that long; 10 s on top of the timeout allow for the plan and first chunks on 2 loaded cores running 8 ranks
        assert o.seconds < timeout + 10, (o.rank, o.seconds)


def test_posting_to_a_dead_peer_raises_comm_error() -> None:
    """gloo refuses to post on a connection a dead peer closed (a RuntimeError at `send`/`recv`, before any wait):
    `post` turns it into a `CommError` naming this rank, the operation and the peer."""
    from reshard.comm import CommError
    from reshard.comm._transfer import post

    class ClosedPg:
        def recv(self, tensors, peer, tag):
            return object()

        def send(self, tensors, peer, tag):
            raise RuntimeError("Connection closed by peer [127.0.0.1]:8360")

    class OneGroup:
        rank, timeout = 2, None

        def data_backend(self, device):
            return ClosedPg()

        def __str__(self) -> str:
            return "Group(4 ranks)"

    t = torch.zeros(4)
    with pytest.raises(CommError, match=r"rank 2 of Group\(4 ranks\): chunk 3: cannot post send to rank 1; the peer"):
        post([(1, t)], [(0, t)], OneGroup(), what="chunk 3")


def on_rank_agreed(w, tag: str) -> None:
    """`execute(agreed=True)`: a plan that ran before runs with no handshake and delivers DTensor's bytes; then rank
    2 passes a float64 source with `agreed=True`: it raises its own error, the other ranks of the plan the fault it
    recorded (not their timeout). Last in the module: the ranks that raise leave waits on their aborted group
    behind, which end at its timeout and slowed the next test's 2 s rendezvous."""
    from reshard.comm import execute

    group = w.new_group(tag, timeout=10)
    src, dst = _layouts()
    p = plan(src, dst)
    full, s, d = _locals(w.rank, src, dst)
    srcs, dsts = ([s] if s is not None else None), ([d] if d is not None else None)
    execute(p, w.rank, srcs, dsts, group)
    if d is not None:
        d.zero_()
    execute(p, w.rank, srcs, dsts, group, agreed=True, confirm=False)
    assert d is None or torch.equal(as_bytes(d), as_bytes(dtensor_local(full, dst))), f"rank {w.rank}: wrong bytes"
    if w.rank == 2:
        srcs = [s.to(torch.float64)]
    t0 = time.perf_counter()
    try:
        execute(p, w.rank, srcs, dsts, group, agreed=True)
    finally:
        group.close()
        assert time.perf_counter() - t0 < 7, f"rank {w.rank} waited out its timeout"


def test_agreed_runs_skip_the_handshake_and_fail_every_rank_on_bad_input(pool) -> None:
    outs = pool.run(on_rank_agreed, "agreed")
    ranks = plan(*_layouts()).ranks
    assert outs[2].error_type == "ValueError" and "bad input, nothing was moved by this rank" in outs[2].error, \
        outs[2].error
    for o in outs:
        if o.rank in ranks and o.rank != 2:
            assert o.error_type == "CommError" and "rank 2" in o.error, (o.rank, o.error, o.trace)
