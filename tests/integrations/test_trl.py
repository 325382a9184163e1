"""reshard inside TRL (`reshard.integrations.trl`, `.venv-trl`: `make test-trl`): GRPO steps through TRL's own
`GRPOTrainer` machinery (`GRPOConfig(use_vllm=True, vllm_mode="server", use_cpu=True)`, 2 trainer processes under
`accelerate launch`, DDP over gloo) into a real `vllm serve` server (TP 2, `--weight-transfer-config
'{"backend":"reshard"}'`), one server for the module.

Oracles: after every sync, the server's greedy completions with log-probs and every worker's forward tensors
equal, bit for bit, those after vLLM's own reload of the checkpoint the trainer saved of the same weights; each
server worker received exactly the bytes of its TP shard (vLLM's split, computed here from the model's config:
vocab-parallel embedding padded to 64 rows, fused q/k/v and gate/up halves, replicated norms) and the trainer
ranks sent those bytes once between them, each about half.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("trl", reason="TRL is installed in .venv-trl (make test-trl)")

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
import trl_cases as tc  # noqa: E402

pytestmark = pytest.mark.trl
TP = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    model = str(root / "model")
    tc.write_model(model)
    s = tc.Server(sys.executable, model, str(root / "server.log"), tp=TP)
    t0 = time.perf_counter()
    s.start()
    print(f"vllm serve TP{TP} started in {time.perf_counter() - t0:.0f} s")
    yield {"server": s, "model": model, "root": root, "reloaded": False}
    s.stop()


def shard_bytes(model_dir: str, tp: int, rank: int) -> int:
    """What vLLM's TP worker `rank` holds of the model, in bfloat16 bytes (the oracle of the counters)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    from safetensors import safe_open

    total = 0
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if name.endswith("embed_tokens.weight"):  # vocab rows padded to 64, then split in TP equal blocks
                per = math.ceil(math.ceil(cfg["vocab_size"] / 64) * 64 / tp)
                rows = max(0, min(cfg["vocab_size"], (rank + 1) * per) - rank * per)
                total += rows * shape[1]
            elif len(shape) == 1:  # norms: every worker holds them whole
                total += shape[0]
            else:  # q/k/v, gate/up (column-parallel) and o/down (row-parallel): 1/TP each
                assert math.prod(shape) % tp == 0, name
                total += math.prod(shape) // tp
    return 2 * total


ZERO3_ACCELERATE = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: true
"""
"""TRL's `examples/accelerate_configs/zero3.yaml` with `use_cpu: true`, 2 processes and no mixed precision."""


def launch(server: dict, out: str, steps: int, *, zero3: bool = False) -> subprocess.CompletedProcess:
    if zero3:
        os.makedirs(out, exist_ok=True)
        config = os.path.join(out, "zero3.yaml")
        with open(config, "w") as f:
            f.write(ZERO3_ACCELERATE)
        how = ["--config_file", config]
    else:
        how = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *how, "--dynamo_backend", "no",
           "--main_process_port", str(tc.free_port()), os.path.join(HERE, "trl_cases.py"),
           "--model", server["model"], "--url", server["server"].url, "--group-port", str(tc.free_port()),
           "--out", out, "--steps", str(steps), "--timeout", "120", *(["--zero3"] if zero3 else [])]
    env = dict(os.environ, PYTHONPATH=tc.ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_example_trl_grpo_runs_and_verifies(server) -> None:
    """`examples/trl_grpo.py` as its docstring says to run it (`accelerate launch --multi_gpu --num_processes 2`),
    against the module's server: it checks its own sync (every trainer rank sent part of the model, none all of it)
    and prints the line `tests/test_examples.py` expects of it. First in the module: the server is still as started."""
    from test_examples import EXPECTED

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(tc.free_port()), os.path.join(tc.ROOT, "examples", "trl_grpo.py"),
           "--model", server["model"], "--url", server["server"].url, "--steps", "2",
           "--out", str(server["root"] / "example")]
    run = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=tc.ROOT, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert re.search(EXPECTED["trl_grpo.py"], run.stdout, re.M), run.stdout[-3000:]


def fresh(server: dict) -> None:
    """A fresh server where vLLM reloaded weights in place (the oracle): such a server refuses the next
    `init_weight_transfer_engine` (docs/frameworks.md, "Not done yet"), and each case builds new groups."""
    if server["reloaded"]:
        server["server"].stop()
        t0 = time.perf_counter()
        server["server"].start()
        server["reloaded"] = False
        print(f"vllm serve restarted in {time.perf_counter() - t0:.0f} s")


@pytest.mark.parametrize("zero3", [False, pytest.param(True, marks=pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs DeepSpeed (make deepspeed-env)"))],
    ids=["ddp", "zero3"])
def test_grpo_steps_sync_every_rank_its_shards(server, zero3: bool) -> None:
    """Under DDP every rank holds the whole model and sends its row blocks; under TRL's ZeRO-3 accelerate config
    each rank sends its own partition (nothing gathered; TRL's own ZeRO-3 sync refuses any non-CUDA device)."""
    fresh(server)
    out = str(server["root"] / ("grpo-zero3" if zero3 else "grpo"))
    t0 = time.perf_counter()
    run = launch(server, out, steps=3, zero3=zero3)
    server["reloaded"] = True
    took = time.perf_counter() - t0
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    syncs = ranks[0]["records"]
    assert len(syncs) == 3 and [s["step"] for s in syncs] == [0, 1, 2], syncs  # one sync per step, before it
    # under ZeRO-3 every parameter is DeepSpeed-partitioned (a ds_tensor), under DDP none is
    assert [r["partitioned"] for r in ranks] == [r["parameters"] if zero3 else 0 for r in ranks], ranks[0]
    want = [shard_bytes(server["model"], TP, w) for w in range(TP)]
    for k, s in enumerate(syncs):
        assert s["diffs"] == [], f"sync {k}: the server differs from vLLM's reload of the trainer's weights: " \
            f"{s['diffs'][:10]}"
        got = [w["bytes_received"] for w in s["received"]]
        assert got == want, f"sync {k}: bytes per server worker {got}, its TP shard {want}"
        sent = [ranks[r]["records"][k]["bytes_sent"] for r in range(2)]
        assert sum(sent) == sum(want), (sent, want)  # every byte left the trainer once
        assert max(sent) <= sum(want) / 2 + 4096, sent  # each trainer rank sent about half
    # the weights moved between syncs (the oracle could fail): the greedy completions changed
    assert len({json.dumps(s["completions"]) for s in syncs}) > 1, [s["completions"][0][0] for s in syncs]
    print(f"GRPO 3 steps, 2 trainer ranks: {took:.0f} s; sync seconds rank 0 "
          f"{[round(s['seconds'], 3) for s in syncs]}; bytes sent {[r['records'][0]['bytes_sent'] for r in ranks]}")


def drive(server: dict, scenario: str, out: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, os.path.join(HERE, "trl_cases.py"), "--drive", scenario, "--model", server["model"],
           "--url", server["server"].url, "--out", out, "--group-port", str(port), "--timeout", "20"]
    return subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=tc.ROOT, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_trainer_rank_lost_mid_sync_then_a_new_group(server) -> None:
    """Trainer rank 1 dies while rank 0 syncs new weights: rank 0 raises within the timeout (no hang), the server
    keeps the previous weights; the next sync (a new group, rank 1 started again) makes the server exact."""
    out = str(server["root"] / "lost")
    os.makedirs(out)
    fresh(server)
    port = tc.free_port()
    t0 = time.perf_counter()
    rank0, rank1 = drive(server, "lost0", out, port), drive(server, "lost1", out, port)
    assert rank1.wait(300) == 3, rank1.stdout.read()[-3000:]
    rejoin = drive(server, "rejoin", out, port)
    try:
        assert rank0.wait(600) == 0, rank0.stdout.read()[-6000:]
        assert rejoin.wait(300) == 0, rejoin.stdout.read()[-6000:]
    finally:
        for p in (rank0, rejoin):
            if p.poll() is None:
                p.kill()
    seen = json.load(open(os.path.join(out, "drive.json")))
    print(f"rank lost: error after {seen['seconds_to_error']:.1f} s: {seen['error'][:300]}; "
          f"scenario {time.perf_counter() - t0:.0f} s")
    assert seen["error"] is not None and "rank 1" in seen["error"], seen["error"]
    assert seen["seconds_to_error"] < 120, seen["seconds_to_error"]
    assert seen["after_failure"] == [], f"the server changed in a failed sync: {seen['after_failure'][:10]}"
    assert seen["second_error"] is None, seen["second_error"]
    assert seen["after_rejoin"] == [], seen["after_rejoin"][:10]
