"""reshard inside TRL: GRPO's server-mode weight sync from every trainer rank's own shards, nothing gathered.

Change one import and keep TRL's `GRPOConfig(use_vllm=True, vllm_mode="server")`, `accelerate launch` and the
reward functions:

    from reshard.integrations.trl import GRPOTrainer   # instead of `from trl import GRPOTrainer`

with the server started as

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend":"reshard"}' \\
        --tensor-parallel-size 2 --logprobs-mode processed_logprobs

Exports `GRPOTrainer` and `ReshardVLLMGeneration` (TRL's classes with the sync replaced; they import `trl`, on
first use), `ShardSync` (one trainer rank's link: sources, group, sends; no TRL), `model_sources`,
`ServerClient` (the server's weight-update routes) and `SyncResult`. See `docs/frameworks.md`.
"""

from typing import Any

from reshard.integrations.trl._client import ServerClient, ServerError
from reshard.integrations.trl._generation import define
from reshard.integrations.trl._sync import ShardSync, SyncResult, model_sources

__all__ = ["GRPOTrainer", "ReshardVLLMGeneration", "ServerClient", "ServerError", "ShardSync", "SyncResult",
           "model_sources"]

_TRL = {"GRPOTrainer", "ReshardVLLMGeneration"}
_DEFINED: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # TRL's classes import trl (seconds, and absent from environments without it): defined on first use
    if name in _TRL:
        if not _DEFINED:
            _DEFINED.update(define())
        return _DEFINED[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
