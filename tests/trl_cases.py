"""Helpers of the TRL tests (`tests/integrations/test_trl.py`, `.venv-trl`): a tiny Qwen3 with a word-level tokenizer, a real
`vllm serve` server (TP 2, reshard's weight-transfer backend, this module's `Probe` as its worker extension), and
the GRPO run that 2 trainer processes execute under `accelerate launch` (`python tests/trl_cases.py ...`).

The oracle after every sync (trainer rank 0, while the other rank waits): the server's greedy completions with
log-probs and every worker's forward tensors (digests); then vLLM's own in-place reload of the checkpoint the
trainer saved of the same weights, observed again: the two must be equal bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import trl_grpo  # noqa: E402  (the example's tiny model and reward)

WORDS = [f"w{i}" for i in range(200)]
PROMPTS = [[3, 4, 5, 6], [100, 20, 30, 117, 42]]
"""Token ids the observation completes greedily."""


def write_model(path: str) -> None:
    """The example's tiny Qwen3 (`examples/trl_grpo.py --write-tiny`): 2 layers, hidden 64, 4 query heads and 2 KV
    heads of 32 (vLLM's CPU attention refuses head_dim 16), tied embeddings as Qwen3-0.6B, float32 weights, and a
    word-level tokenizer of `WORDS` (no download)."""
    trl_grpo.write_tiny(path)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the server ---------------------------------------------------------------------------------------------------

class Probe:
    """vLLM worker extension (`--worker-extension-cls tests.trl_cases.Probe`): what the test reads from each worker
    through the server's `/collective_rpc` (dev mode; JSON results only)."""

    def reshard_received(self) -> dict:
        """This worker's bytes received in the last reshard update."""
        r = self.weight_transfer_engine.last_report
        ex = None if r is None else r.execution
        return {"bytes_received": None if ex is None else int(ex.bytes_received),
                "params": {n: list(p.shape) for n, p in self.model_runner.get_model().named_parameters()},
                "param_bytes": sum(p.numel() * p.element_size()
                                   for p in self.model_runner.get_model().parameters())}

    def forward_digests(self) -> dict:
        """sha1 of every tensor the forward reads (parameters, buffers, the CPU GEMM closures' tensors, and each
        layer's GEMM on a fixed input: `tests/vllm_cases.forward_tensors`)."""
        sys.path.insert(0, HERE)
        from vllm_cases import forward_tensors

        out = {}
        for n, t in forward_tensors(self).items():
            t = t.contiguous()
            out[n] = hashlib.sha1(t.view(-1).view(__import__("torch").uint8).numpy().tobytes()).hexdigest() + \
                f" {tuple(t.shape)} {t.dtype}"
        return out


class Server:
    """`vllm serve path` (TP 2, bfloat16, reshard backend) as a subprocess of the test, its log in `log_path`."""

    def __init__(self, python: str, path: str, log_path: str, *, tp: int = 2) -> None:
        self.python, self.path, self.log_path, self.tp = python, path, log_path, tp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> None:
        sys.path.insert(0, HERE)
        from vllm_cases import omp_threads_bind

        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND=omp_threads_bind(self.tp), PYTHONPATH=ROOT)
        cmd = [self.python, "-m", "vllm.entrypoints.cli.main", "serve", self.path, "--port", str(self.port),
               "--host", "127.0.0.1", "--weight-transfer-config", '{"backend":"reshard"}',
               "--tensor-parallel-size", str(self.tp), "--dtype", "bfloat16", "--enforce-eager",
               "--max-model-len", "128", "--max-num-seqs", "8", "--seed", "0",
               "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", "tests.trl_cases.Probe"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}; log: {tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve did not start in {timeout_s} s; log: {tail(self.log_path)}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None


def tail(path: str, n: int = 3000) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")[-n:]


def post(url: str, route: str, body: dict, timeout: float = 120.0) -> Any:
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip() else None


def rpc(url: str, method: str, **kwargs: str) -> list:
    return post(url, "/collective_rpc", {"method": method, "kwargs": kwargs})["results"]


def observe(url: str, model: str) -> dict:
    """Greedy completions of `PROMPTS` with their top-3 log-probs, and every worker's forward digests."""
    out = post(url, "/v1/completions", {"model": model, "prompt": PROMPTS, "max_tokens": 6, "temperature": 0.0,
                                        "logprobs": 3, "seed": 0})
    completions = [[c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]]
                   for c in sorted(out["choices"], key=lambda c: c["index"])]
    return {"completions": completions, "digests": rpc(url, "forward_digests")}


def differences(got: dict, want: dict) -> list[str]:
    diffs = [] if got["completions"] == want["completions"] else \
        [f"completions {got['completions']} != {want['completions']}"]
    for w, (a, b) in enumerate(zip(got["digests"], want["digests"])):
        diffs += [f"worker {w}: {n}" for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)]
    return diffs


# ---- the trainer (run by `accelerate launch tests/trl_cases.py ...` on each trainer rank) --------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--group-port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--zero3", action="store_true", help="launched under a DeepSpeed ZeRO-3 accelerate config")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from reshard.integrations.trl import GRPOTrainer

    words = WORDS
    prompts = [" ".join(words[(7 * i + j) % len(words)] for j in range(4)) for i in range(64)]
    config = GRPOConfig(output_dir=os.path.join(args.out, "run"), use_cpu=True, use_vllm=True, vllm_mode="server",
                        vllm_server_base_url=args.url, vllm_group_port=args.group_port, per_device_train_batch_size=2,
                        num_generations=4, max_completion_length=8, gradient_accumulation_steps=1,
                        max_steps=args.steps, learning_rate=5e-2,
                        logging_steps=1, report_to="none", save_strategy="no", seed=0, bf16=False)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, args=config, reward_funcs=trl_grpo.reward_distinct,
                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=AutoTokenizer.from_pretrained(args.model), reshard_timeout_s=args.timeout)
    gen, acc = trainer.vllm_generation, trainer.accelerator
    records: list[dict] = []
    synced = gen.sync_weights

    def save(path: str) -> None:
        """The trainer's weights as a checkpoint (under ZeRO-3 gathered by DeepSpeed itself: every rank joins)."""
        m = trainer.accelerator.unwrap_model(trainer.model)
        if args.zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(m.parameters()), modifier_rank=None):
                if acc.is_main_process:
                    m.save_pretrained(path)
        elif acc.is_main_process:
            m.save_pretrained(path)

    def checked_sync() -> None:
        synced()
        r = gen.last_sync
        record = {"step": trainer.state.global_step, "rank": acc.process_index, "bytes_sent": r.bytes_sent,
                  "seconds": r.seconds, "first": r.first}
        got = observe(args.url, args.model) if acc.is_main_process else None
        ck = os.path.join(args.out, f"ck{len(records)}")
        save(ck)
        if acc.is_main_process:
            record["received"] = rpc(args.url, "reshard_received")
            rpc(args.url, "reload_weights", weights_path=ck)
            want = observe(args.url, args.model)
            record["diffs"] = differences(got, want)
            record["completions"] = got["completions"]
        acc.wait_for_everyone()
        records.append(record)

    gen.sync_weights = checked_sync
    trainer.train()
    with open(os.path.join(args.out, f"rank{acc.process_index}.json"), "w") as f:
        json.dump({"records": records, "log": trainer.state.log_history,
                   "trainer_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                   "partitioned": sum(hasattr(p, "ds_tensor") for p in model.parameters()),
                   "parameters": len(list(model.parameters()))}, f)


# ---- a failure: trainer rank 1 lost mid-sync (`python tests/trl_cases.py --drive ...`, plain processes) ------------

def perturb(model: Any, seed: int) -> None:
    """The same new weights on every trainer rank (a stand-in for an optimizer step)."""
    import torch

    with torch.no_grad():
        for k, p in enumerate(model.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 1000 + k)))


def drive(args: argparse.Namespace) -> None:
    """`lost` (ranks 0 and 1): sync v1; then rank 1 exits while rank 0 syncs v2 (it must raise, naming the failure,
    and the server must keep v1); then rank 0 syncs v2 again with `rejoin` (a new rank-1 process) on a new group, and
    the server must equal vLLM's reload of v2. Rank 0 writes what it saw to `--out`/drive.json."""
    import torch
    from transformers import AutoModelForCausalLM

    from reshard.integrations.trl import ServerClient, ShardSync

    rank = 0 if args.drive == "lost0" else 1
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    client = ServerClient(args.url, timeout_s=args.timeout) if rank == 0 else None
    link = ShardSync(rank, 2, 2, "127.0.0.1", args.group_port, client=client, timeout_s=args.timeout,
                     config=model.config)
    named = model.named_parameters
    if args.drive == "rejoin":
        perturb(model, 1)
        link.generation = 1  # the group after one failed sync
        link.timeout_s = 180.0
        link.sync(named)
        return
    link.sync(named)
    seen: dict[str, Any] = {}
    if rank == 0:
        seen["v1"] = observe(args.url, args.model)
    perturb(model, 1)
    if rank == 1:
        os._exit(3)  # lost: rank 0 and the server's workers wait for its shards
    t0 = time.perf_counter()
    try:
        link.sync(named)
        seen["error"] = None
    except Exception as e:  # noqa: BLE001 - what the test asserts on
        seen["error"] = f"{type(e).__name__}: {e}"
    seen["seconds_to_error"] = time.perf_counter() - t0
    seen["after_failure"] = differences(observe(args.url, args.model), seen.pop("v1"))
    link.timeout_s = 180.0  # the new rank 1 is starting
    got = None
    try:
        link.sync(named)
        got = observe(args.url, args.model)
        seen["second_error"] = None
    except Exception as e:  # noqa: BLE001
        seen["second_error"] = f"{type(e).__name__}: {e}"
    if got is not None:
        ck = os.path.join(args.out, "ck_v2")
        model.save_pretrained(ck)
        rpc(args.url, "reload_weights", weights_path=ck)
        seen["after_rejoin"] = differences(got, observe(args.url, args.model))
    with open(os.path.join(args.out, "drive.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    if "--drive" in sys.argv:
        ap = argparse.ArgumentParser()
        for a in ("--drive", "--model", "--url", "--out"):
            ap.add_argument(a, required=True)
        ap.add_argument("--group-port", type=int, required=True)
        ap.add_argument("--timeout", type=float, default=20.0)
        drive(ap.parse_args())
    else:
        main()
