"""reshard as verl's checkpoint-engine backend: trainer workers refit rollout workers, each trainer rank sending a
distinct part of every weight.

Turned on by configuration alone (verl imports this module on every trainer and rollout worker, which registers
the backend):

    actor_rollout_ref.rollout.checkpoint_engine.backend=reshard
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=reshard.integrations.verl

The trainer side without any gather (each trainer rank sends from its own FSDP shards, verl's
`get_per_tensor_param_shard()`), by one more line:

    actor_rollout_ref.rollout.checkpoint_manager_class=reshard.integrations.verl.ShardStreamManager

vLLM rollout engines refit in place, each engine worker receiving only its own shards (reshard's vLLM
weight-transfer backend in the engines, driven through the replicas' servers), by instead:

    actor_rollout_ref.rollout.checkpoint_manager_class=reshard.integrations.verl.EngineShardManager
    +actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config.backend=reshard

Exports `ReshardCheckpointEngine` (the backend class; importable without verl or Ray), `SyncError`, `SyncStats`,
`BACKEND`, `register()`, which registers the class with verl's `CheckpointEngineRegistry` (called on import when
verl is installed; a no-op returning False without it), `ShardStreamManager` (verl's `CheckpointEngineManager`
asking the trainer workers for their shards; needs verl) and `EngineShardManager` (the same, refitting the vLLM
engines themselves; needs verl). See `docs/frameworks.md`.
"""

from typing import Any

from reshard.integrations.verl._checkpoint_engine import BACKEND, DOMAINS, ReshardCheckpointEngine, SyncError, SyncStats
from reshard.integrations.verl._names import SHARD_MODE
from reshard.integrations.verl._vllm import engine_shard_manager

__all__ = ["BACKEND", "DOMAINS", "ReshardCheckpointEngine", "SyncError", "SyncStats", "register"]
# `ShardStreamManager` is left out of `__all__`: it is a verl class, defined on first access (needs verl and Ray)



def register() -> bool:
    """Register `ReshardCheckpointEngine` as verl's `reshard` checkpoint engine; False when verl is not installed."""
    try:  # verl (and Ray, which it imports) only where it is installed: a NeMo RL or plain environment has neither
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
    except ImportError:
        return False
    CheckpointEngineRegistry.register(BACKEND)(ReshardCheckpointEngine)
    return True


def __getattr__(name: str) -> type:
    if name == "ShardStreamManager":  # a verl class: defined only when asked for (verl and Ray are optional)
        return _shard_stream_manager()
    if name == "EngineShardManager":  # likewise
        return engine_shard_manager()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MANAGER: type | None = None


def _shard_stream_manager() -> type:
    global _MANAGER
    if _MANAGER is None:
        from verl.checkpoint_engine import CheckpointEngineManager

        class ShardStreamManager(CheckpointEngineManager):
            """verl's `CheckpointEngineManager` (every step of a sync unchanged) that asks the trainer workers for
            their training engine instead of its full-tensor stream.

            verl 0.9.1's manager calls `actor_wg.update_weights(global_steps=..., mode=self.backend)`, and the
            trainer worker hands its engine to `checkpoint_engine.send_weights` for `mode="delta_sharded"` (the
            stream of full tensors, `.full_tensor()` of every parameter on every rank, for any other mode). The
            backend stays `reshard` everywhere else: the rollout workers, the registry, the engine kwargs; only the
            trainer's mode says "shards". `send_weights` then streams `get_per_tensor_param_shard()`: each trainer
            rank's local FSDP shards (cast to bf16 by verl's FSDP engine), nothing gathered.

            Turned on by `actor_rollout_ref.rollout.checkpoint_manager_class=reshard.integrations.verl.
            ShardStreamManager` (verl's `RolloutConfig.checkpoint_manager_class`), with `backend=reshard`.
            """

            def __init__(self, config: Any, actor_wg: Any, replicas: list) -> None:
                if config.backend != BACKEND:
                    raise ValueError(f"ShardStreamManager drives the {BACKEND!r} checkpoint engine only; "
                                     f"checkpoint_engine.backend is {config.backend!r}")
                super().__init__(config, actor_wg, replicas)
                self.backend = SHARD_MODE  # only the trainer workers' `mode` argument reads it after __init__

        ShardStreamManager.__module__ = __name__
        _MANAGER = ShardStreamManager
    return _MANAGER


register()
