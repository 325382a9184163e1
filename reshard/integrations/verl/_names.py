"""Names verl's configuration and worker code use for this backend."""

BACKEND = "reshard"
"""The backend's name in verl's `CheckpointEngineRegistry` (`checkpoint_engine.backend=reshard`)."""

SHARD_MODE = "delta_sharded"
"""The `mode` verl 0.9.1's trainer worker (`ActorRolloutRefWorker.update_weights`) answers by handing its training
engine itself to the checkpoint engine's `send_weights` instead of the `get_per_tensor_param()` stream."""
