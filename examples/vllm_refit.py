"""Refit a live vLLM engine from a 2-process trainer with the `reshard` weight-transfer backend.

The engine (this process) serves a tiny Qwen3 built from a local `config.json` with random weights; two trainer
processes hold HuggingFace-named weights sharded their own way (columns and norms `S(0)`, rows `S(1)`) and push a
new version into the engine, each byte once, while this process drives vLLM's own update calls. Greedy tokens
before and after show the new weights in use.

Run it in an environment with vLLM (`make vllm-env`, then `.venv-vllm/bin/python examples/vllm_refit.py`). On a CPU
machine set `VLLM_CPU_KVCACHE_SPACE=1`; with `--tp 2` also `VLLM_CPU_OMP_THREADS_BIND='0|1'`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import tempfile

import torch

from reshard import Layout, Mesh, Shard
from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
          "vocab_size": 1000, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1}
TRAINER_RANKS = 2


def hf_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HuggingFace name -> global shape of every weight of a Qwen3 config."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return shapes


def trainer(rank: int, port: int, engine_world_size: int, done: mp.Queue) -> None:
    """One trainer rank: hold its shards of every weight (random here), then push them to the engine."""
    weights = {}
    torch.manual_seed(1234 + rank)
    for name, shape in hf_shapes(CONFIG).items():
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        layout = Layout(shape, Mesh(list(range(TRAINER_RANKS))), [Shard(dim)], torch.bfloat16, name=name)
        local = torch.randn(layout.local_shape(rank)) * 0.05 + (1.0 if len(shape) == 1 else 0.0)
        weights[name] = (local.to(torch.bfloat16), layout)
    info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port,
                                  world_size=TRAINER_RANKS, engine_world_size=engine_world_size)
    engine = ReshardTrainer.trainer_init(info, source=weights)
    report = engine.send_weights()
    done.put((rank, report.network_bytes, report.seconds))
    engine.shutdown()


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="the engine's tensor-parallel size")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  enforce_eager=True, tensor_parallel_size=args.tp, max_model_len=128,
                  weight_transfer_config={"backend": "reshard"})
        prompt = [TokensPrompt(prompt_token_ids=[5, 6, 7, 8])]
        greedy = SamplingParams(max_tokens=8, temperature=0.0)
        before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        print("before:", before)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        done = ctx.Queue()
        procs = [ctx.Process(target=trainer, args=(r, port, args.tp, done)) for r in range(TRAINER_RANKS)]
        for p in procs:
            p.start()
        # the caller's sequence (pause generation first when requests are in flight)
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "trainer_world_size": TRAINER_RANKS}})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": "1"}})
        llm.finish_weight_update(weight_version="1")
        for _ in procs:
            rank, nbytes, seconds = done.get()
            print(f"trainer rank {rank}: plan moves {nbytes} network bytes; seconds {seconds}")
        for p in procs:
            p.join()
        after = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        print("after: ", after)
        llm.shutdown_weight_transfer_engine()
        # the dummy weights and the trainer's differ, so the engine's forward must now give other tokens
        assert list(after) != list(before), "the engine still generates with its old weights"
        print("vllm_refit verified: the engine generates with the trainer's weights")


if __name__ == "__main__":
    main()
