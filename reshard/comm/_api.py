"""`reshard` (local tensors + a plan) and `reshard_dtensor` (DTensors on their own meshes)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from reshard.comm._executor import execute
from reshard.comm._group import CommError, Group, Timeout, as_timedelta
from reshard.comm._handshake import all_gather_digest, all_gather_json
from reshard.planner import (
    DEFAULT_MIN_SPLIT_BYTES,
    DEFAULT_STAGING_BYTES,
    Layout,
    Mesh,
    Plan,
    Topology,
    dtype_from_name,
    dtype_name,
    plan,
)
from reshard.planner._contract import decode_placements, encode_placements, flat_index, placement_str


def reshard(
    src_local: torch.Tensor | None,
    dst_local: torch.Tensor | None,
    plan: Plan,
    group: Group | None = None,
    *,
    verify: bool = False,
    timeout: Timeout | None = None,
) -> torch.Tensor | None:
    """Execute this rank's part of a one-tensor `plan`: write `dst_local` in place from the sources' `src_local`.

    Every rank of the group that takes part in the plan (`plan.ranks`) calls it with the same plan.

    Args:
        src_local: this rank's local tensor of the plan's source layout, or None on a rank that is not a source.
        dst_local: this rank's local tensor of the destination layout (written in place), or None on a rank that
            is not a destination.
        plan: a plan of one tensor (`reshard.plan(src_layout, dst_layout)`), in the group's rank numbering.
        group: default `Group.world()`.
        verify: check every received box against its sender's checksum (see `execute`).
        timeout: seconds or a `timedelta` that any one wait for a peer may last.

    Returns:
        `dst_local`.

    Raises:
        ValueError: on every rank, before any byte moves, for differing plans or wrong local shapes or dtypes.
        CommError: a peer died or did not answer within `timeout`.

    Example (ranks 0-3 hold `S(0)`, ranks 4-7 want `[R, S(1)]` on a 2x2 mesh):
        >>> p = plan(Layout((64, 64), Mesh([0, 1, 2, 3]), [Shard(0)]),
        ...          Layout((64, 64), Mesh([[4, 5], [6, 7]]), [Replicate(), Shard(1)]))
        >>> reshard(shard if rank < 4 else None, out if rank >= 4 else None, p)
    """
    if any(it.src_tensor != 0 or it.dst_tensor != 0 for it in plan.items):
        raise ValueError("reshard: the plan moves several local tensors (items with src_tensor/dst_tensor != 0); "
                         "use reshard.comm.execute with lists of tensors")
    execute(plan, None if group is None else group.rank, None if src_local is None else [src_local],
            None if dst_local is None else [dst_local], group, verify=verify, timeout=timeout)
    return dst_local


# -------------------------------------------------------------------------------------------------------------
# DTensors
# -------------------------------------------------------------------------------------------------------------


def _side_meta(dt: Any, which: str) -> dict[str, Any] | None:
    """What one rank knows of one side's layout: the DTensor's global layout and this rank's place in its mesh.

    Only JSON values (tuples are lists on the wire; `_meta_from_wire` restores them): placements in DTensor
    notation (`S(0)`, `R`, `_S(0, 2)`, `P`).
    """
    if dt is None:
        return None
    from torch.distributed.tensor import DTensor

    if not isinstance(dt, DTensor):
        raise ValueError(f"reshard_dtensor: {which} must be a DTensor or None, got {type(dt).__name__}")
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    return {  # JSON values only (see reshard.planner._wire)
        "shape": [int(s) for s in dt.shape],
        "dtype": dtype_name(dt.dtype),
        "mesh_shape": [int(s) for s in mesh.mesh.shape],
        "mesh_ranks": [int(r) for r in mesh.mesh.flatten().tolist()],
        "axis_names": None if mesh.mesh_dim_names is None else list(mesh.mesh_dim_names),
        "placements": encode_placements(dt.placements),
        "coord": None if coord is None else [int(c) for c in coord],
    }


_SIDE_FIELDS = frozenset({"shape", "dtype", "mesh_shape", "mesh_ranks", "axis_names", "placements", "coord"})


def _read_side_meta(which: str, rank: int, m: Any) -> dict[str, Any] | None:
    """`_check_side_meta`, with a malformed message reported as a `CommError` naming its sender."""
    try:
        return _check_side_meta(which, rank, m)
    except ValueError as e:
        raise CommError(str(e)) from None


def _check_side_meta(which: str, rank: int, m: Any) -> dict[str, Any] | None:
    """One rank's `_side_meta` as received, checked field by field (`ValueError` naming the rank otherwise), with
    sequences as tuples and placements decoded."""
    if m is None:
        return None
    what = f"reshard_dtensor: {which} metadata from rank {rank}"
    if not isinstance(m, dict) or set(m) != _SIDE_FIELDS:
        raise ValueError(f"{what}: expected a dict of {sorted(_SIDE_FIELDS)}, got {m!r}")
    out: dict[str, Any] = {}
    for key in ("shape", "mesh_shape", "mesh_ranks"):
        v = m[key]
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ValueError(f"{what}: {key} must be a list of integers, got {v!r}")
        out[key] = tuple(v)
    coord = m["coord"]
    if coord is not None and (not isinstance(coord, (list, tuple)) or len(coord) != len(out["mesh_shape"]) or not
                              all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < s
                                  for c, s in zip(coord, out["mesh_shape"]))):
        raise ValueError(f"{what}: coord must be None or a position in mesh {list(out['mesh_shape'])}, got {coord!r}")
    out["coord"] = None if coord is None else tuple(coord)
    names = m["axis_names"]
    if names is not None and (not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names)):
        raise ValueError(f"{what}: axis_names must be None or a list of strings, got {names!r}")
    out["axis_names"] = None if names is None else tuple(names)
    dtype_from_name(m["dtype"], what=f"{what}: dtype")
    out["dtype"] = m["dtype"]
    out["placements"] = tuple(decode_placements(m["placements"], what=f"{what}: placements"))
    return out


def _meta_text(m: dict[str, Any]) -> str:
    pl = ", ".join(placement_str(p) for p in m["placements"])
    return (f"{list(m['shape'])} {m['dtype']} mesh {'x'.join(map(str, m['mesh_shape']))} (own ranks "
            f"{list(m['mesh_ranks'])}) [{pl}]")


def _layout_from_metas(which: str, metas: list[dict[str, Any] | None], name: str | None) -> Layout:
    """Build one side's `Layout` in group ranks from every rank's metadata (every rank computes the same)."""
    # Only ranks inside the mesh speak for the layout: DTensor itself reports other global shapes on ranks
    # outside its mesh (`from_local` there gives shape `[0]`), and those ranks hold nothing anyway.
    holders = [(r, m) for r, m in enumerate(metas) if m is not None and m["coord"] is not None]
    if not holders:
        raise ValueError(f"reshard_dtensor: no rank of the group passed a {which} DTensor from inside its mesh; "
                         f"the {which} side must be given on the ranks of its mesh")
    keys = {}
    for r, m in holders:
        keys.setdefault((m["shape"], m["dtype"], m["mesh_shape"], m["mesh_ranks"], m["placements"]), []).append(r)
    if len(keys) > 1:
        head = (f"reshard_dtensor: the {which} DTensors differ between ranks (every rank must pass the same global "
                "layout):")
        lines = [head]
        for ranks in keys.values():
            m = next(m for r, m in holders if r == ranks[0])
            lines.append(f"  ranks {ranks}: {_meta_text(m)}")
        raise ValueError("\n".join(lines))
    first = holders[0][1]
    mesh_shape = first["mesh_shape"]
    size = 1
    for s in mesh_shape:
        size *= s
    group_ranks: list[int | None] = [None] * size
    for r, m in holders:
        flat = flat_index(m["coord"], mesh_shape)
        if group_ranks[flat] is not None:
            raise ValueError(f"reshard_dtensor: {which} mesh coordinate {m['coord']} is claimed by group ranks "
                             f"{group_ranks[flat]} and {r}; each mesh position must be one process")
        group_ranks[flat] = r
    missing = [i for i, g in enumerate(group_ranks) if g is None]
    if missing:
        own = [first["mesh_ranks"][i] for i in missing]
        raise ValueError(f"reshard_dtensor: {which} mesh ranks {own} (own numbering; {_meta_text(first)}) are not "
                         f"in the group or did not pass their {which} DTensor; every rank of a mesh must call with "
                         "its DTensor")
    ranks_tensor = torch.tensor(group_ranks, dtype=torch.int64).reshape(mesh_shape)
    dtype = dtype_from_name(first["dtype"])
    return Layout(first["shape"], Mesh(ranks_tensor, axis_names=first["axis_names"]), list(first["placements"]),
                  dtype, name=name)


def exchange_layouts(src: Any, dst: Any, group: Group, *, timeout: Timeout | None = None,
                     name: str | None = None) -> tuple[Layout, Layout]:
    """The source and destination layouts of a `reshard_dtensor` call, in group ranks, agreed by every rank.

    Each rank contributes what it knows (its DTensors' layouts and its coordinates in their meshes); each mesh
    position is mapped to the group rank of the process holding it, so meshes may use each side's own world
    ranks. The result is cached on the group: a call first all-gathers a 16-byte digest of every rank's
    metadata in one fixed-size collective (so all ranks agree whether the cache applies), and the full metadata
    only when it does not.
    Collective: every rank of the group calls it.
    """
    td = as_timedelta(timeout, default=group.timeout)
    local = (_side_meta(src, "src"), _side_meta(dst, "dst"))
    digest = hashlib.sha256(json.dumps([local[0], local[1], name]).encode()).hexdigest()[:32]
    digests = tuple(all_gather_digest(group, digest, timeout=td, what="reshard_dtensor layout digest"))
    cache = group.cache.setdefault("layouts", {})
    hit = cache.get(digests)
    if hit is not None:
        return hit
    metas = all_gather_json(group, list(local), timeout=td, what="reshard_dtensor layout exchange")
    for r, m in enumerate(metas):
        if not isinstance(m, list) or len(m) != 2:
            raise CommError(f"reshard_dtensor: rank {r} sent layout metadata that is not a [source, destination] "
                            "pair")
    src_layout = _layout_from_metas("source", [_read_side_meta("source", r, m[0]) for r, m in enumerate(metas)],
                                    name)
    dst_layout = _layout_from_metas("destination", [_read_side_meta("destination", r, m[1])
                                                    for r, m in enumerate(metas)], name)
    if len(cache) > 64:
        cache.clear()
    cache[digests] = (src_layout, dst_layout)
    return src_layout, dst_layout


def _meta_key(m: dict[str, Any]) -> tuple:
    return (tuple(m["shape"]), m["dtype"], tuple(m["mesh_shape"]), tuple(m["mesh_ranks"]),
            None if m["axis_names"] is None else tuple(m["axis_names"]), tuple(m["placements"]),
            None if m["coord"] is None else tuple(m["coord"]))


def reshard_dtensor(
    src: Any,
    dst: Any,
    *,
    topology: Topology | None = None,
    group: Group | None = None,
    verify: bool = False,
    timeout: Timeout | None = None,
    relay: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    min_split_bytes: int = DEFAULT_MIN_SPLIT_BYTES,
    name: str | None = None,
) -> Any:
    """Copy DTensor `src` into DTensor `dst` (another mesh and placements), in place. Called by every group rank.

    Args:
        src: the source DTensor, or None on a rank that holds no part of it (an inference rank).
        dst: the destination DTensor, written in place, or None on a rank that holds no part of it (a trainer
            rank). DTensors on ranks outside their mesh (empty locals) may be passed too.
        topology: NVLink domains in group ranks, for relays (see `plan`).
        group: default `Group.world()`. DTensor meshes are in each process's own default-world ranks; they are
            mapped to group ranks by mesh coordinate (see `exchange_layouts`).
        verify, timeout: as in `reshard`.
        relay, staging_bytes, min_split_bytes: planning options (see `plan`).
        name: the tensor's name for messages.

    Returns:
        `dst` (None where `dst` was None).
    """
    group = group if group is not None else Group.world()
    src_layout, dst_layout = exchange_layouts(src, dst, group, timeout=timeout, name=name)
    p = plan(src_layout, dst_layout, topology, relay=relay, staging_bytes=staging_bytes,
             min_split_bytes=min_split_bytes)
    with torch.no_grad():
        src_local = src.to_local() if src is not None else None
        dst_local = dst.to_local() if dst is not None else None
        if src is not None and src_layout.mesh.coordinate(group.rank) is None:
            src_local = None
        if dst is not None and dst_layout.mesh.coordinate(group.rank) is None:
            dst_local = None
    execute(p, group.rank, None if src_local is None else [src_local],
            None if dst_local is None else [dst_local], group, verify=verify, timeout=timeout)
    return dst
