"""Reshard cases and the functions that run them on the ranks of a `reshard.testing.RankPool`.

A `Case` is a source layout and a destination layout (DTensor meshes and placements over the pool's ranks), a
dtype, planning options and a call form. `run_cases` runs a list of cases on every rank, one after another, and
checks each destination local tensor bit for bit against DTensor's own
`distribute_tensor(full, dst_mesh, dst_placements, src_data_rank=None).to_local()`.
"""

from __future__ import annotations

import hashlib
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

R = Replicate()
S0, S1, S2, S3, S4 = (Shard(d) for d in range(5))

FORMS = ("plan", "dtensor", "dtensor_none")
"""How a case calls reshard: `reshard(local, local, plan, rendezvous_group)`; `reshard_dtensor` with DTensors on
every rank and `Group.world()`; `reshard_dtensor` with None for the side a rank is not on, over the rendezvous
group."""

SENTINEL = 0xA5


@dataclass(frozen=True)
class Case:
    """One reshard: `full` of `shape`/`dtype` from `src_mesh`/`src_pl` to `dst_mesh`/`dst_pl`."""

    id: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    src_mesh: Any
    src_pl: tuple
    dst_mesh: Any
    dst_pl: tuple
    form: str = "plan"
    domain_size: int | None = None
    relay: bool = True
    staging: int = 1 << 20
    min_split: int = 1 << 20
    verify: bool = False
    expect: dict = field(default_factory=dict)  # plan statistics the case must have, e.g. {"messages": 0}
    local: bool = False  # each rank plans its own part (`plan_local`), form "plan" only


class Hooked:
    """A prepared copy (`reshard.kernels.PreparedCopy`) that calls `before()` each time before it runs: how the
    fault tests corrupt, stall or kill a rank in the middle of a transfer."""

    def __init__(self, inner: Any, before: Any) -> None:
        self.inner, self.before = inner, before

    def run(self) -> None:
        self.before()
        self.inner.run()


def expect_all_raise(outs: list[Any], error_type: str, *patterns: str) -> None:
    """Every rank's `Outcome` in `outs` is an error of type `error_type` whose message contains each pattern."""
    for o in outs:
        assert not o.ok, f"rank {o.rank} did not raise (returned {o.value!r})"
        assert o.error_type == error_type, f"rank {o.rank}: {o.error}\n{o.trace}"
        for pat in patterns:
            assert pat in o.error, f"rank {o.rank}: {pat!r} not in:\n{o.error}"


def full_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: str) -> torch.Tensor:
    """Random bytes of `shape` and `dtype`, the same on every rank (any bit pattern: NaNs included)."""
    numel = 1
    for s in shape:
        numel *= s
    g = torch.Generator().manual_seed(int(hashlib.sha256(seed.encode()).hexdigest()[:8], 16))
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def dtensor_local(full: torch.Tensor, layout: Any) -> torch.Tensor:
    """DTensor's `distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()` for `layout` on this
    process (its rank in the default world must be its rank in `layout`)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor

    mesh = DeviceMesh("cpu", torch.tensor(layout.mesh.ranks).reshape(layout.mesh.shape), _init_backend=False)
    return distribute_tensor(full, mesh, list(layout.placements), src_data_rank=None).to_local()


def _mesh_ranks(mesh: Any) -> list[int]:
    return torch.as_tensor(mesh).flatten().tolist()


def run_one(w: Any, case: Case) -> dict:
    """Run `case` on this rank; returns what the test process checks (raises on a wrong result)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from reshard import Layout, Mesh, Topology, plan
    from reshard.comm import Group, reshard, reshard_dtensor

    full = full_tensor(case.shape, case.dtype, case.id)
    src_t, dst_t = torch.as_tensor(case.src_mesh), torch.as_tensor(case.dst_mesh)
    smesh = DeviceMesh("cpu", src_t, _init_backend=False)
    dmesh = DeviceMesh("cpu", dst_t, _init_backend=False)
    in_src, in_dst = w.rank in _mesh_ranks(src_t), w.rank in _mesh_ranks(dst_t)
    src_dt = distribute_tensor(full, smesh, list(case.src_pl), src_data_rank=None)
    expected = distribute_tensor(full, dmesh, list(case.dst_pl), src_data_rank=None).to_local()
    out = torch.empty_like(expected)
    as_bytes(out).fill_(SENTINEL) if out.numel() else None
    dst_dt = DTensor.from_local(out, dmesh, list(case.dst_pl), run_check=False, shape=full.shape,
                                stride=full.stride())
    topology = Topology(domain_size=case.domain_size)
    kw = {"relay": case.relay, "staging_bytes": case.staging, "min_split_bytes": case.min_split}
    src_layout = Layout(case.shape, Mesh(src_t), list(case.src_pl), case.dtype)
    dst_layout = Layout(case.shape, Mesh(dst_t), list(case.dst_pl), case.dtype)
    if case.local:
        from reshard.planner import plan_local

        p = plan_local([(src_layout, dst_layout)], topology, w.rank, **kw)
    else:
        p = plan(src_layout, dst_layout, topology, **kw)
    if case.form == "plan":
        reshard(src_dt.to_local() if in_src else None, out if in_dst else None, p, w.group, verify=case.verify,
                timeout=30)
    elif case.form == "dtensor":
        reshard_dtensor(src_dt, dst_dt, topology=topology, group=Group.world(), verify=case.verify, timeout=30,
                        **kw)
    elif case.form == "dtensor_none":
        reshard_dtensor(src_dt if in_src else None, dst_dt if in_dst else None, topology=topology, group=w.group,
                        verify=case.verify, timeout=30, **kw)
    else:
        raise ValueError(case.form)
    if in_dst:
        assert out.shape == expected.shape, (out.shape, expected.shape)
        assert out.dtype == expected.dtype
        if not torch.equal(as_bytes(out), as_bytes(expected)):
            wrong = (as_bytes(out) != as_bytes(expected)).nonzero().flatten()
            raise AssertionError(f"rank {w.rank}: {wrong.numel()} of {as_bytes(out).numel()} bytes differ from "
                                 f"DTensor, first at byte {int(wrong[0])}\n{p.describe()}")
    s = p.stats
    direct = sum(m.nbytes for c in p.for_rank(w.rank).chunks for m in (*c.sends, *c.recvs) if m.direct) \
        if w.rank in p.ranks else 0
    return {"checked": in_dst, "direct_bytes": direct, "messages": s.messages, "network": s.network_bytes,
            "nvlink": s.nvlink_bytes, "local": s.local_bytes, "chunks": s.num_chunks,
            "relays": sum(t.stage > 0 for t in p.transfers)}


def run_cases(w: Any, cases: list[Case], *, staged: bool = False) -> list[tuple[bool, Any]]:
    """Run every case in order on this rank; `(True, result)` or `(False, error text)` per case. `staged`: with
    `RESHARD_ZERO_COPY=0`, so every message goes through staging (the zero-copy path otherwise)."""
    import os

    from reshard.comm._executor import ZERO_COPY_ENV

    before = os.environ.get(ZERO_COPY_ENV)
    os.environ[ZERO_COPY_ENV] = "0" if staged else "1"
    out: list[tuple[bool, Any]] = []
    try:
        for case in cases:
            try:
                out.append((True, run_one(w, case)))
            except Exception as e:  # noqa: BLE001 - reported per case to the test process
                out.append((False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if before is None:
            os.environ.pop(ZERO_COPY_ENV)
        else:
            os.environ[ZERO_COPY_ENV] = before
    return out


# -------------------------------------------------------------------------------------------------------------
# The case list
# -------------------------------------------------------------------------------------------------------------


def _pl(p: Any) -> str:
    from reshard.planner._contract import placement_str

    return placement_str(p).replace(" ", "")


A, B = [0, 1, 2, 3], [4, 5, 6, 7]
A2, B2 = [[0, 1], [2, 3]], [[4, 5], [6, 7]]


def build_cases() -> list[Case]:
    """Every case of the comm suite over 8 ranks. Each group says why its values are there."""
    f32, bf16 = torch.float32, torch.bfloat16
    cases: list[Case] = []

    def add(name: str, *args: Any, **kw: Any) -> None:
        cases.append(Case(name, *args, **kw))

    # M2N class: full replication and full sharding, every shard-dim pair; (13, 10) splits unevenly over 4 ranks
    for sp in (R, S0, S1):
        for dp in (R, S0, S1):
            add(f"full-{_pl(sp)}-to-{_pl(dp)}", (13, 10), f32, A, (sp,), B, (dp,))
    # M2N class: 3-D tensors, every shard-dim pair, bf16; sizes 6, 5, 7 so some splits are uneven
    for i in range(3):
        for j in range(3):
            add(f"3d-S{i}-to-S{j}", (6, 5, 7), bf16, A, (Shard(i),), B2, (R, Shard(j)))
    # M2N class: 2-D meshes with [Shard, Replicate] / [Replicate, Shard] on either side
    for sp in ((S0, R), (R, S1), (S1, R), (R, S0)):
        for dp in ((R, S0), (S1, R)):
            add(f"2dmesh-{''.join(map(_pl, sp))}-to-{''.join(map(_pl, dp))}", (12, 18), f32, A2, sp, B2, dp)
    # M2N class: group-size ratios 3:1 and 1:3 (6 ranks <-> 2 ranks), and a 2x3 mesh
    add("ratio-3to1", (30, 8), f32, [0, 1, 2, 3, 4, 5], (S0,), [6, 7], (S1,))
    add("ratio-3to1-replicated-dst", (30, 8), f32, [[0, 1, 2], [3, 4, 5]], (R, S0), [6, 7], (R,))
    add("ratio-1to3", (30, 8), f32, [6, 7], (S0,), [0, 1, 2, 3, 4, 5], (S1,))
    add("ratio-1to3-2x3", (30, 9), f32, [0, 1], (S1,), [[2, 3, 4], [5, 6, 7]], (S0, S1))
    # M2N class: 1-D tensors: 17 over 4 and 3 (uneven), 5 over 8 (three empty shards)
    add("1d-uneven", (17,), f32, A, (S0,), [4, 5, 6], (S0,))
    add("1d-empty-shards", (5,), f32, list(range(8)), (S0,), [2, 5], (R,))
    # M2N class: 1-, 2- and 4-byte dtypes (and 8-byte, bool, fp8): raw bits of random bytes, NaNs included
    for dt in (torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.int16,
               torch.float32, torch.int32, torch.int64, torch.float64):
        add(f"dtype-{str(dt).removeprefix('torch.')}", (9, 11), dt, A2, (S1, R), [5, 6, 7], (S0,))
    # beyond: 3-D meshes; nested Shard on one dim; _StridedShard (FSDP x TP); uneven; 0-D and 5-D tensors
    M3 = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    add("3dmesh-to-1d", (8, 6, 10), f32, M3, (S0, R, S1), [7, 6, 5, 4], (S2,))
    add("3dmesh-nested-to-3dmesh", (16, 6), bf16, M3, (R, S0, S0), [[[7, 6], [5, 4]], [[3, 2], [1, 0]]], (S1, R, S0))
    add("nested-S0S0-to-S0", (10, 3), f32, A2, (S0, S0), B, (S0,))
    add("nested-uneven-to-nested", (7, 9), f32, A2, (S1, S1), [[4, 5, 6], [7, 0, 1]], (S0, S0))
    add("strided-fsdp-tp-to-tp", (12, 8), bf16, A2, (_StridedShard(0, split_factor=2), S0), B, (S0,))
    add("tp-to-strided", (12, 10), f32, A, (S0,), B2, (_StridedShard(1, split_factor=2), S1))
    add("strided-uneven", (11, 7), f32, [[0, 1, 2], [3, 4, 5]], (_StridedShard(0, split_factor=3), S0), [6, 7],
        (S1,))
    add("uneven-rows-cols", (7, 3), f32, A, (S0,), B2, (S1, S0))
    add("0d", (), f32, [0, 1], (R,), [2, 3, 4, 5, 6, 7], (R,))
    add("0d-2dmesh", (), torch.int64, A2, (R, R), B, (R,))
    add("5d", (2, 3, 1, 4, 5), bf16, A2, (S3, S0), B, (S4,))
    add("5d-empty-dim", (2, 0, 3, 1, 4), f32, A, (S0,), B2, (S2, R))
    # beyond: overlapping and identical source and destination groups (local copies, no self-messages)
    add("overlap-0-5-to-2-7", (24, 12), f32, [0, 1, 2, 3, 4, 5], (S0,), [2, 3, 4, 5, 6, 7], (S1,))
    add("identical-groups-S0-to-S1", (16, 16), f32, list(range(8)), (S0,), list(range(8)), (S1,))
    add("identical-layouts", (16, 16), f32, A2, (S0, S1), A2, (S0, S1), expect={"messages": 0, "network": 0})
    add("same-ranks-permuted", (16, 6), f32, list(range(8)), (S0,), [7, 6, 5, 4, 3, 2, 1, 0], (S0,))
    # beyond: NVLink domains with relays: the destination domain needs whole boxes once, then forwards them
    add("relay-S0-to-R-domain4", (64, 32), f32, A, (S0,), B, (R,), domain_size=4, staging=2048, min_split=256,
        expect={"relays": True})
    add("relay-R-to-R-domain2", (40, 20), f32, A2, (R, S0), B2, (S1, R), domain_size=2, staging=1024, min_split=128,
        expect={"relays": True})
    add("relay-overlap-domain4", (32, 16), bf16, [0, 1, 2, 3, 4, 5], (S1,), [2, 3, 4, 5, 6, 7], (R,), domain_size=4,
        staging=512, min_split=64)
    add("no-relay-domain4", (64, 32), f32, A, (S0,), B, (R,), domain_size=4, relay=False, staging=2048,
        min_split=256)
    # many-to-many: every rank sends to and receives from every other, in many small chunks (deadlock freedom)
    add("m2m-S0-to-S1-tiny-chunks", (64, 64), f32, list(range(8)), (S0,), [3, 6, 1, 4, 7, 2, 5, 0], (S1,), staging=512,
        min_split=64)
    add("m2m-2d-to-2d-tiny-chunks", (48, 40), bf16, [[0, 1, 2, 3], [4, 5, 6, 7]], (S1, S0), [[7, 5], [3, 1], [6, 4],
        [2, 0]], (S0, S1), staging=256, min_split=32)
    # verify=True on the happy path
    add("verify-relay", (64, 32), f32, A, (S0,), B, (R,), domain_size=4, staging=2048, min_split=256, verify=True)
    add("verify-m2m", (33, 17), torch.float16, list(range(8)), (S1,), [5, 2, 7, 0, 3, 6, 1, 4], (S0,), staging=300,
        min_split=32, verify=True)

    # each call form on a subset of the cases above
    forms = []
    for c in cases:
        if c.id.startswith(("full-S0-to-S1", "3d-S2-to-S0", "2dmesh-RS1", "ratio-1to3-2x3", "1d-empty", "3dmesh-nested",
                            "strided-fsdp", "0d-2dmesh", "5d-empty", "overlap", "relay-S0", "m2m-S0", "verify-m2m",
                            "identical-groups")):
            for form in ("dtensor", "dtensor_none"):
                forms.append(Case(f"{c.id}[{form}]", c.shape, c.dtype, c.src_mesh, c.src_pl, c.dst_mesh, c.dst_pl,
                                  form, c.domain_size, c.relay, c.staging, c.min_split, c.verify, c.expect))
    cases.extend(forms)
    cases.extend(random_cases(24, seed=7))
    # rank-local plans (`plan_local`): each rank schedules its own part; relays, tiny chunks (many batches per
    # pair), every rank to every rank, verify, overlapping groups, and random cases
    local = []
    for c in cases:
        if c.form == "plan" and (c.id.startswith(("relay-", "no-relay", "m2m-", "verify-", "overlap", "identical-",
                                                  "ratio-", "strided-", "3dmesh-", "0d", "5d-empty", "1d-empty"))
                                 or c.id in {"random-1", "random-4", "random-9", "random-13", "random-20"}):
            local.append(Case(f"{c.id}[local]", c.shape, c.dtype, c.src_mesh, c.src_pl, c.dst_mesh, c.dst_pl,
                              c.form, c.domain_size, c.relay, c.staging, c.min_split, c.verify, local=True))
    cases.extend(local)
    return cases


def random_cases(n: int, *, seed: int) -> list[Case]:
    """Random meshes (1-3 axes, any ranks of 8), placements, shapes, budgets, domains and call forms."""
    import random

    rng = random.Random(seed)
    out = []
    for k in range(n):
        ndim = rng.randint(1, 4)
        shape = tuple(rng.randint(1, 9) for _ in range(ndim))

        def side(ndim: int = ndim) -> tuple[Any, tuple]:
            mesh_shape = rng.choice([(2,), (3,), (4,), (8,), (2, 2), (2, 3), (2, 4), (2, 2, 2)])
            size = 1
            for s in mesh_shape:
                size *= s
            ranks = rng.sample(range(8), size)
            mesh = torch.tensor(ranks).reshape(mesh_shape).tolist()
            pls = []
            for _ in mesh_shape:
                kind = rng.choice("RSSX")
                d = rng.randrange(ndim)
                pls.append(R if kind == "R" else Shard(d) if kind == "S" else _StridedShard(d, split_factor=2))
            return mesh, tuple(pls)

        sm, sp = side()
        dm, dp = side()
        dtype = rng.choice([torch.uint8, torch.bfloat16, torch.float32, torch.int64])
        out.append(Case(f"random-{k}", shape, dtype, sm, sp, dm, dp, rng.choice(FORMS),
                        rng.choice([None, 2, 4]), rng.random() < 0.8, rng.choice([64, 256, 1 << 20]),
                        rng.choice([8, 1 << 20]), rng.random() < 0.2))
    return out
