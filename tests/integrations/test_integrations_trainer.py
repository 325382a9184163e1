"""The trainer-side home (`reshard.integrations.trainer`): a full tensor every trainer rank holds becomes row blocks
that cover it exactly once (oracle: `torch.chunk`, which DTensor's `Shard(0)` follows), a `(local, spec)` pair a
DTensor equal to DTensor's own `distribute_tensor` on a fake process group, a DTensor stays itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from reshard.integrations.trainer import contiguous_stride, full_layout, local_of, stream_source


@pytest.mark.parametrize("T", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(5, 3), (1, 7), (8,), (0, 4), (), (13, 2, 3)])
def test_full_tensor_rows_cover_once(T: int, shape: tuple[int, ...]) -> None:
    # 5 rows over 4 or 8 ranks: uneven, trailing ranks empty; (0, 4) and (): trainer rank 0 alone
    full = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32)[: torch.Size(shape).numel()]
    full = full.reshape(shape)
    seen = torch.zeros(shape, dtype=torch.int64)
    chunks = torch.chunk(full, T, dim=0) if full.dim() and shape[0] else ()
    for rank in range(T):
        src = stream_source("w", full, None, rank, T)
        if src is None:
            assert rank != 0 and (full.dim() == 0 or shape[0] == 0)
            continue
        local, layout = src
        assert local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # a view, no copy
        assert tuple(layout.shape) == shape and layout.dtype == torch.float32
        if full.dim() and shape[0]:
            expect = chunks[rank] if rank < len(chunks) else full[:0]
            assert torch.equal(local, expect), (rank, T)
            block = full_layout("w", shape, torch.float32, rank, T)
            seen[block.start: block.start + block.local_shape[0]] += 1
        else:
            assert rank == 0 and torch.equal(local, full)
            seen += 1
    assert bool((seen == 1).all()), seen


def test_contiguous_stride_matches_torch() -> None:
    for shape in [(2, 3, 4), (5,), (), (0, 3), (3, 0, 2)]:
        assert contiguous_stride(shape) == torch.empty(shape).stride() or 0 in shape
    assert contiguous_stride((3, 0, 2)) == (2, 2, 1)


@pytest.fixture
def fake_world():
    store = FakeStore()
    dist.init_process_group("fake", rank=1, world_size=4, store=store)
    yield
    dist.destroy_process_group()


def test_spec_pair_equals_distribute_tensor(fake_world) -> None:
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
    full = torch.randn(7, 6)
    placements = [Shard(0), Shard(1)]
    # src_data_rank=None: each rank cuts its own shard from `full` (the fake group's collectives move no data, so a
    # scattered or broadcast DTensor would hold uninitialised memory, NaNs included)
    want = distribute_tensor(full, mesh, placements, src_data_rank=None)
    spec = SimpleNamespace(full_shape=(7, 6), mesh=mesh, placements=placements)
    flat = want.to_local().reshape(-1)  # verl's FSDP engine flattens the local shard
    got = stream_source("w", flat, spec, 1, 2)
    assert tuple(got.shape) == (7, 6) and tuple(got.placements) == tuple(placements)
    assert torch.equal(got.to_local(), want.to_local())
    assert stream_source("w", want, None, 1, 2) is want
    with pytest.raises(ValueError, match="local shard of 5 elements does not match its ShardSpec"):
        local_of(torch.zeros(5), spec)
    other = distribute_tensor(full, mesh, [Replicate(), Shard(0)], src_data_rank=None)
    assert torch.equal(local_of(other, None), full.chunk(2, 0)[1])


def _fsdp2_refit(worker) -> dict:
    """FSDP2 (`fully_shard`, torch's own, over gloo) parameters as sources, as `reshard.integrations.trl` registers
    them (`model_sources`: each rank its local shard, nothing gathered), refit into a replicated copy on both ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from reshard import Layout, Mesh, Replicate
    from reshard.integrations.trl import model_sources
    from reshard.refit import Refit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))  # 7 and 3 rows over 2: uneven
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    sources = model_sources(model.named_parameters(), worker.rank, 2)
    local = {n: tuple(v.to_local().shape) for n, v in sources.items()}
    refit = Refit(worker.group)
    for n, v in sources.items():
        refit.add_source(n, v)
    out = {n: torch.full_like(t, float("nan")) for n, t in full.items()}
    for n, t in out.items():
        refit.add_destination(n, t, Layout(tuple(t.shape), Mesh([0, 1]), [Replicate()], t.dtype, name=n))
    refit.run()
    return {"equal": [n for n in full if torch.equal(out[n], full[n])], "names": list(full), "local": local,
            "want": {n: tuple(torch.chunk(full[n], 2)[worker.rank].shape) if worker.rank < len(torch.chunk(full[n], 2))
                     else (0,) + tuple(full[n].shape[1:]) for n in full}}


@pytest.mark.distributed
def test_fsdp2_parameters_are_their_local_shards() -> None:
    from reshard.testing import shared_pool

    for r, got in enumerate(shared_pool(2).run_ok(_fsdp2_refit)):
        assert got["equal"] == got["names"], (r, got)  # oracle: the weights before fully_shard
        assert got["local"] == got["want"], (r, got)  # each rank registered torch.chunk's row block, not more


def test_megatron_and_zero3_are_kinds_of_the_trainer_side() -> None:
    # the trainer side imports no specific integration: Megatron and DeepSpeed register their kinds on import of
    # `reshard.integrations`, and the trainer side answers through them exactly as the integrations themselves do
    from reshard.integrations import deepspeed, megatron
    from reshard.integrations.trainer import model_kind, parameter_source

    chunk = torch.nn.Module()
    chunk.decoder, chunk.sharded_state_dict = torch.nn.Module(), lambda: {}
    wrapped = torch.nn.Module()
    wrapped.module = chunk  # Megatron's wrappers (DDP, Float16Module) hold the chunk as `.module`
    for source in (chunk, wrapped, [chunk]):
        assert megatron.is_megatron(source) and model_kind(source) == "megatron"
    assert model_kind(torch.nn.Linear(2, 2)) is None and model_kind({"w": torch.zeros(2)}) is None
    plain = torch.zeros(3)
    assert parameter_source("w", plain, 0) is plain  # no partition kind: the parameter itself
    full = torch.arange(12.0).reshape(4, 3)
    param = torch.nn.Parameter(torch.zeros(0))  # ZeRO-3's attributes, as DeepSpeed sets them: rank 1 of 2
    param.ds_tensor, param.ds_shape, param.ds_numel = full.flatten()[6:].clone(), (4, 3), 12
    param.ds_zero_partition_world_size, param.ds_zero_partition_rank = 2, 1
    window, layout = parameter_source("w", param, 1)
    assert torch.equal(window.reshape(-1)[:6], full.flatten()[6:])  # oracle: the full tensor's second half
    assert layout == deepspeed.partition_source("w", param, 1)[1]
    param.ds_numel = 11  # a partition that breaks ZeRO-3's rule: refused as DeepSpeed's own reader refuses it
    with pytest.raises(ValueError) as ours:
        parameter_source("w", param, 1)
    with pytest.raises(ValueError) as theirs:
        deepspeed.partition_source("w", param, 1)
    assert str(ours.value) == str(theirs.value) and "breaks ZeRO-3's rule" in str(ours.value)
