"""Jobs for `test_module_sources.py` (top-level, so they pickle): a trainer module changes between two sends.

Four ranks, as `live_cases`: ranks 0 and 1 train a module of three (8, 6) weights (`model.embed_tokens.weight`,
`model.norm.weight`, `lm_head.weight`, DTensors `Shard(0)` over `[0, 1]`), registered as a module, through
`ReshardTrainer.trainer_init(source=module)` or `Refit.add_module_sources`; ranks 2 and 3 are an untied engine,
holding each weight `Shard(1)` over `[2, 3]`. The expected engine values are cut from the full tensors by hand.
"""

from __future__ import annotations

import torch
from live_cases import ENGINE, SHAPE, TRAIN, dtensor, engine_slice, full

from reshard import Layout, Mesh, Shard
from reshard.comm import Group
from reshard.refit import Refit

NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


class Tiny(torch.nn.Module):
    """`model.embed_tokens`, `model.norm`, `lm_head`: weights of seeds 1, 2 and 3 (`lm_head` tied to the
    embedding when `tied`)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.norm = torch.nn.Module()
        self.lm_head = torch.nn.Module()
        self.model.embed_tokens.weight = torch.nn.Parameter(dtensor(1))
        self.model.norm.weight = torch.nn.Parameter(dtensor(2))
        self.lm_head.weight = self.model.embed_tokens.weight if tied else torch.nn.Parameter(dtensor(3))


def job_module(worker, api: str, case: str, port: int) -> dict:
    """Send, change the trainer module as `case` says, send again. `api`: `"trainer"` (`ReshardTrainer`) or
    `"refit"` (`Refit.add_module_sources`). Returns on engine ranks the engine's slices after each send (`runs`:
    name -> tensor) and on every rank the `ValueError` message of the second send (`error`, None if it ran)."""
    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    rank = worker.rank
    out: dict = {"runs": [], "error": None}
    dests: dict[str, torch.Tensor] = {}
    model = None
    if rank in TRAIN:
        model = Tiny(tied=case in ("untie", "replace"))
        if api == "trainer":
            info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port, world_size=2,
                                          engine_world_size=2, timeout_s=60.0)
            trainer = ReshardTrainer.trainer_init(info, source=model)
            send = trainer.send_weights
        else:
            refit = Refit(Group.rendezvous("127.0.0.1", port, rank, 4, timeout=60), timeout=60)
            refit.add_module_sources(model)
            send = refit.run
    else:
        refit = Refit(Group.rendezvous("127.0.0.1", port, rank, 4, timeout=60), timeout=60)
        for n in NAMES:
            dests[n] = torch.zeros(SHAPE[0], 3)
            refit.add_destination(n, dests[n], Layout(SHAPE, Mesh(list(ENGINE)), [Shard(1)], torch.float32, name=n))
        send = refit.run
    try:
        send()
    except ValueError as e:
        out["error1"] = str(e)
    out["runs"].append({n: t.clone() for n, t in dests.items()})
    if model is not None:
        if case == "replace":  # a new parameter object of the same layout, new values
            model.model.norm.weight = torch.nn.Parameter(dtensor(7))
        elif case == "untie":  # the trainer unties lm_head: its own parameter, its own values
            model.lm_head.weight = torch.nn.Parameter(dtensor(8))
        elif case == "retie":  # lm_head becomes the embedding's parameter
            model.lm_head.weight = model.model.embed_tokens.weight
    try:
        send()
    except ValueError as e:
        out["error"] = str(e)
    out["runs"].append({n: t.clone() for n, t in dests.items()})
    return out


def expected(rank: int, seeds: dict[str, int]) -> dict[str, torch.Tensor]:
    """Engine rank `rank`'s slices of the weights of `seeds` (name -> seed)."""
    return {n: engine_slice(full(s), rank) for n, s in seeds.items()}


def job_init_fails(worker, case: str, port: int) -> dict:
    """Trainer ranks 0 and 1 call `ReshardTrainer.trainer_init` with a mistake (`"late"`: a plain tensor without
    its layout, found while registering, after the group formed; `"early"`: `transposed=` names a weight the source
    does not hold, found before the rendezvous); engine ranks 2 and 3 join the group and run their refit. Returns
    every rank's error (`"TypeName: message"`) and the seconds it took to come."""
    import time

    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    rank, t0 = worker.rank, time.monotonic()
    try:
        if rank in TRAIN:
            info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port, world_size=2,
                                          engine_world_size=2, timeout_s=30.0)
            source = {"model.norm.weight": torch.zeros(SHAPE[0] // 2, SHAPE[1])} if case == "late" else Tiny(False)
            ReshardTrainer.trainer_init(info, source=source, transposed=["nope"] if case == "early" else None)
        else:
            refit = Refit(Group.rendezvous("127.0.0.1", port, rank, 4, timeout=30), timeout=30)
            n = "model.norm.weight"
            refit.add_destination(n, torch.zeros(SHAPE[0], 3), Layout(SHAPE, Mesh(list(ENGINE)), [Shard(1)],
                                                                      torch.float32, name=n))
            refit.run()
        error = None
    except Exception as e:  # noqa: BLE001 - the test checks the type and message
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - t0}


TRAINER_CONFIG = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 256,
                  "num_hidden_layers": 2, "vocab_size": 8, "tie_word_embeddings": False}
"""8 heads of 32 in 2 KV groups; `ENGINE_CONFIGS` keep every tensor's shape and change what shapes cannot show."""
ENGINE_CONFIGS = {
    "same": TRAINER_CONFIG,
    "heads": {**TRAINER_CONFIG, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64},
    "experts": {**TRAINER_CONFIG, "num_experts": 8},
}


def job_facts(worker, engine: str, port: int) -> dict:
    """Trainer ranks 0 and 1: `trainer_init(source=module, config=TRAINER_CONFIG)`; engine ranks 2 and 3 declare
    `hf.model_facts(ENGINE_CONFIGS[engine])`. One send; every rank's `ValueError` message (None if it ran) and the
    engine's tensors after it."""
    from reshard.integrations import hf
    from reshard.integrations.vllm import ReshardTrainer, ReshardTrainerInitInfo

    rank = worker.rank
    dests: dict[str, torch.Tensor] = {}
    if rank in TRAIN:
        info = ReshardTrainerInitInfo(rank=rank, master_address="127.0.0.1", master_port=port, world_size=2,
                                      engine_world_size=2, timeout_s=60.0)
        send = ReshardTrainer.trainer_init(info, source=Tiny(tied=False), config=TRAINER_CONFIG).send_weights
    else:
        refit = Refit(Group.rendezvous("127.0.0.1", port, rank, 4, timeout=60), timeout=60)
        for n in NAMES:
            dests[n] = torch.zeros(SHAPE[0], 3)
            refit.add_destination(n, dests[n], Layout(SHAPE, Mesh(list(ENGINE)), [Shard(1)], torch.float32, name=n))
        refit.declare_facts(hf.model_facts(ENGINE_CONFIGS[engine]), who="engine (its config)")
        send = refit.run
    try:
        send()
        error = None
    except ValueError as e:
        error = str(e)
    return {"error": error, "engine": {n: t.clone() for n, t in dests.items()}}
