"""`Refit(delta=True)` on 8 gloo ranks against a full `Refit` of the same sources, bit for bit, after every run.

Weights: FP8 block weights quantized on the source (their quantized bytes and scales are delta'd) and on the
destination (the high-precision halo is delta'd), a float32 -> bfloat16 cast weight and a same-dtype bfloat16
weight. Runs: first (full), unchanged, a few elements changed, every element changed, a delta destination
overwritten in place between runs (an FP8 weight and the bf16 weight: they must get full boxes), a few changed.
"""

from __future__ import annotations

import pytest
import torch
from refit_cases import FP8_WEIGHTS, _fp8_layouts, bits

pytestmark = pytest.mark.distributed

WORLD = 8
STEPS = ("first", "same", "few", "all", "overwritten", "few-after")


def job_delta_refit(w) -> dict:
    from reshard import Layout, Mesh, Replicate, Shard
    from reshard.comm import Group
    from reshard.planner._blocks import scale_layout
    from reshard.refit import Refit

    rank = w.rank
    precision = {"norm.cast": "cast", "plain.bf16": "same", **{n: "fp8_block" for n in FP8_WEIGHTS}}
    refits = {d: Refit(Group.world(), precision=precision, staging_bytes=1 << 16, delta=d) for d in (True, False)}
    g = torch.Generator().manual_seed(5)
    sources: dict[str, torch.Tensor] = {}
    dests: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    layouts = {n: _fp8_layouts(n) for n in FP8_WEIGHTS}
    layouts["norm.cast"] = (Layout((5, 300), Mesh([0, 1, 2, 3]), [Replicate()], torch.float32, name="norm.cast"),
                            Layout((5, 300), Mesh([4, 5, 6, 7]), [Shard(1)], torch.bfloat16, name="norm.cast"))
    layouts["plain.bf16"] = (Layout((96, 40), Mesh([0, 1, 2, 3]), [Shard(0)], torch.bfloat16, name="plain.bf16"),
                             Layout((96, 40), Mesh([[4, 5], [6, 7]]), [Replicate(), Shard(1)], torch.bfloat16,
                                    name="plain.bf16"))
    for n, (train, infer) in layouts.items():
        if rank in train.ranks:
            sources[n] = (torch.randn(train.local_shape(rank), generator=g) * 0.02).to(train.dtype)
            for r in refits.values():
                r.add_source(n, sources[n], train)
        if rank in infer.ranks:
            for d, r in refits.items():
                t = torch.zeros(infer.local_shape(rank), dtype=infer.dtype)
                scale = torch.zeros(scale_layout(infer).local_shape(rank)) if infer.dtype == torch.float8_e4m3fn \
                    else None
                r.add_destination(n, t, infer, scale=scale)
                dests[d] += [t] + ([scale] if scale is not None else [])
    out = {"equal": [], "fractions": [], "encoded": [], "dense": []}
    for i, step in enumerate(STEPS):
        for k, (n, s) in enumerate(sorted(sources.items())):
            if step in ("few", "few-after"):
                flat = s.view(-1)
                pick = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(100 * i + k))
                flat[pick[: max(1, flat.numel() // 100)]] *= 1.5
            elif step == "all":
                s.copy_(torch.randn(s.shape, generator=g) * 0.02)
        if step == "overwritten" and rank >= 4:
            for t in dests[True]:
                t.view(torch.uint8).fill_(0x11)
        reports = {d: r.run() for d, r in refits.items()}
        out["equal"].append(all(torch.equal(bits(a), bits(b)) for a, b in zip(dests[True], dests[False])))
        rep = reports[True]
        out["fractions"].append(dict(rep.changed_fraction))
        out["encoded"].append(sum(rep.encoded_bytes.values()))
        out["dense"].append(sum(rep.dense_bytes.values()))
    out["snapshot_bytes"] = reports[True].snapshot_bytes
    out["full_report_empty"] = not reports[False].encoded_bytes
    w.group.cache.clear()
    return out


RANK_POOL = WORLD  # the `pool` fixture's ranks (tests/conftest.py)


def test_delta_refit_equals_full_refit(pool) -> None:
    outs = pool.run_ok(job_delta_refit, timeout=300)
    for r, o in enumerate(outs):
        assert all(o["equal"]), (r, dict(zip(STEPS, o["equal"])))
        assert o["full_report_empty"]
    senders = [o for o in outs[:4]]
    enc = {s: sum(o["encoded"][i] for o in senders) for i, s in enumerate(STEPS)}
    dense = {s: sum(o["dense"][i] for o in senders) for i, s in enumerate(STEPS)}
    assert enc["first"] >= dense["first"] > 0
    assert enc["same"] < dense["same"] / 8, (enc, dense)  # headers only
    assert enc["few"] < dense["few"], (enc, dense)
    assert enc["overwritten"] > enc["same"], (enc, dense)  # full boxes for the overwritten destinations
    assert all(o["snapshot_bytes"] > 0 for o in senders)


def test_delta_refit_refuses_verify() -> None:
    from reshard.refit import Refit

    class _G:  # no group is needed to refuse the arguments
        rank = 0

    with pytest.raises(ValueError, match="delta=True and verify=True"):
        Refit(_G(), delta=True, verify=True)
    with pytest.raises(ValueError, match="delta_snapshot"):
        Refit(_G(), delta=True, delta_snapshot="disk")
    from reshard.comm import DeltaSession

    bad = (({"snapshot": "disk"}, "snapshot"), ({"check": "crc"}, "check"), ({"threshold": 2.0}, "threshold"))
    for kw, what in bad:
        with pytest.raises(ValueError, match=what):
            DeltaSession(**kw)
