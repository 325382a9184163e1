"""verl trainer workers refit verl's vLLM rollout engines in place: each engine worker receives exactly its shards.

verl 0.9.1's rollout workers hand whole Hugging Face tensors to vLLM's `load_weights`, which slices them per TP
rank: every worker of a TP replica receives the whole model. Here the rollout side is vLLM's weight-transfer API
with reshard's backend (`reshard.integrations.vllm`), driven by `EngineShardManager` (the driver-side manager,
`rollout.checkpoint_manager_class`) through each replica's server (`collective_rpc`, which verl's `vLLMHttpServer`
has), while the trainer workers send from their shards (verl's `mode="delta_sharded"` hands the training engine to
`ReshardCheckpointEngine.send_weights`, which streams `get_per_tensor_param_shard()`).

One group spans the T trainer ranks (group ranks `0 .. T-1`, trainer rank 0's checkpoint engine serving the store)
and the engines' workers (replica `r`'s worker `k` at `T + r * W + k`, W the workers of one replica). Each engine
worker registers its live parameters (fused `qkv_proj` / `gate_up_proj` slices, padded vocabularies: read from the
engine); each trainer rank registers its shard of every weight. The first sync plans the whole model once; later
syncs rebind the stream's new tensors (`Refit.update_source`) and move them, each byte once per replica.

`EngineLink` is the trainer rank's side (no verl import; the engine-neutral
`reshard.integrations.trainer_link.TrainerLink`); `engine_shard_manager()` builds the manager class (verl and Ray).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from reshard.integrations.group_layout import GroupLayout
from reshard.integrations.trainer import stream_source
from reshard.integrations.trainer_link import TrainerLink, TrainerLinkInfo
from reshard.integrations.verl._names import BACKEND, SHARD_MODE, advise
from reshard.integrations.verl._stream import SyncStats

logger = logging.getLogger(__name__)

ROUNDS_FIRST, ROUNDS_LATER = 3, 2
"""All-rank rounds of a sync into the engines: the first sync's metadata exchange, plan agreement and completion
round; a later sync's live check (which is also its plan agreement) and completion round."""

PREFIX = "reshard-vllm"
"""Store namespace of the engine groups: `reshard-vllm/<generation>`, a new generation for every new group."""


class EngineLink:
    """A trainer rank's side of the engine group: join at the first sync, register the stream, then send each sync.

    Args:
        rank: this trainer rank (`0 .. T-1`), its group rank.
        world_size: T, the trainer ranks.
        engine_world_size: the engine workers of every replica together.
        master: the store's `host`, `port`, `token` and the group's `prefix`.
        timeout_s: seconds any wait for a peer may last.
        verify: check every received box against its sender's checksum.
        precision: `"same"` or `"cast"` (the trainer's dtypes to the engine's; the engines get the same).
    """

    def __init__(self, rank: int, world_size: int, engine_world_size: int, master: dict[str, Any],
                 timeout_s: float, verify: bool, precision: str = "same") -> None:
        self.info = TrainerLinkInfo(rank=rank, world_size=world_size, engine_world_size=engine_world_size,
                                           master_address=master["host"], master_port=int(master["port"]),
                                           token=master["token"] or None, prefix=master["prefix"], host_store=False,
                                           timeout_s=timeout_s, verify=verify, precision=precision)
        self.link: TrainerLink | None = None  # from the first sync's stream

    @property
    def key(self) -> tuple:
        """What the manager asked for (a new target means a new group)."""
        i = self.info
        return (i.rank, i.world_size, i.engine_world_size, i.master_address, i.master_port, i.prefix)

    def send(self, items: Sequence[tuple[str, Any, Any]], stats: SyncStats) -> None:
        """Send one sync's stream (`(name, tensor, ShardSpec or None)`, every weight; blocking).

        The first sync joins the group and registers the stream; a later one binds its new tensors to the
        registered names. A stream that differs from the first one (names, shapes, dtypes, layouts) is refused on
        every rank of the group, before data moves, naming what changed.
        """
        t0 = time.perf_counter()
        source = {name: stream_source(name, t, spec, self.info.rank, self.info.world_size) for name, t, spec in items}
        stats.seconds_stream += time.perf_counter() - t0
        stats.tensors = len(items)
        try:
            if self.link is None:
                held = {n: v for n, v in source.items() if v is not None}
                self.link = TrainerLink.join(self.info, source=held, who="ReshardTrainer.trainer_init")
                self.link.names = [name for name, _, _ in items]  # the registered names, in the first sync's order
            else:
                self.link.rebind([name for name, _, _ in items], source)
            stats.seconds_first_send = time.perf_counter()  # the transfer starts (`send_weights` makes it relative)
            report = self.link.send()
        except BaseException as e:
            if self.link is not None:
                self.link.report_failure(e, "send_weights")
            if isinstance(e, ValueError) and advise(str(e)) != str(e):
                raise ValueError(advise(str(e))) from e
            raise
        ex = report.execution
        stats.bytes_sent = ex.bytes_sent if ex is not None else 0
        stats.rounds = ROUNDS_FIRST if report.first_run else ROUNDS_LATER
        stats.first_plans = int(report.first_run)
        stats.seconds_transfer = report.seconds["transfer"]

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.link = None


_MANAGER: type | None = None


def engine_shard_manager() -> type:
    """The `EngineShardManager` class (defined on first use: it subclasses verl's manager)."""
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = _define()
    return _MANAGER


def _define() -> type:
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.ray_utils import auto_await


    class EngineShardManager(CheckpointEngineManager):
        """verl's manager refitting vLLM rollout replicas through reshard's vLLM weight-transfer backend: each
        engine worker receives exactly its shards, from trainer ranks that send from theirs.

        Turned on by configuration (verl 0.9.1):

            actor_rollout_ref.rollout.checkpoint_engine.backend=reshard
            actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=reshard.integrations.verl
            actor_rollout_ref.rollout.checkpoint_manager_class=reshard.integrations.verl.EngineShardManager
            +actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config.backend=reshard

        A sync: abort and park the replicas' requests, release their KV caches (as verl's manager does), then
        concurrently the trainer workers' `update_weights(mode="delta_sharded")` (their checkpoint engines send
        from the training engine's shards) and, on each replica's first server, vLLM's `init_weight_transfer_engine`
        (first sync, or after a failed one), `start_weight_update`, `update_weights`, `finish_weight_update`; then
        each server's `clear_kv_cache` (the prefix cache holds the old weights' keys) and `set_global_steps`, the
        KV caches back and generation resumed. The rollout workers' checkpoint engines are not used.

        A failed sync raises here (every rank's reason); the engines keep their previous weights where the transfer
        failed (their re-processing only runs after a whole transfer), and the next sync builds a new group.
        """

        def __init__(self, config: Any, actor_wg: Any, replicas: list) -> None:
            if config.backend != BACKEND:
                raise ValueError(f"EngineShardManager drives the {BACKEND!r} checkpoint engine only; "
                                 f"checkpoint_engine.backend is {config.backend!r}")
            super().__init__(config, actor_wg, replicas)
            self.backend = SHARD_MODE  # the trainer workers' `mode`: hand the engine over (its shard export)
            self._joined = False
            self._generation = 0
            self.last_sync: dict[str, Any] = {}
            for r in replicas:
                check_replica(r)

        def add_replicas(self, replicas: list) -> None:
            for r in replicas:
                check_replica(r)
            super().add_replicas(replicas)
            self._joined = False

        def remove_replicas(self, replicas: list) -> None:
            super().remove_replicas(replicas)
            self._joined = False

        @auto_await
        async def update_weights(self, global_steps: int | None = None) -> dict:  # type: ignore[override]
            leaders = [leader_server(r) for r in self.replicas]
            await self.abort_replicas()
            await self.release_kv_cache_replicas()
            T = self.actor_wg.world_size
            W = replica_world_size(self.replicas)
            t0 = time.perf_counter()
            if not self._joined:
                meta = ray.get(self.actor_wg.execute_checkpoint_engine(["prepare"] * T))
                master = meta[0].get("master") if isinstance(meta[0], dict) else None
                if master is None:
                    raise ValueError("EngineShardManager: the first trainer worker's checkpoint engine is not the "
                                     "master (is_master=True on trainer rank 0), so no store serves the group")
                self._generation += 1
                address = {"host": master["host"], "port": master["port"], "token": master["token"],
                           "prefix": f"{PREFIX}/{self._generation}"}
                init_info = ray.get(self.actor_wg.execute_checkpoint_engine(
                    method=["target_engines"] * T, rank=list(range(T)), world_size=[T] * T,
                    engine_world_size=[GroupLayout(T, W, len(leaders)).engine_workers] * T,
                    master=[address] * T))[0]
            version = str(global_steps) if global_steps is not None else None
            trainers = self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend)
            started = False
            try:
                if not self._joined:
                    await _all(s.collective_rpc.remote("init_weight_transfer_engine", kwargs={"init_info": dict(
                        init_info, engines=len(leaders), engine_index=i)}) for i, s in enumerate(leaders))
                    self._joined = True
                await _all(s.collective_rpc.remote("start_weight_update") for s in leaders)
                started = True
                await _every("update_weights", [s.collective_rpc.remote("update_weights", kwargs={
                    "update_info": {"version": version}}) for s in leaders])
                results = await _all(trainers)
                await _all(s.collective_rpc.remote("finish_weight_update") for s in leaders)
                started = False
            except BaseException as e:
                self._joined = False  # the next sync builds a new group on every side
                failures = [("the trainer workers", x) for x in await _settle(trainers)]
                if started:
                    await _settle(s.collective_rpc.remote("finish_weight_update") for s in leaders)
                raise sync_failure(global_steps, e, failures) from e
            await _all(s.clear_kv_cache.remote() for s in leaders)
            if global_steps is not None:
                await _all(s.set_global_steps.remote(global_steps) for s in leaders)
            await self.resume_kv_cache_replicas()
            await self.resume_generation_replicas()
            metrics: dict[str, Any] = {}
            for r in results:
                if isinstance(r, dict):
                    metrics.update(r)
            metrics["reshard/sync_seconds"] = time.perf_counter() - t0
            self.last_sync = metrics
            return metrics

    EngineShardManager.__module__ = "reshard.integrations.verl"
    return EngineShardManager


def check_replica(replica: Any) -> None:
    """Refuse a replica this manager cannot refit: not vLLM, or vLLM without reshard's weight-transfer backend."""
    config = getattr(replica, "config", None)
    name = getattr(config, "name", None)
    if name != "vllm":
        raise ValueError(f"EngineShardManager refits vLLM rollout replicas; replica "
                         f"{getattr(replica, 'replica_rank', '?')} is rollout.name={name!r}")
    kwargs = (getattr(config, "engine_kwargs", None) or {}).get("vllm") or {}
    wtc = kwargs.get("weight_transfer_config") or {}
    backend = wtc.get("backend") if hasattr(wtc, "get") else None
    if backend != "reshard":
        raise ValueError("EngineShardManager: the vLLM engines must load reshard's weight-transfer backend; set "
                         "+actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config.backend=reshard (got "
                         f"weight_transfer_config={dict(wtc) if hasattr(wtc, 'items') else wtc!r})")


def leader_server(replica: Any) -> Any:
    """The replica's first server: its `collective_rpc` reaches every worker of the replica's engine."""
    servers = getattr(replica, "servers", None) or []
    if not servers:
        raise ValueError(f"EngineShardManager: replica {getattr(replica, 'replica_rank', '?')} has no server "
                         "(launch the replicas' servers before the first sync)")
    return servers[0]


def replica_world_size(replicas: Sequence[Any]) -> int:
    """The engine workers of one replica (TP x DP x PP); every replica must have the same."""
    sizes = sorted({int(r.world_size) for r in replicas})
    if not replicas or len(sizes) != 1:
        raise ValueError(f"EngineShardManager: the replicas must all have one world size, got {sizes}")
    return sizes[0]


async def _all(refs: Any) -> list[Any]:
    return list(await asyncio.gather(*list(refs)))


async def _settle(refs: Any) -> list[BaseException]:
    """Wait for every call to end; their errors (also logged at debug)."""
    errors = [r for r in await asyncio.gather(*list(refs), return_exceptions=True) if isinstance(r, BaseException)]
    for r in errors:
        logger.debug("EngineShardManager: after the failure: %s", r)
    return errors


class ReplicaErrors(RuntimeError):
    """Calls on several replicas' servers failed: every replica's error (`errors`: replica index -> exception)."""

    def __init__(self, what: str, errors: dict[int, BaseException]) -> None:
        self.errors = errors
        super().__init__(f"{what} failed on replicas {sorted(errors)}: " + "; ".join(
            f"replica {i}: {_reason(e)}" for i, e in sorted(errors.items())))


async def _every(what: str, refs: Sequence[Any]) -> list[Any]:
    """Every call's result; when some fail, a `ReplicaErrors` with each failed replica's error (not only the
    first's: a replica killed mid-sync fails its own call, the others fail with the group's verdict)."""
    results = await asyncio.gather(*refs, return_exceptions=True)
    errors = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
    if errors:
        raise ReplicaErrors(what, errors)
    return results


def _reason(error: BaseException, limit: int = 4000) -> str:
    """An error's message for the driver's: its type and text (a Ray task error's cause's, when it has one)."""
    cause = getattr(error, "cause", None)
    e = cause if isinstance(cause, BaseException) else error
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}{' ...' if len(text) > limit else ''}"


def sync_failure(step: Any, first: BaseException, failures: Sequence[tuple[str, BaseException]]) -> RuntimeError:
    """The driver's error for a failed sync: the first failure and every other side's reason (each once)."""
    seen = {_reason(first)}
    lines = [f"{'the replicas' if isinstance(first, ReplicaErrors) else 'first failure'}: {_reason(first)}"]
    for who, e in failures:
        r = _reason(e)
        if r not in seen:
            seen.add(r)
            lines.append(f"{who}: {r}")
    return RuntimeError(f"EngineShardManager: the weight sync of step {step} failed; every side's reason:\n  "
                        + "\n  ".join(lines))
