"""How long a live vLLM engine stops generating per update, and what delta updates save, on a real vLLM engine.

Question: with reshard's two-phase update (`phase="stage"` while the engine serves, then `phase="commit"` under a
pause), how long is the pause, against today's one-phase update (transfer, re-processing and copy, all paused)?
And how many bytes and seconds does a delta update take against a full one, after a training step of lr 1e-6 and
1e-5? And how fast does the engine generate while a stage is in flight, against idle?

Setup: a 2-process trainer (FSDP-style `S(0)` shards of a Qwen3's HuggingFace weights, float32 master weights sent
as bfloat16) and a vLLM CPU engine (TP 1, in process), over one gloo group on this machine; model sizes from
`--sizes` (hidden:layers:intermediate). Run in the vLLM environment:

    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=. .venv-vllm/bin/python perf/bench_vllm.py --out perf/out

Writes `bench_vllm.csv` and `bench_vllm.png` (without matplotlib: a message, no plot) into `--out`.

`--ep-bytes`: instead, the simulator's bytes per inference rank of MoE models (DeepSeek-V3, Qwen3-235B-A22B,
Kimi-K2) on 32-GPU engines (TP8 x 4, TP8+EP32, wide EP: DP32+EP32), reshard's against a whole-expert sender (vLLM
`nccl_m2n`'s rule for experts); runs in the core environment:

    PYTHONPATH=. .venv/bin/python perf/bench_vllm.py --ep-bytes
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_csv  # noqa: E402

from reshard.models import ModelConfig, param_specs  # noqa: E402

logger = logging.getLogger("bench_vllm")
HEAD_DIM, HEADS, KV_HEADS, VOCAB = 64, 8, 4, 4096


def config(hidden: int, layers: int, inter: int) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
            "bos_token_id": 0, "eos_token_id": 1}


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HuggingFace name -> shape of every weight of `cfg`'s Qwen3 (`reshard.models.param_specs`)."""
    mc = ModelConfig(name="bench", family="llama", qk_norm=True, tie_word_embeddings=cfg["tie_word_embeddings"],
                     **{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "vocab_size", "head_dim")})
    return {p.name: tuple(p.shape) for p in param_specs(mc)}


def master(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 master weights (norms near 1, matrices ~ N(0, 0.05))."""
    g = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(s, generator=g) * 0.05 + (1.0 if len(s) == 1 else 0.0)) for n, s in shapes(cfg).items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(rank: int, world: int, cfg: dict, port: int, commands, results) -> None:
    """One trainer rank: holds its `S(0)` rows of every weight; `("step", lr)` adds `lr * N(0, 1)` to the master
    weights, `("send", full)` sends the bfloat16 values; `("exit",)`."""
    torch.set_num_threads(1)
    from reshard import Layout, Mesh, Shard
    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    full = master(cfg)
    layouts = {n: Layout(tuple(w.shape), Mesh(list(range(world))), [Shard(0)], torch.bfloat16, name=n)
               for n, w in full.items()}
    rows = {n: lay.pieces(rank)[0].global_box if lay.pieces(rank) else None for n, lay in layouts.items()}
    own = {n: full[n][b.offsets[0]:b.offsets[0] + b.shape[0]].clone() if b else full[n][:0].clone()
           for n, b in rows.items()}
    local = {n: w.to(torch.bfloat16) for n, w in own.items()}
    info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port, world_size=world,
                                  engine_world_size=1, timeout_s=300.0, delta=True)
    t = ReshardTrainer.trainer_init(info, source={n: (local[n], layouts[n]) for n in local})
    g = torch.Generator().manual_seed(100 + rank)
    results.put(("ready", rank))
    while True:
        cmd = commands.get()
        if cmd[0] == "exit":
            t.shutdown()
            return
        if cmd[0] == "step":
            for n, w in own.items():
                w += cmd[1] * torch.randn(w.shape, generator=g)
                local[n].copy_(w)
            results.put(("stepped", rank))
        elif cmd[0] == "send":
            t0 = time.perf_counter()
            report = t.send_weights(full=cmd[1])
            results.put(("sent", rank, time.perf_counter() - t0, sum(report.encoded_bytes.values()),
                         sum(report.dense_bytes.values()), report.network_bytes))


class Trainers:
    def __init__(self, cfg: dict, port: int, world: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=trainer, args=(r, world, cfg, port, self.commands[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def post(self, *cmd) -> None:
        for q in self.commands:
            q.put(cmd)

    def wait(self) -> list:
        return sorted((self.results.get(timeout=600) for _ in self.procs), key=lambda r: r[1])

    def close(self) -> None:
        self.post("exit")
        for p in self.procs:
            p.join(timeout=60)


def write_checkpoint(path: str, cfg: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({n: w.to(torch.bfloat16) for n, w in master(cfg).items()}, os.path.join(path, "model.safetensors"))


def tokens_per_s(llm, num_tokens: int) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])] * 2,
                        SamplingParams(max_tokens=num_tokens // 2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / (time.perf_counter() - t0)


def measure(size: str, repeat: int, lrs: list[float], gen_tokens: int) -> list[dict]:
    from vllm import LLM

    hidden, layers, inter = (int(x) for x in size.split(":"))
    cfg = config(hidden, layers, inter)
    numel = sum(torch.Size(s).numel() for s in shapes(cfg).values())
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(d, cfg)
        llm = LLM(model=d, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256,
                  max_num_seqs=2, seed=0, distributed_executor_backend="uni",
                  weight_transfer_config={"backend": "reshard"})
        port = free_port()
        trainers = Trainers(cfg, port)
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "trainer_world_size": 2, "timeout_s": 300.0,
                                                       "delta": True}})
        trainers.wait()
        base = dict(size=size, params=numel, bf16_mib=round(numel * 2 / 2**20, 2))

        def paused_update(full: bool) -> tuple[float, list]:
            """Today's sequence: the engine is paused for the whole update."""
            t0 = time.perf_counter()
            trainers.post("send", full)
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": "x", "full": full}})
            llm.finish_weight_update()
            pause = time.perf_counter() - t0
            return pause, trainers.wait()

        def two_phase(full: bool, serve: bool) -> tuple[float, float, float | None, list]:
            """Stage while (optionally) serving, then commit under a pause."""
            t0 = time.perf_counter()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": "y", "phase": "stage", "full": full}})
            trainers.post("send", full)
            tps = tokens_per_s(llm, gen_tokens) if serve else None
            sent = trainers.wait()
            stage = time.perf_counter() - t0
            t1 = time.perf_counter()
            llm.update_weights({"update_info": {"version": "y", "phase": "commit"}})
            llm.finish_weight_update()
            return stage, time.perf_counter() - t1, tps, sent

        paused_update(True)  # the first update plans: not timed
        idle = [tokens_per_s(llm, gen_tokens) for _ in range(repeat)]
        for _ in range(repeat):
            pause, sent = paused_update(True)
            rows.append({**base, "kind": "paused_update_full", "seconds": pause,
                         "wire_bytes": sum(r[3] for r in sent)})
            stage, commit, tps, sent = two_phase(True, serve=False)
            rows.append({**base, "kind": "stage_full", "seconds": stage, "wire_bytes": sum(r[3] for r in sent)})
            rows.append({**base, "kind": "commit_pause", "seconds": commit})
            stage, commit, tps, sent = two_phase(True, serve=True)
            rows.append({**base, "kind": "tokens_per_s_during_stage", "value": tps})
        rows += [{**base, "kind": "tokens_per_s_idle", "value": v} for v in idle]
        for lr in lrs:
            for _ in range(repeat):
                for full in (True, False):
                    trainers.post("step", lr)
                    trainers.wait()
                    stage, commit, _, sent = two_phase(full, serve=False)
                    rows.append({**base, "kind": "delta" if not full else "full", "lr": lr, "seconds": stage,
                                 "wire_bytes": sum(r[3] for r in sent), "dense_bytes": sum(r[4] for r in sent)})
        trainers.close()
        llm.shutdown_weight_transfer_engine()
        llm.llm_engine.engine_core.shutdown(timeout=1.0)
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    return rows


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        rs = [r for r in rows if r["size"] == size]

        def med(kind: str, key: str = "seconds", **match) -> float:
            vals = [r[key] for r in rs if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]
            return statistics.median(vals) if vals else float("nan")

        paused, commit = med("paused_update_full"), med("commit_pause")
        lines.append(f"{size} ({rs[0]['bf16_mib']} MiB bf16): paused update {paused * 1e3:.1f} ms, two-phase pause "
                     f"(commit) {commit * 1e3:.1f} ms ({commit / paused:.2f} of it); stage "
                     f"{med('stage_full') * 1e3:.1f} ms; tokens/s idle {med('tokens_per_s_idle', 'value'):.1f}, "
                     f"during a stage {med('tokens_per_s_during_stage', 'value'):.1f}")
        for lr in dict.fromkeys(r["lr"] for r in rs if "lr" in r):
            fb, db = med("full", "wire_bytes", lr=lr), med("delta", "wire_bytes", lr=lr)
            lines.append(f"  lr {lr:g}: full {fb / 2**20:.2f} MiB in {med('full', lr=lr) * 1e3:.1f} ms, delta "
                         f"{db / 2**20:.3f} MiB in {med('delta', lr=lr) * 1e3:.1f} ms: {fb / max(db, 1):.1f}x fewer "
                         "bytes")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for k, kind in enumerate(("paused_update_full", "commit_pause")):
        vals = [statistics.median([r["seconds"] for r in rows if r["size"] == s and r["kind"] == kind]) * 1e3
                for s in sizes]
        axes[0].bar([i + 0.4 * k for i in range(len(sizes))], vals, width=0.4, label=kind)
    axes[0].set_xticks([i + 0.2 for i in range(len(sizes))], sizes)
    axes[0].set_ylabel("ms the engine does not generate")
    axes[0].legend()
    lrs = sorted({r["lr"] for r in rows if "lr" in r})
    for k, kind in enumerate(("full", "delta")):
        vals = [statistics.median([r["wire_bytes"] for r in rows if r["size"] == sizes[-1] and r.get("lr") == lr
                                   and r["kind"] == kind]) / 2**20 for lr in lrs]
        axes[1].bar([i + 0.4 * k for i in range(len(lrs))], vals, width=0.4, label=kind)
    axes[1].set_xticks([i + 0.2 for i in range(len(lrs))], [f"lr {lr:g}" for lr in lrs])
    axes[1].set_ylabel(f"MiB on the wire per update ({sizes[-1]})")
    axes[1].set_yscale("log")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path)
    logger.info("wrote %s", path)


EP_SYSTEMS = ("gen=tp8,dp4", "gen=tp8,dp4,ep32", "gen=tp1,dp32,ep32")  # TP8 x 4 replicas, TP8+EP, wide EP
EP_MODELS = ("deepseek-v3", "qwen3-235b-a22b", "kimi-k2")


def ep_bytes_rows(train: str = "train=tp8,pp8,ep8", domain: int = 72) -> list[dict]:
    """The simulator's bytes per inference rank (`reshard.sim.engine_bytes`) for MoE models on 32-GPU engines, with
    and without expert parallelism: reshard's (each rank its own share) against a whole-expert sender (every routed
    expert whole to every rank). Pure planning: no engine, no device."""
    from reshard.models import PRESETS
    from reshard.sim import System, engine_bytes, model_layouts

    rows = []
    for model in EP_MODELS:
        for gen in EP_SYSTEMS:
            system = System.parse(f"{train} {gen} domain={domain}")
            got = engine_bytes(model_layouts(PRESETS[model], system), list(system.gen_ranks))
            own = max(a for a, _ in got.values())
            whole = max(b for _, b in got.values())
            rows.append({"model": model, "engine": gen.removeprefix("gen="), "reshard_gib_per_rank": own / 2**30,
                         "whole_expert_gib_per_rank": whole / 2**30, "ratio": whole / own})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ep-bytes", action="store_true",
                    help="only print the simulator's bytes per inference rank for MoE engines with and without EP")
    ap.add_argument("--sizes", default="256:2:512,1024:4:2816", help="hidden:layers:intermediate, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--out", default="perf/out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.ep_bytes:
        for r in ep_bytes_rows():
            print(f"{r['model']:>16} {r['engine']:>12}: reshard {r['reshard_gib_per_rank']:8.1f} GiB/rank, "  # noqa: T201
                  f"whole-expert sender {r['whole_expert_gib_per_rank']:8.1f} GiB/rank ({r['ratio']:.1f}x)")
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    rows: list[dict] = []
    lrs = [float(x) for x in args.lrs.split(",")]
    for size in args.sizes.split(","):
        rows += measure(size, args.repeat, lrs, args.gen_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info(torch.device("cpu"))
    write_csv(out / "bench_vllm.csv", [{**r, **info} for r in rows])
    for line in summary(rows):
        print(line)  # noqa: T201  (a benchmark's report)
    plot(rows, out / "bench_vllm.png")


if __name__ == "__main__":
    threading.current_thread().name = "bench_vllm"
    main()
