"""Trainer layouts from every rank's registrations: DTensor mesh ranks mapped to group ranks, sub-meshes merged.

Each trainer rank registers its parameters as it holds them. A DTensor's mesh is in the process's own default-world
ranks, which need not be the refit group's ranks (a `Group.rendezvous` that puts the engine first), and a weight
that a 2-D parallelism does not shard on every axis is often a DTensor on a *sub-mesh*: FSDP2 over each TP rank's
own dp sub-mesh makes a norm `S(0)` on ranks `[0, 2]` on ranks 0 and 2 and `S(0)` on `[1, 3]` on ranks 1 and 3.
Those are two whole copies of one tensor, not a disagreement.

`source_layouts(metas)` turns the gathered registrations into one layout per weight, in group ranks:

1. Rank mapping: every DTensor registration says which mesh position its process holds (its coordinate), so the
   DTensor rank at that position is that process's group rank. Every rank computes the same map from the same
   metadata; a DTensor rank claimed by two processes, or a process claiming two DTensor ranks, is an error that
   shows the map found.
2. Merging: registrations of one weight that differ must lie on disjoint ranks (each a whole copy: replicas). Equal
   mesh shapes and placements stack into one `Layout` with a leading `Replicate()` axis (`[[0, 2], [1, 3]]`,
   `[R, S(0)]` above); otherwise the copies' pieces form one `ExplicitLayout`. Copies that overlap, or differ in
   global shape or dtype, are a conflict, reported with each rank's layout and what would make them consistent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate

from reshard.planner import ExplicitLayout, Layout, Mesh, dtype_name
from reshard.planner._contract import decode_layout, flat_index
from reshard.refit._meta import LayoutLike


def remap_ranks(lay: Layout, mapping: Mapping[int, int]) -> Layout:
    """`lay` with its mesh ranks (a DTensor's own numbering) replaced by `mapping[rank]` (group ranks)."""
    ranks = torch.tensor([mapping[r] for r in lay.mesh.ranks], dtype=torch.int64).reshape(lay.mesh.shape)
    return Layout(lay.shape, Mesh(ranks, lay.mesh.axis_names), list(lay.placements), lay.dtype, name=lay.name)


def _map_text(mapping: Mapping[int, int]) -> str:
    if not mapping:
        return "{} (no process registered a DTensor from inside its mesh)"
    return "{" + ", ".join(f"{k} -> {v}" for k, v in sorted(mapping.items())) + "}"


def dtensor_rank_map(metas: Sequence[dict]) -> tuple[dict[int, int], list[str]]:
    """DTensor (own-world) rank -> group rank, from every registration's mesh coordinate; and the errors found.

    Example: group ranks 4..7 registering DTensors on a `[[0, 1], [2, 3]]` mesh at coordinates `(0, 0)`, `(0, 1)`,
    `(1, 0)`, `(1, 1)` give `{0: 4, 1: 5, 2: 6, 3: 7}`.
    """
    claims: dict[int, set[int]] = {}
    owns: dict[int, set[int]] = {}
    errors = []
    for m in metas:
        for n, src in m["sources"].items():
            if src.get("coord") is None:
                continue
            lay = decode_layout(src["layout"])
            coord = src["coord"]
            if not (isinstance(lay, Layout) and isinstance(coord, list) and len(coord) == len(lay.mesh.shape)
                    and all(type(c) is int and 0 <= c < s for c, s in zip(coord, lay.mesh.shape))):
                errors.append(f"source {n!r}: rank {m['rank']} registered it as a DTensor at mesh coordinate "
                              f"{coord!r}, which is not a position in its layout's mesh")
                continue
            own = lay.mesh.ranks[flat_index(coord, lay.mesh.shape)]
            claims.setdefault(own, set()).add(m["rank"])
            owns.setdefault(m["rank"], set()).add(own)
    mapping = {own: min(gs) for own, gs in claims.items()}
    for own, gs in sorted(claims.items()):
        if len(gs) > 1:
            errors.append(f"DTensor mesh rank {own} (the DTensors' own numbering) is held by group ranks {sorted(gs)};"
                          " each mesh position must be one process (DTensors of one side must come from one "
                          "torch.distributed world)")
    for g, os_ in sorted(owns.items()):
        if len(os_) > 1:
            errors.append(f"group rank {g} holds DTensors at mesh ranks {sorted(os_)} of different meshes; one "
                          "process must be one DTensor rank in every mesh")
    if errors:
        errors.append(f"DTensor rank -> group rank mapping found: {_map_text(mapping)}")
    return mapping, errors


def _describe(lay: LayoutLike) -> str:
    if isinstance(lay, Layout):
        return repr(lay)
    per = "; ".join(f"rank {r}: {[str(p.global_box) for p in lay.pieces(r)]}" for r in lay.ranks)
    return f"explicit {list(lay.shape)} {dtype_name(lay.dtype)} pieces {per}"


def merge_copies(name: str, copies: Sequence[LayoutLike]) -> LayoutLike:
    """One layout holding every copy: replicas on disjoint ranks (checked by the caller), in the order given.

    Equal mesh shapes, axis names and placements give a `Layout` on the stacked mesh with `Replicate()` first;
    anything else the union of the copies' pieces as an `ExplicitLayout`.
    """
    first = copies[0]
    if all(isinstance(c, Layout) and c.mesh.shape == first.mesh.shape and c.placements == first.placements
           and c.mesh.axis_names == first.mesh.axis_names for c in copies):
        ranks = torch.stack([torch.tensor(c.mesh.ranks, dtype=torch.int64).reshape(c.mesh.shape) for c in copies])
        names = None if first.mesh.axis_names is None else ("replica", *first.mesh.axis_names)
        return Layout(first.shape, Mesh(ranks, axis_names=names), [Replicate(), *first.placements], first.dtype,
                      name=name)
    pieces = {r: c.pieces(r) for c in copies for r in c.ranks}
    shapes = {r: c.local_shape(r) for c in copies for r in c.ranks}
    return ExplicitLayout(first.shape, first.dtype, pieces, shapes, name=name)


def source_layouts(metas: Sequence[dict]) -> tuple[dict[str, LayoutLike], dict[str, set[int]], list[str]]:
    """Per trainer weight: its global layout in group ranks, the ranks that registered it, and every error found.

    Args:
        metas: every rank's metadata (`rank`, and `sources`: name -> `{"layout": encoded, "coord": list | None}`;
            a coordinate means a DTensor registration whose mesh is in the process's own world ranks).
    """
    mapping, errors = dtensor_rank_map(metas)
    regs: dict[str, list[tuple[list[int], LayoutLike]]] = {}
    decoded: dict[int, tuple[Any, LayoutLike]] = {}  # ranks of one registration table share its encoded layouts
    for sources, ranks in by_table(metas, "sources"):
        for n, src in sources.items():
            enc = src["layout"]
            hit = decoded.get(id(enc))
            if hit is None or hit[0] is not enc:
                hit = decoded[id(enc)] = (enc, decode_layout(enc))
            lay = hit[1]
            if src.get("coord") is not None and isinstance(lay, Layout):
                unmapped = sorted(r for r in lay.mesh.ranks if r not in mapping)
                if unmapped:
                    errors.append(f"source {n!r}: its DTensor mesh ranks {unmapped} (own numbering, mesh "
                                  f"{list(lay.mesh.ranks)}) are held by no process of the group that registered a "
                                  f"DTensor; DTensor rank -> group rank mapping found: {_map_text(mapping)}")
                    continue
                lay = remap_ranks(lay, mapping)
            regs.setdefault(n, []).append((ranks, lay))
    layouts: dict[str, LayoutLike] = {}
    holders: dict[str, set[int]] = {}
    for n, rs in sorted(regs.items()):
        holders[n] = {r for ranks, _ in rs for r in ranks}
        distinct: list[tuple[LayoutLike, list[int]]] = []
        for ranks, lay in rs:
            for d, who in distinct:
                if d is lay or d == lay:
                    who.extend(ranks)
                    break
            else:
                distinct.append((lay, list(ranks)))
        for _, who in distinct:
            who.sort()
        if len(distinct) > 1:
            why = _conflict(distinct)
            if why:
                lines = "\n    ".join(f"ranks {who}: {_describe(d)}" for d, who in distinct)
                errors.append(f"source {n!r}: ranks disagree on its layout:\n    {lines}\n  {why}")
                continue
        lay = distinct[0][0] if len(distinct) == 1 else merge_copies(n, [d for d, _ in distinct])
        missing = sorted(set(lay.ranks) - holders[n])
        if missing:
            errors.append(f"source {n!r}: ranks {missing} hold part of it by its layout but did not register it")
            continue
        layouts[n] = lay
    return layouts, holders, errors


def by_table(metas: Sequence[dict], field: str) -> list[tuple[dict, list[int]]]:
    """`(m[field], ranks)` per distinct object: ranks of one registration table share its dicts
    (`reshard.refit._metawire.join_registrations`), so a loop over registrations costs per table, not per rank.
    In order of each object's lowest rank; ranks ascending."""
    groups: dict[int, tuple[dict, list[int]]] = {}
    for m in sorted(metas, key=lambda m: m["rank"]):
        obj = m[field]
        g = groups.get(id(obj))
        if g is None:
            groups[id(obj)] = (obj, [m["rank"]])
        else:
            g[1].append(m["rank"])
    return list(groups.values())


def _conflict(distinct: Sequence[tuple[LayoutLike, list[int]]]) -> str | None:
    """Why these copies of one weight cannot be merged, and what would make them consistent; None if they can."""
    shapes = {(tuple(d.shape), d.dtype) for d, _ in distinct}
    if len(shapes) > 1:
        return ("the global shape or dtype differs: every rank must register the same global tensor (check the "
                "name: two different parameters may have been registered under one name)")
    seen: dict[int, list[int]] = {}
    for d, who in distinct:
        for r in d.ranks:
            if r in seen:
                return (f"rank {r} is in the layout registered by ranks {seen[r]} and in the one registered by ranks "
                        f"{who}: layouts that differ may only lie on disjoint ranks, each a whole copy (as FSDP over "
                        "each TP rank's own sub-mesh gives). Build every copy from one DeviceMesh with the same "
                        "placements, or register the same Layout on every rank that holds part of the weight")
            seen[r] = who
    return None

