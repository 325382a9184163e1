"""Building a refit's whole-model plan from every rank's metadata: names, ties, shapes, dtypes, precision and
policy checked (the same on every rank, so every rank raises the same error), then one plan for the model.

`build(options, meta)` reads only the gathered metadata and the `Refit`'s options (`BuildOptions`), never the
`Refit` itself, so this module does not import `reshard.refit._refit`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from reshard.cost import get_hardware
from reshard.planner import LocalPlan, Plan, PlanItem, Topology, plan_local, plan_many
from reshard.planner._contract import decode_layout
from reshard.refit._fp8 import FP8, Fp8Weight
from reshard.refit._gather import GatherBroadcastWeight
from reshard.refit._meta import LayoutLike
from reshard.refit._names import NameMap, match_names, merge_aliases
from reshard.refit._policy import Choice, choose
from reshard.refit._sources import by_table, source_layouts

PRECISIONS = ("same", "cast", "fp8_block")


class BuildOptions(Protocol):
    """What the plan builder reads of a `Refit`."""

    rank: int
    name_map: NameMap
    ignore_sources: frozenset[str]
    precision: Any
    policy: str
    policies: Mapping[str, str]
    topology: Topology
    relay: bool
    staging_bytes: int
    hardware: Any
    planning: str  # "global" or "local" (resolved)
    delta: Any  # a DeltaSession or None


@dataclass
class Built:
    source_layouts: dict[str, LayoutLike]
    source_names: list[str]
    dest_names: list[str]
    plan: Plan | LocalPlan
    choices: dict[str, str]
    gather_broadcast: list[Any]
    scale_names: list[str]
    fp8: list[Fp8Weight]
    num_src: int
    num_dst: int


def _precision(precision: Any, name: str) -> str:
    if isinstance(precision, str):
        return precision
    if callable(precision):
        return precision(name)
    return precision.get(name, "same")


def build(refit: BuildOptions, meta: list[dict]) -> Built:
    """Check the gathered metadata (the same on every rank, so every rank raises the same error) and plan."""
    errors = [e for m in sorted(meta, key=lambda m: m["rank"]) for e in m["errors"]]
    src_layouts, _, src_errors = source_layouts(meta)
    errors.extend(src_errors)
    dests: dict[str, list] = {}
    dest_holders: dict[str, set[int]] = {}
    disagree: list[tuple[int, str]] = []
    for table, ranks in by_table(meta, "dests"):
        for n, comps in table.items():
            if n in dests and dests[n] != comps:
                first = min(dest_holders[n])
                disagree.extend((r, f"destination {n!r}: ranks disagree on its layout (rank {r} differs from rank "
                                    f"{first}): {spec_difference(dests[n], comps, f'rank {first} has', f'rank {r} has')}")
                                for r in ranks)
            dests.setdefault(n, comps)
            dest_holders.setdefault(n, set()).update(ranks)
    errors.extend(e for _, e in sorted(disagree, key=lambda x: x[0]))
    dst_components: dict[str, tuple[str, str, LayoutLike]] = {}  # global name -> (dest tensor, global, layout)
    for dn, comps in sorted(dests.items()):
        for gname, spec in comps:
            lay = decode_layout(spec)
            missing = sorted(set(lay.ranks) - dest_holders[dn])
            if missing:
                errors.append(f"destination {dn!r}: ranks {missing} hold part of it by its layout but did not "
                              "register it")
            if gname in dst_components:
                errors.append(f"destination global tensor {gname!r} is declared by both {dst_components[gname][0]!r}"
                              f" and {dn!r}")
            dst_components[gname] = (dn, gname, lay)

    # names: unmapped, extra (mapped to nothing declared), duplicate, missing, one-sided ties (see _names)
    by_rank = sorted(meta, key=lambda m: m["rank"])
    src_aliases = merge_aliases([(m["rank"], m["aliases"]["sources"]) for m in by_rank], "trainer", errors)
    dst_aliases = merge_aliases([(m["rank"], m["aliases"]["dests"]) for m in by_rank], "inference", errors)
    pairs, name_errors = match_names(src_layouts, dst_components, name_map=refit.name_map,
                                     ignore=refit.ignore_sources,
                                     src_aliases=_by_name(src_aliases), dst_aliases=_by_name(dst_aliases))
    errors.extend(name_errors)
    scaled: dict[str, set[int]] = {}
    for m in meta:
        for n in m["scaled"]:
            scaled.setdefault(n, set()).add(m["rank"])
    modes: dict[str, str] = {}
    for sname, gname in pairs:
        s, (dn, _, d) = src_layouts[sname], dst_components[gname]
        mode = modes[sname] = _precision(refit.precision, sname)
        if tuple(s.shape) != tuple(d.shape):
            errors.append(f"weight {sname!r} -> {gname!r}: global shape {tuple(s.shape)} on the trainer, "
                          f"{tuple(d.shape)} on the inference side")
        elif mode not in PRECISIONS:
            errors.append(f"weight {sname!r}: precision must be one of {PRECISIONS}, got {mode!r}")
        elif d.dtype == FP8 or mode == "fp8_block":
            if mode != "fp8_block" or d.dtype != FP8 or not s.dtype.is_floating_point:
                errors.append(f"weight {sname!r} -> {gname!r}: dtype {s.dtype} on the trainer, {d.dtype} on the "
                              f"inference side with precision {mode!r}; FP8 block weights need "
                              "precision='fp8_block' and a float8_e4m3fn destination")
            else:
                missing_scale = sorted(dest_holders[dn] - scaled.get(dn, set()))
                if missing_scale:
                    errors.append(f"destination {dn!r}: ranks {missing_scale} registered no scale tensor "
                                  "(weight_scale_inv) for this FP8 block weight; pass scale=...")
        elif s.dtype != d.dtype and mode != "cast":
            errors.append(f"weight {sname!r} -> {gname!r}: dtype {s.dtype} on the trainer, {d.dtype} on the "
                          "inference side (use precision='cast' to cast while packing)")
    if errors:
        raise ValueError(f"Refit on rank {refit.rank}: {len(errors)} problem(s), nothing was moved:\n  "
                         + "\n  ".join(errors))

    source_names = sorted(src_layouts)
    dest_names = sorted(dests)
    scale_names = sorted(n for n in scaled if n in dests)
    s_index = {n: i for i, n in enumerate(source_names)}
    d_index = {n: i for i, n in enumerate(dest_names)}
    scale_index = {n: len(dest_names) + k for k, n in enumerate(scale_names)}
    extra_src, extra_dst = len(source_names), len(dest_names) + len(scale_names)
    items: list[PlanItem] = []
    choices: dict[str, str] = {}
    gather_broadcast: list[Any] = []
    fp8: list[Fp8Weight] = []
    pending: list[tuple[str, PlanItem]] = []  # policy "auto": decided with the whole-model plan below
    for sname, gname in sorted(pairs, key=lambda kv: (dst_components[kv[1]][0], kv[1])):
        dn, _, dlay = dst_components[gname]
        if modes[sname] == "fp8_block":
            w = Fp8Weight(gname, src_layouts[sname], dlay, s_index[sname], d_index[dn], scale_index[dn],
                          extra_src, extra_dst)
            extra_src += w.num_extra_src
            extra_dst += w.num_extra_dst
            fp8.append(w)
            items.extend(w.items)
            choices[sname] = "reshard, fp8_block quantized on the " + ("source" if w.on_source else "destination")
            continue
        item = PlanItem(src_layouts[sname], dlay, s_index[sname], d_index[dn], name=gname,
                        precision="cast" if modes[sname] == "cast" else "same")
        method = _fixed_method(refit, sname, item)
        choices[sname] = method or "auto"  # keeps the order; replaced below
        if method is None:
            pending.append((sname, item))
        elif method == "reshard":
            items.append(item)
        else:
            gather_broadcast.append(GatherBroadcastWeight(item))
    if refit.planning == "local":
        # each rank plans its own part; `auto` needs the whole plan's per-weight times, so those weights reshard
        for sname, item in pending:
            choices[sname] = Choice("reshard")
            items.append(item)
        p: Plan | LocalPlan = plan_local(items, refit.topology, refit.rank, relay=refit.relay,
                                         staging_bytes=refit.staging_bytes,
                                         single_batch_chunks=refit.delta is not None)
        return Built(src_layouts, source_names, dest_names, p, choices, gather_broadcast, scale_names, fp8, extra_src,
                     extra_dst)
    p = plan_many(items + [it for _, it in pending], refit.topology, relay=refit.relay,
                  staging_bytes=refit.staging_bytes)
    if pending:
        hw = refit.hardware if refit.hardware is not None else get_hardware("h100")
        decided = choose([it for _, it in pending], p, hw, refit.topology.domain, first=len(items))
        for (sname, item), c in zip(pending, decided):
            choices[sname] = c
            if c == "gather_broadcast":
                gather_broadcast.append(GatherBroadcastWeight(item))
            else:
                items.append(item)
        if len(items) < len(p.items):  # some went by gather-and-broadcast: plan the rest without them
            p = plan_many(items, refit.topology, relay=refit.relay, staging_bytes=refit.staging_bytes)
    return Built(src_layouts, source_names, dest_names, p, choices, gather_broadcast, scale_names, fp8, extra_src,
                  extra_dst)


def _by_name(aliases: dict[str, str]) -> dict[str, list[str]]:
    """alias -> name, as name -> [aliases]."""
    out: dict[str, list[str]] = {}
    for a, n in sorted(aliases.items()):
        out.setdefault(n, []).append(a)
    return out


def _fixed_method(refit: BuildOptions, sname: str, item: PlanItem) -> Choice | None:
    """The method `policies` / `policy` fix for this weight, or None for `auto` (see `reshard.refit._policy`)."""
    policy = refit.policies.get(sname, refit.policy)
    if item.precision != "same":
        if policy == "gather_broadcast":
            raise ValueError(f"weight {sname!r}: gather_broadcast moves values as they are; use policy 'reshard' "
                             f"or 'auto' with precision {item.precision!r}")
        return Choice("reshard")
    return None if policy == "auto" else Choice(policy)


def spec_difference(a: Any, b: Any, who_a: str, who_b: str, path: str = "") -> str:
    """The first field where two registrations' metadata differ (the `[[global name, encoded layout], ...]` lists
    `reshard.planner._contract.encode_layout` writes), with both values: `"component 'w' field axis_names: rank 2 has
    ['dp', 'tp'], rank 3 has ['x', 'y']"`. Lists of plain values are shown whole."""
    nested = isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(
        isinstance(x, (list, dict)) for x in a)
    if nested:
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                named = not path and isinstance(x, list) and isinstance(y, list) and len(x) == len(y) == 2 and \
                    isinstance(x[0], str) and x[0] == y[0]
                if named:
                    return spec_difference(x[1], y[1], who_a, who_b, f"component {x[0]!r}")
                return spec_difference(x, y, who_a, who_b, f"{path}[{i}]")
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k) != b.get(k):
                return spec_difference(a.get(k), b.get(k), who_a, who_b, f"{path} field {k}".strip())
    return f"{path or 'components'}: {who_a} {_short(a)}, {who_b} {_short(b)}"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 200 else text[:200] + "..."
