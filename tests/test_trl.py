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

import json
import math
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("trl", reason="TRL is installed in .venv-trl (make test-trl)")

HERE = os.path.dirname(os.path.abspath(__file__))
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
    yield {"server": s, "model": model, "root": root}
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


def launch(server: dict, out: str, steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(tc.free_port()), os.path.join(HERE, "trl_cases.py"),
           "--model", server["model"], "--url", server["server"].url, "--group-port", str(tc.free_port()),
           "--out", out, "--steps", str(steps), "--timeout", "120"]
    env = dict(os.environ, PYTHONPATH=tc.ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def test_grpo_steps_sync_every_rank_its_shards(server) -> None:
    out = str(server["root"] / "grpo")
    t0 = time.perf_counter()
    run = launch(server, out, steps=3)
    took = time.perf_counter() - t0
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    syncs = ranks[0]["records"]
    assert len(syncs) == 3 and [s["step"] for s in syncs] == [0, 1, 2], syncs  # one sync per step, before it
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

