"""reshard as verl's checkpoint-engine backend, driven by verl's real `CheckpointEngineManager` on a local Ray cluster.

Two trainer workers (FSDP2 over gloo, a tiny Qwen3 with random weights) and two rollout workers (verl's own
`CheckpointEngineWorker`, two TP1 replicas), selected by configuration alone (`backend="reshard"`,
`custom_backend_module="reshard.integrations.verl"`). Runs in `.venv-verl` (`make test-frameworks`); one Ray
cluster and one set of workers for the module (their start-up is most of the time), the fault test last (it ends
a worker).

Oracles: every received tensor against the trainer's own `full_tensor()`, byte for byte, after three syncs with
weights changed between them; as a negative control, each sync's tensors differ from the previous sync's (a backend
that delivered stale bytes would fail the byte check). Bytes: the trainer ranks together send the model exactly
once (each a distinct part, none more than its share), and the rollout side's buckets hold at most `bucket_size`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verl", reason="verl is installed in .venv-verl (make test-frameworks)")

import ray
import torch

import reshard.testing.verl as vc
from reshard.comm import CommError
from reshard.integrations.verl import ReshardCheckpointEngine, SyncError

pytestmark = pytest.mark.frameworks

BUCKET = 1 << 20
TIMEOUT = 30
HEADER_ROW = 32  # bytes of one trainer rank's row of a bucket's header, sent with every bucket


@pytest.fixture(scope="module")
def cluster():
    vc.ray_init()
    trainer, rollout, replicas, manager = vc.setup(engine_kwargs={"timeout_s": TIMEOUT}, bucket_mb=1)
    yield trainer, rollout, manager, replicas
    ray.shutdown()


def _check_received(trainer, rollout) -> dict[str, torch.Tensor]:
    full = trainer.full_state()[0]
    for worker, (order, got) in enumerate(rollout.received()):
        assert order == list(full), f"rollout worker {worker}: names {order[:4]}... != {list(full)[:4]}..."
        for name, want in full.items():
            have = got[name]
            assert have.shape == want.shape and have.dtype == want.dtype, name
            assert torch.equal(have.view(torch.uint8), want.view(torch.uint8)), f"rollout {worker}: {name} differs"
    return full


def test_three_syncs_byte_equal(cluster) -> None:
    """Three syncs with weights changed between them; the second and third are steady: one all-rank round on
    every rank (the plans kept, the stream's digest checked once)."""
    trainer, rollout, manager, _ = cluster
    model_bytes = sum(t.nbytes for t in trainer.full_state()[0].values())
    previous = None
    for step in range(3):
        metrics = vc.sync(manager, step)
        full = _check_received(trainer, rollout)
        if previous is not None:  # negative control: the weights did change, so stale bytes would have failed above
            assert all(not torch.equal(full[n], previous[n]) for n in full)
        previous = full
        sent = [metrics[f"reshard/rank{r}/bytes_sent"] for r in range(2)]
        stats = rollout.engine_attr("last_sync")
        headers = HEADER_ROW * 2 * stats[0].buckets
        # every trainer rank sends a distinct part of each tensor: together the model once, none more than its share
        assert sum(sent) == model_bytes + headers, (sent, model_bytes)
        assert max(sent) <= model_bytes / 2 + 64 * 31 + headers / 2, sent
        for s in stats:
            assert 0 < s.largest_bucket <= BUCKET, s
            assert s.tensors == len(full)
            assert s.first_plans == (0 if step else s.buckets), s  # plans are built once, reused by later syncs
        rounds = [s.rounds for s in trainer.engine_attr("last_sync") + stats]
        assert rounds == ([1] * 4 if step else [4 * stats[0].buckets + 1] * 4), rounds
        trainer.change_weights(step + 1)


@pytest.mark.parametrize("stream", ["dtensor", "shard"])
def test_sharded_streams(cluster, stream) -> None:
    """DTensors and `(name, local, ShardSpec)` (verl's `get_per_tensor_param_shard()`): nothing gathered on the
    trainer, each rank sends (part of) its own FSDP shard."""
    trainer, rollout, manager, _ = cluster
    trainer.set_stream(stream)
    try:
        vc.sync(manager, 10)  # the stream changed (another kind of source): replanned
        assert [s.replanned for s in rollout.engine_attr("last_sync")] == [0, 0]
        metrics = vc.sync(manager, 11)
        _check_received(trainer, rollout)
        full = trainer.full_state()[0]
        sent = [metrics[f"reshard/rank{r}/bytes_sent"] for r in range(2)]
        buckets = rollout.engine_attr("last_sync")[0].buckets
        assert sum(sent) == sum(t.nbytes for t in full.values()) + HEADER_ROW * 2 * buckets, sent
        assert [s.rounds for s in trainer.engine_attr("last_sync")] == [1, 1]
    finally:
        trainer.set_stream("full")


def test_a_changed_layout_is_replanned(cluster) -> None:
    """The same names, shapes and dtypes but another layout (the DTensors resharded by columns): the manifest is
    equal, so only the trainer ranks see the change; the steady sync replans at the first bucket on every rank,
    delivers exactly, and the next sync is steady again."""
    trainer, rollout, manager, _ = cluster
    trainer.set_stream("dtensor")
    try:
        vc.sync(manager, 60)
        vc.sync(manager, 61)
        assert [s.rounds for s in trainer.engine_attr("last_sync")] == [1, 1]  # steady on the row layout
        trainer.set_stream("dtensor-cols")
        vc.sync(manager, 62)
        _check_received(trainer, rollout)
        assert [s.replanned for s in trainer.engine_attr("last_sync") + rollout.engine_attr("last_sync")] == [0] * 4
        vc.sync(manager, 63)
        _check_received(trainer, rollout)
        assert [s.rounds for s in trainer.engine_attr("last_sync") + rollout.engine_attr("last_sync")] == [1] * 4
    finally:
        trainer.set_stream("full")


def test_shard_stream_manager_by_configuration(cluster) -> None:
    """`checkpoint_manager_class=reshard.integrations.verl.ShardStreamManager` (loaded as verl's trainer loads it):
    verl's own trainer-side `update_weights` then hands the training engine to `send_weights`, which streams
    `get_per_tensor_param_shard()` (each rank's local FSDP shards in bf16): the full-tensor export is never asked
    for, each trainer rank sends exactly its own shards, and the rollout workers get every tensor, byte-equal to
    the trainer's `full_tensor()` in bf16."""
    trainer, rollout, manager, replicas = cluster
    shard_manager = vc.make_manager(manager.config, trainer, replicas, "reshard.integrations.verl.ShardStreamManager")
    assert type(shard_manager).__name__ == "ShardStreamManager"
    trainer.export_calls()
    for step in (50, 51):
        trainer.change_weights(step)
        metrics = vc.sync(shard_manager, step)
        assert trainer.export_calls() == [{"full": 0, "shard": 1}] * 2
        full = {n: t.to(torch.bfloat16) for n, t in trainer.full_state()[0].items()}
        for worker, (order, got) in enumerate(rollout.received()):
            assert order == list(full)
            for name, want in full.items():
                assert got[name].dtype == torch.bfloat16 and torch.equal(got[name].view(torch.uint8),
                                                                         want.view(torch.uint8)), (worker, name)
        stats = trainer.engine_attr("last_sync")
        if step == 51:  # steady (the first sync replanned: bf16 shards are another stream than fp32 full tensors)
            assert [s.rounds for s in stats + rollout.engine_attr("last_sync")] == [1] * 4
            sent = [metrics[f"reshard/rank{r}/bytes_sent"] for r in range(2)]
            local = trainer.local_bytes(torch.bfloat16)
            headers = HEADER_ROW * stats[0].buckets
            assert sent == [b + headers for b in local], (sent, local)  # each rank its own shards, none gathered
    vc.sync(manager, 52)  # back to verl's default manager: the full-tensor stream again
    assert trainer.export_calls() == [{"full": 1, "shard": 0}] * 2


def test_bad_kwargs_on_every_worker(cluster) -> None:
    """The real path: verl builds the engine on every worker from `engine_kwargs.reshard`; every one refuses (the
constructor's other refusals: `tests/integrations/test_integrations_verl.py`)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import reshard.integrations.verl  # noqa: F401  (registers the backend, as custom_backend_module does)

    with pytest.raises(TypeError, match="unknown engine_kwargs"):
        CheckpointEngineRegistry.new("reshard", bucket_size=BUCKET, is_master=True, nonsense=True)
    trainer, rollout, _, _ = cluster
    assert trainer.new_engine("reshard", {"timeout_s": 5}) == ["ReshardCheckpointEngine"] * 2
    refs = [w.new_engine.remote("reshard", {"timeout_s": "soon"}) for w in trainer.workers + rollout.workers]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError, match="timeout_s must be seconds > 0"):
            ray.get(ref)


def test_build_topology_refuses_mismatch(cluster) -> None:
    trainer, rollout, _, _ = cluster
    meta = ray.get(trainer.execute_checkpoint_engine(["prepare"] * 2)
                   + rollout.execute_checkpoint_engine(["prepare"] * 2))
    with pytest.raises(ValueError, match=r"metadata from 4 workers, but actor_wg_world_size 2 \+ rollout_world_size "
                                         r"3 = 5"):
        ReshardCheckpointEngine.build_topology(2, 3, meta)
    with pytest.raises(ValueError, match="exactly the first trainer worker must be the master"):
        ReshardCheckpointEngine.build_topology(2, 2, meta[1:] + meta[:1])
    with pytest.raises(ValueError, match="did not report reshard checkpoint-engine metadata"):
        ReshardCheckpointEngine.build_topology(2, 2, meta[:3] + [{"backend": "nccl"}])


def test_world_size_mismatch_fails_every_rank(cluster) -> None:
    """A rollout worker told another world size: every rank's `init_process_group` raises, none hangs."""
    trainer, rollout, manager, _ = cluster
    meta = ray.get(trainer.execute_checkpoint_engine(["prepare"] * 2)
                   + rollout.execute_checkpoint_engine(["prepare"] * 2))
    # a fresh group (the live one would be kept): bump the generation the master reported
    meta[0]["master"]["generation"] += 100
    tkw, rkw = ReshardCheckpointEngine.build_topology(2, 2, meta)
    rkw["world_size"][1] = 5
    rkw["domains"][1] = rkw["domains"][1] + [rkw["domains"][1][-1]]
    refs = (trainer.execute_checkpoint_engine(method=["init_process_group"] * 2, **tkw)
            + rollout.execute_checkpoint_engine(method=["init_process_group"] * 2, **rkw))
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError, match="CommError"):
            ray.get(ref, timeout=TIMEOUT + 30)
    # the next sync builds a new group and works
    vc.sync(manager, 20)
    _check_received(trainer, rollout)


def test_engine_error_fails_every_rank(cluster) -> None:
    """A rollout engine that refuses a tensor mid-sync: it raises, the other rollout worker and both trainers raise
    too (none waits out the timeout), and the other worker's error says what its engine already took."""
    trainer, rollout, manager, _ = cluster
    ray.get(rollout.workers[1].fail_after.remote(3))
    try:
        manager.build_process_group(rollout)  # verl's own steps 1-3 of a sync
        refs = trainer.update_weights(global_steps=30) + rollout.update_weights(global_steps=30)
        errors = []
        for ref in refs:
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                ray.get(ref, timeout=TIMEOUT + 30)
            errors.append(str(info.value))
        assert "the engine refused" in errors[3]
        assert "CommError" in errors[0] and "CommError" in errors[1]
        assert "SyncError" in errors[2] and "tensors were given to the engine" in errors[2]
    finally:
        ray.get(rollout.workers[1].fail_after.remote(None))
    vc.sync(manager, 31)  # recovers: a new group
    _check_received(trainer, rollout)


def test_peer_disappears_fails_every_rank(cluster) -> None:
    """A rollout worker whose process ends mid-sync: the trainers and the other rollout worker raise `CommError`
    within the timeout. Last in the module: the worker is gone."""
    trainer, rollout, manager, _ = cluster
    ray.get(rollout.workers[1].fail_after.remote(5, "exit"))
    manager.build_process_group(rollout)
    refs = trainer.update_weights(global_steps=40) + rollout.update_weights(global_steps=40)
    for ref in refs[:3]:
        with pytest.raises(ray.exceptions.RayTaskError, match="CommError|SyncError"):
            ray.get(ref, timeout=TIMEOUT + 30)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(refs[3], timeout=TIMEOUT)


def test_errors_are_comm_errors() -> None:
    assert issubclass(SyncError, CommError)  # callers that catch reshard's CommError catch a failed sync too
