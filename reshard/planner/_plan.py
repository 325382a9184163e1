"""Planning: turn source layouts into destination layouts with a minimal, balanced list of transfers.

`plan(src, dst)` plans one tensor; `plan_many(items)` plans many tensors into one `Plan` whose chunks coalesce
every box bound for the same peer. Planning is pure Python on plain values: no device, no process group.

The entry points are here, with the plan cache; the rest of the planner's plan side is one concept a module:
- `_item`: `PlanItem`, one tensor to move, and its checks;
- `_build`: the builder, the per-geometry recipes and their emission, the network lower bound;
- `_chunks`: the transfer units' store, chunk assignment and transfer columns;
- `_data`: `PlanData`, the plan's stored form, and `UnitSpan`;
- `_plan_type`: `Plan`, its statistics, fingerprint, per-rank programs and description;
- `_messages`: a rank's side of a chunk cut into messages and the box lists of its pack and unpack calls;
- `_validate`: the checks a `Plan` makes of its `PlanData` when built.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict, defaultdict
from typing import Any, Iterable

from reshard.planner import _checks
from reshard.planner._build import _Builder, _emit_recipe, _network_lower_bound, _recipe
from reshard.planner._chunks import RELAY_CHUNK_LAG, Member, _assign_chunks
from reshard.planner._data import PlanData, UnitSpan
from reshard.planner._format import format_bytes, format_stats
from reshard.planner._item import PlanItem, _check_item
from reshard.planner._layout import _geometry_id
from reshard.planner._plan_type import PLAN_VERSION, Plan
from reshard.planner._topology import Topology
from reshard.planner._types import PIPELINE_DEPTH

# PLAN_VERSION, RELAY_CHUNK_LAG, Plan, PlanData, PlanItem, format_bytes and format_stats live in the modules above;
# they stay importable from here, where they were before the split
__all__ = ["DEFAULT_MIN_SPLIT_BYTES", "DEFAULT_STAGING_BYTES", "PLAN_VERSION", "RELAY_CHUNK_LAG", "Plan", "PlanData",
           "PlanItem", "clear_plan_cache", "format_bytes", "format_stats", "plan", "plan_many"]

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 << 20
"""Staging memory per rank. The executor keeps `PIPELINE_DEPTH` chunks in flight, so one chunk's send plus receive
bytes on a rank are at most `staging_bytes // PIPELINE_DEPTH`."""

DEFAULT_MIN_SPLIT_BYTES = 1 << 20
"""A box is split across several senders (or relay receivers) only into parts of at least this many bytes."""

UNIT_SHARE = 16
"""Items of equal geometry move together in units of at most 1/UNIT_SHARE of a destination rank's mean bytes, so
that choosing one sender and relay for a whole unit still spreads the load, and at most half a chunk, so that a
rank can still send one unit and receive another in the same chunk."""

_PLAN_CACHE: OrderedDict[tuple, Plan] = OrderedDict()
_PLAN_CACHE_SIZE = 128


def clear_plan_cache() -> None:
    """Forget every cached plan, and empty every other planner cache (layout geometries, digests)."""
    _PLAN_CACHE.clear()
    _checks.clear_caches()


def _as_items(items: Iterable[Any]) -> tuple[PlanItem, ...]:
    out = []
    for i, it in enumerate(items):
        if isinstance(it, PlanItem):
            out.append(it)
        else:
            try:
                src, dst = it
            except (TypeError, ValueError):
                raise ValueError(f"plan_many: item {i} must be a PlanItem or a (src, dst) pair, got {it!r}") from None
            out.append(PlanItem(src, dst, src_tensor=i, dst_tensor=i))
    return tuple(out)


def plan_many(
    items: Iterable[Any],
    topology: Topology | None = None,
    *,
    relay: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    limits: _checks.PlanLimits | None = None,
) -> Plan:
    """Plan many tensors at once, so boxes bound for the same peer share messages.

    Args:
        items: `PlanItem`s, or `(src_layout, dst_layout)` pairs (item `i` then lives in local tensor `i` on both
            sides).
        topology: NVLink domains; default: every rank its own domain.
        relay: when several ranks of one domain need a box held outside it, send it across the network once and
            forward it over NVLink (stage 1). Without relay every destination receives directly.
        staging_bytes: staging memory per rank; one chunk's send + receive bytes per rank stay within
            `staging_bytes // PIPELINE_DEPTH`.
        min_split_bytes: smallest part a box is split into to spread it over several senders or relay receivers.
        limits: bounds on the inputs and the plan's size (`PlanLimits`; default `PlanLimits()`); inputs beyond
            them are refused with a `ValueError` before planning.

    Returns:
        A `Plan`, cached on its inputs (see `clear_plan_cache`).

    Algorithm, per item:
        1. Group the source pieces by global box: each unique box and its holders (replicas).
        2. For each destination rank and piece: the part the rank holds in its own source tensor is a local copy.
           The rest is cut along the unique source boxes (found through a `BoxIndex`). A part held by a rank in
           the destination's domain comes over NVLink, from the least-loaded such holder; otherwise it is a
           network need of the domain.
        3. Per domain, identical network needs of several ranks are merged. Each is split into parts (at most one
           per needer) that cross the network once, each to the needer with the least network receive load so
           far, from the holder with the least network send load; the receiver forwards it over NVLink to the
           other needers (stage 1). So network bytes equal the lower bound.
        4. Boxes are cut to fit a chunk; chunks are assigned by first fit (see `reshard.planner._chunks`).

    Steps 1-3 run once per geometry (a pair of layouts up to names and local tensors); items of one geometry then
    move in units of several items that share the choices of steps 2-3 (see `UNIT_SHARE` for their size).

    Example (worked by hand): a `(4, 4)` tensor on ranks `[0, 1]` as `S(0)` to ranks `[2, 3]` as `R`, with
    `Topology(domain_size=2)`: domain 1 (ranks 2, 3) needs rows 0:2 (from rank 0) and 2:4 (from rank 1). Rows
    0:2 go to rank 2 over the network and rank 2 forwards them to rank 3; rows 2:4 go to rank 3 (the less loaded
    receiver) and are forwarded to rank 2. Network bytes = 64 = the lower bound; NVLink bytes = 64.
    """
    items = _as_items(items)
    limits = _checks.check_call(topology, relay, limits)
    topology = topology if topology is not None else Topology()
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < PIPELINE_DEPTH:
        raise ValueError(f"plan: staging_bytes must be an integer >= {PIPELINE_DEPTH}, got {staging_bytes!r}")
    if isinstance(min_split_bytes, bool) or not isinstance(min_split_bytes, int) or min_split_bytes < 1:
        raise ValueError(f"plan: min_split_bytes must be a positive integer, got {min_split_bytes!r}")
    key = (tuple(it.key for it in items), topology.key, relay, staging_bytes, min_split_bytes)
    key = (key, _checks.names_key(items), limits)
    cached = _PLAN_CACHE.get(key)
    if cached is not None:
        _PLAN_CACHE.move_to_end(key)
        return cached
    for i, it in enumerate(items):
        _check_item(it, i)
    chunk_cap = staging_bytes // PIPELINE_DEPTH
    for it in items:
        if it.dst.dtype.itemsize > chunk_cap:
            raise ValueError(
                f"tensor {it.label!r}: staging_bytes={staging_bytes} cannot hold one element of {it.dst.dtype} "
                f"{PIPELINE_DEPTH} times ({PIPELINE_DEPTH} chunks in flight)"
            )
    _checks.check_items(items, staging_bytes, limits)
    # planning allocates many small tuples and no cycles: the cyclic collector would only rescan them
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        b = _Builder(topology, relay, chunk_cap, min_split_bytes)
        lower_by_domain = _network_lower_bound(items, topology)
        dst_per_domain: dict[Any, set[int]] = defaultdict(set)
        for dst in {_geometry_id(it.dst): it.dst for it in items}.values():  # rank sets repeat with geometries
            for r in dst.ranks:
                dst_per_domain[b.domain(r)].add(r)
        b.fair_recv = {d: lower_by_domain[d] / len(rs) for d, rs in dst_per_domain.items() if lower_by_domain.get(d)}
        needed_by_geometry: dict[int, int] = {}
        for it in items:
            g = _geometry_id(it.dst)
            if g not in needed_by_geometry:
                needed_by_geometry[g] = sum(p.global_box.numel for r in it.dst.ranks for p in it.dst.pieces(r)) \
                    * it.dst.dtype.itemsize
        needed = sum(needed_by_geometry[_geometry_id(it.dst)] for it in items)
        # items of equal geometry (every layer of a model) share one recipe, and move in units of several items
        # that take the same choices: fewer, larger transfers (see UNIT_SHARE for how large)
        unit_cap = min(chunk_cap // 2, max(1, needed // (max(1, sum(map(len, dst_per_domain.values()))) * UNIT_SHARE)))
        groups: dict[tuple[int, int], list[int]] = {}
        for i, it in enumerate(items):
            groups.setdefault((_geometry_id(it.src), _geometry_id(it.dst)), []).append(i)
        templates: list[UnitSpan] = []  # each geometry's first unit
        for members in groups.values():
            rc = _recipe(b, items[members[0]])
            if rc.check_arrivals:
                size = 1
            else:
                size = max(1, unit_cap // rc.max_part_bytes) if rc.max_part_bytes else len(members)
            for a in range(0, len(members), size):
                unit = tuple(Member(i, items[i].src_tensor, items[i].dst_tensor) for i in members[a:a + size])
                start, first_part = len(b.raw), b.transfers.num_parts
                _emit_recipe(b, rc, unit)
                if a == 0:
                    templates.append(UnitSpan(start, len(b.raw), first_part, b.transfers.num_parts))
        chunks = _assign_chunks(b.transfers.columns(), chunk_cap)
        result = Plan(PlanData(items, topology, relay, staging_bytes, min_split_bytes, b.transfers, chunks,
                               sum(lower_by_domain.values()), needed, tuple(templates)))
        _checks.check_plan(result, limits)
        b.transfers.compact()  # no object per row from here on (see `_Rows`)
    finally:
        if gc_was_enabled:
            gc.enable()
    _PLAN_CACHE[key] = result
    if len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
        _PLAN_CACHE.popitem(last=False)
    logger.debug("planned %d items: %s", len(items), result)
    return result


def plan(
    src: Any,
    dst: Any,
    topology: Topology | None = None,
    *,
    relay: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    precision: str = "same",
    limits: _checks.PlanLimits | None = None,
) -> Plan:
    """Plan moving one tensor from layout `src` to layout `dst`. See `plan_many` for the arguments and algorithm.

    The source and destination rank sets may be disjoint (trainer -> inference), overlap, or be equal. With
    `precision="cast"` the dtypes may differ (e.g. float32 master weights -> bfloat16): values are cast while
    packing, and the wire carries the destination dtype.
    """
    return plan_many(
        [PlanItem(src, dst, precision=precision)], topology, relay=relay, staging_bytes=staging_bytes,
        min_split_bytes=min_split_bytes, limits=limits,
    )
