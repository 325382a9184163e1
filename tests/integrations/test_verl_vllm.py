"""verl's trainer workers refit real vLLM engines of TP 2 through reshard's vLLM backend (`EngineShardManager`).

Runs in `.venv-vllm` with verl added (`make verl-vllm-env`; `make test-frameworks`): verl's `CheckpointEngineManager`
subclass loaded from its configuration name, verl's `RayWorkerGroup` of two trainer workers (FSDP2 over gloo, a tiny
Qwen3, verl 0.9.1's own `ActorRolloutRefWorker.update_weights` handing the training engine to the checkpoint
engine), two verl `RolloutReplica`s, each with verl 0.9.1's own `vLLMHttpServer` actor (vLLM's OpenAI API server
around an `AsyncLLM` of TP 2 on CPU, the rollout config's `engine_kwargs.vllm` forwarded by verl's own code). Not run:
verl's rollout workers and `vLLMReplica.launch_servers`, which hands each server the GPUs Ray gave the workers (a
CPU-only cluster has none); the servers are started as it starts them, without workers
(`reshard.testing.verl.engine_replicas`), and one keyword of verl's `abort_all_requests` is translated for vLLM 0.32
(`reshard.testing.verl.verl_server_class`).

Oracles: after the last sync, every tensor each engine worker's forward reads, and each layer's GEMM on a probe
input, equal bit for bit those of vLLM's own in-place reload (`reload_weights`) of a checkpoint of the trainer's
weights (the stream's bf16 cast); as negative controls, the values before each sync differ from after it. Bytes:
each engine worker receives exactly the bytes of its own shards, computed from the Hugging Face shapes by vLLM's TP
rules in this file, not by reshard. A sync whose stream lost a tensor is refused on every rank and leaves the
engine's tensors bit for bit as they were; the next sync builds a new group.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl", reason="verl is added to .venv-vllm by make verl-vllm-env")
pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm (make vllm-env)")

import ray
import torch
import vllm_cases as vc

import reshard.testing.verl as tv

pytestmark = pytest.mark.frameworks

TP = 2
REPLICAS = 2
TIMEOUT = 60
PROMPT = [11, 23, 5, 801, 42, 7]
CONFIG = dict(tv.CONFIG, hidden_size=128, intermediate_size=256, head_dim=32)
"""The verl tests' tiny Qwen3 with vLLM CPU attention's smallest head size (32), vocabulary 5000 (padded to 5056)."""


def _received_bytes(worker) -> int:
    """Bytes this engine worker received in the last update."""
    return worker.weight_transfer_engine.last_report.execution.bytes_received


def _own_shard_bytes(full: dict[str, torch.Tensor], rank: int) -> int:
    """bf16 bytes of TP rank `rank`'s shards of the Hugging Face weights `full`, by vLLM's TP rules: a 1-D weight
    (a norm) whole; the vocabulary (embedding, lm_head) in blocks of the vocabulary padded to a multiple of 64, only
    its real rows; every other weight (q/k/v/gate/up by rows, o/down by columns; each divisible by TP here) its
    1/TP part."""
    total = 0
    for name, t in full.items():
        if t.dim() == 1:
            n = t.numel()
        elif "embed_tokens" in name or name.startswith("lm_head"):
            vocab = t.shape[0]
            block = -(-vocab // 64) * 64 // TP
            n = max(0, min(vocab, (rank + 1) * block) - rank * block) * t.shape[1]
        else:
            n = t.numel() // TP
        total += 2 * n
    return total


@pytest.fixture(scope="module")
def cluster():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tv.ray_init(extra_path=(here, os.path.dirname(os.path.abspath(__file__))))
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
           "VLLM_CPU_OMP_THREADS_BIND": vc.omp_threads_bind(TP)}
    trainer, replicas, manager = tv.setup_engines(num_trainers=2, num_replicas=REPLICAS, rollout_tp=TP,
                                                  engine_kwargs={"timeout_s": TIMEOUT}, server_env=env,
                                                  config=CONFIG)
    yield trainer, replicas, manager
    ray.shutdown()


def test_engine_workers_receive_only_their_shards(cluster, tmp_path) -> None:
    """Syncs into two TP 2 engines: the first (a new group), a steady one (the stream's new tensors rebound), a
    refused one (the stream changed), the next (a new group); the engines' weights at the end against vLLM's own
    load. vLLM's in-place reload is the last step: a reloaded engine's norms carry vLLM's own loader wrappers, which
    reshard refuses to lay out at a later `init_weight_transfer_engine`."""
    trainer, replicas, manager = cluster
    assert type(manager).__name__ == "EngineShardManager"
    servers = [r.servers[0] for r in replicas]

    def each(method: str, *args) -> list:
        return ray.get([getattr(s, method).remote(*args) for s in servers])

    initial = each("call", vc.forward_tensors)
    each("taken_calls")

    # the first sync: each engine worker receives exactly its own shards
    metrics = tv.sync(manager, 1)
    assert each("taken_calls") == [[
        "abort_all_requests", "release_kv_cache", "init_weight_transfer_engine", "start_weight_update",
        "update_weights", "finish_weight_update", "clear_kv_cache", "set_global_steps", "resume_kv_cache",
        "resume_generation"]] * REPLICAS
    assert each("global_steps_now") == [1] * REPLICAS
    assert any(k.startswith("reshard/rank") for k in metrics)
    full = trainer.full_state()[0]
    whole = sum(t.numel() * 2 for t in full.values())  # bf16 on the engine
    received = each("call", _received_bytes)
    assert received == [[_own_shard_bytes(full, w) for w in range(TP)]] * REPLICAS
    assert max(max(r) for r in received) < 0.6 * whole  # a worker given whole tensors would receive `whole`
    synced = each("call", vc.forward_tensors)
    for e in range(REPLICAS):
        assert _differences(synced[e], initial[e]), "the sync left the engine's weights as they were"

    # a steady sync: the same group, the stream's new tensors rebound
    trainer.change_weights(2)
    tv.sync(manager, 2)
    assert [c[2:5] for c in each("taken_calls")] == [["start_weight_update", "update_weights",
                                                      "finish_weight_update"]] * REPLICAS
    assert each("call", _received_bytes) == received
    steady = each("call", vc.forward_tensors)
    assert all(_differences(steady[e], synced[e]) for e in range(REPLICAS))

    # a changed stream: refused on every rank before any byte moves; the engines keep their weights
    trainer.change_weights(3)
    trainer.skip_in_export(["lm_head.weight"])
    with pytest.raises(Exception, match=r"the trainer's stream changed since the group was built: missing "
                                        r"\['lm_head.weight'\]"):
        tv.sync(manager, 3)
    for calls in each("taken_calls"):
        assert "update_weights" in calls and "clear_kv_cache" not in calls, calls
    kept = each("call", vc.forward_tensors)
    for e in range(REPLICAS):
        assert not _differences(kept[e], steady[e]), "a refused sync changed the engine's weights"

    # the next sync builds a new group on every side and lands the trainer's weights
    trainer.skip_in_export([])
    tv.sync(manager, 4)
    assert all("init_weight_transfer_engine" in c for c in each("taken_calls"))
    landed = each("call", vc.forward_tensors)
    assert all(each("greedy", PROMPT))  # the engines serve after the syncs
    _save(trainer, str(tmp_path))
    ray.get([s.collective_rpc.remote("reload_weights", kwargs={"weights_path": str(tmp_path)}) for s in servers])
    reference = each("call", vc.forward_tensors)  # vLLM's own load of the trainer's weights
    for e in range(REPLICAS):
        diffs = _differences(landed[e], reference[e])
        assert not diffs, f"engine {e}: {len(diffs)} differences from vLLM's own load:\n" + "\n".join(diffs[:20])
        assert _differences(steady[e], reference[e])  # the control: the weights changed since the steady sync


def test_manager_refuses_engines_without_the_backend(cluster) -> None:
    from verl.workers.config import HFModelConfig, RolloutConfig

    from reshard.integrations.verl import EngineShardManager

    trainer, replicas, _ = cluster
    ce = replicas[0].config.checkpoint_engine
    model_config = HFModelConfig(path=tv.model_dir(), load_tokenizer=False)
    for kwargs, name, match in (({}, "vllm", "weight_transfer_config.backend=reshard"),
                                ({"weight_transfer_config": {"backend": "nccl"}}, "vllm", "got weight_transfer"),
                                ({"weight_transfer_config": {"backend": "reshard"}}, "sglang", "rollout.name")):
        rc = RolloutConfig(name=name, checkpoint_engine=ce, tensor_model_parallel_size=TP,
                           engine_kwargs={"vllm": kwargs})
        with pytest.raises(ValueError, match=match):
            EngineShardManager(config=ce, actor_wg=trainer, replicas=[tv.Replica(replica_rank=0, config=rc,
                                                                                  model_config=model_config)])


def _save(trainer, path: str) -> None:
    """The trainer's weights as a bf16 checkpoint (the stream's cast) in `path`."""
    from safetensors.torch import save_file

    save_file({n: t.to(torch.bfloat16) for n, t in trainer.full_state()[0].items()},
              os.path.join(path, "model.safetensors"))


def _differences(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> list[str]:
    """What differs between two engines' forward tensors (per worker; empty when equal bit for bit)."""
    return vc.differences(([], got), ([], want))
