"""reshard against verl's own weight-sync backends, in the same verl setup and run: bytes and seconds per sync.

Usage (in `.venv-verl`, `make verl-env`):
    python perf/bench_frameworks.py [--trainers 2] [--rollouts 2] [--hidden 256] [--layers 4] [--vocab 8000]
        [--bucket-mb 4] [--syncs 5] [--backends reshard,gloo-single-sender,naive] [--out perf/out]

One local Ray cluster; per backend a fresh set of verl workers (`tests/verl_cases.py`: trainer workers with a tiny
Qwen3 under FSDP2 over gloo, rollout workers = verl's `CheckpointEngineWorker`), driven by verl's real
`CheckpointEngineManager.update_weights`. Every trainer rank streams `(name, p.full_tensor())`, as verl's FSDP
engine does. Backends:
    reshard             `reshard.integrations.verl` (`domains="node"`: the rollout workers of this machine forward
                        to each other, as GPUs of one node would over NVLink).
    gloo-single-sender  verl's `nccl` backend's algorithm over gloo (`perf/verl_gloo_baseline.py`): trainer rank 0
                        sends every bucket, the rollout ranks pass it along (NCCL's ring broadcast).
    naive               verl's colocated `naive` backend: each trainer worker loads the stream into an in-process
                        copy (no network; what a colocated rollout engine would load).
After a warm-up sync (group rendezvous, plans), `--syncs` timed syncs, with the weights changed between them
(untimed); the last sync's received tensors are checked against the trainer's, byte for byte. Rows give the driver's
wall time of `update_weights` (median and spread), bytes sent per trainer rank (the busiest and the total; counted by
reshard's executor and by the baseline's own message sizes) and bytes sent by rollout ranks (forwarding); for reshard
also the slowest trainer rank's `send_weights` seconds and its seconds in all-rank rounds (`SyncStats.seconds_rounds`:
the bucket manifests, each bucket's plan agreement and completion rounds, the commit).
Writes `bench_frameworks.csv` under `--out` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import ray  # noqa: E402  (after the path set-up)
import torch  # noqa: E402  (after the path set-up)
import verl_cases as vc  # noqa: E402  (after the path set-up)
from _common import machine_info, spread, write_csv  # noqa: E402  (after the path set-up)

MODULES = {"reshard": "reshard.integrations.verl", "gloo-single-sender": "verl_gloo_baseline", "naive": None}


def run_backend(backend: str, args: argparse.Namespace, config: dict) -> dict[str, object]:
    kwargs = {"timeout_s": 120} if backend != "naive" else {}
    trainer, rollout, _, manager = vc.setup(backend, num_trainers=args.trainers, num_rollout=args.rollouts,
                                            bucket_mb=args.bucket_mb, engine_kwargs=kwargs, config=config,
                                            custom_module=MODULES[backend])
    try:
        vc.sync(manager, 0)  # warm-up
        seconds, sent, forwarded, rounds, busy = [], [], [], [], []
        for step in range(1, args.syncs + 1):
            trainer.change_weights(step)
            t0 = time.perf_counter()
            metrics = vc.sync(manager, step)
            seconds.append(time.perf_counter() - t0)
            per_rank = [float(v) for k, v in sorted(metrics.items()) if k.endswith("bytes_sent")]
            sent.append(per_rank or [0.0] * args.trainers)
            if backend == "reshard":
                forwarded.append(sum(s.bytes_sent for s in rollout.engine_attr("last_sync")))
                mine = trainer.engine_attr("last_sync")
                rounds.append(max(s.seconds_rounds for s in mine))
                busy.append(max(s.seconds for s in mine))
            elif backend != "naive":
                forwarded.append(sum(rollout.engine_attr("bytes_sent")))
            else:
                forwarded.append(0)
        full = trainer.full_state()[0]
        model_bytes = sum(t.nbytes for t in full.values())
        got = rollout.received() if backend != "naive" else [([], c) for c in trainer.colocated_weights()]
        for _, rec in got:
            assert list(rec) == list(full) and all(
                torch.equal(rec[n].view(torch.uint8), full[n].view(torch.uint8)) for n in full), backend
        med, lo, hi = spread(seconds)
        return {"backend": backend, "trainers": args.trainers, "rollouts": args.rollouts,
                "model_bytes": model_bytes, "tensors": len(full), "bucket_bytes": args.bucket_mb << 20,
                "syncs": args.syncs, "seconds_median": round(med, 4), "seconds_min": round(lo, 4),
                "seconds_max": round(hi, 4), "busiest_trainer_bytes": int(max(max(s) for s in sent)),
                "trainer_bytes_total": int(statistics.median(sum(s) for s in sent)),
                "rollout_forward_bytes": int(statistics.median(forwarded)), "byte_equal": True,
                "trainer_send_s": round(statistics.median(busy), 4) if busy else "",
                "trainer_rounds_s": round(statistics.median(rounds), 4) if rounds else ""}
    finally:
        for w in trainer.workers + rollout.workers:
            ray.kill(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--bucket-mb", type=int, default=4)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--backends", default="reshard,gloo-single-sender,naive")
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    config = dict(vc.CONFIG, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                  num_hidden_layers=args.layers, vocab_size=args.vocab, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=args.hidden // 4)
    vc.ray_init(extra_path=(str(HERE),))
    rows = []
    try:
        for backend in args.backends.split(","):
            row = run_backend(backend, args, config)
            row.update(machine_info(torch.device("cpu")))
            rows.append(row)
            print(row, flush=True)
    finally:
        ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "bench_frameworks.csv", rows)
    print(f"\nmodel {rows[0]['model_bytes'] / 1e6:.1f} MB ({rows[0]['tensors']} tensors), {args.trainers} trainer + "
          f"{args.rollouts} rollout workers, bucket {args.bucket_mb} MiB, {args.syncs} syncs; cpus "
          f"{os.cpu_count()}\n")
    print("| backend | sync s (median, min-max) | busiest trainer rank sent | all trainer ranks sent | rollout ranks "
          "forwarded |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['seconds_median']:.3f} ({r['seconds_min']:.3f}-{r['seconds_max']:.3f}) | "
              f"{r['busiest_trainer_bytes'] / 1e6:.2f} MB | {r['trainer_bytes_total'] / 1e6:.2f} MB | "
              f"{r['rollout_forward_bytes'] / 1e6:.2f} MB |")
    for r in rows:
        if r["trainer_rounds_s"] != "":
            print(f"\n{r['backend']}: slowest trainer rank's send_weights {r['trainer_send_s']:.3f} s, of which "
                  f"{r['trainer_rounds_s']:.3f} s in all-rank rounds (medians; the rounds include packing overlapped "
                  "with them)")


if __name__ == "__main__":
    main()
