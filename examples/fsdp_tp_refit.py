"""Quick start: refit a Hugging Face model trained with FSDP2 + TP into a vLLM-style TP engine, on CPU.

Eight processes on this machine (gloo): ranks 0-3 train a tiny Qwen3 (random weights, no download) with HF's own
tensor-parallel plan and FSDP2 over the data-parallel axis of a `(dp, tp)` mesh; ranks 4-7 are an engine of two
TP2 replicas holding vLLM's fused `qkv_proj` / `gate_up_proj` and a padded vocabulary. The trainer registers its
parameters as they are, the engine its own tensors, and `refit.run()` moves every weight, each byte once:

    python examples/fsdp_tp_refit.py

Needs `transformers` (the `test` extra). In an RL job the two sides are usually separate launches joined by
`reshard.comm.Group.rendezvous`; DTensor meshes then stay in the trainer's own ranks and `Refit` maps them.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from reshard.comm import Group
from reshard.integrations import hf
from reshard.refit import Refit

TRAINER, ENGINE = [0, 1, 2, 3], [4, 5, 6, 7]


def tiny_qwen3():
    """A 2-layer Qwen3 config with a vocabulary that neither the TP size nor 64 divides."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=203, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def run(rank: int) -> dict:
    """One process's part, in an initialised 8-rank default world. Returns the report, and on trainer rank 0 the
    full weights (`full_tensor()`), on engine ranks their local tensors."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import Qwen3ForCausalLM

    config = tiny_qwen3()
    # every process of the world builds the trainer's mesh (creating its process groups is collective)
    mesh = DeviceMesh("cpu", torch.tensor(TRAINER).reshape(2, 2), mesh_dim_names=("dp", "tp"))
    refit = Refit(Group.world(), verify=True)  # every box checked against its sender's hash on arrival
    out: dict = {}
    if rank in TRAINER:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model.model, mesh["tp"], {k: styles[v]() for k, v in config.base_model_tp_plan.items()
                                                     if v in styles})
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        for name, p in model.named_parameters():  # the whole registration
            refit.add_source(name, p)
    else:
        engine = {}
        for t in hf.engine_tensors(config, hf.EngineParallel(ENGINE, tp=2)):
            if rank in t.ranks:
                engine[t.name] = torch.zeros(t.local_shape(rank), dtype=t.dtype)
                t.register(refit, engine[t.name])
    out["report"] = refit.run()  # call it again after every optimizer step: the plan is reused
    if rank in TRAINER:
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        if rank == 0:
            out["full"] = full
    else:
        out["engine"] = engine
    return out


def _process(rank: int, world_size: int, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    out = run(rank)
    if rank in (0, 4):
        r = out["report"]
        print(f"rank {rank}: {r.num_tensors} weights, {r.network_bytes + r.nvlink_bytes} bytes over links in "
              f"{r.messages} messages, {r.seconds['transfer'] * 1e3:.1f} ms transfer")
    if rank == 4:
        print("engine rank 4 holds", {n: tuple(t.shape) for n, t in list(out["engine"].items())[:3]}, "...")
    dist.barrier()
    if rank == 0:
        print("fsdp_tp_refit verified: every engine box matched its sender's checksum")
    dist.destroy_process_group()


def main() -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_process, args=(8, port), nprocs=8)


if __name__ == "__main__":
    main()
