"""reshard as a vLLM weight-transfer backend: refit a live vLLM engine in place from a sharded trainer.

Setup (the `vllm.general_plugins` entry point registers the backend in every vLLM process):
    llm = LLM(model=..., weight_transfer_config={"backend": "reshard"})
    trainer = ReshardTrainer.trainer_init(ReshardTrainerInitInfo(rank=r, world_size=T, engine_world_size=N, ...),
                                          source={hf_name: dtensor, ...})
    llm.init_weight_transfer_engine(...); llm.start_weight_update(); llm.update_weights(...); ...

Exports the trainer side (`ReshardTrainer`, `ReshardTrainerInitInfo`, importable without vLLM), the engine side
(`ReshardWeightTransferEngine`, `ReshardInitInfo`, `ReshardUpdateInfo`, `engine_targets`; these import vLLM) and
`register`, the plugin entry point. See `docs/vllm.md`.
"""

from typing import Any

from reshard.integrations.vllm._trainer import ReshardTrainer, ReshardTrainerInitInfo

__all__ = [
    "BACKEND",
    "ReshardInitInfo",
    "ReshardTrainer",
    "ReshardTrainerInitInfo",
    "ReshardUpdateInfo",
    "ReshardWeightTransferEngine",
    "engine_targets",
    "register",
]

BACKEND = "reshard"
"""The name of the backend in `weight_transfer_config={"backend": ...}`."""

_ENGINE = {"ReshardWeightTransferEngine", "ReshardInitInfo", "ReshardUpdateInfo"}


def __getattr__(name: str) -> Any:
    # the engine side imports vLLM: only on use, so a trainer environment without vLLM can import this package
    if name in _ENGINE:
        from reshard.integrations.vllm import _weight_transfer

        return getattr(_weight_transfer, name)
    if name == "engine_targets":
        from reshard.integrations.vllm._layouts import engine_targets

        return engine_targets
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the `reshard` backend with vLLM's weight-transfer factories (the `vllm.general_plugins` entry
    point; idempotent, as vLLM calls it in every process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "reshard.integrations.vllm._weight_transfer",
                                                    "ReshardWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "reshard.integrations.vllm._trainer",
                                                     "ReshardTrainer")
