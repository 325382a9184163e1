"""reshard's TRL sync against TRL's own algorithm, replayed over gloo: seconds per sync and bytes per trainer rank and
per server worker, T trainer ranks into a TP-2 server, in one run.

Usage (in `.venv-trl`, `make trl-env`):
    PYTHONPATH=$PWD .venv-trl/bin/python perf/bench_trl.py [--trainers 2,4] [--syncs 3] [--hidden 256] [--layers 4]
        [--vocab 8000] [--out perf/out]

One `vllm serve` server (TP 2, bfloat16, reshard's weight-transfer backend; `tests/trl_cases.Server`) for the whole
run. Per T, T trainer processes hold a Qwen3 of the given size (float32) sharded FSDP2-style: each rank a `Shard(0)`
row block of every weight (torch.chunk's split). Each round the weights change (untimed), then both methods sync:
    reshard  `reshard.integrations.trl.ShardSync` (what `reshard.integrations.trl.GRPOTrainer` runs): every trainer
             rank sends its own rows, cast to the server's bfloat16, straight to the server workers that hold them;
             trainer rank 0 drives the server's HTTP weight-update routes. Timed on trainer rank 0 from the call to
             the server's `finish_weight_update` (vLLM's weight re-processing included). Bytes: the trainer ranks'
             and the server workers' own counters.
    trl      TRL 1.16's server-mode algorithm (`VLLMGeneration.sync_weights` -> `VLLMClient.update_named_params`)
             over gloo: every trainer rank gathers every parameter whole (`full_tensor()`: an all-gather of the row
             blocks), trainer rank 0 sends each one whole, in the trainer's float32, to each of 2 receiver processes
             standing in for the server's TP workers (TRL broadcasts every tensor to every worker; the receivers
             keep nothing, so vLLM's loading is not in this time). Timed from a barrier to the receivers' last byte.
Prints a markdown table and writes `bench_trl.csv` under `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import torch  # noqa: E402  (after the path set-up)
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import trl_cases as tc  # noqa: E402  (the server, its worker probe)
from _common import machine_info, write_csv  # noqa: E402

TP = 2


def write_model(path: str, hidden: int, layers: int, vocab: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tc.trl_grpo.write_tiny(path)  # its tokenizer; the weights are replaced below
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), head_dim=32,
                      max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=2, pad_token_id=1,
                      bos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)


def rank_main(rank: int, T: int, args: argparse.Namespace, url: str, ports: tuple[int, int], q) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from reshard import Layout, Mesh, Shard
    from reshard.integrations.trl import ServerClient, ShardSync

    world = T + TP
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    trainers = dist.new_group(list(range(T)))
    sender = dist.new_group([0] + list(range(T, world)))  # TRL's group: trainer rank 0 and the server's workers
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    names = [n for n, _ in model.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shards = {}
    if rank < T:  # FSDP2-style row blocks, padded to equal size for the all-gather (as FSDP2's own)
        for n, p in model.named_parameters():
            rows = -(-p.shape[0] // T)
            full = torch.zeros((rows * T,) + tuple(p.shape[1:]))
            full[: p.shape[0]] = p.detach()
            shards[n] = full[rank * rows:(rank + 1) * rows].clone()
    del model
    link = None
    if rank < T:
        link = ShardSync(rank, T, TP, "127.0.0.1", ports[1], client=ServerClient(url) if rank == 0 else None,
                         timeout_s=600.0)

    def reshard_sources():
        for n in names:
            layout = Layout(shapes[n], Mesh(list(range(T))), [Shard(0)], torch.float32, name=n)
            rows = layout.local_shape(rank)[0]
            yield n, (shards[n][:rows], layout)

    results = []
    for round_ in range(args.syncs + 1):  # round 0: warm-up (rendezvous, plans)
        if rank < T:
            g = torch.Generator().manual_seed(round_ * 7919 + rank)
            for t in shards.values():
                t.add_(1e-3 * torch.randn(t.shape, generator=g))
        dist.barrier()
        row = {"round": round_, "rank": rank}
        if rank < T:
            r = link.sync(reshard_sources)
            row.update(reshard_s=r.seconds, reshard_sent=r.bytes_sent)
        dist.barrier()
        t0 = time.perf_counter()
        sent = received = 0
        for n in names:
            if rank < T:
                local = shards[n]
                full = torch.empty((local.shape[0] * T,) + tuple(local.shape[1:]))
                dist.all_gather(list(full.chunk(T)), local, group=trainers)
                full = full[: shapes[n][0]].contiguous()
            else:
                full = torch.empty(shapes[n])
            if rank == 0 or rank >= T:
                dist.broadcast(full, src=0, group=sender)
                if rank == 0:
                    sent += full.nbytes * TP
                else:
                    received += full.nbytes
        dist.barrier()
        row.update(trl_s=time.perf_counter() - t0, trl_sent=sent, trl_received=received)
        results.append(row)
    if link is not None:
        link.close()
    q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", default="2,4")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--out", default="perf/out")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_trl_")
    args.model = os.path.join(tmp, "model")
    write_model(args.model, args.hidden, args.layers, args.vocab)
    model_bytes = sum(p.numel() for p in
                      __import__("transformers").AutoModelForCausalLM.from_pretrained(args.model).parameters()) * 4
    server = tc.Server(sys.executable, args.model, os.path.join(tmp, "server.log"), tp=TP)
    t0 = time.perf_counter()
    server.start(timeout_s=900)
    print(f"server TP{TP} up in {time.perf_counter() - t0:.0f} s; model {model_bytes / 2**20:.1f} MiB float32")
    rows = []
    info = machine_info(torch.device("cpu"))
    try:
        for T in [int(t) for t in args.trainers.split(",")]:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            ports = (tc.free_port(), tc.free_port())
            procs = [ctx.Process(target=rank_main, args=(r, T, args, server.url, ports, q)) for r in range(T + TP)]
            for p in procs:
                p.start()
            per_rank = [q.get(timeout=3600) for _ in procs]
            for p in procs:
                p.join(60)
            received = [w["bytes_received"] for w in tc.rpc(server.url, "reshard_received")]
            by_rank = {res[0]["rank"]: res for res in per_rank}
            timed = range(1, args.syncs + 1)
            trainer0 = by_rank[0]
            row = {"T": T, "server_tp": TP, "model_mib_fp32": round(model_bytes / 2**20, 1), **info,
                   "reshard_s_median": statistics.median(trainer0[k]["reshard_s"] for k in timed),
                   "reshard_s_min": min(trainer0[k]["reshard_s"] for k in timed),
                   "reshard_sent_max": max(by_rank[r][-1]["reshard_sent"] for r in range(T)),
                   "reshard_sent_total": sum(by_rank[r][-1]["reshard_sent"] for r in range(T)),
                   "reshard_received_per_worker": "/".join(str(b) for b in received),
                   "trl_s_median": statistics.median(trainer0[k]["trl_s"] for k in timed),
                   "trl_s_min": min(trainer0[k]["trl_s"] for k in timed),
                   "trl_sent_max": max(by_rank[r][-1]["trl_sent"] for r in range(T)),
                   "trl_received_per_worker": "/".join(str(by_rank[r][-1]["trl_received"])
                                                       for r in range(T, T + TP))}
            rows.append(row)
            print(row, flush=True)
    finally:
        server.stop()
    write_csv(Path(args.out) / "bench_trl.csv", rows)
    mib = 2**20
    print("\n| T | method | sync s (median, min) | busiest trainer rank sent MiB | all trainer ranks MiB | "
          "per server worker MiB |\n|---|---|---|---|---|---|")
    for r in rows:
        per = "/".join(f"{int(b) / mib:.2f}" for b in r["reshard_received_per_worker"].split("/"))
        print(f"| {r['T']} | reshard | {r['reshard_s_median']:.3f}, {r['reshard_s_min']:.3f} | "
              f"{r['reshard_sent_max'] / mib:.2f} | {r['reshard_sent_total'] / mib:.2f} | {per} |")
        per = "/".join(f"{int(b) / mib:.2f}" for b in r["trl_received_per_worker"].split("/"))
        print(f"| {r['T']} | TRL (replayed, gloo) | {r['trl_s_median']:.3f}, {r['trl_s_min']:.3f} | "
              f"{r['trl_sent_max'] / mib:.2f} | {r['trl_sent_max'] / mib:.2f} | {per} |")
    print(f"machine: {info['cpu']}, {info['cpu_count']} CPUs, load {info['load_avg_1min']}; commit {info['commit']}")


if __name__ == "__main__":
    main()
