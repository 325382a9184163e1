"""`ReshardCheckpointEngine`: reshard as a verl checkpoint-engine backend (`backend=reshard`).

verl's `CheckpointEngineManager.update_weights` drives one sync on every trainer (actor) worker and every rollout
worker: `prepare()` -> `build_topology(...)` (in the driver) -> `init_process_group(**kw)` -> `send_weights(...)`
on the trainer workers concurrently with `receive_weights()` on the rollout workers -> `finalize()`.

What moves where:
- Trainer ranks `0 .. T-1`, rollout ranks `T .. T+R-1` meet in one `reshard.Group.rendezvous` whose TCP store
  trainer rank 0 hosts (its address and the job token come from `prepare()`; the driver hands them over).
- The trainer streams `(name, tensor)` pairs (verl's FSDP engine: `.full_tensor()` of every parameter, on every
  rank), or hands over its training engine (`ShardStreamManager`: verl's `mode="delta_sharded"`), whose
  `get_per_tensor_param_shard()` is streamed. The stream is cut into buckets of at most `bucket_size` bytes
  (`_buckets`); all trainer ranks derive the same buckets.
- A full tensor is registered on trainer rank t as its `t`-th row block (`Shard(0)` over the T trainer ranks), so
  every trainer rank sends a distinct part of each tensor and none sends more than its share. A DTensor, or a local
  shard with verl's `ShardSpec` (`get_per_tensor_param_shard()`), is registered with its own layout: nothing is
  gathered on the trainer side.
- Every rollout rank receives each bucket whole (vLLM's `load_weights` takes whole Hugging Face tensors) into a
  bucket buffer, and `receive_weights` yields `(name, view)` pairs from it. With `domains="node"` the rollout
  ranks of one node form one domain: each byte crosses from the trainers to that node once and is forwarded there
  (NVLink on a GPU node), so the trainers together send the model once per rollout node, not once per rollout rank.
- Each bucket index keeps its plan while the group lives (`rebuild_group=False`); a sync whose stream equals the
  last one's runs them with one all-rank round in all, a changed stream is found at its first changed bucket on
  every rank and replanned from there (`_stream`).

Errors: bad or missing `engine_kwargs` are a `ValueError` / `TypeError` in the constructor, on every worker;
`build_topology` refuses metadata of the wrong length or without a master; a rank given another world size, or a
peer that does not join or disappears, is a `CommError` on every rank within `timeout_s`. A rollout worker never
yields the last bucket of a sync before every rank confirmed it received every bucket and its engine took every
earlier one; if a sync fails after some buckets were yielded, `receive_weights` raises `SyncError` saying how many
tensors the engine already took (its weights are then a mix of two versions until the next sync succeeds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import torch

from reshard.comm import TOKEN_ENV, CommError, Group, is_loopback, serve_store
from reshard.integrations.group_layout import GroupLayout
from reshard.integrations.verl import _buckets as bk
from reshard.integrations.verl._names import BACKEND
from reshard.integrations.verl._stream import Stream, SyncStats, short, topology_of
from reshard.integrations.verl._vllm import EngineLink
from reshard.planner import is_dtensor

logger = logging.getLogger(__name__)

FORMAT = 1
"""Version of the metadata `prepare()` returns; `build_topology` refuses a mix."""

DOMAINS = ("node", "rank")
"""`domains=` options: `"node"` (ranks of one side on one node share a domain), `"rank"` (every rank its own)."""

DEVICES = ("auto", "cpu", "cuda")

PRECISIONS = ("same", "cast")
"""`precision=` options (into vLLM engines)."""


class SyncError(CommError):
    """A weight sync failed; the message says what the rollout engine had already been given."""


class ReshardCheckpointEngine:
    """verl checkpoint engine moving weights with reshard (see the module docstring for the protocol).

    Args:
        bucket_size: bytes per bucket (verl's `update_weights_bucket_megabytes << 20`).
        is_master: True on trainer rank 0 (verl passes it on the trainer side), which hosts the group's store.
        host: address the master's store binds to and the others dial; default Ray's node IP address, else
            `127.0.0.1`.
        port: the store's port on the master; 0 (default) picks a free one.
        token: the group's shared secret; default `RESHARD_TOKEN` from the environment, else a fresh random one
            drawn by the master and handed to every worker by the driver (`build_topology`).
        timeout_s: seconds any wait for a peer may last (rendezvous, each bucket).
        domains: `"node"` (default) or `"rank"`: see the module docstring.
        rebuild_group: build a new group (and new plans) in every sync instead of keeping them.
        device: where buckets live: `"auto"` (CUDA when available), `"cpu"` or `"cuda"`.
        staging_bytes: reshard's staging budget per rank (default: reshard's).
        verify: check every received box against its sender's checksum.
        precision: into vLLM engines (`EngineShardManager`): `"same"` (the trainer's dtypes must be the engine's)
            or `"cast"` (cast to the engine's dtype while packing, bit-exact to torch); the engines get the same.
            The rollout workers' path receives whole tensors in the trainer's dtype and does not read it.

    Attributes:
        wire_format: verl's `"named_tensors"`: `receive_weights` yields `(name, tensor)` pairs.
        last_sync: this rank's `SyncStats` of the last sync.
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        allowed = ("host", "port", "token", "timeout_s", "domains", "rebuild_group", "device", "staging_bytes",
                   "verify", "precision")
        unknown = sorted(set(engine_kwargs) - set(allowed))
        if unknown:
            raise TypeError(f"reshard checkpoint engine: unknown engine_kwargs {unknown}; valid keys under "
                            f"checkpoint_engine.engine_kwargs.reshard are {list(allowed)}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < bk.ALIGN:
            raise ValueError(f"reshard checkpoint engine: bucket_size must be an integer number of bytes >= "
                             f"{bk.ALIGN}, got {bucket_size!r} (checkpoint_engine.update_weights_bucket_megabytes)")
        kw: dict[str, Any] = {"host": None, "port": 0, "token": None, "timeout_s": 300.0, "domains": "node",
                              "rebuild_group": False, "device": "auto", "staging_bytes": None, "verify": False,
                              "precision": "same"}
        kw.update(engine_kwargs)
        _check(kw["host"] is None or (isinstance(kw["host"], str) and kw["host"]), "host", kw["host"],
               "a non-empty address string or null")
        _check(_is_int(kw["port"]) and 0 <= kw["port"] < 65536, "port", kw["port"], "an integer in [0, 65536)")
        _check(kw["token"] is None or isinstance(kw["token"], str), "token", "<hidden>", "a string or null")
        _check(_is_num(kw["timeout_s"]) and kw["timeout_s"] > 0, "timeout_s", kw["timeout_s"], "seconds > 0")
        _check(kw["domains"] in DOMAINS, "domains", kw["domains"], f"one of {DOMAINS}")
        _check(isinstance(kw["rebuild_group"], bool), "rebuild_group", kw["rebuild_group"], "true or false")
        _check(kw["device"] in DEVICES, "device", kw["device"], f"one of {DEVICES}")
        _check(kw["staging_bytes"] is None or (_is_int(kw["staging_bytes"]) and kw["staging_bytes"] > 0),
               "staging_bytes", kw["staging_bytes"], "a positive integer or null")
        _check(isinstance(kw["verify"], bool), "verify", kw["verify"], "true or false")
        _check(kw["precision"] in PRECISIONS, "precision", kw["precision"], f"one of {PRECISIONS}")
        if kw["device"] == "cuda" and not torch.cuda.is_available():
            raise ValueError("reshard checkpoint engine: device='cuda' but CUDA is not available on this worker")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.host: str | None = kw["host"]
        self.port: int = kw["port"]
        self.token: str | None = kw["token"] or os.environ.get(TOKEN_ENV) or None
        self.timeout_s = float(kw["timeout_s"])
        self.domains: str = kw["domains"]
        self.rebuild_group: bool = kw["rebuild_group"]
        dev = kw["device"]
        self.device = torch.device("cuda" if dev == "cuda" or (dev == "auto" and torch.cuda.is_available()) else "cpu")
        self.staging_bytes: int | None = kw["staging_bytes"]
        self.verify: bool = kw["verify"]
        self.precision: str = kw["precision"]
        self.last_sync = SyncStats()
        self._store: Any = None  # the master's TCP store, alive as long as this engine
        self._generation = 0  # the master's count of groups it hosted
        self._group: Group | None = None
        self._session: dict[str, Any] | None = None  # the live group's prefix, rank and world size
        self._num_trainers = 0
        self._stream: Stream | None = None  # the live group's bucket plans and buffers
        self._failed = False  # the last sync failed on this rank
        self._link: EngineLink | None = None  # the vLLM engines' group (EngineShardManager), when targeted

    # ---- verl's interface ---------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """This worker's metadata for `build_topology` (picklable): its node, its live group, and on the master the
        store's address and the token."""
        if self._group is not None and (self._failed or self._group.fault() is not None):
            self._close_group()  # a failed sync leaves the group aborted: the next one builds a new group
        meta: dict[str, Any] = {"format": FORMAT, "backend": BACKEND, "node": _node_id(), "session": self._session,
                                "master": None}
        if self.is_master:
            if self._store is None:
                self._start_store()
            meta["master"] = {"host": self.host, "port": self._store.port, "token": self.token,
                              "generation": self._generation, "rebuild_group": self.rebuild_group}
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: Sequence[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Group ranks, world size, the master's address and the NVLink domains, per worker (run in the driver).

        Args:
            actor_wg_world_size: T, the trainer workers.
            rollout_world_size: R, the rollout workers.
            metadata: `prepare()` of the T trainer workers, then of the R rollout workers.

        Returns:
            `(trainer kwargs, rollout kwargs)`: per `init_process_group` argument, one value per worker.

        Raises:
            ValueError: world sizes that are not positive integers, metadata of another length, from another
                backend or version, or without the master as its first entry.
        """
        T, R = actor_wg_world_size, rollout_world_size
        for what, v in (("actor_wg_world_size", T), ("rollout_world_size", R)):
            if not _is_int(v) or v < 1:
                raise ValueError(f"reshard build_topology: {what} must be an integer >= 1, got {v!r}")
        meta = list(metadata)
        if len(meta) != T + R:
            raise ValueError(f"reshard build_topology: got metadata from {len(meta)} workers, but "
                             f"actor_wg_world_size {T} + rollout_world_size {R} = {T + R} workers must take part")
        bad = [i for i, m in enumerate(meta) if not isinstance(m, dict) or m.get("backend") != BACKEND
               or m.get("format") != FORMAT]
        if bad:
            raise ValueError(f"reshard build_topology: workers {bad} did not report reshard checkpoint-engine "
                             f"metadata of format {FORMAT} (is every worker configured with backend=reshard and the "
                             f"same reshard version?); got {[_hidden(meta[i]) for i in bad][:3]}")
        masters = [i for i, m in enumerate(meta) if m.get("master") is not None]
        if masters != [0]:
            raise ValueError(f"reshard build_topology: exactly the first trainer worker must be the master "
                             f"(is_master=True), found masters at positions {masters} of {T + R}")
        master = meta[0]["master"]
        world = T + R
        gen = int(master["generation"])
        live = f"reshard-verl/{gen}"
        reuse = not master["rebuild_group"] and all(
            m["session"] is not None and m["session"]["prefix"] == live and m["session"]["rank"] == i
            and m["session"]["world_size"] == world and m["session"]["num_trainers"] == T
            for i, m in enumerate(meta))
        prefix = live if reuse else f"reshard-verl/{gen + 1}"
        domains = [_domain(i < T, m["node"]) for i, m in enumerate(meta)]
        address = {"host": master["host"], "port": master["port"], "token": master["token"], "prefix": prefix}

        def kwargs(ranks: range) -> dict[str, list[Any]]:
            return {"rank": list(ranks), "world_size": [world] * len(ranks), "num_trainers": [T] * len(ranks),
                    "master": [address] * len(ranks), "domains": [domains] * len(ranks)}

        logger.info("reshard build_topology: %d trainer + %d rollout workers, group %s (%s)", T, R, prefix,
                    "kept" if reuse else "new")
        return kwargs(range(T)), kwargs(range(T, world))

    def init_process_group(self, rank: int, world_size: int, num_trainers: int, master: dict[str, Any],
                           domains: Sequence[Any]) -> None:
        """Join the group (or keep the live one, when `build_topology` said so)."""
        if not (_is_int(world_size) and world_size >= 2 and _is_int(rank) and 0 <= rank < world_size
                and _is_int(num_trainers) and 1 <= num_trainers < world_size and len(domains) == world_size):
            raise ValueError(f"reshard init_process_group: inconsistent topology: rank={rank!r}, world_size="
                             f"{world_size!r}, num_trainers={num_trainers!r}, {len(domains)} domains")
        prefix = master["prefix"]
        session = {"prefix": prefix, "rank": rank, "world_size": world_size, "num_trainers": num_trainers}
        if self._group is not None and self._session == session:
            return
        self._close_group()
        if self.is_master:
            self._generation = int(prefix.rsplit("/", 1)[1])
        token = master["token"] or None
        group = Group.rendezvous(master["host"], int(master["port"]), rank, world_size, prefix=prefix,
                                 is_master=False, token=token, timeout=self.timeout_s)
        self._group, self._session, self._num_trainers = group, session, num_trainers
        kw: dict[str, Any] = {"topology": topology_of(domains, self.domains == "node"), "policy": "reshard",
                              "verify": self.verify, "timeout": self.timeout_s}
        if self.staging_bytes is not None:
            kw["staging_bytes"] = self.staging_bytes
        self._stream = Stream(group, num_trainers, self.bucket_size, self.device, kw, self.timeout_s)
        logger.info("reshard init_process_group: rank %d of %d (%d trainer ranks), %s", rank, world_size,
                    num_trainers, prefix)

    def finalize(self) -> None:
        """End a sync: with `rebuild_group`, close the group and drop the plans and buffers."""
        if self.rebuild_group:
            self._close_group()

    def target_engines(self, rank: int, world_size: int, engine_world_size: int,
                       master: dict[str, Any]) -> dict[str, Any]:
        """Send the next syncs into vLLM engine workers with reshard's weight-transfer backend instead of the rollout
        workers (`EngineShardManager` calls it on every trainer worker; the group is joined at the next
        `send_weights`). A target other than the current one closes the current engine group.

        Returns:
            the `init_info` of vLLM's `init_weight_transfer_engine` that matches this side (address, prefix,
            token, timeout, verify); the manager adds each engine's `engines` / `engine_index`.
        """
        if not (_is_int(world_size) and world_size >= 1 and _is_int(rank) and 0 <= rank < world_size
                and _is_int(engine_world_size) and engine_world_size >= 1):
            raise ValueError(f"reshard target_engines: inconsistent topology: rank={rank!r}, world_size="
                             f"{world_size!r}, engine_world_size={engine_world_size!r}")
        link = EngineLink(rank, world_size, engine_world_size, master, self.timeout_s, self.verify,
                          precision=self.precision)
        if self._link is None or self._link.key != link.key:  # a failed sync closed the link already
            self._close_link()
            self._link = link
        return self._link.info.engine_init_info()

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Send the weights (every trainer worker calls it with its own stream).

        Args:
            weights: an iterable or async iterable of `(name, tensor)` (full tensors or DTensors) or of
                `(name, local shard, ShardSpec)`; or a verl training engine (verl passes it for
                `mode="delta_sharded"`, which `ShardStreamManager` sets): its `get_per_tensor_param_shard()`, or
                its `get_per_tensor_param()` if it has no shard export.
            global_steps: the trainer step (logged, returned in the metrics).

        Returns:
            verl metrics: this rank's bytes sent and seconds (`reshard/...`).
        """
        if self._link is not None:
            return await self._send_to_engines(weights, global_steps)
        group = self._require("send_weights", trainer=True)
        stream_of = self._stream
        assert stream_of is not None
        t0 = time.perf_counter()
        stats = SyncStats(step=global_steps)
        self.last_sync = stats
        stream = _stream_of(weights)
        stream_of.begin()
        pending: list[tuple[str, Any, Any]] = []
        used, index = 0, 0
        task: asyncio.Future | None = None  # the previous bucket's transfer, overlapping the next bucket's stream
        try:
            items = _aiter(stream).__aiter__()
            while True:
                t_item = time.perf_counter()
                try:
                    item = await items.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    stats.seconds_stream += time.perf_counter() - t_item
                name, tensor, spec = _normalise(item)
                size = bk.aligned(bk.nbytes_of(_full_shape(tensor, spec), tensor.dtype))
                if pending and used + size > self.bucket_size:
                    if task is not None:
                        await task
                    task = asyncio.ensure_future(asyncio.to_thread(self._send_bucket, index, pending, False, stats))
                    pending, used, index = [], 0, index + 1
                pending.append((name, tensor, spec))
                used += size
            if task is not None:
                await task
                task = None
            await asyncio.to_thread(self._send_bucket, index, pending, True, stats)
        except BaseException as e:
            self._failed = True
            if not isinstance(e, CommError):
                group.report_fault(group.rank, f"trainer rank {group.rank}: send_weights failed: "
                                               f"{type(e).__name__}: {e}")
            if task is not None and not task.done():
                await asyncio.wait([task])  # the group is not free until the running bucket ends (it fails too)
            if task is not None:
                _retrieve(task)
            raise
        stats.seconds = time.perf_counter() - t0
        stats.seconds_first_send = max(0.0, stats.seconds_first_send - t0)
        logger.info("reshard send_weights: rank %d, step %s: %d tensors in %d buckets, %d bytes sent, %d all-rank "
                    "rounds, %.3f s", group.rank, global_steps, stats.tensors, stats.buckets, stats.bytes_sent,
                    stats.rounds, stats.seconds)
        return {f"reshard/rank{group.rank}/bytes_sent": float(stats.bytes_sent),
                f"reshard/rank{group.rank}/seconds": stats.seconds,
                f"reshard/rank{group.rank}/rounds": float(stats.rounds)}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for every weight, bucket by bucket (every rollout worker calls it).

        A yielded tensor is a view of a bucket buffer: valid until the consumer asks for the tensors of the bucket
        after the next one (copy it to keep it longer). The next bucket is received while the consumer loads the
        current one.
        """
        group = self._require("receive_weights", trainer=False)
        stream_of = self._stream
        assert stream_of is not None
        stream_of.begin()
        t0 = time.perf_counter()
        stats = SyncStats(step=global_steps)
        self.last_sync = stats
        loop = asyncio.get_running_loop()
        index = 0
        yielded = 0
        done = False
        task = loop.run_in_executor(None, stream_of.receive, 0, stats)
        try:
            while True:
                entries, views, last = await task
                if last:  # every rank holds every bucket and its engine took all but this one: only then hand it on
                    task = loop.run_in_executor(None, stream_of.commit, stats)
                    await task
                else:
                    index += 1
                    task = loop.run_in_executor(None, stream_of.receive, index, stats)
                for e, v in zip(entries, views):
                    yield e.name, v
                    yielded += 1
                if last:
                    done = True
                    break
        except CommError as e:
            raise SyncError(f"rollout rank {group.rank}: the weight sync of step {global_steps} failed after "
                            f"{yielded} tensors were given to the engine"
                            + (" (its weights are now a mix of two versions until a sync succeeds)" if yielded else
                               " (none was given: the engine still holds its previous weights)")
                            + f": {e}") from e
        finally:
            if not done:
                task.add_done_callback(_retrieve)  # the bucket in flight fails too: its error is this one's echo
                self._failed = True
                # the consumer stopped early (GeneratorExit or its own error) or the sync failed: tell the peers, so
                # they raise now instead of waiting out the timeout
                group.report_fault(group.rank, f"rollout rank {group.rank}: receive_weights stopped after {yielded} "
                                               "tensors")
            stats.tensors = yielded
            stats.seconds = time.perf_counter() - t0

    # ---- internals ----------------------------------------------------------------------------------------------
    def _require(self, what: str, *, trainer: bool) -> Group:
        if self._group is None or self._session is None:
            raise ValueError(f"reshard checkpoint engine: {what} before init_process_group (verl calls prepare, "
                             "build_topology and init_process_group first)")
        is_trainer = GroupLayout(self._num_trainers, self._group.size - self._num_trainers).is_trainer(
            self._session["rank"])
        if is_trainer != trainer:
            raise ValueError(f"reshard checkpoint engine: {what} called on group rank {self._session['rank']}, a "
                             f"{'trainer' if is_trainer else 'rollout'} rank ({self._num_trainers} trainer ranks "
                             "come first)")
        return self._group

    def _start_store(self) -> None:
        if self.host is None:
            self.host = _node_ip()
        if self.token is None and not is_loopback(self.host):
            self.token = secrets.token_hex(16)  # handed to the workers by the driver, never written to the store
        self._store = serve_store(self.host, self.port, self.timeout_s)
        logger.info("reshard checkpoint engine: store at %s:%d", self.host, self._store.port)

    async def _send_to_engines(self, weights: Any, global_steps: int | None) -> dict[str, float]:
        link = self._link
        assert link is not None
        t0 = time.perf_counter()
        stats = SyncStats(step=global_steps)
        self.last_sync = stats
        items = [_normalise(item) async for item in _aiter(_stream_of(weights))]  # the engine's export, every weight
        stats.seconds_stream = time.perf_counter() - t0
        try:
            await asyncio.to_thread(link.send, items, stats)
        except BaseException:
            self._close_link()  # the next sync (EngineShardManager joins anew) builds a new group
            raise
        stats.seconds = time.perf_counter() - t0
        stats.seconds_first_send -= t0
        rank = link.info.rank
        logger.info("reshard send_weights (engines): rank %d, step %s: %d tensors, %d bytes sent, %.3f s", rank,
                    global_steps, stats.tensors, stats.bytes_sent, stats.seconds)
        return {f"reshard/rank{rank}/bytes_sent": float(stats.bytes_sent), f"reshard/rank{rank}/seconds": stats.seconds}

    def _close_link(self) -> None:
        if self._link is not None:
            self._link.close()
        self._link = None

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group, self._session, self._stream, self._failed = None, None, None, False

    def _send_bucket(self, index: int, items: list[tuple[str, Any, Any]], last: bool, stats: SyncStats) -> None:
        rows = [bk.manifest_row(n, _full_shape(t, s), t.dtype, _kind(t, s)) for n, t, s in items]
        self._stream.send(index, items, rows, last, stats)  # type: ignore[union-attr]
        stats.tensors += len(items)


# ---- helpers ------------------------------------------------------------------------------------------------------
def _retrieve(future: Any) -> None:
    """Mark a finished future's error as seen (asyncio would log it, with a traceback, when the future is collected)."""
    if future.done() and not future.cancelled():
        future.exception()


def _hidden(value: Any) -> Any:
    """`value` (a worker's metadata, as it may come) for a message: every `token` entry, at any depth, `<hidden>`."""
    if isinstance(value, dict):
        return {k: "<hidden>" if k == "token" else _hidden(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_hidden(v) for v in value]
    return value


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"reshard checkpoint engine: engine_kwargs.reshard.{name} must be {expected}, got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _node_id() -> str:
    try:
        import ray

        if getattr(ray, "is_initialized", lambda: False)():  # (a directory named `ray` on the path is no Ray)
            return str(ray.get_runtime_context().get_node_id())
    except ImportError:
        pass
    import socket

    return socket.gethostname()


def _node_ip() -> str:
    try:
        import ray

        if getattr(ray, "is_initialized", lambda: False)():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:
        pass
    return "127.0.0.1"


def _domain(trainer: bool, node: str) -> tuple[str, str]:
    """A rank's domain under `domains="node"`: its side and its node (trainer and rollout GPUs of one node are
    kept apart: the rollout side's forwarding is what the domain is for)."""
    return ("trainer" if trainer else "rollout", str(node))


def _stream_of(weights: Any) -> Any:
    """The stream to send: a verl training engine's `get_per_tensor_param_shard()` (its local shards), or, for an
    engine without a shard export, its `get_per_tensor_param()` (full tensors); any other `weights` is the stream."""
    if hasattr(weights, "get_per_tensor_param_shard"):
        return weights.get_per_tensor_param_shard()[0]
    if hasattr(weights, "get_per_tensor_param"):
        return weights.get_per_tensor_param()[0]
    return weights


async def _aiter(stream: Any) -> AsyncIterator[Any]:
    if hasattr(stream, "__aiter__"):
        async for x in stream:
            yield x
    elif isinstance(stream, Iterable):
        for x in stream:
            yield x
    else:
        raise TypeError(f"reshard send_weights: weights must be an iterable of (name, tensor) or (name, shard, "
                        f"ShardSpec), or an engine with get_per_tensor_param_shard(); got {type(stream).__name__}")


def _normalise(item: Any) -> tuple[str, Any, Any]:
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3) or not isinstance(item[0], str):
        raise TypeError(f"reshard send_weights: expected (name, tensor) or (name, shard, ShardSpec), got "
                        f"{type(item).__name__} {short(item)}")
    name, tensor = item[0], item[1]
    spec = item[2] if len(item) == 3 else None
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"reshard send_weights: {name!r}: expected a tensor, got {type(tensor).__name__}")
    if spec is not None:
        if getattr(spec, "place", None) is not None:
            raise NotImplementedError(f"reshard send_weights: {name!r}: ShardSpec with an explicit `place` (a "
                                      "virtual full tensor) is not supported; pass DTensor placements")
        if spec.mesh is None:  # unsharded: the local tensor is the full tensor (flattened by verl's FSDP export)
            return name, tensor.reshape(tuple(spec.full_shape)), None
    return name, tensor, spec


def _kind(t: Any, spec: Any) -> str:
    if spec is not None:
        return "shard"
    return "dtensor" if is_dtensor(t) else "full"


def _full_shape(t: Any, spec: Any) -> tuple[int, ...]:
    if spec is not None:
        return tuple(int(s) for s in spec.full_shape)
    return tuple(t.shape)
