"""Refit a vLLM engine actor from FSDP2 trainer actors on Ray, across optimizer steps.

Two trainer actors train a tiny Qwen3 (random weights, FSDP2 over gloo between them: their own `torch.distributed`
world); one engine actor serves it with vLLM and reshard's vLLM weight-transfer backend. The driver asks trainer
rank 0 for a rendezvous address (an actor method returning `(ip, port)`), draws the job token, and hands both to
every actor; the trainers and the engine meet in one `reshard.Group.rendezvous`. After each of `--steps` AdamW steps
the engine is refit in place (each byte once, no full tensor gathered). At the end the engine's greedy tokens must
equal those of a second engine that loaded the trainer's final weights from a safetensors checkpoint.

Run it where vLLM and Ray are installed (`make ray-vllm-env`, then `.venv-vllm/bin/python examples/ray_refit.py`).
On a CPU machine set `VLLM_CPU_KVCACHE_SPACE=1`. Across machines: start one Ray cluster (`ray start --head`, then
`ray start --address=HEAD:6379` on the others) and run this with `RAY_ADDRESS=auto`; nothing else changes (the
address is trainer rank 0's node IP, so the token is required, and it travels from the driver).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import tempfile
from typing import Any

import ray
import torch

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1}
TRAINERS = 2
PROMPT = [5, 6, 7, 8, 9]


def free_address() -> tuple[str, int]:
    """This node's IP address and a free port on it."""
    ip = ray.util.get_node_ip_address().strip("[]")
    with socket.socket() as s:
        s.bind((ip, 0))
        return ip, s.getsockname()[1]


@ray.remote(num_cpus=1)
class Trainer:
    """One trainer rank: its FSDP2 shard of the model, an AdamW optimizer, and the reshard trainer engine."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        torch.set_num_threads(1)

    def address(self) -> tuple[str, int]:
        return free_address()

    def setup(self, dist_address: tuple[str, int]) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import Qwen3Config, Qwen3ForCausalLM

        dist.init_process_group("gloo", init_method=f"tcp://{dist_address[0]}:{dist_address[1]}", rank=self.rank,
                                world_size=TRAINERS)
        torch.manual_seed(0)  # every rank builds the same initial model
        cfg = Qwen3Config(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
        self.model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (TRAINERS,))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def join(self, address: tuple[str, int]) -> None:
        from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

        info = ReshardTrainerInitInfo(rank=self.rank, master_address=address[0], master_port=address[1],
                                      world_size=TRAINERS, engine_world_size=1)
        self.engine = ReshardTrainer.trainer_init(info, source=self.model)  # the FSDP2 DTensors as they are

    def train_step(self, step: int) -> float:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(2, CONFIG["vocab_size"], (2, 16), generator=g)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss)

    def send_weights(self) -> int:
        return self.engine.send_weights().network_bytes

    def save(self, path: str) -> None:
        """Write `config.json` + `model.safetensors` of the current weights (collective; rank 0 writes)."""
        from safetensors.torch import save_file

        full = {n: p.full_tensor().contiguous() for n, p in self.model.named_parameters()}
        if self.rank == 0:
            save_file(full, os.path.join(path, "model.safetensors"))
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump(CONFIG, f)


@ray.remote(num_cpus=1)
class Engine:
    """A vLLM engine (reshard's weight-transfer backend) in a Ray actor."""

    def __init__(self, model_dir: str, load_format: str) -> None:
        from vllm import LLM

        self.llm = LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True, dtype="bfloat16",
                       enforce_eager=True, max_model_len=128, weight_transfer_config={"backend": "reshard"})

    def join(self, address: tuple[str, int]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": {"master_address": address[0],
                                                            "master_port": address[1], "trainer_world_size": TRAINERS}})

    def update(self, version: int) -> None:
        # between generate calls; with requests in flight, pause generation first
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {"version": str(version)}})
        self.llm.finish_weight_update(weight_version=str(version))

    def greedy(self) -> list[int]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], SamplingParams(max_tokens=12,
                                                                                         temperature=0.0),
                                use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def shutdown(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps, each followed by a refit")
    args = parser.parse_args()
    token = secrets.token_hex(16)  # the job token: drawn by the driver, handed to every actor
    env: dict[str, Any] = {"RESHARD_TOKEN": token, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                                           "1"),
                           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(runtime_env={"env_vars": env})
    else:  # one machine: logical CPUs, no dashboard, a small object store
        ray.init(num_cpus=16, include_dashboard=False, object_store_memory=200 << 20, runtime_env={"env_vars": env})
    try:
        with tempfile.TemporaryDirectory() as dummy_dir, tempfile.TemporaryDirectory() as ckpt_dir:
            with open(os.path.join(dummy_dir, "config.json"), "w") as f:
                json.dump(CONFIG, f)
            trainers = [Trainer.remote(r) for r in range(TRAINERS)]
            dist_address = ray.get(trainers[0].address.remote())
            ray.get([t.setup.remote(dist_address) for t in trainers])
            engine = Engine.remote(dummy_dir, "dummy")
            address = ray.get(trainers[0].address.remote())  # trainer rank 0 hosts the group's store
            ray.get([engine.join.remote(address)] + [t.join.remote(address) for t in trainers])
            tokens = [ray.get(engine.greedy.remote())]
            for step in range(1, args.steps + 1):
                losses = ray.get([t.train_step.remote(step) for t in trainers])
                moved = ray.get([engine.update.remote(step)] + [t.send_weights.remote() for t in trainers])[1:]
                tokens.append(ray.get(engine.greedy.remote()))
                print(f"step {step}: loss {losses[0]:.4f}, refit moved {moved[0]} network bytes; greedy {tokens[-1]}")
            ray.get(engine.shutdown.remote())
            ray.get([t.save.remote(ckpt_dir) for t in trainers])
            ray.kill(engine)  # room for the reference engine
            reference = Engine.remote(ckpt_dir, "auto")
            expected = ray.get(reference.greedy.remote())
        print(f"reference engine loaded from the checkpoint: greedy {expected}")
        assert tokens[-1] == expected, f"refit engine {tokens[-1]} != checkpoint-loaded engine {expected}"
        assert tokens[0] != expected, "the dummy-weight engine already gave these tokens: the check proves nothing"
        print(f"ray_refit verified: {args.steps} optimizer steps refit into the vLLM actor; greedy tokens equal a "
              "checkpoint-loaded engine's")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
