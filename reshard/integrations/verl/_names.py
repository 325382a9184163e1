"""Names verl's configuration and worker code use for this backend."""

BACKEND = "reshard"
"""The backend's name in verl's `CheckpointEngineRegistry` (`checkpoint_engine.backend=reshard`)."""

SHARD_MODE = "delta_sharded"
"""The `mode` verl 0.9.1's trainer worker (`ActorRolloutRefWorker.update_weights`) answers by handing its training
engine itself to the checkpoint engine's `send_weights` instead of the `get_per_tensor_param()` stream."""

PRECISION_KEY = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.reshard.precision"
"""Where a verl user sets the cast of the trainer's dtype to the engine's (`ReshardCheckpointEngine(precision=)`)."""


def advise(message: str) -> str:
    """`message` with reshard's generic advice (`precision='cast'`, a `Refit` argument a verl user never sees)
    replaced by the verl setting that gives it."""
    return message.replace("use precision='cast'", f"set {PRECISION_KEY}=cast")
