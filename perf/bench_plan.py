"""Planning time for 256 -> 256-rank layout pairs, cold (cache cleared) and from the cache, next to a per-tensor
exact-overlap planner (`perf/_exact_overlap_plan.py`: exact intersections of shard boxes, no relays or chunks) timed
cold in the same rounds, interleaved, with both transfer counts; wall and CPU time (`process_time`) with paired
ratios of each, and the cost of a full GC pass with the plan alive.

Usage:
    python perf/bench_plan.py [--ranks 256] [--repeat 5] [--out perf/out] [--model-only] [--staging-mib N]

Writes `bench_plan.csv` (with machine and versions) and `bench_plan.png` into `--out`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_info, python_speed_ms, write_csv  # noqa: E402
from _exact_overlap_plan import exact_overlap_plan  # noqa: E402

from reshard import Layout, Mesh, Topology, clear_plan_cache, plan  # noqa: E402


def cases(n: int) -> list[tuple[str, Layout, Layout, Topology]]:
    """Layout pairs of `n` trainer ranks -> `n` inference ranks (disjoint unless said), 8-GPU domains."""
    shape = (25600, 5120)  # Qwen3-32B MLP weight
    bf16 = torch.bfloat16
    tr = torch.arange(n)
    inf = torch.arange(n, 2 * n)
    t8 = Topology(domain_size=8)

    def lay(ranks: torch.Tensor, dims: tuple[int, ...], pl: list) -> Layout:
        return Layout(shape, Mesh(ranks.reshape(dims)), pl, bf16)

    return [
        ("TP8xDP -> TP4 replicas", lay(tr, (n // 8, 8), [Replicate(), Shard(0)]),
         lay(inf, (n // 4, 4), [Replicate(), Shard(0)]), t8),
        ("FSDP -> TP8 replicas", lay(tr, (n,), [Shard(0)]), lay(inf, (n // 8, 8), [Replicate(), Shard(0)]), t8),
        ("FSDP2+TP8 (_StridedShard) -> TP8 replicas",
         lay(tr, (n // 8, 8), [_StridedShard(0, split_factor=8), Shard(0)]),
         lay(inf, (n // 8, 8), [Replicate(), Shard(0)]), t8),
        ("colocated TP8xDP -> TP2 replicas", lay(tr, (n // 8, 8), [Replicate(), Shard(0)]),
         lay(tr, (n // 2, 2), [Replicate(), Shard(1)]), t8),
        ("all-to-all S(0) -> S(1) (n^2 transfers)", lay(tr, (n,), [Shard(0)]), lay(inf, (n,), [Shard(1)]), t8),
        ("S(0) -> [R, S(0)] (n/2 x 2)", lay(tr, (n,), [Shard(0)]), lay(inf, (n // 2, 2), [Replicate(), Shard(0)]),
         t8),
        ("S(0) -> [R, S(0)] (2 x n/2)", lay(tr, (n,), [Shard(0)]), lay(inf, (2, n // 2), [Replicate(), Shard(0)]),
         t8),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="perf/out")
    ap.add_argument("--model", default="deepseek-v3", help="whole-model case: preset ('' to skip)")
    ap.add_argument("--system", default="train=pp8,ep16,gpus256 gen=tp8,dp32 domain=72",
                    help="whole-model case: trainer and inference parallelism (reshard.sim.System)")
    ap.add_argument("--staging-mib", type=int, default=None, help="whole-model case: staging budget per rank")
    ap.add_argument("--model-only", action="store_true", help="skip the per-tensor layout pairs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.model:  # first, so its first plan is the first of the process (nothing cached, as in a fresh rank)
        rows.append(whole_model(args.model, args.system, args.repeat, args.staging_mib))
    for name, src, dst, topo in [] if args.model_only else cases(args.ranks):
        rows.append(pair(name, src, dst, topo, args.ranks, args.repeat))
    write_csv(out / "bench_plan.csv", rows)
    plot(rows, out / "bench_plan.png")
    print(f"wrote {out / 'bench_plan.csv'} and {out / 'bench_plan.png'}")


def pair(name: str, src: Layout, dst: Layout, topo: Topology, ranks: int, repeat: int) -> dict:
    """`plan(src, dst, topo)` cold and cached, and the exact-overlap baseline cold, interleaved per round; wall time
    and CPU time (`time.process_time`, steadier on a shared machine) of each, with paired ratios; then a full GC
    pass with the plan alive, and the same pass once it is released (the difference is the plan's)."""
    cold, warm, base, cold_cpu, base_cpu = [], [], [], [], []
    speed = python_speed_ms()
    p = b = None
    for _ in range(repeat):
        clear_plan_cache()
        p = b = None  # one plan alive at a time
        c0, t0 = time.process_time(), time.perf_counter()
        p = plan(src, dst, topo)
        cold.append(time.perf_counter() - t0)
        cold_cpu.append(time.process_time() - c0)
        t0 = time.perf_counter()
        plan(src, dst, topo)
        warm.append(time.perf_counter() - t0)
        clear_plan_cache()  # the baseline builds the layouts' pieces too
        c0, t0 = time.process_time(), time.perf_counter()
        b = exact_overlap_plan(src, dst)
        base.append(time.perf_counter() - t0)
        base_cpu.append(time.process_time() - c0)
    num_base = len(b)
    b = None
    t0 = time.process_time()  # CPU time: a pass is pure computation, and wall time swings with the load
    gc.collect()  # the first full pass with the plan alive (it lands on whatever allocates next)
    gc_s = time.process_time() - t0
    stats = p.stats
    clear_plan_cache()
    p = None
    gc.collect()
    t0 = time.process_time()
    gc.collect()  # the same pass once the plan is gone: what the rest of the process costs the collector
    gc_bare_s = time.process_time() - t0
    row = {
        "case": name,
        "ranks": ranks,
        "transfers": stats.num_transfers,
        "cold_ms_median": statistics.median(cold) * 1e3,
        "cold_ms_min": min(cold) * 1e3,
        "cold_ms_max": max(cold) * 1e3,
        "cold_cpu_ms_median": statistics.median(cold_cpu) * 1e3,
        "cached_ms_median": statistics.median(warm) * 1e3,
        "first_ms": cold[0] * 1e3,
        "exact_overlap_transfers": num_base,
        "exact_overlap_ms_median": statistics.median(base) * 1e3,
        "exact_overlap_cpu_ms_median": statistics.median(base_cpu) * 1e3,
        "cold_over_exact_overlap": statistics.median(c / e for c, e in zip(cold, base)),  # paired per round
        "cold_over_exact_overlap_cpu": statistics.median(c / e for c, e in zip(cold_cpu, base_cpu)),
        "gc_full_pass_ms": gc_s * 1e3,
        "gc_full_pass_after_release_ms": gc_bare_s * 1e3,
        "python_speed_ms": max(speed, python_speed_ms()),  # the slower of before and after
        **machine_info(torch.device("cpu")),
    }
    print(f"{name:<45} transfers {row['transfers']:>6}  cold {row['cold_ms_median']:8.1f} ms "
          f"[{row['cold_ms_min']:.1f}, {row['cold_ms_max']:.1f}] (cpu {row['cold_cpu_ms_median']:.1f})  cached "
          f"{row['cached_ms_median']:.3f} ms  exact-overlap {num_base:>6} transfers "
          f"{row['exact_overlap_ms_median']:8.1f} ms (cpu {row['exact_overlap_cpu_ms_median']:.1f})  "
          f"ratio {row['cold_over_exact_overlap']:.2f}, cpu "
          f"{row['cold_over_exact_overlap_cpu']:.2f}  gc pass {gc_s * 1e3:.0f} ms "
          f"({gc_bare_s * 1e3:.0f} once released)  "
          f"(reference {row['python_speed_ms']:.0f} ms)")
    return row


def whole_model(model: str, system: str, repeat: int, staging_mib: int | None = None) -> dict:
    """Plan every weight of `model` (experts stacked) at once: cold (caches cleared), then from the cache."""
    from reshard.models import PRESETS
    from reshard.planner import PlanItem, plan_many
    from reshard.sim import System, model_layouts

    sysm = System.parse(system)
    layouts = model_layouts(PRESETS[model], sysm, stack_experts=True)
    items = [PlanItem(w.train, w.gen, i, i, w.spec.name) for i, w in enumerate(layouts)]
    topo = Topology(domain_size=sysm.domain_size)
    kwargs = {"staging_bytes": staging_mib << 20} if staging_mib else {}
    cold, warm, cold_cpu = [], [], []
    speed = [python_speed_ms()]
    gc.collect()
    t0 = time.process_time()
    gc.collect()  # a full pass with no plan alive: what the rest of the process costs the collector
    gc_bare_s = time.process_time() - t0
    p = None
    for _ in range(repeat):
        clear_plan_cache()
        p = None  # release the previous plan (~230 MiB) first: a rank plans with one plan alive, not two
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        p = plan_many(items, topo, **kwargs)
        cold.append(time.perf_counter() - t0)
        cold_cpu.append(time.process_time() - c0)
        for _ in range(5):  # a cyclic-GC pass over the plan's objects can land on any lookup; take the median
            t0 = time.perf_counter()
            plan_many(items, topo, **kwargs)
            warm.append(time.perf_counter() - t0)
    # what a rank meets next: the cyclic GC's first full pass over the plan's objects (it lands on whatever
    # allocates next), and finding its own part of the plan (the busiest inference rank)
    busiest = max(sysm.gen_ranks, key=lambda r: p.stats.per_rank[r].send + p.stats.per_rank[r].recv)
    t0 = time.process_time()
    gc.collect()
    gc_s = time.process_time() - t0
    tracked = len(gc.get_objects())
    t0 = time.perf_counter()
    p.for_rank(busiest)
    for_rank_s = time.perf_counter() - t0
    speed.append(python_speed_ms())
    staging = f"{staging_mib} MiB" if staging_mib else "default"
    name = f"whole {model} ({len(items)} tensors), {system}, staging {staging}"
    row = {
        "case": name,
        "ranks": f"{len(sysm.train_ranks)}->{len(sysm.gen_ranks)}",
        "transfers": p.stats.num_transfers,
        "cold_ms_median": statistics.median(cold) * 1e3,
        "cold_ms_min": min(cold) * 1e3,
        "cold_ms_max": max(cold) * 1e3,
        "cold_cpu_ms_median": statistics.median(cold_cpu) * 1e3,
        "cached_ms_median": statistics.median(warm) * 1e3,
        "first_ms": cold[0] * 1e3,  # nothing cached in the process yet (layout pieces included)
        "python_speed_ms": max(speed),  # the slower of the reference workload before and after
        "for_rank_ms": for_rank_s * 1e3,
        "gc_full_pass_ms": gc_s * 1e3,
        "gc_full_pass_without_plan_ms": gc_bare_s * 1e3,
        "gc_tracked_objects": tracked,
        **machine_info(torch.device("cpu")),
    }
    print(f"{name}: transfers {row['transfers']}, chunks {p.stats.num_chunks}, first {row['first_ms']:.0f} ms, "
          f"cold {row['cold_ms_median']:.0f} ms [{row['cold_ms_min']:.0f}, {row['cold_ms_max']:.0f}] (cpu "
          f"{row['cold_cpu_ms_median']:.0f} ms), "
          f"cached {row['cached_ms_median']:.2f} ms; a full GC pass {gc_s * 1e3:.0f} ms ({tracked} tracked objects; "
          f"{gc_bare_s * 1e3:.0f} ms before any plan), then "
          f"for_rank({busiest}) {for_rank_s * 1e3:.0f} ms; reference Python workload {speed[0]:.0f} ms before, "
          f"{speed[1]:.0f} ms after (see python_speed_ms)")
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["case"] for r in rows]
    ax.barh(names, [r["cold_ms_median"] for r in rows], label="cold (median)")
    ax.barh(names, [r["cached_ms_median"] for r in rows], label="cached (median)")
    ax.set_xscale("log")
    ax.set_xlabel("planning time (ms), log scale")
    r0 = rows[0]
    ax.set_title(f"plan(), cold and cached, {r0['cpu']}, {r0['cpu_count']} cpus")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
