"""Whole-model refit on this machine's CPU ranks (gloo): reshard against gather-and-broadcast, per model preset.

Usage:
    python perf/bench_refit.py [--model qwen3-0.6b] [--layers N] [--system "train=tp2,dp2 gen=tp2,dp2 domain=4"]
                               [--repeat 3] [--out perf/out]

Each method runs the same `Refit`, verified against the full model: `reshard` (the whole-model plan on every rank,
`planning="global"`), `reshard (rank-local plan)` (`planning="local"`: each rank plans and schedules only its own
part, `reshard.planner.plan_local`) and `gather_broadcast`. The first run includes the metadata exchange and
planning; the timed steady-state runs follow, each after a barrier. Bytes moved and messages are the plan's (for
the rank-local plan, summed over the ranks' own). Writes `bench_refit.csv` (machine, versions, configuration,
bytes, messages, median and spread, first run and its planning) and `bench_refit.png`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch  # noqa: E402
from _common import machine_info, write_csv  # noqa: E402
from refit_demo import refit_job  # noqa: E402

from reshard.planner import format_bytes  # noqa: E402
from reshard.sim import System  # noqa: E402
from reshard.testing import RankPool  # noqa: E402

METHODS = (("reshard", "reshard", "global"), ("reshard (rank-local plan)", "reshard", "local"),
           ("gather_broadcast", "gather_broadcast", "global"))
"""(row name, `Refit` policy, `Refit` planning)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--system", default="train=tp2,dp2 gen=tp2,dp2 domain=4")
    ap.add_argument("--repeat", type=int, default=3, help="pool jobs per method; each job times one steady run")
    ap.add_argument("--out", default="perf/out")
    args = ap.parse_args()
    sysm = System.parse(args.system)
    world = max(max(sysm.train_ranks), max(sysm.gen_ranks)) + 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with RankPool(world, timeout_s=1200) as pool:
        for method, policy, planning in METHODS:
            steady, first, plan_s, moved, messages = [], [], [], 0, 0
            for _ in range(args.repeat):
                res = pool.run_ok(refit_job, args.model, args.system, policy, args.layers, planning)
                if any(r["bad"] for r in res):
                    raise SystemExit(f"{method}: result differs from the full model")
                steady.append(max(r["steady"]["transfer"] for r in res))
                first.append(max(sum(r["first"].values()) for r in res))
                plan_s.append(max(r["first"]["plan"] for r in res))
                if policy == "gather_broadcast":
                    moved = res[0]["gb_bytes"]
                elif planning == "local":  # each rank reports what it receives
                    moved = sum(r["network"] + r["nvlink"] for r in res)
                    messages = sum(r["messages"] for r in res)
                else:
                    moved, messages = res[0]["network"] + res[0]["nvlink"], res[0]["messages"]
            row = {
                "method": method,
                "model": args.model,
                "layers": args.layers or "all",
                "system": args.system,
                "world_size": world,
                "bytes_moved": moved,
                "messages": messages,
                "first_run_plan_s_median": statistics.median(plan_s),
                "steady_s_median": statistics.median(steady),
                "steady_s_min": min(steady),
                "steady_s_max": max(steady),
                "first_run_s_median": statistics.median(first),
                **machine_info(torch.device("cpu")),
                "backend": "gloo (CPU)",
            }
            rows.append(row)
            print(f"{method:<26} moved {format_bytes(moved):>12}  steady {row['steady_s_median']:.2f} s "
                  f"[{row['steady_s_min']:.2f}, {row['steady_s_max']:.2f}]  "
                  f"first run {row['first_run_s_median']:.2f} s (plan {row['first_run_plan_s_median']:.2f} s), "
                  f"{messages} messages")
    by = {r["method"]: r for r in rows}
    rs, local, gb = by["reshard"], by["reshard (rank-local plan)"], by["gather_broadcast"]
    print(f"reshard is {gb['steady_s_median'] / rs['steady_s_median']:.1f}x faster than gather-and-broadcast and moves "
          f"{gb['bytes_moved'] / rs['bytes_moved']:.1f}x fewer bytes; the rank-local plan's steady run takes "
          f"{local['steady_s_median'] / rs['steady_s_median']:.2f}x the whole plan's")
    write_csv(out_dir / "bench_refit.csv", rows)
    plot(rows, out_dir / "bench_refit.png")
    print(f"wrote {out_dir / 'bench_refit.csv'} and {out_dir / 'bench_refit.png'}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["method"] for r in rows]
    a.bar(names, [r["steady_s_median"] for r in rows],
          yerr=[[r["steady_s_median"] - r["steady_s_min"] for r in rows],
                [r["steady_s_max"] - r["steady_s_median"] for r in rows]])
    a.set_ylabel("steady-state refit (s)")
    b.bar(names, [r["bytes_moved"] / 2**30 for r in rows])
    b.set_ylabel("bytes moved (GiB)")
    fig.suptitle(f"{rows[0]['model']} refit, {rows[0]['system']}, {rows[0]['cpu']}, {rows[0]['cpu_count']} cpus")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
