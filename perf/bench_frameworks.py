"""reshard against verl's own weight-sync backends, in the same verl workers and run, interleaved: bytes, seconds,
all-rank rounds and trainer-side assembly per sync.

Usage (in `.venv-verl`, `make verl-env`):
    python perf/bench_frameworks.py [--trainers 2] [--rollouts 2] [--rollout-tp 1] [--hidden 256] [--layers 4]
        [--vocab 8000] [--bucket-mb 4] [--syncs 5] [--backends reshard,reshard-shard,gloo-single-sender,naive]
        [--out perf/out]

One local Ray cluster and one set of verl workers (`reshard.testing.verl`: trainer workers with a tiny Qwen3 under
FSDP2 over gloo, whose trainer-side sync is verl 0.9.1's own `ActorRolloutRefWorker.update_weights`; rollout
workers = verl's `CheckpointEngineWorker`, `--rollouts / --rollout-tp` replicas of `--rollout-tp` workers). Every
worker holds one checkpoint engine per backend, and each sync is verl's real `CheckpointEngineManager.update_weights`
with that backend's engines. Backends:
    reshard             `reshard.integrations.verl`, verl's default manager: the trainer ranks stream
                        `(name, p.full_tensor())` (verl's FSDP `get_per_tensor_param()`): every rank gathers every
                        parameter, then sends a distinct row block of it.
    reshard-shard       the same backend with `checkpoint_manager_class=reshard.integrations.verl.ShardStreamManager`:
                        verl hands the training engine to `send_weights`, which streams `get_per_tensor_param_shard()`
                        (each rank's local FSDP shards in bf16; nothing gathered). Half the bytes of fp32.
    reshard-dtensor     the same backend, the trainer's `get_per_tensor_param()` streaming the fp32 DTensors instead of
                        their full tensors (not what verl 0.9.1's FSDP engine streams: a control with the fp32 bytes
                        of the other backends and no gather). Not in the default `--backends`.
    gloo-single-sender  verl's `nccl` backend's algorithm over gloo (`perf/verl_gloo_baseline.py`): every trainer rank
                        gathers the full tensors, trainer rank 0 sends every bucket, the rollout ranks pass it along
                        (NCCL's ring broadcast).
    naive               verl's colocated `naive` backend: each trainer worker loads the stream into an in-process
                        copy (no network; what a colocated rollout engine would load).
    reshard-vllm        `checkpoint_manager_class=reshard.integrations.verl.EngineShardManager`: real vLLM CPU
                        engines (`--rollouts / --rollout-tp` replicas of TP `--rollout-tp`, each in verl's own
                        `vLLMHttpServer` actor, `reshard.testing.verl.engine_replicas`) refit in place through reshard's
                        vLLM weight-transfer backend from the trainers' shard stream: each engine worker receives its
                        own shards only. Its time includes vLLM's weight re-processing; its bytes are the engine
                        workers' own counters. Needs vLLM: run the bench in `.venv-vllm` with verl on PYTHONPATH
                        (`make verl-vllm-env`; `PYTHONPATH=.verl-vllm VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python
                        perf/bench_frameworks.py ...`). Its check is vLLM's own reload of the trainer's last weights
                        against the engine's tensors, after the last sync (bit for bit).
After one warm-up sync per backend (group rendezvous, plans), `--syncs` rounds: the weights change (untimed), then
every backend syncs once, in an order rotated each round (so none always runs first after the change), each
sync's received tensors checked against the trainer's `full_tensor()` byte for byte (bf16 for `reshard-shard`;
untimed). Per backend: the driver's wall time of `update_weights` (median and spread), bytes sent per trainer rank
(the busiest and the total), bytes received per rollout rank (the most) against the bytes of the rank's own shards in
vLLM's TP layout (`reshard.integrations.hf.engine_tensors`: what a rank of a TP replica needs), bytes forwarded by
rollout ranks, the slowest trainer rank's seconds waiting for the stream (the framework's assembly: `full_tensor()`)
and until its first bucket moves, and all-rank rounds per sync. Also the 1-minute load average during the run.
Writes `bench_frameworks.csv` under `--out` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

import ray  # noqa: E402  (after the path set-up)
import torch  # noqa: E402  (after the path set-up)
from _common import machine_info, spread, write_csv  # noqa: E402  (after the path set-up)
from verl.workers.config import CheckpointEngineConfig  # noqa: E402  (after the path set-up)

import reshard.testing.verl as vc  # noqa: E402  (after the path set-up)

# label -> (verl backend name, custom_backend_module, checkpoint_manager_class, what get_per_tensor_param() streams)
BACKENDS = {
    "reshard": ("reshard", "reshard.integrations.verl", None, "full"),
    "reshard-shard": ("reshard", "reshard.integrations.verl", "reshard.integrations.verl.ShardStreamManager", "full"),
    "reshard-dtensor": ("reshard", "reshard.integrations.verl", None, "dtensor"),
    "gloo-single-sender": ("gloo-single-sender", "verl_gloo_baseline", None, "full"),
    "naive": ("naive", None, None, "full"),
    "reshard-vllm": ("reshard", "reshard.integrations.verl", "reshard.integrations.verl.EngineShardManager", "full"),
}
ENGINES = ("reshard-vllm",)
"""Backends that refit real vLLM engines (verl's servers, replicas of `--rollout-tp`) instead of the rollout workers."""


def own_shard_bytes(model: torch.nn.Module, num_rollout: int, tp: int, dtype: torch.dtype) -> list[int]:
    """Per rollout rank, the bytes of the Hugging Face tensors' parts it holds in vLLM's TP layout (in `dtype`)."""
    from reshard.integrations.hf import EngineParallel, engine_tensors

    out = [0] * num_rollout
    for et in engine_tensors(model, EngineParallel(range(num_rollout), tp=tp)):
        for _, layout in et.components:
            for r in range(num_rollout):
                out[r] += sum(math.prod(p.global_box.shape) for p in layout.pieces(r)) * dtype.itemsize
    return out


def check(label: str, trainer, rollout, full: dict[str, torch.Tensor]) -> None:
    if label in ENGINES:
        return  # checked after the last sync (check_engines)
    if label == "naive":
        got = [c for c in trainer.colocated_weights()]
    else:
        got = [rec for _, rec in rollout.received()]
    want = {n: t.to(torch.bfloat16) for n, t in full.items()} if label == "reshard-shard" else full
    for rec in got:
        assert list(rec) == list(want) and all(
            torch.equal(rec[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want), label


def check_engines(replicas: list, full: dict[str, torch.Tensor], tmp: str) -> None:
    """Every tensor each engine worker's forward reads equals vLLM's own reload of `full` (bf16), bit for bit."""
    from safetensors.torch import save_file

    save_file({n: t.to(torch.bfloat16) for n, t in full.items()}, os.path.join(tmp, "model.safetensors"))
    for r in replicas:
        server = r.servers[0]
        got = ray.get(server.call.remote(_forward_tensors))
        ray.get(server.collective_rpc.remote("reload_weights", kwargs={"weights_path": tmp}))
        want = ray.get(server.call.remote(_forward_tensors))
        for a, b in zip(got, want):
            same = a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8),
                                                            b[k].reshape(-1).view(torch.uint8)) for k in a)
            assert same, "reshard-vllm: the engine differs from vLLM's own load"


def _forward_tensors(worker) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the engine worker's model (CPU copies), and each Linear layer's output on a
    fixed input (the CPU backend may hold a weight where no tensor shows it)."""
    model = worker.model_runner.get_model()
    out = {n: t.detach().cpu().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    from vllm.model_executor.layers.linear import LinearBase

    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            width = getattr(m, "input_size_per_partition", None) or m.input_size
            x = torch.linspace(-1, 1, 3 * width).reshape(3, -1).to(torch.bfloat16)
            out[f"{name}|probe"] = m.quant_method.apply(m, x).detach().clone()
    return out


def _engine_bytes(worker) -> tuple[int, int]:
    """(received, sent) bytes of an engine worker's last update (run in the vLLM worker)."""
    ex = worker.weight_transfer_engine.last_report.execution
    return ex.bytes_received, ex.bytes_sent


def observe(label: str, trainer, rollout, replicas: list, metrics: dict, T: int) -> dict[str, float]:
    """What one sync of `label` did, from its engines' own counters."""
    per_rank = [float(v) for k, v in sorted(metrics.items()) if k.endswith("bytes_sent")]
    row = {"busiest": max(per_rank or [0.0]), "total": sum(per_rank), "received": 0.0, "forwarded": 0.0,
           "stream_s": float("nan"), "first_send_s": float("nan"), "rounds": 0.0}
    if label == "naive":
        return row
    if label in ENGINES:
        mine = trainer.engine_attr("last_sync")
        got = [ray.get(r.servers[0].call.remote(_engine_bytes)) for r in replicas]
        row.update(received=max(b[0] for g in got for b in g), forwarded=sum(b[1] for g in got for b in g),
                   stream_s=max(s.seconds_stream for s in mine), first_send_s=max(s.seconds_first_send for s in mine),
                   rounds=max(s.rounds for s in mine))
    elif label.startswith("reshard"):
        mine, theirs = trainer.engine_attr("last_sync"), rollout.engine_attr("last_sync")
        row.update(received=max(s.bytes_received for s in theirs), forwarded=sum(s.bytes_sent for s in theirs),
                   stream_s=max(s.seconds_stream for s in mine), first_send_s=max(s.seconds_first_send for s in mine),
                   rounds=max(s.rounds for s in mine + theirs))
    else:
        row.update(received=max(rollout.engine_attr("bytes_received")),
                   forwarded=sum(rollout.engine_attr("bytes_sent")),
                   stream_s=max(trainer.engine_attr("seconds_stream")),
                   first_send_s=max(trainer.engine_attr("seconds_first_send")))
    return row


def engine_replicas(replicas: list, config: dict, tp: int) -> list:
    """One vLLM engine replica (verl's own server, TP `tp`, reshard's weight-transfer backend) per rollout replica,
    loading a checkpoint (vLLM reloads in place only from one: the final check)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_CPU_OMP_THREADS_BIND": threads_bind(tp)}
    rc, mc = vc.engine_configs(replicas[0].config.checkpoint_engine, config, tp, 7)
    return vc.engine_replicas(rc, mc, len(replicas), env)


def threads_bind(tp: int) -> str:
    """vLLM CPU's `VLLM_CPU_OMP_THREADS_BIND` for `tp` workers: this process's CPUs split among them (shared when
    there are fewer CPUs than workers)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        return "|".join([",".join(map(str, cpus))] * tp)
    per = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(tp))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--rollout-tp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--bucket-mb", type=int, default=4)
    ap.add_argument("--syncs", type=int, default=5)
    has_vllm = importlib.util.find_spec("vllm") is not None
    ap.add_argument("--backends", default=",".join(b for b in BACKENDS if b != "reshard-dtensor"
                                                   and (has_vllm or b not in ENGINES)))
    ap.add_argument("--out", type=Path, default=HERE / "out")
    args = ap.parse_args()
    labels = args.backends.split(",")
    unknown = sorted(set(labels) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backends {unknown}; choose from {list(BACKENDS)}")
    config = dict(vc.CONFIG, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                  num_hidden_layers=args.layers, vocab_size=args.vocab, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=args.hidden // 4)
    vc.ray_init(extra_path=(str(HERE),))
    samples: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    loads: list[float] = []
    try:
        first = BACKENDS[labels[0]]
        trainer, rollout, replicas, _ = vc.setup(first[0], num_trainers=args.trainers, num_rollout=args.rollouts,
                                                 rollout_tp=args.rollout_tp, bucket_mb=args.bucket_mb,
                                                 config=config, custom_module=first[1])
        engines: list = []
        if any(label in ENGINES for label in labels):
            engines = engine_replicas(replicas, config, args.rollout_tp)
        managers = {}
        for label in labels:
            backend, module, manager_class, _ = BACKENDS[label]
            kwargs = {"timeout_s": 120} if backend != "naive" else {}
            ce = CheckpointEngineConfig(backend=backend, update_weights_bucket_megabytes=args.bucket_mb,
                                        engine_kwargs={backend: kwargs}, custom_backend_module=module)
            trainer.add_engine(label, ce)
            rollout.add_engine(label, ce)
            managers[label] = vc.make_manager(ce, trainer, engines if label in ENGINES else replicas, manager_class)

        def run(label: str, step: int) -> tuple[float, dict]:
            trainer.use_engine(label)
            rollout.use_engine(label)
            trainer.set_stream(BACKENDS[label][3])
            t0 = time.perf_counter()
            metrics = vc.sync(managers[label], step)
            return time.perf_counter() - t0, metrics

        for label in labels:
            run(label, 0)  # warm-up: rendezvous, plans
        for step in range(1, args.syncs + 1):
            trainer.change_weights(step)
            full = trainer.full_state()[0]
            loads.append(os.getloadavg()[0])
            order = labels[step % len(labels):] + labels[: step % len(labels)]
            for label in order:
                seconds, metrics = run(label, step)
                check(label, trainer, rollout, full)
                samples[label].append(dict(observe(label, trainer, rollout, engines, metrics, args.trainers),
                                           seconds=seconds))
        full = trainer.full_state()[0]
        model = vc.build_model(config, 0)
        if engines:
            with tempfile.TemporaryDirectory() as tmp:
                check_engines(engines, full, tmp)
    finally:
        ray.shutdown()
    model_bytes = sum(t.nbytes for t in full.values())
    rows = []
    for label in labels:
        s = samples[label]
        med, lo, hi = spread([x["seconds"] for x in s])
        dtype = torch.bfloat16 if label in ("reshard-shard", *ENGINES) else torch.float32
        need = max(own_shard_bytes(model, args.rollouts, args.rollout_tp, dtype)) if label != "naive" else 0
        row = {"backend": label, "trainers": args.trainers, "rollouts": args.rollouts, "rollout_tp": args.rollout_tp,
               "model_bytes": model_bytes, "tensors": len(full), "bucket_bytes": args.bucket_mb << 20,
               "syncs": args.syncs, "seconds_median": round(med, 4), "seconds_min": round(lo, 4),
               "seconds_max": round(hi, 4), "byte_equal": True, "rollout_rank_needs_bytes": need,
               "load_avg_1min_min": round(min(loads), 2), "load_avg_1min_max": round(max(loads), 2)}
        for key in ("busiest", "total", "received", "forwarded", "rounds", "stream_s", "first_send_s"):
            row[key] = round(statistics.median(x[key] for x in s), 4)
        row.update(machine_info(torch.device("cpu")))
        rows.append(row)
        print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "bench_frameworks.csv", rows)
    print(f"\nmodel {model_bytes / 1e6:.1f} MB fp32 ({len(full)} tensors), {args.trainers} trainer + {args.rollouts} "
          f"rollout workers (TP{args.rollout_tp} replicas), bucket {args.bucket_mb} MiB, {args.syncs} interleaved "
          f"syncs; cpus {os.cpu_count()}, load average {min(loads):.1f}-{max(loads):.1f}\n")
    print("| backend | sync s, median [min, max] | all-rank rounds | trainer: stream (assembly) s, first send s | "
          "busiest trainer rank sent | all trainer ranks sent | a rollout rank received (its TP shards) | rollout "
          "ranks forwarded |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['seconds_median']:.3f} [{r['seconds_min']:.3f}, {r['seconds_max']:.3f}] | "
              f"{r['rounds']:.0f} | {_secs(r['stream_s'], r['first_send_s'])} | {r['busiest'] / 1e6:.2f} MB | "
              f"{r['total'] / 1e6:.2f} MB | {r['received'] / 1e6:.2f} MB ({r['rollout_rank_needs_bytes'] / 1e6:.2f}) "
              f"| {r['forwarded'] / 1e6:.2f} MB |")


def _secs(stream_s: float, first_send_s: float) -> str:
    """The assembly column: blank where the backend has no trainer-side stream to wait for (`naive`)."""
    return "" if math.isnan(stream_s) else f"{stream_s:.3f}, {first_send_s:.3f}"


if __name__ == "__main__":
    main()
