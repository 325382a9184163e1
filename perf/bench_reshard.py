"""Reshard vs gather-and-broadcast vs DTensor `redistribute`, on real ranks of this machine (gloo on CPU, NCCL on GPU).

Usage:
    python perf/bench_reshard.py [--world 8] [--rows 25600 --cols 5120 --dtype bfloat16] [--repeat 5] [--warmup 1]
                                 [--staging-mib 64] [--scenarios tp-to-tp2xdp,...] [--backend gloo] [--out perf/out]

For each scenario (see `perf/scenarios.py`; the default weight is a Qwen3-32B MLP weight, 25600 x 5120
bf16), every method runs `--warmup` untimed and `--repeat` timed times in the same processes; each run is timed
barrier to barrier and the slowest rank counts. Every result is checked bit for bit against DTensor's
`distribute_tensor(...).to_local()`. Bytes are the payload moved between ranks: exact from the layouts for reshard
and gather-and-broadcast, and for `redistribute` counted from the functional collectives DTensor issues (each
element a rank receives from another, once; on gloo DTensor falls back from all-to-all to all-gather).

Writes `bench_reshard.csv` (with the machine, versions and configuration) and `bench_reshard.png` into `--out`, and
prints a table and the target checks: on the disjoint TP -> TP2 x DP refit, reshard >= 2x faster than
gather-and-broadcast; on same-mesh scenarios, no slower than `redistribute`.

Speed mode (`--mode speed`, also part of the default `--mode all`; `[--cases a,b,c,d] [--staged]`): on the four
cases of `scenarios.speed_cases` (one 25600 x 5120 bf16 weight TP4 -> TP2 x 2, FSDP4 S(0) -> TP4 S(1),
[DP2, TP2] [R, S(0)] -> TP4 S(1), and 100 tensors of a small model TP4 -> TP2 x 2, on 8 ranks), reshard runs next to
`wire` (reshard's own per-peer byte counts from pre-packed buffers, raw send/recv, one message per peer) and
`exact_overlap` (a per-tensor transfer of exact intersections, contiguous views sent and received directly,
replicas completed by all-gather, no staging budget), in `--repeat` interleaved rounds (the order rotates). Ratios
are medians over rounds of reshard's time / the other method's in the same round; the breakdown comes from
`ExecutionReport`'s `seconds_*` fields. Writes `bench_speed.csv` and `bench_speed.png` and checks the targets:
reshard <= 1.25x wire and <= 0.8x exact_overlap on each case, every result bit-exact against DTensor.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios import (
    SPEED_METHODS,
    ScenarioResult,
    SpeedResult,
    compare_job,
    format_results,
    format_speed,
    merge,
    merge_speed,
    scenarios,
    speed_cases,
    speed_job,
)

from reshard.testing import launch  # noqa: E402

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int8": torch.int8}


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, {gpu}"


def write_csv(results: list[ScenarioResult], path: Path, config: dict) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["scenario", "method", "world_size", "shape", "dtype", "bytes", "median_s", "min_s", "max_s",
                    "runs", "speedup_vs_method", "verified", "note", "machine", "torch", "python", "config"])
        for r in results:
            base = r.methods.get("reshard")
            for m in r.methods.values():
                speed = "" if base is None else f"{m.median / base.median:.3f}"
                w.writerow([r.scenario, m.method, r.world_size, "x".join(map(str, r.shape)), r.dtype,
                            "" if m.bytes is None else m.bytes, f"{m.median:.6f}", f"{min(m.seconds):.6f}",
                            f"{max(m.seconds):.6f}", len(m.seconds), speed, m.verified, m.note, machine(),
                            torch.__version__, platform.python_version(), config])


def plot(results: list[ScenarioResult], path: Path, title: str) -> None:
    """Median time per scenario and method, with min-max error bars; bytes moved on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ["reshard", "gather-broadcast", "redistribute"]
    colors = {"reshard": "tab:blue", "gather-broadcast": "tab:orange", "redistribute": "tab:green"}
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(15, 0.9 * len(results) + 2.5), sharey=True)
    height = 0.27
    for k, m in enumerate(methods):
        ys, med, lo, hi, byts = [], [], [], [], []
        for i, r in enumerate(results):
            if m in r.methods:
                res = r.methods[m]
                ys.append(i + (k - 1) * height)
                med.append(res.median * 1e3)
                lo.append((res.median - min(res.seconds)) * 1e3)
                hi.append((max(res.seconds) - res.median) * 1e3)
                byts.append((res.bytes or 0) / 2**20)
        if not ys:
            continue
        ax_t.barh(ys, med, height, xerr=[lo, hi], color=colors[m], label=m, capsize=2)
        ax_b.barh(ys, byts, height, color=colors[m], label=m)
    ax_t.set_yticks(range(len(results)), [r.scenario for r in results])
    ax_t.invert_yaxis()
    ax_t.set_xlabel("median time per reshard, ms (bars: min-max)")
    ax_b.set_xlabel("bytes moved between ranks, MiB")
    ax_t.legend(loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_speed_csv(results: list[SpeedResult], path: Path, config: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "method", "tensors", "bytes", "median_s", "min_s", "max_s", "rounds",
                    "reshard_over_method_paired_median", "verified", "reshard_pack_s", "reshard_wait_s",
                    "reshard_unpack_s", "reshard_handshake_s", "reshard_confirm_s", "reshard_other_s", "note",
                    "machine", "torch", "config"])
        for r in results:
            b = r.breakdown
            for m in SPEED_METHODS:
                sec = r.seconds[m]
                ratio = "" if m == "reshard" else f"{r.ratio(m):.3f}"
                w.writerow([r.name, m, r.tensors, r.nbytes, f"{statistics.median(sec):.6f}", f"{min(sec):.6f}",
                            f"{max(sec):.6f}", len(sec), ratio, r.verified[m] if m != "wire" else "n/a (no data)",
                            *(f"{b.get(k, 0):.6f}"
                              for k in ("pack", "wire", "unpack", "handshake", "confirm", "other")),
                            r.note, machine(), torch.__version__, config])


def plot_speed(results: list[SpeedResult], path: Path, title: str) -> None:
    """Left: median time per case and method, reshard's bar split into pack / wait / unpack / control; right:
    median paired ratios reshard / wire and reshard / exact_overlap with the targets (1.25, 0.8)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(15, 1.2 * len(results) + 2.5), sharey=True)
    h = 0.27
    parts = [("pack", "tab:blue"), ("wire", "tab:cyan"), ("unpack", "tab:purple"), ("handshake", "tab:gray"),
             ("other", "lightgray")]  # `other` includes the completion round
    for i, r in enumerate(results):
        left = 0.0
        for k, color in parts:
            v = r.breakdown.get(k, 0) * 1e3
            ax_t.barh(i - h, v, h, left=left, color=color, label=f"reshard: {k}" if i == 0 else None)
            left += v
        ax_t.barh(i, statistics.median(r.seconds["wire"]) * 1e3, h, color="tab:green", label="wire" if i == 0 else None)
        ax_t.barh(i + h, statistics.median(r.seconds["exact_overlap"]) * 1e3, h, color="tab:orange",
                  label="exact_overlap" if i == 0 else None)
        ax_r.barh(i - h / 2, r.ratio("wire"), h, color="tab:green", label="reshard / wire" if i == 0 else None)
        ax_r.barh(i + h / 2, r.ratio("exact_overlap"), h, color="tab:orange",
                  label="reshard / exact_overlap" if i == 0 else None)
    ax_r.axvline(1.25, color="tab:green", ls="--", lw=1)
    ax_r.axvline(0.8, color="tab:orange", ls="--", lw=1)
    ax_t.set_yticks(range(len(results)), [r.name for r in results])
    ax_t.invert_yaxis()
    ax_t.set_xlabel("median ms per call (reshard's bar: each part's slowest rank, stacked; may exceed the call)")
    ax_r.set_xlabel("median of paired ratios (dashed: targets <= 1.25 vs wire, <= 0.8 vs exact_overlap)")
    ax_t.legend(loc="lower right", fontsize=8)
    ax_r.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_speed(args: argparse.Namespace, out: Path) -> bool:
    table = speed_cases(args.world, (args.rows, args.cols), _DTYPES[args.dtype])
    keys = list(table) if args.cases == "all" else args.cases.split(",")
    unknown = [k for k in keys if k not in table]
    if unknown:
        raise SystemExit(f"unknown speed cases {unknown}; expected some of {list(table)}")
    t0 = time.perf_counter()
    opts = {"zero_copy": False} if args.staged else None
    per_rank = launch(speed_job, args.world, [table[k] for k in keys], rounds=args.repeat, warmup=args.warmup,
                      staging_bytes=int(args.staging_mib * 2**20), execute_options=opts, backend=args.backend)
    results = merge_speed(per_rank)
    config = (f"speed world={args.world} backend={args.backend} shape={args.rows}x{args.cols} dtype={args.dtype} "
              f"rounds={args.repeat} warmup={args.warmup} staging_mib={args.staging_mib} staged={args.staged} "
              f"load={os.getloadavg()[0]:.1f}")
    write_speed_csv(results, out / "bench_speed.csv", config)
    plot_speed(results, out / "bench_speed.png", f"{config}\n{machine()}, torch {torch.__version__}")
    print(f"{config}; {time.perf_counter() - t0:.1f} s in all")
    print(format_speed(results))
    ok = True
    for r in results:
        if not all(v for m, v in r.verified.items() if m != "wire"):
            print(f"WRONG RESULT: {r.name}: {[m for m, v in r.verified.items() if not v]}")
            ok = False
        rw, re_ = r.ratio("wire"), r.ratio("exact_overlap")
        if rw > 1.25 or re_ > 0.8:
            print(f"TARGET MISSED: {r.name}: reshard is {rw:.2f}x wire (want <= 1.25) and {re_:.2f}x exact_overlap "
                  f"(want <= 0.8)")
            ok = False
    print(f"wrote {out / 'bench_speed.csv'} and {out / 'bench_speed.png'}; speed targets {'met' if ok else 'MISSED'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8, help="ranks to spawn (a multiple of 4)")
    ap.add_argument("--rows", type=int, default=25600)
    ap.add_argument("--cols", type=int, default=5120)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--staging-mib", type=float, default=64.0, help="reshard staging budget per rank")
    ap.add_argument("--scenarios", default="all", help="comma-separated keys of scenarios() in perf/scenarios.py")
    ap.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo", choices=["gloo", "nccl"])
    ap.add_argument("--out", default="perf/out")
    ap.add_argument("--mode", default="all", choices=["all", "compare", "speed"],
                    help="compare: reshard vs gather-and-broadcast vs redistribute; speed: reshard vs wire vs "
                         "exact_overlap on the speed cases (perf/scenarios.py speed_cases), interleaved rounds")
    ap.add_argument("--cases", default="all", help="comma-separated keys of speed_cases() (a, b, c, d)")
    ap.add_argument("--staged", action="store_true", help="speed mode: reshard with execute(zero_copy=False), every "
                    "message through staging")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    speed_ok = run_speed(args, out) if args.mode in ("all", "speed") else True
    if args.mode == "speed":
        return 0 if speed_ok else 1

    table = scenarios(args.world, (args.rows, args.cols), _DTYPES[args.dtype])
    keys = list(table) if args.scenarios == "all" else args.scenarios.split(",")
    unknown = [k for k in keys if k not in table]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; expected some of {list(table)}")
    chosen = [table[k] for k in keys]
    t0 = time.perf_counter()
    per_rank = launch(compare_job, args.world, chosen, warmup=args.warmup, repeat=args.repeat,
                      staging_bytes=int(args.staging_mib * 2**20), backend=args.backend)
    results = merge(per_rank)
    wall = time.perf_counter() - t0
    config = (f"world={args.world} backend={args.backend} shape={args.rows}x{args.cols} dtype={args.dtype} "
              f"repeat={args.repeat} warmup={args.warmup} staging_mib={args.staging_mib}")
    write_csv(results, out / "bench_reshard.csv", config)
    plot(results, out / "bench_reshard.png", f"{config}\n{machine()}, torch {torch.__version__}")
    print(f"{machine()}, torch {torch.__version__}; {config}; {wall:.1f} s in all")
    print(format_results(results))
    ok = True
    for k, r in zip(keys, results):
        if k == "tp-to-tp2xdp" and (r.speedup() or 0) < 2.0:
            print(f"TARGET MISSED: {r.scenario}: {r.speedup():.2f}x faster than gather-and-broadcast (want >= 2x)")
            ok = False
        sp = r.speedup("redistribute")
        if sp is not None and sp < 1.0:
            print(f"TARGET MISSED: {r.scenario}: reshard is {sp:.2f}x as fast as redistribute (want >= 1x)")
            ok = False
        if not all(m.verified for m in r.methods.values()):
            print(f"WRONG RESULT: {r.scenario}: {[m.method for m in r.methods.values() if not m.verified]}")
            ok = False
    print(f"wrote {out / 'bench_reshard.csv'} and {out / 'bench_reshard.png'}; targets {'met' if ok else 'MISSED'}")
    return 0 if ok and speed_ok else 1


if __name__ == "__main__":
    sys.exit(main())
