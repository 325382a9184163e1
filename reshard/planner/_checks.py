"""What `plan` and `plan_many` check before planning: argument types, the items, and the plan's size.

Every check raises before any box is cut, with a message naming the tensor, the value and what was expected:
`TypeError` for a wrong type, `ValueError` for a wrong value. The checks run in the same order on every rank
(the planner is deterministic), so every rank refuses the same input the same way.

Size bounds: `PlanLimits` caps the inputs (elements per dim, bytes per tensor, largest rank, pieces per rank) and
the plan (transfers, chunks). The plan's size is bounded *before* it is built, from a lower bound that needs only
each geometry's pieces: every element a destination rank needs and does not hold itself arrives in some transfer,
a transfer carries at most one chunk's staging (`staging_bytes // 2`), and a chunk's receive bytes on a rank stay
within it. So a rank receiving `B` such bytes needs at least `ceil(B / chunk)` chunks, and the plan at least the
sum of those per item and rank in transfers. A plan whose bound passes is still counted once built.

Staging: the planner cuts boxes down to single elements when a chunk cannot hold a whole row, so the indivisible
unit is one element, and a staging budget that cannot hold one element in each of its two chunks is refused.
A budget that can, but is far too small for the tensors (`staging_bytes=256` meant as MiB), is refused by the
chunk bound above, in milliseconds, instead of planning hundreds of thousands of chunks.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Any, Sequence

from torch.distributed.tensor.placement_types import _StridedShard

from reshard.planner._box import _as_int
from reshard.planner._index import BoxIndex, intersection_volume, union_volume
from reshard.planner._layout import BoundedCache, Layout, _geometry_id, clear_caches
from reshard.planner._topology import Topology

__all__ = ["BoundedCache", "PlanLimits", "clear_caches"]

_LAYOUT_ATTRS = ("shape", "dtype", "ranks", "pieces", "local_shape", "key")


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """Upper bounds on a plan's inputs and size; `plan` and `plan_many` refuse anything beyond them with a
    `ValueError` naming the limit and the value, before planning (`limits=PlanLimits(...)` overrides them per call).

    The defaults are far above real models (DeepSeek-V3 from 256 training to 256 inference GPUs plans 931k
    transfers in 2,775 chunks with the default 256 MiB staging) and far below what would run for minutes or
    exhaust memory.

    Attributes:
        max_dim_size: elements along any one dim of a global tensor.
        max_tensor_bytes: bytes of one global tensor (keeps every byte count well inside int64).
        max_rank: the largest global rank a layout may name (rank ids index dense per-rank arrays).
        max_pieces_per_rank: pieces a `_StridedShard` layout may cut one rank's local tensor into (the product of
            its split factors, an upper bound known without computing them).
        max_transfers: transfers in the plan.
        max_chunks: chunks in the plan.
    """

    max_dim_size: int = 1 << 48
    max_tensor_bytes: int = 1 << 56
    max_rank: int = 1 << 20
    max_pieces_per_rank: int = 1 << 16
    max_transfers: int = 1 << 25
    max_chunks: int = 1 << 18

    def __post_init__(self) -> None:
        for f in fields(self):
            v = _as_int(getattr(self, f.name), f"PlanLimits: {f.name}")
            if v < 1:
                raise ValueError(f"PlanLimits: {f.name} must be >= 1, got {v}")


DEFAULT_LIMITS = PlanLimits()


def check_call(topology: Any, relay: Any, limits: Any) -> PlanLimits:
    """The arguments of `plan_many` other than the items; returns the limits to apply."""
    if topology is not None and not isinstance(topology, Topology):
        hint = f" (for NVLink domains of {topology} ranks write Topology(domain_size={topology}))" \
            if isinstance(topology, int) and not isinstance(topology, bool) else ""
        raise TypeError(f"plan: topology must be a reshard.Topology or None, got {topology!r} "
                        f"({type(topology).__name__}){hint}")
    if not isinstance(relay, bool):
        raise TypeError(f"plan: relay must be a bool (True or False), got {relay!r} ({type(relay).__name__})")
    if limits is None:
        return DEFAULT_LIMITS
    if not isinstance(limits, PlanLimits):
        raise TypeError(f"plan: limits must be a reshard.PlanLimits or None, got {limits!r}")
    return limits


def check_item_fields(item: Any) -> None:
    """The fields of a `PlanItem`, when it is built: layouts that are layouts, tensor indices that are ints >= 0."""
    who = f"PlanItem {item.name!r}" if isinstance(item.name, str) else "PlanItem"
    if item.name is not None and not isinstance(item.name, str):
        raise TypeError(f"PlanItem: name must be a str or None, got {item.name!r}")
    for side in ("src", "dst"):
        layout = getattr(item, side)
        missing = [a for a in _LAYOUT_ATTRS if not hasattr(layout, a)]
        if missing:
            raise TypeError(
                f"{who}: {side} must be a layout (Layout, ExplicitLayout, or anything with shape, dtype, ranks, "
                f"pieces(rank), local_shape(rank) and key), got {layout!r} ({type(layout).__name__}, which lacks "
                f"{', '.join(missing)})"
            )
    for side in ("src_tensor", "dst_tensor"):
        index = _as_int(getattr(item, side), f"{who}: {side} (the index of the rank's local tensor)")
        if index < 0:
            raise ValueError(f"{who}: {side} must be >= 0 (the index of the rank's local tensor in the list "
                             f"passed to the executor), got {index}")
    if not isinstance(item.precision, str):
        raise TypeError(f"{who}: precision must be 'same' or 'cast', got {item.precision!r}")


def names_key(items: Sequence[Any]) -> tuple:
    """The layout names of the items, for the plan cache key: layouts of equal geometry but other names must not
    share a plan, whose items (and so its messages and `describe()`) carry the names."""
    return tuple((getattr(it.src, "name", None), getattr(it.dst, "name", None)) for it in items)


def check_items(items: Sequence[Any], staging_bytes: int, limits: PlanLimits) -> None:
    """The checks that need the layouts' geometry, in increasing cost: sizes and ranks (no pieces computed), then
    two items writing one destination, a source that does not hold what the destination needs, and the lower
    bound on the plan's chunks and transfers.

    Args:
        items: the `PlanItem`s, already checked one by one (shapes and dtypes agree).
        staging_bytes: the staging budget per rank; one chunk holds `staging_bytes // 2`.
        limits: the bounds to apply.
    """
    seen: set[int] = set()
    for it in items:
        for side, layout in (("source", it.src), ("destination", it.dst)):
            gid = _geometry_id(layout)
            if gid not in seen:
                seen.add(gid)
                _check_sizes(layout, side, it.label, limits)
    check_destinations_and_coverage(items)
    _check_size_bound(items, staging_bytes // 2, staging_bytes, limits)


def _check_sizes(layout: Any, side: str, label: str, limits: PlanLimits) -> None:
    who = f"tensor {label!r}"
    shape = tuple(layout.shape)
    for d, n in enumerate(shape):
        if n > limits.max_dim_size:
            raise ValueError(f"{who}: dim {d} of shape {shape} has {n} elements, over the limit "
                             f"PlanLimits.max_dim_size={limits.max_dim_size}")
    nbytes = math.prod(shape) * layout.dtype.itemsize
    if nbytes > limits.max_tensor_bytes:
        raise ValueError(f"{who}: shape {shape} of {layout.dtype} is {nbytes} bytes, over the limit "
                         f"PlanLimits.max_tensor_bytes={limits.max_tensor_bytes}")
    ranks = tuple(layout.ranks)
    top = max(ranks, default=0)
    if top > limits.max_rank:
        raise ValueError(f"{who}: the {side} layout names rank {top}, over the limit PlanLimits.max_rank="
                         f"{limits.max_rank} (ranks are global ranks of one job: 0 to world size - 1)")
    if isinstance(layout, Layout):
        pieces = math.prod(p.split_factor for p in layout.placements if isinstance(p, _StridedShard))
        if pieces > limits.max_pieces_per_rank:
            raise ValueError(f"{who}: the {side} layout's _StridedShard split factors cut a rank's tensor into up to "
                             f"{pieces} pieces, over the limit PlanLimits.max_pieces_per_rank="
                             f"{limits.max_pieces_per_rank}")


def _check_destinations(items: Sequence[Any]) -> None:
    """No element of a rank's destination tensor is written by two items (fused layouts write disjoint parts)."""
    by_tensor: dict[int, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        by_tensor[it.dst_tensor].append(i)
    for tensor, members in by_tensor.items():
        if len(members) < 2:
            continue
        ranks = sorted({r for i in members for r in items[i].dst.ranks})
        for r in ranks:
            boxes = [(p.local_box, i) for i in members for p in items[i].dst.pieces(r)]
            index = BoxIndex([b for b, _ in boxes])
            for k, (box, i) in enumerate(boxes):
                for j in index.query(box):
                    other, oi = boxes[j]
                    if j > k and oi != i and box.numel and _overlap(box, other):
                        raise ValueError(
                            f"tensor {items[i].label!r} (item {i}) and tensor {items[oi].label!r} (item {oi}) both "
                            f"write destination tensor {tensor} on rank {r}: local boxes {box} and {other} overlap "
                            "(expected each destination element written by one item; give each its own dst_tensor "
                            "or disjoint local boxes)"
                        )


def _overlap(a: Any, b: Any) -> bool:
    return all(x < y + t and y < x + s for x, s, y, t in zip(a.offsets, a.shape, b.offsets, b.shape))


def _check_coverage(items: Sequence[Any]) -> None:
    """The source holds every element the destination needs (always so for a DTensor `Layout` source, whose mesh
    is never empty); checked once per pair of geometries for other sources."""
    seen: set[tuple[int, int]] = set()
    for i, it in enumerate(items):
        if isinstance(it.src, Layout):
            continue
        key = (_geometry_id(it.src), _geometry_id(it.dst))
        if key in seen:
            continue
        seen.add(key)
        need = [p.global_box for r in it.dst.ranks for p in it.dst.pieces(r)]
        have = [p.global_box for r in it.src.ranks for p in it.src.pieces(r)]
        needed = union_volume(need)
        held = intersection_volume(need, have)
        if held < needed:
            raise ValueError(f"tensor {it.label!r} (item {i}): the source layout holds {held} of the {needed} elements "
                             f"the destination layout needs (expected every needed element on some source rank)")


def check_destinations_and_coverage(items: Sequence[Any]) -> None:
    """The checks of `check_items` that hold for any plan of the items, not its size: no destination element
    written by two items, and a source that holds what the destination needs."""
    _check_destinations(items)
    _check_coverage(items)


def _check_size_bound(items: Sequence[Any], chunk_cap: int, staging_bytes: int, limits: PlanLimits) -> None:
    """Refuse a plan whose lower bound on chunks or transfers (see the module docstring) is over the limits."""
    groups: dict[tuple[int, int], list[Any]] = {}  # per pair of geometries: [an item, how many]
    for it in items:
        key = (_geometry_id(it.src), _geometry_id(it.dst))
        group = groups.get(key)
        if group is None:
            groups[key] = [it, 1]
        else:
            group[1] += 1
    recv: dict[int, int] = defaultdict(int)
    transfers = 0
    for it, count in groups.values():
        for r, n in _bytes_to_receive(it).items():
            recv[r] += n * count
            transfers += -(-n // chunk_cap) * count
    if not recv:
        return
    rank = max(recv, key=lambda r: (recv[r], -r))
    chunks = -(-recv[rank] // chunk_cap)
    hint = (f"; staging_bytes is in bytes: {staging_bytes} MiB is {staging_bytes} << 20" if staging_bytes < 1 << 20
            else "")
    if chunks > limits.max_chunks:
        raise ValueError(
            f"plan: with staging_bytes={staging_bytes} (chunks of {chunk_cap} bytes) rank {rank} alone receives "
            f"{recv[rank]} bytes in at least {chunks} chunks, over the limit PlanLimits.max_chunks={limits.max_chunks}"
            f" (expected a larger staging_bytes, or limits=PlanLimits(max_chunks=...)){hint}"
        )
    if transfers > limits.max_transfers:
        raise ValueError(
            f"plan: with staging_bytes={staging_bytes} (chunks of {chunk_cap} bytes) the plan needs at least "
            f"{transfers} transfers, over the limit PlanLimits.max_transfers={limits.max_transfers} (expected a "
            f"larger staging_bytes, or limits=PlanLimits(max_transfers=...)){hint}"
        )


def _bytes_to_receive(item: Any) -> dict[int, int]:
    """Per destination rank: bytes it needs and does not hold in its own source tensor (a lower bound when its own
    source pieces overlap each other)."""
    src, dst = item.src, item.dst
    itemsize = dst.dtype.itemsize
    src_ranks = set(src.ranks)
    tiled = isinstance(dst, Layout)  # a DTensor layout's pieces tile its local tensor: count them by its shape
    out: dict[int, int] = {}
    for r in dst.ranks:
        total = math.prod(dst.local_shape(r)) if tiled else sum(p.global_box.numel for p in dst.pieces(r))
        if not total:
            continue
        own = [p.global_box for p in src.pieces(r)] if r in src_ranks else []
        if own:
            index = BoxIndex(own)
            for p in dst.pieces(r):
                g = p.global_box
                for j in index.query(g):
                    o = own[j]
                    total -= math.prod(max(0, min(a + s, b + t) - max(a, b))
                                       for a, s, b, t in zip(g.offsets, g.shape, o.offsets, o.shape))
        if total > 0:
            out[r] = total * itemsize
    return out


def check_plan(plan: Any, limits: PlanLimits) -> None:
    """The built plan's counts against the limits (the lower bound checked before planning may be below them)."""
    s = plan.stats
    if s.num_chunks > limits.max_chunks:
        raise ValueError(f"plan: {s.num_chunks} chunks, over the limit PlanLimits.max_chunks={limits.max_chunks} "
                         f"(expected a larger staging_bytes={plan.staging_bytes}, or "
                         "limits=PlanLimits(max_chunks=...))")
    if s.num_transfers > limits.max_transfers:
        raise ValueError(f"plan: {s.num_transfers} transfers, over the limit PlanLimits.max_transfers="
                         f"{limits.max_transfers} (expected a larger staging_bytes={plan.staging_bytes}, or "
                         "limits=PlanLimits(max_transfers=...))")


def bounded_cache(name: str, maxsize: int) -> BoundedCache:
    """A new LRU cache of at most `maxsize` entries, emptied by `clear_plan_cache()`."""
    return BoundedCache(name, maxsize)
