"""The host-staged route: CUDA tensors in a group whose data moves over gloo (CPU trainers and a GPU engine), on CPU.

This machine may have no GPU, so ranks stand in for CUDA ones: a stand-in rank reports its tensors' device as
`cuda:0` to the preparation (as `tests/comm/test_comm_nccl_rules.py` does), the real `choose_route` decides from the
group's data backends (gloo only here), and only the device of the route it chose is then swapped back to the CPU
(the tensors are CPU tensors), keeping `staged=True`. So everything after the decision is the code a real CUDA rank
runs: the device slots and their separate host mirror, the copy of each packed chunk to the mirror, gloo moving the
mirror, the copy of each received chunk on to the device slot before the unpack, the slots and mirrors reused from
chunk to chunk, relayed boxes forwarded after they landed, checksums through the mirror. The destinations are
checked bit for bit against DTensor, and a model-level `Refit`'s against the oracle of vLLM's layout rules
(`tests/vllm_oracle.py`). What only a GPU shows (pinned memory, non-blocking copies and the stream and
event order around them) is not proven here: see docs/comm.md.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from comm_cases import as_bytes, dtensor_local, full_tensor

pytestmark = pytest.mark.distributed

RANK_POOL = 4


def _items():
    """Odd geometry on purpose: prime extents (uneven shards), a 1-byte dtype, a rank on both sides (1: local
    copies), and a tensor replicated over ranks 2 and 3 of one NVLink domain (one crossing, then a relay from the
    destination tensor that landed)."""
    from reshard import Layout, Mesh, PlanItem

    a = (Layout((37, 11), Mesh([0, 1]), [Shard(0)], torch.float32),
         Layout((37, 11), Mesh([1, 2, 3]), [Shard(1)], torch.float32))
    b = (Layout((29,), Mesh([0, 1]), [Shard(0)], torch.int8), Layout((29,), Mesh([2, 3]), [Replicate()], torch.int8))
    c = (Layout((5, 7, 3), Mesh([0, 1, 2]), [Shard(1)], torch.bfloat16),
         Layout((5, 7, 3), Mesh([3, 1]), [Shard(0)], torch.bfloat16))
    return [PlanItem(*a, 0, 0, "a"), PlanItem(*b, 1, 1, "b"), PlanItem(*c, 2, 2, "c")]


_REAL: dict = {}


def stand_in(on: bool, decided: list | None = None) -> None:
    """On this rank, from now on (`on`) or no longer: tensors reported as `cuda:0` to the run's preparation, the
    real route decision recorded in `decided`, and the chosen route's device swapped back to the CPU."""
    import reshard.comm._prepare as prep

    if not _REAL:
        _REAL.update(checked=prep._checked, route=prep.choose_route)
    if not on:
        prep._checked, prep.choose_route = _REAL["checked"], _REAL["route"]
        return

    def as_cuda(*args, **kwargs):
        errs, _ = _REAL["checked"](*args, **kwargs)
        return errs, torch.device("cuda", 0)

    def route_on_cpu(device, backends):
        route = _REAL["route"](device, backends)  # the real decision, from the group's data backends
        if decided is not None:
            decided.append((str(device), sorted(backends), route.wire, route.staged))
        return prep.Route(torch.device("cpu"), route.wire, staged=route.staged)

    prep._checked, prep.choose_route = as_cuda, route_on_cpu


def job_staged(w, cuda_ranks: tuple[int, ...], verify: bool) -> dict:
    """Ranks in `cuda_ranks` stand in for CUDA ranks; two refits of the same plan (the second reuses the staging
    and its host mirror), each checked against DTensor."""
    import reshard.comm._prepare as prep
    from reshard import Topology, plan_many
    from reshard.comm import execute

    p = plan_many(_items(), Topology(domain_size=2), staging_bytes=256, min_split_bytes=16)
    fulls = [full_tensor(it.src.shape, it.src.dtype, f"hoststage/{it.label}") for it in p.items]
    srcs = [dtensor_local(f, it.src) if w.rank in it.src.ranks else None for f, it in zip(fulls, p.items)]
    expected = [dtensor_local(f, it.dst) if w.rank in it.dst.ranks else None for f, it in zip(fulls, p.items)]
    dsts = [torch.full_like(e, 3) if e is not None else None for e in expected]
    has_src = any(t is not None for t in srcs)
    has_dst = any(t is not None for t in dsts)
    decided: list = []
    def poison(staging) -> None:  # no byte left over from an earlier run can stand in for a missing copy
        for t in [*staging.slots, *(staging.host.slots if staging.host is not None else [])]:
            t.fill_(0xEE)

    reports, mirrors, wrong = [], [], []
    w.group.cache.clear()
    prog = p.for_rank(w.rank)
    if prog.chunks:  # reserved here, poisoned, and then used by `execute` (it fits)
        poison(prep.staging_for(w.group, prog, torch.device("cpu"), verify, host=w.rank in cuda_ranks))
    try:
        stand_in(w.rank in cuda_ranks, decided)
        for _ in range(2):
            for d in dsts:
                if d is not None:
                    d.fill_(3)
            reports.append(execute(p, w.rank, srcs if has_src else None, dsts if has_dst else None, w.group,
                                   verify=verify))
            staging = w.group.cache.get("staging")
            host = getattr(staging, "host", None)
            if staging is not None:
                poison(staging)
            mirrors.append(None if host is None else (
                [s.data_ptr() for s in staging.slots], [s.data_ptr() for s in host.slots]))
            # checked in the test process: a rank that raised here would leave its peers waiting in the next refit
            wrong.append([it.label for d, e, it in zip(dsts, expected, p.items)
                          if d is not None and not torch.equal(as_bytes(d), as_bytes(e))])
    finally:
        stand_in(False)
        w.group.cache.clear()
    r = reports[-1]
    return {"wrong": wrong, "decided": decided, "route": r.route, "host_staged": r.bytes_host_staged,
            "wire": r.bytes_sent + r.bytes_received, "received": r.bytes_received, "direct": r.bytes_direct, "chunks": r.chunks,
            "verified": r.verified_boxes, "mirrors": mirrors}


CASES = {
    "cpu-trainer-into-cuda-engine": (2, 3),
    "cuda-trainer-into-cpu-engine": (0, 1),
    "a-staged-rank-on-each-side": (1, 2),
}


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
@pytest.mark.parametrize("case", list(CASES))
def test_host_staged_refit_is_exact_against_dtensor(pool, case: str, verify: bool) -> None:
    cuda_ranks = CASES[case]
    outs = pool.run_ok(job_staged, cuda_ranks, verify, timeout=120)
    for rank, o in enumerate(outs):
        assert o["wrong"] == [[], []], f"rank {rank}: bytes differ from DTensor's in {o['wrong']} (per refit)"
        if rank in cuda_ranks:
            # the real decision: CUDA tensors, a gloo-only group -> staged through host memory, a "cpu" wire
            assert o["decided"] and all(d == ("cuda:0", ["cpu"], "cpu", True) for d in o["decided"]), o["decided"]
            assert o["route"] == "host-staged", o
            assert o["wire"] > 0 and o["host_staged"] == o["wire"], o  # every wire byte went through the mirror
            assert o["direct"] == 0, o  # gloo cannot read device memory: no zero-copy message
            assert o["chunks"] > 2, o  # more chunks than slots: slots and mirror are reused
            first, second = o["mirrors"]
            assert first == second, o  # reserved once, reused by the next refit
            assert not set(first[0]) & set(first[1]), o  # the mirror is memory of its own
        else:
            assert o["route"] in ("direct", "") and o["host_staged"] == 0 and o["mirrors"] == [None, None], o
        if verify and o["received"]:
            assert o["verified"] > 0, o  # checksums came through the mirror and were checked


def job_refit_into_staged_engine(w) -> dict:
    """The model-level `Refit` (a tiny DeepSeek-style MoE, trainer TP2 on ranks 0-1, engine TP2 on ranks 2-3 with
    fused and padded tensors): the engine ranks stand in for CUDA ones, the trainer ranks are CPU processes."""
    from refit_cases import _verify, setup

    decided: list = []
    try:
        stand_in(w.rank >= 2, decided)
        refit, _, dests, sysm, config = setup("tiny-deepseek", "train=tp2 gen=tp2 domain=2", w.rank, 5,
                                              staging_bytes=4096, group=w.group)
        report = refit.run()
        return {"mismatches": _verify(w.rank, dests, sysm, config, 5), "checked": len(dests), "decided": decided,
                "report": repr(report)}
    finally:
        stand_in(False)
        w.group.cache.clear()


def test_refit_from_cpu_trainers_into_a_staged_engine_matches_the_vllm_layout_oracle(pool) -> None:
    outs = pool.run_ok(job_refit_into_staged_engine, timeout=200)
    for rank, o in enumerate(outs):
        assert o["mismatches"] == [], (rank, o["mismatches"])
        assert all(d[2:] == ("cpu", True) for d in o["decided"]) and bool(o["decided"]) == (rank >= 2), (rank, o)
    assert sum(o["checked"] for o in outs[2:]) > 0


def job_refused_without_host_staging(w) -> str | None:
    """A delta run cannot take the host-staged route: refused on both ranks before any byte."""
    from reshard import Layout, Mesh, plan
    from reshard.comm import DeltaSession, execute

    if w.rank >= 2:
        return None
    p = plan(Layout((6, 4), Mesh([0]), [Replicate()], torch.float32),
             Layout((6, 4), Mesh([1]), [Replicate()], torch.float32))
    src = [torch.arange(24.0).reshape(6, 4)] if w.rank == 0 else None
    dst = [torch.full((6, 4), -7.0)] if w.rank == 1 else None
    try:
        stand_in(w.rank == 1)
        execute(p, w.rank, src, dst, w.group, delta=DeltaSession(), timeout=20)
    except ValueError as e:
        return f"ValueError: {e} untouched={dst is None or bool((dst[0] == -7.0).all())}"
    finally:
        stand_in(False)
        w.group.cache.clear()
    return "moved"


def test_a_run_that_cannot_stage_is_refused_on_every_rank(pool) -> None:
    outs = pool.run_ok(job_refused_without_host_staging, timeout=120)
    for o in outs[:2]:
        assert o.startswith("ValueError:") and "untouched=True" in o, o
    assert "cannot stage cuda:0 tensors through host memory" in outs[1], outs[1]


def test_route_choice() -> None:
    """The decision itself, on its own: direct where the group has a backend for the tensors' device type, host
    staging for CUDA tensors over gloo, refused otherwise."""
    from reshard.comm._hoststage import Route, choose_route

    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert choose_route(cpu, {"cpu"}) == Route(cpu, "cpu")
    assert choose_route(cuda, {"cpu", "cuda"}) == Route(cuda, "cuda")
    assert choose_route(cuda, {"cpu"}) == Route(cuda, "cpu", staged=True)
    with pytest.raises(ValueError, match=r"no backend for cpu tensors \(the group has \['cuda'\]\)"):
        choose_route(cpu, {"cuda"})
