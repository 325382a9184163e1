"""`EngineShardManager`'s driver error when a sync fails (verl's real manager class, in `.venv-verl`; the trainer
worker group and the replicas' servers are stand-ins that fail as a replica killed mid-sync makes them fail).

A vLLM replica killed mid-sync fails its own `collective_rpc("update_weights")` with vLLM's "cancelled"; the surviving
replica's engine workers and the trainer workers fail with reshard's reason (the group's verdict naming the dead
rank). The driver's error must carry every side's reason, not only the first call's."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is installed in .venv-verl (make test-frameworks)")

pytestmark = pytest.mark.frameworks

CANCELLED = "collective_rpc failed: cancelled"
ENGINE_REASON = "rank 4 of Group(reshard-vllm/1): refit transfer stopped: rank 3 failed: worker 1 of replica 0 died"
TRAINER_REASON = "trainer rank 0: refit transfer stopped: rank 3 failed: the connection to rank 3 closed"


class _Rpc:
    def __init__(self, fail: str | None) -> None:
        self.fail, self.calls = fail, []

    def remote(self, method: str, kwargs: dict | None = None):
        self.calls.append(method)

        async def call():
            if method == "update_weights" and self.fail:
                raise RuntimeError(self.fail)
            return None

        return call()


def _manager(fail_first: str, fail_second: str):
    from reshard.integrations.verl import EngineShardManager

    class Manager(EngineShardManager):  # the replicas' KV-cache and generation calls are not what is tested here
        async def abort_replicas(self) -> None:
            pass

        async def release_kv_cache_replicas(self) -> None:
            pass

    async def trainer_fails():
        await asyncio.sleep(0.05)
        raise ValueError(TRAINER_REASON)

    m = Manager.__new__(Manager)
    m.backend, m._joined, m._generation, m.last_sync = "delta_sharded", True, 1, {}
    m.replicas = [SimpleNamespace(servers=[SimpleNamespace(collective_rpc=_Rpc(f))], world_size=2, replica_rank=i)
                  for i, f in enumerate((fail_first, fail_second))]
    m.actor_wg = SimpleNamespace(world_size=2, update_weights=lambda **kw: [trainer_fails(), trainer_fails()])
    return m


def test_the_drivers_error_carries_every_sides_reason() -> None:
    """Replica 0 fails with vLLM's "cancelled", replica 1 and both trainer workers with reshard's reason: the
    driver's error names all of them (before, only "collective_rpc failed: cancelled"); the next sync joins anew."""
    m = _manager(CANCELLED, ENGINE_REASON)
    with pytest.raises(RuntimeError) as e:
        m.update_weights(global_steps=7)
    text = str(e.value)
    assert "the weight sync of step 7 failed" in text, text
    assert f"replica 0: RuntimeError: {CANCELLED}" in text and f"replica 1: RuntimeError: {ENGINE_REASON}" in text
    assert f"the trainer workers: ValueError: {TRAINER_REASON}" in text, text
    assert text.count(TRAINER_REASON) == 1, text  # each reason once
    assert m._joined is False
    for r in m.replicas:  # the engines were told to end the update (their weights stay the previous ones)
        assert r.servers[0].collective_rpc.calls[-1] == "finish_weight_update", r.servers[0].collective_rpc.calls
