"""Bounded planning: inputs beyond `PlanLimits` are refused fast, before planning, and every planner cache is bounded
and emptied by `clear_plan_cache()`.

Each refusal is timed: before these bounds the same inputs ran forever (a 2**62-element tensor), 21 s and 716 MiB
(`staging_bytes=256` for a 64 MiB weight) or tried to allocate 1 TiB (rank 2**40). The 1 s budget is generous: the
checks take about a millisecond.
"""

from __future__ import annotations

import gc
import time
import tracemalloc

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard import Layout, Mesh, PlanLimits, clear_plan_cache, plan

DEFAULTS = PlanLimits()


def _refused_fast(match: str, call) -> None:
    start = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        call()
    elapsed = time.perf_counter() - start
    # a refusal takes milliseconds, building what it refuses minutes; 5 s leaves room for a loaded 2-core machine
    assert elapsed < 5.0, f"refused after {elapsed:.2f} s"


def _copy(shape: tuple[int, ...], src_ranks: list[int], dst_ranks: list[int], dtype=torch.float32, name=None):
    """Layouts that move a whole tensor from replicas on `src_ranks` to replicas on `dst_ranks`."""
    return (Layout(shape, Mesh(src_ranks), [Replicate()], dtype, name=name),
            Layout(shape, Mesh(dst_ranks), [Replicate()], dtype, name=name))


def test_defaults_are_the_documented_values() -> None:
    assert (DEFAULTS.max_dim_size, DEFAULTS.max_rank, DEFAULTS.max_chunks, DEFAULTS.max_transfers) == (
        2**48, 2**20, 2**18, 2**25)


def test_a_2_62_element_tensor_is_refused_fast() -> None:
    src, dst = _copy((2**62,), [0], [1], name="huge")
    _refused_fast(r"tensor 'huge': dim 0 of shape \(4611686018427387904,\) has 4611686018427387904 elements, over "
                  r"the limit PlanLimits.max_dim_size=281474976710656", lambda: plan(src, dst))
    # every dim within bounds, the product not: 2**64 bytes
    src, dst = _copy((2**31, 2**31), [0], [1], name="wide")
    _refused_fast(r"tensor 'wide': shape \(2147483648, 2147483648\) of torch.float32 is 18446744073709551616 bytes, "
                  r"over the limit PlanLimits.max_tensor_bytes=72057594037927936", lambda: plan(src, dst))


def test_staging_meant_as_mib_is_refused_before_planning() -> None:
    """64 MiB from rank 0 to rank 1 in chunks of 128 bytes: 524,288 chunks, over the default 262,144."""
    src, dst = _copy((4096, 4096), [0], [1], name="w")
    _refused_fast(r"staging_bytes=256 \(chunks of 128 bytes\) rank 1 alone receives 67108864 bytes in at least "
                  r"524288 chunks, over the limit PlanLimits.max_chunks=262144.*256 MiB is 256 << 20",
                  lambda: plan(src, dst, staging_bytes=256))
    # the same in MiB plans (one chunk)
    assert plan(src, dst, staging_bytes=256 << 20).stats.num_chunks == 1


def test_the_chunk_and_transfer_bounds_are_exact_lower_bounds() -> None:
    """(64, 64) float32 from rank 0 to rank 1 with 128-byte chunks: each 256-byte row is cut in two, so by hand
    128 transfers in 128 chunks. A limit of 128 plans, 127 is refused before planning."""
    src, dst = _copy((64, 64), [0], [1], name="w")
    p = plan(src, dst, staging_bytes=256, limits=PlanLimits(max_chunks=128, max_transfers=128))
    assert (p.stats.num_chunks, p.stats.num_transfers) == (128, 128)
    with pytest.raises(ValueError, match=r"at least 128 chunks, over the limit PlanLimits.max_chunks=127"):
        plan(src, dst, staging_bytes=256, limits=PlanLimits(max_chunks=127))
    with pytest.raises(ValueError, match=r"at least 128 transfers, over the limit PlanLimits.max_transfers=127"):
        plan(src, dst, staging_bytes=256, limits=PlanLimits(max_transfers=127))


def test_the_built_plan_is_counted_too() -> None:
    """(64, 3) float32 with 8-byte chunks: the bound says 768 / 8 = 96 transfers, but a 3-element row is cut into
    2 + 1 elements, so the plan has 128. A limit of 100 passes the bound and is caught on the built plan."""
    src, dst = _copy((64, 3), [0], [1], name="w")
    assert plan(src, dst, staging_bytes=16).stats.num_transfers == 128
    with pytest.raises(ValueError, match=r"plan: 128 transfers, over the limit PlanLimits.max_transfers=100"):
        plan(src, dst, staging_bytes=16, limits=PlanLimits(max_transfers=100))


def test_a_cached_plan_is_not_returned_past_stricter_limits() -> None:
    src, dst = _copy((64, 64), [0], [1], name="w")
    plan(src, dst, staging_bytes=256)
    with pytest.raises(ValueError, match=r"max_chunks=10\b"):
        plan(src, dst, staging_bytes=256, limits=PlanLimits(max_chunks=10))


def test_a_rank_of_2_40_is_refused_fast() -> None:
    src = Layout((8,), Mesh([0, 2**40]), [Shard(0)], name="w")
    dst = Layout((8,), Mesh([1]), [Replicate()], name="w")
    _refused_fast(r"tensor 'w': the source layout names rank 1099511627776, over the limit "
                  r"PlanLimits.max_rank=1048576", lambda: plan(src, dst))
    _refused_fast(r"destination layout names rank 1048577", lambda: plan(dst, Layout((8,), Mesh([2**20 + 1]),
                                                                                       [Replicate()], name="w")))
    # the limit itself is a valid rank
    p = plan(dst, Layout((8,), Mesh([2**20]), [Replicate()]))
    assert p.stats.network_bytes == 32


def test_strided_split_factors_are_bounded() -> None:
    src = Layout((2**20,), Mesh([0, 1]), [_StridedShard(0, split_factor=2**17)], name="s")
    dst = Layout((2**20,), Mesh([2]), [Replicate()], name="s")
    _refused_fast(r"tensor 's': the source layout's _StridedShard split factors cut a rank's tensor into up to "
                  r"131072 pieces, over the limit PlanLimits.max_pieces_per_rank=65536", lambda: plan(src, dst))


def test_plan_limits_are_checked() -> None:
    with pytest.raises(ValueError, match=r"PlanLimits: max_chunks must be >= 1, got 0"):
        PlanLimits(max_chunks=0)
    with pytest.raises(TypeError, match=r"PlanLimits: max_rank must be an integer, got the bool True"):
        PlanLimits(max_rank=True)
    src, dst = _copy((4,), [0], [1])
    with pytest.raises(TypeError, match=r"limits must be a reshard.PlanLimits or None, got 5"):
        plan(src, dst, limits=5)


def _cache_sizes() -> dict[str, int]:
    from reshard.planner import _layout, _plan

    sizes = {c.name: len(c) for c in _layout._CACHES}
    sizes["plans"] = len(_plan._PLAN_CACHE)
    return sizes


def test_every_planner_cache_is_bounded_and_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cache holds its documented bound; filled past a bound it stops there, not past it, and
    `clear_plan_cache()` empties them all. The bounds are lowered for the fill (each cache evicts by its own
    `maxsize`, the plan cache by `_PLAN_CACHE_SIZE`, read on every insert), so a few hundred plans overflow them."""
    from reshard.planner import _blocks, _layout, _plan, _plan_type, _wire

    clear_plan_cache()
    assert set(_cache_sizes()) == {"layout geometries", "layout digests", "derived block layouts", "decoded meshes",
                                   "plans"}
    caches = {c.name: c for c in _layout._CACHES}
    assert caches["layout geometries"].maxsize == _layout.GEOMETRY_CACHE_SIZE
    assert caches["layout digests"] is _plan_type._KEY_DIGESTS and caches["derived block layouts"] is _blocks._DERIVED
    assert caches["decoded meshes"] is _wire._MESHES and _wire._MESHES.maxsize == _wire.MESH_CACHE_SIZE
    # lowered, and all different, so a cache evicting by another's bound fails
    bounds = {"layout geometries": 96, "layout digests": 64, "derived block layouts": 24, "decoded meshes": 40,
              "plans": 16}
    for name, cache in caches.items():
        monkeypatch.setattr(cache, "maxsize", bounds[name])
    monkeypatch.setattr(_plan, "_PLAN_CACHE_SIZE", bounds["plans"])
    for n in range(1, 201):
        src, dst = Layout((n, 3), Mesh([0, 1]), [Shard(0)]), Layout((n, 3), Mesh([2]), [Replicate()])
        plan(src, dst)
    for n in range(1, bounds["derived block layouts"] + 100):
        _blocks.scale_layout(Layout((n, 256), Mesh([0, 1]), [Shard(0)]), (128, 128))
    for n in range(bounds["decoded meshes"] + 60):  # a mesh of other ranks each time
        _wire.decode_layout(_wire.encode_layout(Layout((4, 3), Mesh([n, n + 1]), [Shard(0)])))
    assert _cache_sizes() == bounds
    clear_plan_cache()
    assert _cache_sizes() == dict.fromkeys(bounds, 0)


def test_clear_plan_cache_frees_the_geometry_memory() -> None:
    """Pieces of 2,500 geometries (the cache keeps 2,048, over 1 MiB) are freed by `clear_plan_cache()`: the
    cache is the only holder once the layouts are gone."""
    clear_plan_cache()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for n in range(1, 2501):
            Layout((n, 7), Mesh([0, 1, 2]), [Shard(1)]).pieces(1)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        clear_plan_cache()
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held > 1 << 20  # the measurement sees the cache (a negative control for the assertion below)
    assert left < 256 << 10, f"{left} bytes left after clear_plan_cache()"


def test_geometry_ids_are_never_reused() -> None:
    """A geometry evicted or cleared and seen again gets a new id: equal ids must mean equal geometry, or plans of
    different layouts would share recipes and digests."""
    a = Layout((5, 3), Mesh([0, 1]), [Shard(0)])
    clear_plan_cache()
    b = Layout((6, 3), Mesh([0, 1]), [Shard(0)])
    assert a.geometry_id != b.geometry_id
    c = Layout((5, 3), Mesh([0, 1]), [Shard(0)])
    assert c.geometry_id not in (a.geometry_id, b.geometry_id)
    assert plan(a, Layout((5, 3), Mesh([2]), [Replicate()])).fingerprint == \
        plan(c, Layout((5, 3), Mesh([2]), [Replicate()])).fingerprint
