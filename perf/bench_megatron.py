"""Megatron-core trainer -> engine refit: reshard (every weight shard to shard) against NeMo RL's split and against
gather-and-broadcast, measured on gloo ranks and modelled on the simulator's Megatron clusters.

Measured: 4 trainer processes hold a real megatron-core `GPTModel` (`tests/megatron_cases.py`: TP2 x PP2 dense with
tied embeddings, or PP2 x EP2 MoE) and 4 other processes an engine of 2 TP2 replicas (`reshard.integrations.hf`
tensors), all in one `Group.rendezvous`; the same `Refit` machinery runs three ways:
- `reshard`: `policy="reshard"`, every weight shard to shard;
- `nemo_rl_split`: what NeMo RL's `nccl_reshard` path does: the FFN projections (dense and per expert gate / up /
  down) shard to shard, every other weight (attention, norms, embeddings, router, output layer) gathered on one
  trainer rank and sent whole to every generation rank (`policy="gather_broadcast"` with those names overridden);
- `gather_broadcast`: every weight gathered and sent whole to every generation rank.
Per method: bytes sent by the busiest trainer rank, bytes received per generation rank, total bytes, seconds per
refit (median of `--repeat` runs after a first run that builds the plans).

Modelled (`--sim`): the simulator's Megatron-style layouts of Qwen3-235B-A22B on `qwen235b-TP2CP2PP4EP16-128gpus-gb200`
and DeepSeek-V3 on `dsv3-128gpus-gb200`: total bytes and bytes into the busiest and the least-loaded generation rank,
for reshard's whole-model plan, the split (FFN plan + the rest broadcast) and gather-and-broadcast.

Usage (in the environment `make megatron-env` builds):
    .venv-vllm/bin/python perf/bench_megatron.py --cases dense moe --repeat 5 --sim
Writes `perf/out/megatron/bench_megatron.csv`, `sim_megatron.csv` and `bench_megatron.png`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import re
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

from _common import machine_info, write_csv  # noqa: E402

METHODS = ("reshard", "nemo_rl_split", "gather_broadcast")
FFN = re.compile(r"(gate|up|down)_proj")  # NeMo RL moves these shard to shard (dense, shared and routed experts)
TRAINERS, ENGINES = 4, 4
OUT = HERE / "out" / "megatron"


def _refit(method: str, group, names: list[str]):
    from reshard.refit import Refit

    if method == "reshard":
        return Refit(group, policy="reshard", name=method)
    policies = {n: "reshard" for n in names if FFN.search(n)} if method == "nemo_rl_split" else {}
    return Refit(group, policy="gather_broadcast", policies=policies, name=method)


def _rank(rank: int, case: str, ports: tuple[int, int], repeat: int, out, done) -> None:
    """One process: a Megatron trainer rank (0-3) or an engine rank (4-7); puts `(rank, results)` on `out`."""
    import warnings

    warnings.filterwarnings("ignore")
    import megatron_cases as mc
    import torch.distributed as dist

    import reshard.refit._gather as gather_module
    from reshard.comm import Group
    from reshard.integrations import hf, megatron

    torch.set_num_threads(1)
    # the gather-and-broadcast weights run `execute` themselves: count their bytes too (instrumentation only)
    tally = [0, 0]
    execute = gather_module.execute

    def counted(*a, **k):
        rep = execute(*a, **k)
        if rep is not None:
            tally[0] += rep.bytes_sent
            tally[1] += rep.bytes_received
        return rep

    gather_module.execute = counted
    model = None
    if rank < TRAINERS:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", world_size=TRAINERS, rank=rank)
        model = mc.build(case)
    group = Group.rendezvous("127.0.0.1", ports[1], rank, TRAINERS + ENGINES, timeout=300)
    names = sorted(mc.hf_param_shapes(case))
    results = {}
    for method in METHODS:
        refit = _refit(method, group, names)
        if model is not None:
            megatron.add_sources(refit, model, vocab_size=mc.VOCAB)
        else:
            par = hf.EngineParallel(range(TRAINERS, TRAINERS + ENGINES), tp=2)
            for t in hf.engine_tensors(mc.hf_param_shapes(case), par, config=mc.hf_config(case), dtype=torch.float32):
                if rank in t.ranks:
                    t.register(refit, torch.zeros(t.local_shape(rank)))
        refit.run()  # metadata and plans
        seconds = []
        for _ in range(repeat):
            tally[:] = [0, 0]
            t0 = time.perf_counter()
            report = refit.run()
            seconds.append(time.perf_counter() - t0)
        ex = report.execution
        results[method] = {"sent": (ex.bytes_sent if ex else 0) + tally[0],
                           "received": (ex.bytes_received if ex else 0) + tally[1], "seconds": seconds}
    out.put((rank, results))
    done.wait(600)  # rank 0 hosts the group's store: every rank leaves only when all have finished
    group.close()


def measure(case: str, repeat: int) -> list[dict]:
    from reshard.testing import free_port

    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=_rank, args=(r, case, ports, repeat, out, done)) for r in range(TRAINERS + ENGINES)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + 900
    while len(got) < len(procs):
        try:
            rank, value = out.get(timeout=1.0)
            got[rank] = value
        except Exception:  # queue.Empty: check that every rank is still alive
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"bench_megatron {case}: ranks {dead or 'all'} died or timed out") from None
    done.set()
    for p in procs:
        p.join(timeout=60)
    rows = []
    for method in METHODS:
        per = {r: got[r][method] for r in got}
        per_run = [max(per[r]["seconds"][i] for r in per) for i in range(repeat)]  # a refit ends on its last rank
        gen = [per[r]["received"] for r in range(TRAINERS, TRAINERS + ENGINES)]
        rows.append({"case": case, "method": method, "total_bytes": sum(p["sent"] for p in per.values()),
                     "max_trainer_send_bytes": max(per[r]["sent"] for r in range(TRAINERS)),
                     "max_gen_recv_bytes": max(gen), "min_gen_recv_bytes": min(gen),
                     "seconds_median": statistics.median(per_run), "seconds_min": min(per_run),
                     "seconds_max": max(per_run), "repeat": repeat})
    return rows


SIM_CONFIGS = (("qwen3-235b-a22b", "qwen235b-TP2CP2PP4EP16-128gpus-gb200"), ("deepseek-v3", "dsv3-128gpus-gb200"))


def simulate_split(model: str, system: str, hardware: str = "gb200") -> list[dict]:
    """Bytes of reshard, the split and gather-and-broadcast on a modelled cluster (plans only, no devices)."""
    from reshard import Topology, gather_broadcast_bytes, plan_many
    from reshard.cost import get_hardware
    from reshard.models import PRESETS
    from reshard.sim import load_system, model_layouts, plan_items

    sys_ = load_system(system)
    dom = sys_.domain_size or get_hardware(hardware).domain_size
    sys_ = sys_.with_domain_size(dom)
    topo = Topology(domain_size=dom)
    layouts = model_layouts(PRESETS[model], sys_)
    items = plan_items(layouts)
    gen = sorted(set().union(*(w.gen.ranks for w in layouts)))

    def recv(plan) -> dict[int, int]:
        per = plan.stats.per_rank
        return {r: (per[r].network_recv + per[r].nvlink_recv) if r in per else 0 for r in gen}

    def moved(plan) -> int:
        return plan.stats.network_bytes + plan.stats.nvlink_bytes

    t0 = time.perf_counter()
    whole = plan_many(items, topo, relay=True)
    ffn = [i for i, w in enumerate(layouts) if FFN.search(w.spec.name)]
    ffn_plan = plan_many([items[i] for i in ffn], topo, relay=True)
    plan_s = time.perf_counter() - t0
    rest = [w for i, w in enumerate(layouts) if i not in set(ffn)]
    rest_bytes = sum(w.spec.nbytes for w in rest)  # every generation rank receives each of them whole
    gb_rest = sum(gather_broadcast_bytes(w.train, w.gen)["total"] for w in rest)
    gb_all = sum(gather_broadcast_bytes(w.train, w.gen)["total"] for w in layouts)
    model_bytes = sum(w.spec.nbytes for w in layouts)
    r_whole, r_ffn = recv(whole), recv(ffn_plan)
    common = {"model": model, "system": system, "domain_size": dom, "gen_ranks": len(gen), "model_bytes": model_bytes,
              "ffn_weights": len(ffn), "other_weights": len(rest), "plan_seconds": round(plan_s, 2)}
    return [
        {**common, "method": "reshard", "total_bytes": moved(whole), "max_gen_recv_bytes": max(r_whole.values()),
         "min_gen_recv_bytes": min(r_whole.values())},
        {**common, "method": "nemo_rl_split", "total_bytes": moved(ffn_plan) + gb_rest,
         "max_gen_recv_bytes": max(r_ffn.values()) + rest_bytes,
         "min_gen_recv_bytes": min(r_ffn.values()) + rest_bytes},
        {**common, "method": "gather_broadcast", "total_bytes": gb_all, "max_gen_recv_bytes": model_bytes,
         "min_gen_recv_bytes": model_bytes},
    ]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(METHODS)
    for k, method in enumerate(METHODS):
        sel = [next(r for r in rows if r["case"] == c and r["method"] == method) for c in cases]
        xs = [i + k * width for i in range(len(cases))]
        axes[0].bar(xs, [r["max_gen_recv_bytes"] / 1e6 for r in sel], width, label=method)
        axes[1].bar(xs, [r["seconds_median"] * 1e3 for r in sel], width, label=method)
    for ax, what in zip(axes, ("MB into the busiest generation rank", "ms per refit (median)")):
        ax.set_xticks([i + width for i in range(len(cases))], cases)
        ax.set_title(what)
    axes[0].legend()
    fig.suptitle("Megatron-core trainer (4 ranks) -> 2 TP2 engine replicas, gloo on CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _mb(b: int) -> str:
    return f"{b / 1e6:,.2f}" if b < 1e9 else f"{b / 1e9:,.1f} G"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["dense", "moe"], choices=["dense", "moe", "tpdp"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sim", action="store_true", help="also the simulator's Megatron configs (plans take minutes)")
    args = ap.parse_args()
    info = machine_info(torch.device("cpu"))
    rows = []
    for case in args.cases:
        rows += measure(case, args.repeat)
    write_csv(OUT / "bench_megatron.csv", [{**r, **info} for r in rows])
    plot(rows, OUT / "bench_megatron.png")
    print("| case | method | total MB | busiest trainer sends MB | MB into each generation rank (max / min) | "
          "ms per refit (median, min-max) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['method']} | {_mb(r['total_bytes'])} | {_mb(r['max_trainer_send_bytes'])} | "
              f"{_mb(r['max_gen_recv_bytes'])} / {_mb(r['min_gen_recv_bytes'])} | {r['seconds_median'] * 1e3:.1f} "
              f"({r['seconds_min'] * 1e3:.1f}-{r['seconds_max'] * 1e3:.1f}) |")
    if args.sim:
        sim = []
        for model, system in SIM_CONFIGS:
            sim += simulate_split(model, system)
        write_csv(OUT / "sim_megatron.csv", [{**r, **info} for r in sim])
        print("\n| model on system | method | total GB | GB into the busiest / least-loaded generation rank |")
        print("|---|---|---|---|")
        for r in sim:
            print(f"| {r['model']} on {r['system']} | {r['method']} | {r['total_bytes'] / 1e9:,.1f} | "
                  f"{r['max_gen_recv_bytes'] / 1e9:,.2f} / {r['min_gen_recv_bytes'] / 1e9:,.2f} |")


if __name__ == "__main__":
    main()
