"""DeepSpeed ZeRO-3 trainers into a TP-2 engine: reshard's sync from each rank's own partition against TRL's ZeRO-3
algorithm replayed over gloo; sync seconds, bytes per rank and each trainer rank's peak memory during the sync, in
one run.

Usage (in the TRL environment with DeepSpeed, `make deepspeed-env`):
    DS_ACCELERATOR=cpu PYTHONPATH=$PWD .venv-trl/bin/python perf/bench_deepspeed.py [--trainers 2,3] [--syncs 3]
        [--hidden 256] [--layers 4] [--vocab 8000] [--out perf/out]

Per T: T trainer processes run a real DeepSpeed ZeRO-3 engine (`DS_ACCELERATOR=cpu`, gloo, float32, every parameter
partitioned: `stage3_param_persistence_threshold` 0) of a Qwen3 of the given size; 2 engine processes hold the
model in bfloat16 as vLLM's TP-2 workers lay it out (`reshard.integrations.hf.engine_tensors`). Each round the
partitions change in place (untimed), then both methods sync, each timed from a barrier of all ranks to the next:
    reshard  `reshard.integrations.deepspeed.add_sources` + `Refit.run()`: every trainer rank sends its own
             partition's ranges, cast to bfloat16 while packing, straight to the engine ranks that hold them.
    trl      TRL 1.16's server-mode ZeRO-3 sync (`VLLMGeneration._iter_named_params` -> `update_named_params` ->
             vLLM's `packed_nccl_broadcast_producer`): every trainer rank gathers each parameter whole
             (`deepspeed.zero.GatheredParameters`, one at a time), trainer rank 0 keeps the gathered tensors, packs
             them into 1 GiB buffers (vLLM's default; here the whole model fits one) and broadcasts each, in the
             trainer's float32, to both engine ranks (which receive the whole model and keep nothing).
Peak memory: each trainer rank's resident-set high-water mark during the sync (`/proc/self/status` VmHWM, reset
through `/proc/self/clear_refs` before it) above its resident set at the start, next to its partition's size; glibc
is told to map every allocation above 128 KiB on its own (`MALLOC_MMAP_THRESHOLD_`), so freed tensors leave the
resident set and each sync's own allocations show. reshard reserves its staging at the first run (the warm-up,
reported apart as `reshard_first_peak`) and reuses it.
Writes `bench_deepspeed.csv` and `bench_deepspeed.png` under `--out`; prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402  (after the path set-up)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import machine_info, write_csv  # noqa: E402

TP = 2
PACKED_BUFFER = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


def config(args: argparse.Namespace):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                       num_key_value_heads=max(2, args.hidden // 64), head_dim=32, max_position_embeddings=256,
                       tie_word_embeddings=False)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    return _rss("VmRSS")


def _pg(store, prefix: str, rank: int, size: int):
    """A gloo process group of its own (the default world is DeepSpeed's trainer world)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, datetime.timedelta(seconds=600))


def rank_main(rank: int, T: int, args: argparse.Namespace, ports: tuple[int, int, int], q) -> None:
    torch.set_num_threads(1)
    from reshard.comm import Group
    from reshard.integrations import deepspeed as ds_sources
    from reshard.integrations import hf
    from reshard.refit import Refit

    world = T + TP
    trainer = rank < T
    store = dist.TCPStore("127.0.0.1", ports[0], world, rank == 0, timeout=datetime.timedelta(seconds=600))
    everyone = _pg(store, "all", rank, world)
    sender = _pg(store, "trl", 0 if rank == 0 else rank - T + 1, 1 + TP) if rank == 0 or not trainer else None
    cfg = config(args)
    engine = None
    if trainer:
        import deepspeed
        from transformers import Qwen3ForCausalLM

        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(T), LOCAL_WORLD_SIZE=str(T),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[1]))
        deepspeed.init_distributed(dist_backend="gloo")
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                     "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                     "steps_per_print": 10 ** 9}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                          config=ds_config)
        del model
    group = Group.rendezvous("127.0.0.1", ports[2], rank, world, prefix="bench-deepspeed", timeout=600)
    refit = Refit(group, timeout=600, precision="cast", policy="reshard")
    if trainer:
        ds_sources.add_sources(refit, engine)
        params = list(engine.module.named_parameters())
        partition = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for _, p in params)
    else:
        par = hf.EngineParallel(range(T, world), tp=TP)
        for t in hf.engine_tensors(cfg, par, dtype=torch.bfloat16):
            if rank in t.ranks:
                t.register(refit, torch.zeros(t.local_shape(rank), dtype=torch.bfloat16))
        shapes = [(n, tuple(s)) for n, s in _shapes(cfg)]
        partition = 0

    def trl_replay() -> int:
        """TRL's ZeRO-3 server sync (see the module docstring); the bytes this rank sent."""
        sent = 0
        if trainer:
            import deepspeed

            held: list[torch.Tensor] = []
            size = 0
            for _, p in params:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                    if rank == 0:
                        held.append(p.data)  # the producer keeps the gathered tensor past its gather
                        size += p.data.nbytes
                if rank == 0 and size >= PACKED_BUFFER:
                    sent += _broadcast_packed(sender, held)
                    held, size = [], 0
            if rank == 0 and held:
                sent += _broadcast_packed(sender, held)
        else:
            total = sum(torch.Size(s).numel() * 4 for _, s in shapes)
            for nbytes in _chunks(total):
                buf = torch.empty(nbytes, dtype=torch.uint8)
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                sender.broadcast([buf], opts).wait()
        return sent

    rows = []
    for round_ in range(args.syncs + 1):  # round 0: warm-up (metadata, plan, DeepSpeed's gather set-up)
        if trainer:
            g = torch.Generator().manual_seed(round_ * 7919 + rank)
            for _, p in params:
                p.ds_tensor.add_(1e-3 * torch.randn(p.ds_tensor.shape, generator=g))
        row = {"round": round_, "rank": rank, "partition_bytes": partition}
        for method in ("reshard", "trl"):
            everyone.barrier().wait()
            base = _reset_peak()
            t0 = time.perf_counter()
            if method == "reshard":
                rep = refit.run()
                sent = rep.execution.bytes_sent if rep.execution is not None else 0
            else:
                sent = trl_replay()
            everyone.barrier().wait()
            row[f"{method}_s"] = time.perf_counter() - t0
            row[f"{method}_sent"] = sent
            row[f"{method}_peak"] = _rss("VmHWM") - base
        rows.append(row)
    q.put(rows)
    everyone.barrier().wait()
    group.close()


def _shapes(cfg) -> list[tuple[str, torch.Size]]:
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        return [(n, p.shape) for n, p in Qwen3ForCausalLM(cfg).named_parameters()]


def _chunks(total: int) -> list[int]:
    """The packed buffers' sizes for `total` bytes (the receivers know the sizes from the metadata)."""
    return [min(PACKED_BUFFER, total - k) for k in range(0, total, PACKED_BUFFER)]


def _broadcast_packed(sender, held: list[torch.Tensor]) -> int:
    packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in held])
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    sender.broadcast([packed], opts).wait()
    return packed.nbytes * TP  # one copy to each worker


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    mib = 2 ** 20
    labels = [f"T={r['T']}" for r in rows]
    x = range(len(rows))
    for k, (m, name) in enumerate((("reshard", "reshard"), ("trl", "TRL ZeRO-3 (replayed)"))):
        axes[0].bar([i + 0.4 * k for i in x], [r[f"{m}_s_median"] for r in rows], 0.4, label=name)
        axes[1].bar([i + 0.4 * k for i in x], [r[f"{m}_peak_max"] / mib for r in rows], 0.4, label=name)
    axes[1].plot([i + 0.2 for i in x], [r["partition_max"] / mib for r in rows], "k_", markersize=30,
                 label="largest partition")
    axes[1].plot([i + 0.2 for i in x], [r["model_bytes"] / mib for r in rows], "r_", markersize=30,
                 label="whole model (fp32)")
    axes[0].set(title="sync seconds (median)", xticks=[i + 0.2 for i in x], xticklabels=labels)
    axes[1].set(title="busiest trainer rank's peak memory in the sync, MiB", xticks=[i + 0.2 for i in x],
                xticklabels=labels)
    for a in axes:
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", default="2,3")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--out", default="perf/out")
    args = ap.parse_args()
    from reshard.testing import free_port

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # the ranks (spawned) inherit it: see the docstring

    model_bytes = sum(s.numel() for _, s in _shapes(config(args))) * 4
    info = machine_info(torch.device("cpu"))
    rows = []
    for T in [int(t) for t in args.trainers.split(",")]:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ports = (free_port(), free_port(), free_port())
        procs = [ctx.Process(target=rank_main, args=(r, T, args, ports, q)) for r in range(T + TP)]
        for p in procs:
            p.start()
        by_rank = {res[0]["rank"]: res for res in (q.get(timeout=3600) for _ in procs)}
        for p in procs:
            p.join(60)
        timed = range(1, args.syncs + 1)
        row: dict = {"T": T, "engine_tp": TP, "model_bytes": model_bytes, **info}
        for m in ("reshard", "trl"):
            secs = [by_rank[0][k][f"{m}_s"] for k in timed]
            row[f"{m}_s_median"], row[f"{m}_s_min"] = statistics.median(secs), min(secs)
            sent = [by_rank[r][-1][f"{m}_sent"] for r in range(T)]
            row[f"{m}_sent_per_rank"] = "/".join(str(s) for s in sent)
            row[f"{m}_sent_total"] = sum(sent)
            peaks = [max(by_rank[r][k][f"{m}_peak"] for k in timed) for r in range(T)]
            row[f"{m}_peak_per_rank"] = "/".join(str(p) for p in peaks)
            row[f"{m}_peak_max"] = max(peaks)
        row["reshard_first_peak_per_rank"] = "/".join(str(by_rank[r][0]["reshard_peak"]) for r in range(T))
        row["partition_per_rank"] = "/".join(str(by_rank[r][0]["partition_bytes"]) for r in range(T))
        row["partition_max"] = max(by_rank[r][0]["partition_bytes"] for r in range(T))
        rows.append(row)
        print({k: v for k, v in row.items() if k not in info}, flush=True)
    out = Path(args.out)
    write_csv(out / "bench_deepspeed.csv", rows)
    plot(rows, out / "bench_deepspeed.png")
    mib = 2 ** 20

    def per(s: str) -> str:
        return "/".join(f"{int(b) / mib:.1f}" for b in s.split("/"))

    print(f"\nmodel {model_bytes / mib:.1f} MiB float32\n\n| T | method | sync s (median, min) | "
          "sent per trainer rank MiB"
          " | peak sync memory per trainer rank MiB | partition per rank MiB |\n|---|---|---|---|---|---|")
    for r in rows:
        for m, name in (("reshard", "reshard"), ("trl", "TRL ZeRO-3 (replayed, gloo)")):
            print(f"| {r['T']} | {name} | {r[f'{m}_s_median']:.3f}, {r[f'{m}_s_min']:.3f} | "
                  f"{per(r[f'{m}_sent_per_rank'])} | {per(r[f'{m}_peak_per_rank'])} | {per(r['partition_per_rank'])} |")
    for r in rows:
        print(f"T={r['T']}: reshard's first run (plan, staging reserved) peak per trainer rank MiB "
              f"{per(r['reshard_first_peak_per_rank'])}")
    print(f"machine: {info['cpu']}, {info['cpu_count']} CPUs, load {info['load_avg_1min']}; commit {info['commit']}")


if __name__ == "__main__":
    main()
