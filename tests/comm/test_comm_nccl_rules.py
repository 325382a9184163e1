"""NCCL's rules on CPU: the `reshard_nccl_rules` backend's own contract, then reshard on it.

The backend's contract (lazy communicators, asynchronous completion with poisoned receive buffers, unchecked sizes,
one rank per device, a dead peer a stall) is checked on groups built directly over the pool's store. Then reshard's
NCCL path: a first refit in which trainer replicas send nothing completes because the communicator is connected at
rendezvous (and stalls into a `CommError` when it is not), and two ranks on one device are refused at rendezvous.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from reshard.testing import NCCL_RULES

pytestmark = pytest.mark.distributed

RANK_POOL = {"world_size": 8, "backend": NCCL_RULES, "timeout_s": 240}  # the refit needs 8; contracts use 3
SMALL = 3


def rules_group(w, tag: str, *, timeout: float = 20.0, delay_s: float | None = None):
    """A 3-rank `NcclRulesGroup` over the pool's store (ranks 0-2), built like torch builds a registered backend."""
    import torch.distributed as dist

    from reshard.testing import NcclRulesGroup

    store = dist.PrefixStore(f"rules/{tag}/", dist.TCPStore(w.host, w.port, is_master=False,
                                                            timeout=datetime.timedelta(seconds=30)))
    return NcclRulesGroup(store, w.rank, SMALL, datetime.timedelta(seconds=timeout), delay_s=delay_s), store


def job_lazy_first_batch(w) -> dict | None:
    """Ranks 0 and 1 swap in a coalesced batch while rank 2 has not joined: the batch cannot complete (its receive
    buffer holds poison, `wait()` returned anyway) until rank 2 connects."""
    if w.rank >= SMALL:
        return None
    pg, store = rules_group(w, "lazy")
    if w.rank == 2:
        store.wait(["checked/0", "checked/1"])
        pg.eager_connect_single_device(None)
        return None
    peer = 1 - w.rank
    out = torch.arange(5, dtype=torch.float32) + 10 * w.rank
    inp = torch.zeros(5)
    pg._start_coalescing(torch.device("cpu"))
    pg.recv([inp], peer, 1)
    pg.send([out], peer, 1)
    work = pg._end_coalescing(torch.device("cpu"))
    returned = work.wait()  # NCCL's wait on CUDA: a stream wait, never a host block
    time.sleep(0.5)
    before = {"completed": work.is_completed(), "poisoned": bool((inp.view(torch.uint8) == 0xFF).all())}
    store.set(f"checked/{w.rank}", b"1")
    work.synchronize()
    return {"returned": returned, **before, "after": inp.tolist(), "expected": (torch.arange(5.0) + 10 * peer).tolist()}


def test_first_batch_waits_for_every_rank_to_join_and_wait_does_not_block(pool) -> None:
    outs = pool.run_ok(job_lazy_first_batch, timeout=120)
    for o in outs[:2]:
        assert o["returned"] is True
        assert o["completed"] is False and o["poisoned"] is True, o
        assert o["after"] == o["expected"]


def job_sizes_unchecked(w) -> dict | None:
    """Rank 0 sends 4 floats into rank 1's 6-float receive, rank 1 sends 6 into rank 0's 4: no error (gloo would
    refuse both), `min` of the sizes lands."""
    if w.rank >= SMALL:
        return None
    pg, _ = rules_group(w, "sizes")
    pg.eager_connect_single_device(None)
    if w.rank == 2:
        return None
    n_send, n_recv = (4, 4) if w.rank == 0 else (6, 6)
    out = torch.arange(n_send, dtype=torch.float32) + 100 * w.rank
    inp = torch.zeros(6 if w.rank == 1 else 4)
    pg._start_coalescing(torch.device("cpu"))
    pg.recv([inp], 1 - w.rank, 1)
    pg.send([out], 1 - w.rank, 1)
    work = pg._end_coalescing(torch.device("cpu"))
    work.synchronize()
    return {"error": work.exception(), "got": inp.view(torch.int32).tolist(), "n_recv": n_recv}


def test_sizes_of_a_matched_pair_are_not_checked(pool) -> None:
    outs = pool.run_ok(job_sizes_unchecked, timeout=120)
    assert outs[0]["error"] is None and outs[1]["error"] is None
    assert outs[0]["got"] == (torch.arange(4.0) + 100).view(torch.int32).tolist()  # 4 of rank 1's 6
    poison = torch.full((2,), -1, dtype=torch.int32).tolist()  # 0xFFFFFFFF: never written
    assert outs[1]["got"] == torch.arange(4.0).view(torch.int32).tolist() + poison


def job_reuse_and_stall(w) -> dict | None:
    """Rank 0 writes a buffer it posted to rank 1 before the batch completed (detected); rank 0 waits for a
    receive rank 2 never sends (alive, it just does not post): the receive never completes and never raises."""
    from reshard.testing import rules_violations

    if w.rank >= SMALL:
        return None
    pg, store = rules_group(w, "reuse", delay_s=0.5)
    pg.eager_connect_single_device(None)
    result: dict = {}
    if w.rank == 0:
        x = torch.ones(16)
        work = pg.send([x], 1, 1)
        x.add_(1)  # the rule break: NCCL may send either version
        work.synchronize()
        result["reuse_error"] = str(work.exception())
        result["violations"] = len(rules_violations())
        stalled = pg.recv([torch.zeros(3)], 2, 2)
        time.sleep(1.5)
        result["stall"] = (stalled.is_completed(), stalled.exception(), stalled.wait())
        pg.abort()
        store.set("stall-checked", b"1")
    elif w.rank == 1:
        got = torch.zeros(16)
        pg.recv([got], 0, 1).synchronize()
    else:
        store.wait(["stall-checked"])
    return result


def test_buffer_reuse_is_detected_and_a_silent_peer_is_a_stall_not_an_error(pool) -> None:
    out = pool.run_ok(job_reuse_and_stall, timeout=120)[0]
    assert "written after its send was posted" in out["reuse_error"]
    assert out["violations"] >= 1
    assert out["stall"] == (False, None, True)


def job_duplicate_device(w, via: str) -> str | None:
    """Ranks 0 and 1 bind device 0: the backend's own connect refuses like NCCL, and `Group.rendezvous` refuses
    before any data backend connects, naming both ranks, on every rank."""
    from reshard.comm import Group
    from reshard.testing import set_rules_device

    if w.rank >= SMALL:
        return None
    set_rules_device(0 if w.rank < 2 else w.rank)
    try:
        if via == "backend":
            pg, _ = rules_group(w, "dup")
            pg.eager_connect_single_device(None)
        else:
            Group.rendezvous(w.host, w.port, w.rank, SMALL, prefix="case/dup", timeout=20, is_master=False,
                             backend=NCCL_RULES)
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        return f"{type(e).__name__}: {e}"
    finally:
        set_rules_device(w.rank)
    return "accepted"


@pytest.mark.parametrize("via,pattern", [
    ("backend", "RuntimeError: .*Duplicate GPU detected: rank 0 and rank 1 both on device 0"),
    ("rendezvous", "ValueError: .*ranks 0 and 1 are both bound to cpu:0 on one host.*torch.cuda.set_device"),
])
def test_two_ranks_on_one_device_are_refused_on_every_rank(pool, via: str, pattern: str) -> None:
    import re

    outs = pool.run_ok(job_duplicate_device, via, timeout=120)
    for r in range(SMALL):
        assert re.search(pattern, outs[r]), (r, outs[r])


REFIT_SYSTEM = "train=ep2,dp2 gen=tp2,dp2 domain=4"  # trainer ranks 0-3 (2 and 3: replicas that send nothing)


def job_first_refit(w, tag: str, eager: bool, timeout: float) -> dict:
    """The first refit of a new group whose trainer replicas (ranks 2 and 3) never post a message."""
    from refit_cases import _verify, setup

    import reshard.comm._devices as devices

    devices.EAGER = eager
    try:
        group = w.new_group(tag, timeout=timeout)
    finally:
        devices.EAGER = True
    try:
        refit, _, dests, sysm, config = setup("tiny-deepseek", REFIT_SYSTEM, w.rank, 3, group=group)
        refit.run()
        return {"mismatches": _verify(w.rank, dests, sysm, config, 3), "checked": len(dests),
                "posted": group.data_backend(torch.device("cpu")).num_posted}
    finally:
        group.close()


def test_first_refit_with_replicas_that_send_nothing_completes(pool) -> None:
    outs = pool.run_ok(job_first_refit, "eager", True, 60.0, timeout=200)
    for o in outs:
        assert o["mismatches"] == [], o["mismatches"]
    assert sum(o["checked"] for o in outs[4:]) > 0
    assert outs[2]["posted"] == outs[3]["posted"] == 0 < outs[0]["posted"]  # the replicas indeed post nothing


def test_without_eager_connect_the_same_refit_stalls_into_a_comm_error(pool) -> None:
    """The hazard eager connect removes: lazily created, the communicator's first batch waits for ranks 2 and 3,
    which never post; reshard's deadline ends the wait with a `CommError` instead of a hang."""
    outs = pool.run(job_first_refit, "lazy", False, 6.0, timeout=200)
    assert [o.rank for o in outs if o.ok] == [2, 3], [(o.rank, o.error) for o in outs]  # they post nothing
    for o in outs:
        if not o.ok:  # every rank that posted names rank 2, the first that never joined the communicator
            assert o.error_type == "CommError", f"rank {o.rank}: {o.error}\n{o.trace}"
            assert "did not complete within 6.0 s: rank 2 did not take part" in o.error, o.error


def job_mixed_devices(w) -> str | None:
    """Rank 1 stands in for a CUDA engine in a group with an NCCL backend (its tensors' device reported as
    `cuda:0`, its staging and its "NCCL" kept on the CPU, since this machine may have no GPU); rank 0 holds CPU
    tensors. Each side has a backend for its own tensors, so without the device agreement they would post on
    different backends (on a real mix: both wait out the timeout). The plan handshake must refuse on both ranks
    before any byte: rank 1's destination stays as it was."""
    import reshard.comm._prepare as prep
    from reshard import Layout, Mesh, plan
    from reshard.comm import reshard

    if w.rank >= 2:
        return None
    from torch.distributed.tensor import Replicate

    p = plan(Layout((6, 4), Mesh([0]), [Replicate()], torch.float32),
             Layout((6, 4), Mesh([1]), [Replicate()], torch.float32))
    src = torch.arange(24.0).reshape(6, 4) if w.rank == 0 else None
    dst = torch.full((6, 4), -7.0) if w.rank == 1 else None
    original = prep._checked
    if w.rank == 1:
        def as_cuda(*args, **kwargs):
            errs, _ = original(*args, **kwargs)
            return errs, torch.device("cuda", 0)

        prep._checked = as_cuda
        w.group._data["cuda"] = w.group._data["cpu"]
        real_staging = prep.staging_for
        prep.staging_for = lambda group, prog, device, verify, **kw: real_staging(group, prog, torch.device("cpu"),
                                                                                  verify, **kw)
    try:
        reshard(src, dst, p, w.group, timeout=20)
    except ValueError as e:
        untouched = dst is None or bool((dst == -7.0).all())
        return f"ValueError: {e} untouched={untouched}"
    finally:
        prep._checked = original
        if w.rank == 1:
            prep.staging_for = real_staging
            del w.group._data["cuda"]
    return "moved"


def test_mixed_device_types_are_refused_on_every_rank_before_any_byte(pool) -> None:
    outs = pool.run_ok(job_mixed_devices, timeout=120)
    for o in outs[:2]:
        assert o.startswith("ValueError:") and "untouched=True" in o, o
        assert "tensors' device type" in o and "'cpu'" in o and "'cuda'" in o, o


def job_nccl_without_cuda(w) -> str | None:
    from reshard.comm import Group

    if w.rank >= 2:
        return None
    try:
        Group.rendezvous(w.host, w.port, w.rank, 2, prefix="case/nccl-no-cuda", timeout=20, is_master=False,
                         backend="nccl")
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs ranks without CUDA")
def test_nccl_asked_where_ranks_have_no_cuda_is_refused_on_every_rank(pool) -> None:
    """Decided after the device exchange, before any NCCL communicator (whose creation needs every rank)."""
    outs = pool.run_ok(job_nccl_without_cuda, timeout=120)
    for o in outs[:2]:
        assert "backend='nccl' needs a CUDA build of torch and a GPU on every rank; ranks [0, 1] have none" in o, o


def test_rank_pool_refuses_more_nccl_ranks_than_gpus() -> None:
    """NCCL refuses two ranks on one device, so the pool does not put several ranks on `cuda:0`: it refuses."""
    from reshard.testing import RankPool

    n = torch.cuda.device_count() + 1
    pattern = rf"needs one GPU per rank .*{n} ranks, {n - 1} GPUs visible.*reshard_nccl_rules"
    with pytest.raises(ValueError, match=pattern):
        RankPool(n, backend="nccl")
