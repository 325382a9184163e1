"""The first refit at thousands of GPUs: what one rank receives in the metadata round, and what its first plan costs.

Usage:
    python perf/bench_scale.py [--models deepseek-v3 kimi-k2] [--gpus 256 1024 2048] [--out perf/out/scale]
                               [--no-plan]
    python perf/bench_scale.py --control 2 4 8 [--rounds 30]
    python perf/bench_scale.py --profile kimi-k2 256
    python perf/bench_scale.py --balance deepseek-v3 "train=pp2,ep8,gpus16 gen=tp8,dp2 domain=8"

Layouts come from `reshard.sim.model_layouts` (Megatron-style PP x EP trainer -> vLLM-style TP8 replicas, 72-GPU
NVLink domains; `SYSTEMS` below), one process standing for one rank. Per (model, GPUs per side, method):

- metadata: each rank's registration as `Refit` encodes it (`reshard.refit._metawire.registration`), in control
  messages of the wire format (`reshard.comm._wire.encode`). `global` (the metadata round before `_metawire`): one
  all-gather of every rank's whole registration; gloo pads it to the widest, so a rank receives `ranks x widest`.
  `local` (`Refit._exchange_metadata` now): one all-gather of every rank's record (`ranks x widest record`), then
  each distinct registration table once (a broadcast per table). The `local` row also times joining them into
  every rank's metadata (`join_registrations`), its peak allocation (`tracemalloc`), and the trainer layouts'
  merge that `build` runs next (`source_layouts`).
- plan: `plan_many` of the whole model, as every rank runs it today, in a child process: wall time and peak RSS
  (`ru_maxrss`; the child's RSS after imports and layouts is `baseline_bytes`). A plan over `PlanLimits` is
  refused; the row then says after how long and at what peak (`plan_refused_after_s`, `plan_error`).
- local plan (`local` rows): `plan_local` of one rank (its part, `plan_rank`, scheduled into the chunks and messages
  the executor runs: what `Refit(planning="local")` builds), each sampled rank in a child process of its own (`SAMPLE`:
  first, middle and last trainer and engine ranks): cold wall time, peak RSS (`ru_maxrss`, with the child's
  `baseline_bytes` after imports and layouts) and the allocations' peak of a second, warm call (`tracemalloc`,
  `plan_alloc_peak_bytes`). The row's plan columns are the busiest sampled rank's (most bytes sent + received,
  `busiest_rank`), the `typical_*` columns the sampled rank of median bytes.

Writes `bench_scale.csv` (machine, versions, configuration per row) and `bench_scale.png`. With `--control`, instead
times the control rounds on a few real gloo ranks of this machine (`control.csv`): the plan agreement (a binomial
tree rooted at the lowest rank; the messages its busiest rank handles are counted from the tree's shape, also at
1,024-4,096 ranks), the metadata round's record all-gather and a 100 kB table broadcast, to see how each grows with
the ranks.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import machine_info, python_speed_ms, write_csv  # noqa: E402

from reshard._progress import Progress  # noqa: E402
from reshard.comm._wire import encode  # noqa: E402
from reshard.models import get_preset  # noqa: E402
from reshard.planner import Topology, format_bytes, plan_local, plan_many, plan_rank  # noqa: E402
from reshard.refit._metawire import join_registrations, registration, split_registration, table_owners  # noqa: E402
from reshard.refit._sources import source_layouts  # noqa: E402
from reshard.sim import System, model_layouts, plan_items  # noqa: E402

SYSTEMS = {
    256: "train=pp8,ep32,gpus256 gen=tp8,dp32 domain=72",
    1024: "train=pp8,ep128,gpus1024 gen=tp8,dp128 domain=72",
    2048: "train=pp16,ep128,gpus2048 gen=tp8,dp256 domain=72",
}
"""GPUs per side -> the cluster (trainer and engine each that many GPUs)."""

WHAT = "refit metadata exchange"
SIZE_ROUND = 8  # bytes per rank of the all-gather of payload sizes before each padded all-gather


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _registrations(model: str, gpus: int) -> tuple[System, list, dict[int, dict], dict[int, int]]:
    """The cluster, its layouts, one registration per distinct role (trainer stage s -> key s, engine -> -1) and
    each rank's role."""
    system = System.parse(SYSTEMS[gpus])
    layouts = model_layouts(get_preset(model), system)
    no_alias: dict = {"sources": {}, "dests": {}}
    roles: dict[int, dict] = {}
    of_rank: dict[int, int] = {}
    stage_size = system.train.stage_size
    for s in range(system.train.pp):
        rank = s * stage_size
        srcs = {w.spec.name: w.train for w in layouts if w.stage == s}
        roles[s] = registration(rank, srcs, {}, {}, [], no_alias, [], ["", "0" * 32])
    first_gen = system.gen_ranks[0]
    roles[-1] = registration(first_gen, {}, {}, {w.spec.name: [(w.spec.name, w.gen)] for w in layouts}, [], no_alias,
                             [], ["", "0" * 32])
    for r in system.train_ranks:
        of_rank[r] = r // stage_size
    for r in system.gen_ranks:
        of_rank[r] = -1
    return system, layouts, roles, of_rank


def metadata_rows(model: str, gpus: int) -> list[dict[str, object]]:
    """Per-rank metadata bytes of both methods (and the `local` join's time and peak memory)."""
    system, _, roles, of_rank = _registrations(model, gpus)
    ranks = len(of_rank)
    global_sizes = {k: len(encode(WHAT, m)) for k, m in roles.items()}
    widest = max(global_sizes.values())
    parts = {k: split_registration(m) for k, m in roles.items()}
    record_sizes = {k: len(encode(WHAT, rec)) for k, (rec, _, _) in parts.items()}
    # every rank's record: its role's, with its own rank (the widest rank number stands for all)
    records = []
    for r in sorted(of_rank):
        rec = dict(parts[of_rank[r]][0])
        rec["rank"] = r
        records.append(rec)
    widest_record = max(record_sizes.values()) + len(str(max(of_rank))) - 1
    owners = table_owners(records)
    table_bytes = sum(size for _, size in owners.values())
    engine_table = parts[-1][2]
    tables = {rec["table"]: json.loads(parts[k][2]) for k, (rec, _, _) in parts.items()}
    t0 = time.perf_counter()
    metas = join_registrations(records, tables)
    join_s = time.perf_counter() - t0
    assert len(metas) == ranks
    t0 = time.perf_counter()
    source_layouts(metas)
    sources_s = time.perf_counter() - t0
    del metas
    tracemalloc.start()
    join_registrations(records, tables)
    join_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    base = {"model": model, "gpus_per_side": gpus, "system": SYSTEMS[gpus], "ranks": ranks}
    return [
        {**base, "method": "global", "metadata_received_bytes": ranks * (widest + SIZE_ROUND),
         "metadata_sent_bytes_max": widest, "group_moves_bytes": ranks * ranks * (widest + SIZE_ROUND),
         "distinct_tables": "", "trainer_payload_bytes": min(v for k, v in global_sizes.items() if k >= 0),
         "engine_payload_bytes": global_sizes[-1], "join_seconds": "", "join_peak_bytes": ""},
        {**base, "method": "local",
         "metadata_received_bytes": ranks * (widest_record + SIZE_ROUND) + table_bytes,
         "metadata_sent_bytes_max": widest_record + max(size for _, size in owners.values()),
         "group_moves_bytes": ranks * ranks * (widest_record + SIZE_ROUND) + ranks * table_bytes,
         "distinct_tables": len(owners), "trainer_payload_bytes": min(v for k, v in record_sizes.items() if k >= 0),
         "engine_payload_bytes": record_sizes[-1], "engine_table_bytes": len(engine_table),
         "join_seconds": round(join_s, 4), "join_peak_bytes": join_peak,
         "source_layouts_seconds": round(sources_s, 4)},
    ]


def plan_child(model: str, gpus: int) -> None:
    """Child process: the whole model's plan as every rank builds it today; prints JSON."""
    system = System.parse(SYSTEMS[gpus])
    items = plan_items(model_layouts(get_preset(model), system))
    baseline = _peak_bytes()
    t0 = time.perf_counter()
    try:
        p = plan_many(items, Topology(domain_size=system.domain_size))
    except ValueError as e:  # the plan's own bounds (PlanLimits) refuse it: when, and at what memory
        print(json.dumps({"plan_seconds": "", "plan_refused_after_s": round(time.perf_counter() - t0, 3),
                          "peak_bytes": _peak_bytes(), "baseline_bytes": baseline, "plan_error": str(e)[:200]}))
        return
    seconds = time.perf_counter() - t0
    s = p.stats
    print(json.dumps({"plan_seconds": round(seconds, 3), "peak_bytes": _peak_bytes(), "baseline_bytes": baseline,
                      "transfers": s.num_transfers, "messages": s.messages, "network_bytes": s.network_bytes,
                      "network_lower_bound": s.network_lower_bound, "nvlink_bytes": s.nvlink_bytes}))


def local_child(model: str, gpus: int, rank: int) -> None:
    """Child process: rank `rank`'s plan (`plan_local`: its part, scheduled), as that rank alone computes it;
    prints JSON."""
    system = System.parse(SYSTEMS[gpus])
    items = plan_items(model_layouts(get_preset(model), system))
    topology = Topology(domain_size=system.domain_size)
    baseline = _peak_bytes()
    t0 = time.perf_counter()
    lp = plan_local(items, topology, rank)
    seconds = time.perf_counter() - t0
    peak = _peak_bytes()
    del lp
    tracemalloc.start()
    lp = plan_local(items, topology, rank)
    alloc_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    part = lp.part
    prog = lp.for_rank(rank)
    sent, recv = part.bytes_by_link("send"), part.bytes_by_link("recv")
    print(json.dumps({"rank": rank, "plan_seconds": round(seconds, 3), "peak_bytes": peak, "baseline_bytes": baseline,
                      "plan_alloc_peak_bytes": alloc_peak, "transfers": len(part.transfers),
                      "chunks": len(prog.chunks), "messages": sum(len(c.sends) + len(c.recvs) for c in prog.chunks),
                      "send_bytes": sent["network"] + sent["nvlink"], "recv_bytes": recv["network"] + recv["nvlink"]}))


def sample_ranks(model: str, gpus: int) -> list[int]:
    """`SAMPLE`: the first, middle and last rank of the trainer and of the engine."""
    items = plan_items(model_layouts(get_preset(model), System.parse(SYSTEMS[gpus])))
    out: list[int] = []
    for side in ("src", "dst"):
        ranks = sorted({r for it in items for r in getattr(it, side).ranks})
        out += [ranks[0], ranks[len(ranks) // 2], ranks[-1]]
    return out


def local_plan_row(model: str, gpus: int) -> dict[str, object]:
    """The `local` row's plan columns: every sampled rank in a child of its own; the busiest and the typical one."""
    res = []
    for r in sample_ranks(model, gpus):
        out = subprocess.run([sys.executable, __file__, "--local-child", model, str(gpus), str(r)],
                             capture_output=True, text=True, check=True)
        res.append(json.loads(out.stdout.strip().splitlines()[-1]))
    res.sort(key=lambda x: x["send_bytes"] + x["recv_bytes"])
    busiest, typical = res[-1], res[len(res) // 2]
    row: dict[str, object] = {"sampled_ranks": " ".join(str(x["rank"]) for x in res), "busiest_rank": busiest["rank"]}
    for k in ("plan_seconds", "peak_bytes", "baseline_bytes", "plan_alloc_peak_bytes", "transfers", "chunks",
              "messages", "send_bytes", "recv_bytes"):
        row[k] = busiest[k]
        row[f"typical_{k}"] = typical[k]
    row["typical_rank"] = typical["rank"]
    row["max_sampled_plan_seconds"] = max(x["plan_seconds"] for x in res)
    return row


def balance(model: str, spec: str) -> None:
    """Every rank's `plan_rank` part next to `plan_many` on a cluster small enough for the global plan: network
    bytes against its lower bound, and the busiest sender's and receiver's bytes against the global plan's."""
    from collections import defaultdict

    system = System.parse(spec)
    items = plan_items(model_layouts(get_preset(model), system))
    topology = Topology(domain_size=system.domain_size)
    s = plan_many(items, topology).stats
    send: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    net = 0
    for r in sorted({r for it in items for r in (*it.src.ranks, *it.dst.ranks)}):
        for t in plan_rank(items, topology, r).transfers:
            if t.src == r and t.dst != r:
                send[r] += t.nbytes
                net += t.nbytes if t.link == "network" else 0
            if t.dst == r and t.src != r:
                recv[r] += t.nbytes
    print(f"{model} {spec}: network {format_bytes(net)} local plans, {format_bytes(s.network_bytes)} global "
          f"(lower bound {format_bytes(s.network_lower_bound)}); busiest sender {format_bytes(max(send.values()))} "
          f"local, {format_bytes(s.max_rank_send_bytes)} global (mean {format_bytes(int(s.mean_rank_send_bytes))}); "
          f"busiest receiver {format_bytes(max(recv.values()))} local, {format_bytes(s.max_rank_recv_bytes)} global")


def _control_job(w, rounds: int) -> dict[str, float]:
    """On every rank of a pool: median seconds of the plan agreement (`agree`, a binomial tree rooted at rank 0)
    and of the metadata round's record all-gather and one table broadcast, over `rounds` rounds each."""
    import datetime
    import statistics

    from reshard.comm import agree, all_gather_json
    from reshard.comm._contract import broadcast_bytes

    group = w.new_group("control", timeout=60)
    td = datetime.timedelta(seconds=60)
    ranks = list(range(w.world_size))
    record = {"rank": w.rank, "table": "0" * 32, "table_bytes": 100_000, "coords": [], "odd_coords": {},
              "errors": [], "identity": [None, "0" * 32]}
    table = b"x" * 100_000
    out: dict[str, list[float]] = {"agree": [], "records": [], "table": []}
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            agree(group, ranks, "f" * 32, [], list, timeout=td, what="plan handshake")
            t1 = time.perf_counter()
            all_gather_json(group, record, timeout=td, what=WHAT)
            t2 = time.perf_counter()
            broadcast_bytes(group, table if w.rank == 0 else None, root=0, size=len(table), timeout=td, what=WHAT)
            t3 = time.perf_counter()
            out["agree"].append(t1 - t0)
            out["records"].append(t2 - t1)
            out["table"].append(t3 - t2)
    finally:
        group.close()
    return {k: statistics.median(v) for k, v in out.items()}


def agree_messages(n: int) -> tuple[int, int]:
    """Messages the busiest rank sends and receives in one agreement round of `n` ranks when all agree: over
    `agree`'s binomial tree (a header up and a reply down per tree edge), and over a star rooted at the lowest rank
    (the round before the tree). Counted from the tree's shape (`_tree`), not measured."""
    from reshard.comm._handshake import _tree

    ranks = list(range(n))
    tree = max(2 * len(_tree(ranks, r)[1]) + (2 if r else 0) for r in ranks)
    return tree, 2 * (n - 1)


def control_rows(sizes: list[int], rounds: int) -> list[dict[str, object]]:
    """The control rounds on `sizes` gloo ranks of this machine: the slowest rank's median per round."""
    from reshard.testing import RankPool

    for n in (1024, 2048, 4096):
        tree, star = agree_messages(n)
        print(f"agreement round of {n} ranks: the busiest rank handles {tree} messages over the tree, {star} as a "
              "star's root (counted from the tree's shape)", flush=True)
    rows: list[dict[str, object]] = []
    for n in sizes:
        with RankPool(n, timeout_s=120) as pool:
            res = pool.run_ok(_control_job, rounds, timeout=600)
        row: dict[str, object] = {"control_ranks": n, "rounds": rounds}
        row["agree_busiest_messages"], row["agree_star_root_messages"] = agree_messages(n)
        for k in ("agree", "records", "table"):
            row[f"{k}_seconds"] = round(max(r[k] for r in res), 6)
        rows.append(row)
        print(f"control rounds on {n} gloo ranks: agree {row['agree_seconds'] * 1e3:.2f} ms, record all-gather "
              f"{row['records_seconds'] * 1e3:.2f} ms, 100 kB table broadcast {row['table_seconds'] * 1e3:.2f} ms",
              flush=True)
    return rows


def plot(rows: list[dict[str, object]], path: Path) -> None:
    """Metadata received per rank and plan time against GPUs per side, per model and method (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for model in sorted({str(r["model"]) for r in rows}):
        for method, style in (("global", "o-"), ("local", "s--")):
            pts = [r for r in rows if r["model"] == model and r["method"] == method]
            ax1.plot([r["gpus_per_side"] for r in pts], [float(r["metadata_received_bytes"]) for r in pts], style,
                     label=f"{model} {method}")
            pts = [r for r in pts if r.get("plan_seconds") not in (None, "")]
            if pts:
                ax2.plot([r["gpus_per_side"] for r in pts], [float(r["plan_seconds"]) for r in pts], style,
                         label=f"{model} {method}")
    ax1.axhline(50e6, color="grey", lw=0.8, ls=":", label="50 MB target")
    ax2.axhline(2.0, color="grey", lw=0.8, ls=":", label="2 s target")
    for ax, title in ((ax1, "metadata received per rank (bytes)"), (ax2, "first plan per rank (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs per side")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["deepseek-v3", "kimi-k2"])
    ap.add_argument("--gpus", nargs="+", type=int, default=[256, 1024, 2048], choices=sorted(SYSTEMS))
    ap.add_argument("--out", default="perf/out/scale")
    ap.add_argument("--no-plan", action="store_true", help="metadata only (the plans take minutes at 2,048)")
    ap.add_argument("--control", nargs="*", type=int, default=None, metavar="RANKS",
                    help="instead: time the control rounds (plan agreement, record all-gather, table broadcast) on "
                         "this many gloo ranks each (e.g. 2 4 8); writes control.csv")
    ap.add_argument("--rounds", type=int, default=30, help="rounds per control measurement")
    ap.add_argument("--profile", nargs=2, metavar=("MODEL", "GPUS"),
                    help="instead: cProfile today's whole-model plan (the 15 costliest functions, cumulative)")
    ap.add_argument("--balance", nargs=2, metavar=("MODEL", "SYSTEM"),
                    help="instead: every rank's plan_rank part against plan_many on a small cluster (bytes, balance)")
    ap.add_argument("--no-local-plan", action="store_true", help="skip the rank-local plans (plan_rank)")
    ap.add_argument("--plan-child", nargs=2, metavar=("MODEL", "GPUS"), help=argparse.SUPPRESS)
    ap.add_argument("--local-child", nargs=3, metavar=("MODEL", "GPUS", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plan_child:
        plan_child(args.plan_child[0], int(args.plan_child[1]))
        return
    if args.balance:
        balance(*args.balance)
        return
    if args.local_child:
        local_child(args.local_child[0], int(args.local_child[1]), int(args.local_child[2]))
        return
    if args.profile:
        import cProfile
        import pstats

        system = System.parse(SYSTEMS[int(args.profile[1])])
        items = plan_items(model_layouts(get_preset(args.profile[0]), system))
        prof = cProfile.Profile()
        prof.runcall(plan_many, items, Topology(domain_size=system.domain_size))
        pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
        return
    info = {**machine_info(torch.device("cpu")), "python_speed_ms": f"{python_speed_ms():.1f}"}
    if args.control is not None:
        rows = [{**r, **info} for r in control_rows(args.control or [2, 4, 8], args.rounds)]
        write_csv(Path(args.out) / "control.csv", rows)
        print(f"wrote {Path(args.out) / 'control.csv'}")
        return
    rows: list[dict[str, object]] = []
    for model in args.models:
        for gpus in args.gpus:
            with Progress(f"bench_scale {model} {gpus}+{gpus}") as progress:  # minutes per case at 2,048
                progress.step("metadata")
                meta = metadata_rows(model, gpus)
                if not args.no_plan:
                    progress.step("whole-model plan")
                    out = subprocess.run([sys.executable, __file__, "--plan-child", model, str(gpus)],
                                         capture_output=True, text=True, check=True)
                    meta[0].update(json.loads(out.stdout.strip().splitlines()[-1]))
                if not args.no_local_plan:
                    progress.step("rank-local plans")
                    meta[1].update(local_plan_row(model, gpus))
            for row in meta:
                rows.append({**row, **info})
                plan = ""
                if row.get("plan_seconds") not in (None, ""):
                    plan = f", plan {row['plan_seconds']} s, peak {format_bytes(int(row['peak_bytes']))}"
                    if row.get("busiest_rank") is not None:
                        plan += (f" (busiest sampled rank {row['busiest_rank']}, baseline "
                                 f"{format_bytes(int(row['baseline_bytes']))}, plan allocations "
                                 f"{format_bytes(int(row['plan_alloc_peak_bytes']))}; typical rank "
                                 f"{row['typical_rank']}: {row['typical_plan_seconds']} s)")
                elif row.get("plan_error"):
                    plan = (f", plan refused after {row['plan_refused_after_s']} s at peak "
                            f"{format_bytes(int(row['peak_bytes']))}: {row['plan_error'][:60]}")
                print(f"{model} {gpus}+{gpus} {row['method']:6s}: metadata received "
                      f"{format_bytes(int(row['metadata_received_bytes']))} per rank{plan}", flush=True)
    out_dir = Path(args.out)
    write_csv(out_dir / "bench_scale.csv", rows)
    try:
        plot(rows, out_dir / "bench_scale.png")
        print(f"wrote {out_dir / 'bench_scale.csv'} and {out_dir / 'bench_scale.png'}")
    except ImportError:
        print(f"wrote {out_dir / 'bench_scale.csv'} (no matplotlib: no plot)")


if __name__ == "__main__":
    main()
