"""Whole-model refit on this machine's CPU ranks (gloo): reshard against gather-and-broadcast, per model preset.

Usage:
    python perf/bench_refit.py [--model qwen3-0.6b] [--layers N] [--system "train=tp2,dp2 gen=tp2,dp2 domain=4"]
                               [--repeat 3] [--out perf/out]

    python perf/bench_refit.py --rounds [--model qwen3-0.6b] [--layers 1] [--system "train=tp2 gen=tp2 domain=2"]
                               [--steps 20] [--out perf/out]

Each method runs the same `Refit`, verified against the full model: `reshard` (the whole-model plan on every rank,
`planning="global"`), `reshard (rank-local plan)` (`planning="local"`: each rank plans and schedules only its own
part, `reshard.planner.plan_local`) and `gather_broadcast`. The first run includes the metadata exchange and
planning; the timed steady-state runs follow, each after a barrier. Bytes moved and messages are the plan's (for
the rank-local plan, summed over the ranks' own). Writes `bench_refit.csv` (machine, versions, configuration,
bytes, messages, median and spread, first run and its planning) and `bench_refit.png`.

`--rounds`: a steady refit's all-rank control rounds and time, now (one agreement before data moves: the live
check is the plan handshake) against the older protocol (the live check, then the plan handshake:
`Refit._separate_handshake`), side by side on one `Refit` of each rank: `--steps` steady runs of each, alternating,
each after a barrier, every one verified. Rounds are counted from the messages on the control backend
(`reshard.testing.counted_group`, on every rank but the lowest); the time is the slowest rank's wall time of
`Refit.run()`. Writes `bench_refit_rounds.csv` and `bench_refit_rounds.png`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch  # noqa: E402
from _common import machine_info, write_csv  # noqa: E402
from refit_demo import differences, refit_job, register, step  # noqa: E402

from reshard import Group, Refit, Topology  # noqa: E402
from reshard.models import PRESETS  # noqa: E402
from reshard.planner import format_bytes  # noqa: E402
from reshard.sim import System, model_layouts  # noqa: E402
from reshard.testing import RankPool, counted_group  # noqa: E402

PROTOCOLS = (("one agreement (live check = plan handshake)", False),
             ("live check + plan handshake (older)", True))
"""(row name, `Refit._separate_handshake`)."""

METHODS = (("reshard", "reshard", "global"), ("reshard (rank-local plan)", "reshard", "local"),
           ("gather_broadcast", "gather_broadcast", "global"))
"""(row name, `Refit` policy, `Refit` planning)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--system", default=None, help='default "train=tp2,dp2 gen=tp2,dp2 domain=4" '
                    '(--rounds: "train=tp2 gen=tp2 domain=2")')
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's; --rounds: 4096)")
    ap.add_argument("--hidden", type=int, default=None, help="--rounds: hidden size (default: the preset's; a "
                    "multiple of 128: 64-wide heads, intermediate 3x)")
    ap.add_argument("--repeat", type=int, default=3, help="pool jobs per method; each job times one steady run")
    ap.add_argument("--out", default="perf/out")
    ap.add_argument("--rounds", action="store_true", help="control rounds of a steady refit, now and before")
    ap.add_argument("--steps", type=int, default=20, help="--rounds: steady runs of each protocol")
    args = ap.parse_args()
    if args.rounds:
        return main_rounds(args)
    args.system = args.system or "train=tp2,dp2 gen=tp2,dp2 domain=4"
    if args.vocab is not None:
        raise SystemExit("--vocab is for --rounds (the methods run the demo's model)")
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
    _bars(path, [r["method"] for r in rows],
          [("steady-state refit (s)", *_steady(rows, 1.0)),
           ("bytes moved (GiB)", [r["bytes_moved"] / 2**30 for r in rows], None)],
          f"{rows[0]['model']} refit, {rows[0]['system']}, {rows[0]['cpu']}, {rows[0]['cpu_count']} cpus")


def _steady(rows: list[dict], scale: float) -> tuple[list[float], list[list[float]]]:
    """The rows' median steady seconds times `scale`, and their min-max spread as error bars."""
    return ([r["steady_s_median"] * scale for r in rows],
            [[(r["steady_s_median"] - r["steady_s_min"]) * scale for r in rows],
             [(r["steady_s_max"] - r["steady_s_median"]) * scale for r in rows]])


def _bars(path: Path, names: list[str], panels: list[tuple[str, list[float], Any]], title: str) -> None:
    """One bar chart per `(y label, values, error bars or None)` panel, side by side, saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(9, 3.5))
    for ax, (label, values, err) in zip(axes, panels):
        ax.bar(names, values, yerr=err)
        ax.set_ylabel(label)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rounds_job(w, model: str, system: str, layers: int, vocab: int, hidden: int | None, steps: int) -> dict:
    """One rank: a first run, then `steps` steady runs of each protocol of `PROTOCOLS`, alternating (so load drift
    on a shared machine falls on both alike); per protocol, the rounds seen on this rank and the seconds of each
    run, and the destination boxes that differ from the step's values."""
    import torch.distributed as dist

    config = PRESETS[model].replace(num_hidden_layers=layers, vocab_size=vocab)
    if hidden is not None:  # a narrower model of the same kind: the control rounds' share of a run grows
        config = config.replace(hidden_size=hidden, intermediate_size=3 * hidden, head_dim=64,
                                num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128)
    sysm = System.parse(system)
    weights = model_layouts(config, sysm, stack_experts=True)
    group, counter = counted_group(Group.world())
    refit = Refit(group, topology=Topology(domain_size=sysm.domain_size), policy="reshard", staging_bytes=64 << 20)
    sources, dests = register(refit, w.rank, weights)
    dist.barrier()
    refit.run()
    out: dict = {"rank": w.rank, "bad": [], **{name: {"rounds": [], "seconds": []} for name, _ in PROTOCOLS}}
    n = 0
    for _ in range(steps):
        for name, separate in PROTOCOLS:
            n += 1
            step(sources, w.rank, n)
            refit._separate_handshake = separate
            counter.clear()
            dist.barrier()
            t0 = time.perf_counter()
            refit.run()
            out[name]["seconds"].append(time.perf_counter() - t0)
            out[name]["rounds"].append(counter.rounds())
            out["bad"] += differences(dests, weights, w.rank, n)
    return out


def main_rounds(args: argparse.Namespace) -> None:
    system = args.system or "train=tp2 gen=tp2 domain=2"
    layers = args.layers if args.layers is not None else 1
    vocab = args.vocab if args.vocab is not None else 4096
    sysm = System.parse(system)
    world = max(max(sysm.train_ranks), max(sysm.gen_ranks)) + 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with RankPool(world, timeout_s=1200) as pool:
        res = pool.run_ok(rounds_job, args.model, system, layers, vocab, args.hidden, args.steps)
    if any(r["bad"] for r in res):
        raise SystemExit(f"a steady run's result differs from the model: {[r['bad'][:3] for r in res]}")
    rows = []
    for name, separate in PROTOCOLS:
        rounds = {tuple(r[name]["rounds"]) for r in res[1:]}  # any rank but the lowest sees every round
        if len(rounds) != 1 or len(set(next(iter(rounds)))) != 1:
            raise SystemExit(f"{name}: the ranks or runs saw different round counts: {rounds}")
        # a run's time is its slowest rank's
        seconds = [max(r[name]["seconds"][i] for r in res) for i in range(args.steps)]
        rows.append({
            "protocol": name,
            "separate_handshake": separate,
            "model": args.model,
            "layers": layers,
            "vocab_size": vocab,
            "hidden_size": args.hidden or PRESETS[args.model].hidden_size,
            "system": system,
            "world_size": world,
            "steady_runs": args.steps,
            "control_rounds": next(iter(rounds))[0],
            "steady_s_median": statistics.median(seconds),
            "steady_s_min": min(seconds),
            "steady_s_max": max(seconds),
            **machine_info(torch.device("cpu")),
            "backend": "gloo (CPU)",
        })
        print(f"{name:<46} {rows[-1]['control_rounds']} all-rank control rounds, steady run "
              f"{rows[-1]['steady_s_median'] * 1e3:.1f} ms [{rows[-1]['steady_s_min'] * 1e3:.1f}, "
              f"{rows[-1]['steady_s_max'] * 1e3:.1f}] over {args.steps} runs")
    now, before = rows
    print(f"one agreement: {before['control_rounds']} -> {now['control_rounds']} rounds, steady run "
          f"{before['steady_s_median'] / now['steady_s_median']:.2f}x faster (median)")
    write_csv(out_dir / "bench_refit_rounds.csv", rows)
    plot_rounds(rows, out_dir / "bench_refit_rounds.png")
    print(f"wrote {out_dir / 'bench_refit_rounds.csv'} and {out_dir / 'bench_refit_rounds.png'}")


def plot_rounds(rows: list[dict], path: Path) -> None:
    r0 = rows[0]
    _bars(path, ["now" if not r["separate_handshake"] else "older" for r in rows],
          [("all-rank control rounds per steady run", [r["control_rounds"] for r in rows], None),
           ("steady refit (ms, median, min-max)", *_steady(rows, 1e3))],
          f"{r0['model']} ({r0['layers']} layers, hidden {r0['hidden_size']}, vocab {r0['vocab_size']}) steady refit, "
          f"{r0['system']}, {r0['cpu']}, {r0['cpu_count']} cpus")


if __name__ == "__main__":
    main()
