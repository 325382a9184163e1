"""The demo of `make demo`: `python examples/refit_demo.py [--world-size 8] [--layers N] [--plan-only]`.

1. Plan a realistic single-weight reshard (a Qwen3-32B MLP weight, trainer TP4 x DP2 -> inference TP2 x 4 replicas,
   8-GPU NVLink domains) and print its statistics beside gather-and-broadcast's bytes.
2. Refit a Qwen3-0.6B-shaped model with random weights on this CPU: 4 trainer ranks (TP2 x DP2) -> 4 inference
   ranks (vLLM-style TP2 x 2 replicas, fused `qkv_proj` / `gate_up_proj`, padded vocabulary), over gloo, once by
   reshard and once by gather-and-broadcast. Both results are verified against the full model, and a table
   shows bytes and time per phase.

Prints `demo verified` at the end when every destination element matched, and exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib

import torch
import torch.distributed as dist

from reshard import Group, Layout, Mesh, Refit, Replicate, Shard, Topology
from reshard.cost import print_plan_report
from reshard.integrations.fused import engine_tensors
from reshard.models import PRESETS
from reshard.planner import format_bytes
from reshard.sim import System, model_layouts
from reshard.testing import RankPool

QWEN3_32B_MLP = (25600, 5120)  # gate_proj.weight: intermediate_size x hidden_size
REFIT_SYSTEM = "train=tp2,dp2 gen=tp2,dp2 domain=4"  # trainer ranks 0-3, inference 4-7; two 4-GPU "domains"


def demo_layouts(shape: tuple[int, ...] = QWEN3_32B_MLP, dtype: torch.dtype = torch.bfloat16) -> tuple[Layout, Layout]:
    """TP4 x DP2 on ranks 0-7 -> TP2 x 4 replicas on ranks 8-15, dim 0 sharded by TP on both sides."""
    src = Layout(shape, Mesh(torch.arange(8).reshape(2, 4), ("dp", "tp")), [Replicate(), Shard(0)], dtype,
                 name="mlp.gate_proj.weight")
    dst = Layout(shape, Mesh(torch.arange(8, 16).reshape(4, 2), ("replica", "tp")), [Replicate(), Shard(0)], dtype,
                 name="mlp.gate_proj.weight")
    return src, dst


def weight_values(name: str, shape: tuple[int, ...], dtype: torch.dtype, step: int) -> torch.Tensor:
    """Deterministic random bits for weight `name` after optimizer step `step`, equal in every process."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1_000_003 * step)
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    info = torch.iinfo(int_dtype)
    return torch.empty(shape, dtype=int_dtype).random_(info.min, info.max, generator=g).view(dtype)


def _local(full: torch.Tensor, layout, rank: int) -> torch.Tensor:
    out = torch.empty(layout.local_shape(rank), dtype=full.dtype)
    for p in layout.pieces(rank):
        out[p.local_box.slices()] = full[p.global_box.slices()]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def refit_job(w, model: str, system: str, policy: str, layers: int | None, planning: str = "auto") -> dict:
    """One rank (`w`, a `reshard.testing.Worker`) of the refit demo: register, run twice (metadata + plan, then the
    steady state), verify. `planning`: `Refit(planning=...)` (`"local"`: each rank plans only its own part)."""
    rank = w.rank
    config = PRESETS[model] if layers is None else PRESETS[model].replace(num_hidden_layers=layers)
    sysm = System.parse(system)
    weights = model_layouts(config, sysm, stack_experts=True)
    refit = Refit(Group.world(), topology=Topology(domain_size=sysm.domain_size), policy=policy,
                  staging_bytes=64 << 20, planning=planning)
    sources, dests = register(refit, rank, weights)
    dist.barrier()  # time the refit, not the set-up skew between ranks
    first = refit.run()
    step(sources, rank, 1)
    dist.barrier()
    steady = refit.run()
    bad = differences(dests, weights, rank, 1)
    return {
        "rank": rank,
        "first": first.seconds,
        "steady": steady.seconds,
        "network": first.network_bytes,
        "nvlink": first.nvlink_bytes,
        "local": first.local_bytes,
        "gb_bytes": first.gather_broadcast_bytes,
        "messages": first.messages,
        "items": len(refit.plan.items),
        "weights": len(first.choices),
        "dest_tensors": len(dests),
        "bad": bad,
    }


def register(refit: Refit, rank: int, weights: list) -> tuple[dict, list]:
    """Register this rank's part of `weights` (`reshard.sim.model_layouts`) with `refit`: the trainer's tensors hold
    step 0's values, the engine's (vLLM-style fused tensors) zeros. Returns `(sources, dests)` for `step` and
    `differences`."""
    sources = {}
    for w in weights:
        if rank in w.train.ranks:
            local = _local(weight_values(w.spec.name, w.spec.shape, w.spec.dtype, 0), w.train, rank)
            refit.add_source(w.spec.name, local, w.train)
            sources[w.spec.name] = (local, w)
    dests = []
    for et in engine_tensors([(w.spec.name, w.gen) for w in weights]):
        if rank in et.ranks:
            local = torch.zeros(et.local_shape(rank), dtype=et.dtype)
            refit.add_destination(et.name, local, list(et.components), dim=et.dim)
            dests.append((local, et))
    return sources, dests


def step(sources: dict, rank: int, n: int) -> None:
    """An optimizer step: step `n`'s values written in place into the trainer's tensors."""
    for local, w in sources.values():
        local.copy_(_local(weight_values(w.spec.name, w.spec.shape, w.spec.dtype, n), w.train, rank))


def differences(dests: list, weights: list, rank: int, n: int) -> list[str]:
    """The destination boxes of this rank that do not hold step `n`'s values, bit for bit."""
    bad = []
    specs = {w.spec.name: w.spec for w in weights}
    for local, et in dests:
        for gname, lay in et.fused():
            spec = specs[gname]
            full = weight_values(gname, spec.shape, spec.dtype, n)
            for p in lay.pieces(rank):
                if not torch.equal(_bits(local[p.local_box.slices()]), _bits(full[p.global_box.slices()])):
                    bad.append(f"{et.name} <- {gname} {p.global_box}")
    return bad


def run_refit_demo(world_size: int = 8, model: str = "qwen3-0.6b", layers: int | None = None) -> int:
    """Refit `model` with random weights on `world_size` CPU ranks, by reshard and by gather-and-broadcast; 0 when
    every destination element matched the full model."""
    print(f"\n== refit: {model} with random weights, trainer TP2 x DP2 (ranks 0-3) -> inference TP2 x 2 replicas "
          "(ranks 4-7), gloo on this CPU ==")
    t0 = time.perf_counter()
    with RankPool(world_size, timeout_s=600) as pool:
        print(f"started {world_size} ranks in {time.perf_counter() - t0:.1f} s")
        results = {}
        for policy in ("reshard", "gather_broadcast"):
            out = pool.run_ok(refit_job, model, REFIT_SYSTEM, policy, layers)
            bad = [b for o in out for b in o["bad"]]
            if bad:
                print(f"{policy}: {len(bad)} pieces differ from the full model, e.g. {bad[:3]}")
                return 1
            results[policy] = out
    o = results["reshard"][0]
    print(f"{o['weights']} weights -> {sum(r['dest_tensors'] for r in results['reshard'][4:])} engine tensors on "
          f"4 ranks (fused qkv_proj, gate_up_proj); every destination element verified against the full model")
    print(f"{'method':<22}{'bytes moved':>14}{'metadata s':>12}{'plan s':>9}{'transfer s':>12}{'steady run s':>14}")
    for policy, out in results.items():
        moved = out[0]["network"] + out[0]["nvlink"] if policy == "reshard" else out[0]["gb_bytes"]
        meta = max(r["first"]["metadata"] for r in out)
        plan_s = max(r["first"]["plan"] for r in out)
        first_t = max(r["first"]["transfer"] for r in out)
        steady = max(r["steady"]["transfer"] for r in out)
        print(f"{policy:<22}{format_bytes(moved):>14}{meta:>12.2f}{plan_s:>9.2f}{first_t:>12.2f}{steady:>14.2f}")
    r, g = results["reshard"], results["gather_broadcast"]
    ratio = max(x["steady"]["transfer"] for x in g) / max(max(x["steady"]["transfer"] for x in r), 1e-9)
    print(f"steady-state refit: reshard {ratio:.1f}x faster than gather-and-broadcast; "
          f"{r[0]['messages']} messages for {r[0]['items']} global tensors")
    return 0


def print_plan(src: Layout, dst: Layout, topology: Topology) -> None:
    """Plan `src -> dst` and print its statistics beside gather-and-broadcast's bytes (what `python -m reshard plan`
    prints)."""
    print_plan_report(src, dst, topology, relay=True, describe=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--plan-only", action="store_true", help="only plan, move no data")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the refit model (default: all)")
    args = ap.parse_args(argv)
    src, dst = demo_layouts()
    print("== plan: Qwen3-32B mlp.gate_proj.weight, trainer TP4 x DP2 -> inference TP2 x 4 replicas ==")
    print_plan(src, dst, Topology(domain_size=8))
    if args.plan_only:
        return 0
    rc = run_refit_demo(args.world_size, layers=args.layers)
    if rc == 0:
        print("demo verified")
    return rc


if __name__ == "__main__":
    sys.exit(main())
