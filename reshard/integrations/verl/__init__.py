"""reshard as verl's checkpoint-engine backend: trainer workers refit rollout workers, each trainer rank sending a
distinct part of every weight.

Turned on by configuration alone (verl imports this module on every trainer and rollout worker, which registers
the backend):

    actor_rollout_ref.rollout.checkpoint_engine.backend=reshard
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=reshard.integrations.verl

Exports `ReshardCheckpointEngine` (the backend class; importable without verl or Ray), `SyncError`, `SyncStats`,
`BACKEND` and `register()`, which registers the class with verl's `CheckpointEngineRegistry` (called on import when
verl is installed; a no-op returning False without it). See `docs/frameworks.md`.
"""

from reshard.integrations.verl._engine import BACKEND, DOMAINS, ReshardCheckpointEngine, SyncError, SyncStats

__all__ = ["BACKEND", "DOMAINS", "ReshardCheckpointEngine", "SyncError", "SyncStats", "register"]


def register() -> bool:
    """Register `ReshardCheckpointEngine` as verl's `reshard` checkpoint engine; False when verl is not installed."""
    try:  # verl (and Ray, which it imports) only where it is installed: a NeMo RL or plain environment has neither
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
    except ImportError:
        return False
    CheckpointEngineRegistry.register(BACKEND)(ReshardCheckpointEngine)
    return True


register()
