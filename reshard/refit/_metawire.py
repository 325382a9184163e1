"""A refit's metadata on the wire in O(what is distinct): each rank's own facts, each distinct registration once.

Today's form of one rank's metadata (`registration`) lists every tensor it registered with its whole layout, and
each layout lists every rank of its mesh; every rank of a mesh registers the same layouts. So the round sends it in
two parts (`split_registration`):

- the rank's *record*: its rank, its errors, its refit identity, the mesh coordinates of its DTensor sources (the
  only per-rank registration fact), and the digest and size of its *table*; all-gathered, a few hundred bytes each;
- its *table*: the names it registered, each pointing into a list of its distinct layouts, mesh ranks written as a
  range (`"ranks_range": [start, step]`) where they are one; ranks that registered the same tensors hold equal
  tables (byte for byte: `canonical` JSON), and each distinct table travels once, from the lowest rank holding it.

`join_registrations` rebuilds every rank's metadata in today's form from the records and the distinct tables, after
checking each table against the digest its ranks announced; ranks of one table share its objects, so the rebuilt
list costs memory per distinct table, not per rank. Pure functions on JSON values, but for the round itself:
`exchange_metadata` (a refit's first run: this rank's registration checked, sent, and every rank's received).

Example: ranks 0-3 each register `w` as `S(0)` on mesh `[0, 1, 2, 3]`: four records of ~150 bytes and one table
(`{"layouts": [{..., "ranks_range": [0, 1]}], "sources": {"w": 0}, ...}`) instead of four copies of the layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from reshard.comm import CommError, all_gather_json
from reshard.comm._contract import as_timedelta, broadcast_bytes
from reshard.planner._contract import encode_layout, flat_index
from reshard.refit._meta import LayoutLike, aliases_ok, check_local, check_scale

DIGEST_CHARS = 32
"""Hex digits of a table digest (sha256, truncated)."""

MAX_RECORD_ERRORS = 16
"""A record carries at most this many of its rank's errors, then a line counting the rest: records stay small next to
each other, as the control round's allowance wants (`reshard.comm._wire.control_allowance`)."""

_RECORD_FIELDS = frozenset({"rank", "table", "table_bytes", "coords", "odd_coords", "errors", "identity"})
_TABLE_FIELDS = frozenset({"layouts", "sources", "dests", "scaled", "aliases"})


def registration(rank: int, sources: Mapping[str, LayoutLike], coords: Mapping[str, Any],
                 dests: Mapping[str, Sequence[tuple[str, LayoutLike]]], scaled: Sequence[str],
                 aliases: Mapping[str, Mapping[str, Sequence[str]]], errors: Sequence[str],
                 identity: Sequence[Any]) -> dict[str, Any]:
    """One rank's metadata in the form `reshard.refit._build.build` reads (JSON values only).

    Args:
        rank: the rank.
        sources: source name -> its layout.
        coords: source name -> the DTensor mesh coordinate this rank registered it at (absent or None otherwise).
        dests: destination name -> its `(global name, layout)` components.
        scaled: the destinations this rank registered a scale tensor for.
        aliases: `{"sources": {name: [alias, ...]}, "dests": {...}}`.
        errors: this rank's local problems.
        identity: `[refit name, nonce]`.
    """
    return {
        "rank": rank,
        "sources": {n: {"layout": encode_layout(lay), "coord": coords.get(n)} for n, lay in sorted(sources.items())},
        "dests": {n: [[g, encode_layout(lay)] for g, lay in comps] for n, comps in sorted(dests.items())},
        "scaled": sorted(scaled),
        "aliases": {side: {n: list(a) for n, a in sorted(aliases[side].items())} for side in ("sources", "dests")},
        "errors": list(errors),
        "identity": list(identity),
    }


def canonical(value: Any) -> bytes:
    """`value`'s one JSON text: sorted keys, no spaces (equal values give equal bytes on every rank)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def digest(value: Any) -> str:
    """The `DIGEST_CHARS`-hex-digit digest of `canonical(value)`."""
    return hashlib.sha256(canonical(value)).hexdigest()[:DIGEST_CHARS]


def _compact(enc: dict[str, Any]) -> dict[str, Any]:
    """An encoded layout with its mesh ranks as `"ranks_range": [start, step]` when they are one range."""
    ranks = enc.get("ranks")
    if enc.get("kind") != "mesh" or not isinstance(ranks, list) or not ranks:
        return enc
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    if step <= 0 or any(b - a != step for a, b in zip(ranks, ranks[1:])):
        return enc
    out = {k: v for k, v in enc.items() if k != "ranks"}
    out["ranks_range"] = [ranks[0], step]
    return out


def _expand(enc: Any, where: str, memo: dict[tuple, list[int]] | None = None) -> Any:
    """`_compact` undone; `ValueError` naming `where` for a malformed range (the layout's own checks follow).
    `memo`: rank lists already expanded, shared by the layouts of one mesh."""
    if not isinstance(enc, dict) or "ranks_range" not in enc:
        return enc
    rng, shape = enc["ranks_range"], enc.get("mesh_shape")
    if not (isinstance(rng, list) and len(rng) == 2 and all(type(v) is int for v in rng) and rng[1] > 0
            and isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape) and "ranks" not in enc):
        raise ValueError(f"{where}: malformed ranks_range {str(rng)[:80]} (mesh_shape {str(shape)[:80]})")
    out = {k: v for k, v in enc.items() if k != "ranks_range"}
    start, step = rng
    key = (start, step, math.prod(shape))
    ranks = memo.get(key) if memo is not None else None
    if ranks is None:
        ranks = list(range(start, start + step * key[2], step))
        if memo is not None:
            memo[key] = ranks
    out["ranks"] = ranks
    return out


def split_registration(meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """`registration`'s output as `(record, table, table bytes)`: what is this rank's own, and what every rank that
    registered the same tensors shares (its `canonical` bytes; the record carries their digest and size)."""
    layouts: list[dict[str, Any]] = []
    index: dict[bytes, int] = {}

    def lid(enc: dict[str, Any]) -> int:
        c = _compact(enc)
        key = canonical(c)
        k = index.get(key)
        if k is None:
            k = index[key] = len(layouts)
            layouts.append(c)
        return k

    table = {
        "sources": {n: lid(s["layout"]) for n, s in meta["sources"].items()},
        "dests": {n: [[g, lid(enc)] for g, enc in comps] for n, comps in meta["dests"].items()},
        "scaled": meta["scaled"],
        "aliases": meta["aliases"],
        "layouts": layouts,
    }
    data = canonical(table)
    # a process is one DTensor rank in every mesh: the sources of one layout share one coordinate, sent once
    by_layout: dict[int, Any] = {}
    odd: dict[str, Any] = {}
    for n, s in meta["sources"].items():
        k = table["sources"][n]
        if by_layout.setdefault(k, s["coord"]) != s["coord"]:
            odd[n] = s["coord"]
    record = {
        "rank": meta["rank"],
        "table": hashlib.sha256(data).hexdigest()[:DIGEST_CHARS],
        "table_bytes": len(data),
        "coords": [[k, c] for k, c in sorted(by_layout.items()) if c is not None],
        "odd_coords": odd,
        "errors": _capped(meta["errors"], meta["rank"]),
        "identity": meta["identity"],
    }
    return record, table, data


def _capped(errors: list[str], rank: int) -> list[str]:
    if len(errors) <= MAX_RECORD_ERRORS:
        return errors
    return errors[:MAX_RECORD_ERRORS] + [f"... and {len(errors) - MAX_RECORD_ERRORS} more problem(s) on rank {rank}"]


def table_owners(records: Sequence[Any]) -> dict[str, tuple[int, int]]:
    """Distinct table digest -> `(lowest rank announcing it, its size in bytes)`, in digest order. Records must have
    passed `check_record`."""
    out: dict[str, tuple[int, int]] = {}
    for m in records:
        if m["table"] not in out:
            out[m["table"]] = (m["rank"], m["table_bytes"])
    return dict(sorted(out.items()))


def check_record(r: int, m: Any) -> str | None:
    """Why rank `r`'s record is malformed, or None."""
    if not (isinstance(m, dict) and set(m) == _RECORD_FIELDS and m["rank"] == r):
        return f"rank {r} sent malformed metadata: {str(m)[:200]}"
    if not (isinstance(m["table"], str) and len(m["table"]) == DIGEST_CHARS and type(m["table_bytes"]) is int
            and m["table_bytes"] >= 0 and isinstance(m["coords"], list) and isinstance(m["odd_coords"], dict)
            and all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int for p in m["coords"])
            and isinstance(m["errors"], list)):
        return f"rank {r} sent malformed metadata: {str(m)[:200]}"
    ident = m["identity"]
    if not (isinstance(ident, list) and len(ident) == 2 and isinstance(ident[1], str)
            and (ident[0] is None or isinstance(ident[0], str))):
        return f"rank {r} sent a malformed identity: {str(ident)[:200]}"
    return None


def join_registrations(records: Sequence[dict[str, Any]], tables: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every rank's metadata in `registration`'s form, from the (checked) records and the distinct tables by digest.

    Raises:
        ValueError: a table does not match its digest, or is malformed, naming the rank that sent it; a record's
            coordinates name a source its table does not hold.
    """
    owners = table_owners(records)
    shared: dict[str, dict[str, Any]] = {}
    for dg, table in tables.items():
        owner = owners[dg][0]
        where = f"refit metadata exchange: rank {owner}'s registration table"
        if digest(table) != dg:
            raise ValueError(f"{where} does not match its digest {dg}")
        if not (isinstance(table, dict) and set(table) == _TABLE_FIELDS and isinstance(table["layouts"], list)
                and isinstance(table["sources"], dict) and isinstance(table["dests"], dict)):
            raise ValueError(f"{where} is malformed: {str(table)[:200]}")
        memo: dict[tuple, list[int]] = {}
        layouts = [_expand(enc, where, memo) for enc in table["layouts"]]

        def lay(k: Any) -> Any:
            if type(k) is not int or not 0 <= k < len(layouts):
                raise ValueError(f"{where} points at layout {k!r} of {len(layouts)}")
            return layouts[k]

        try:
            dests = {n: [[g, lay(k)] for g, k in comps] for n, comps in table["dests"].items()}
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: malformed destinations: {e}") from None
        shared[dg] = {"sources": {n: {"layout": lay(k), "coord": None} for n, k in table["sources"].items()},
                      "dests": dests, "scaled": table["scaled"], "aliases": table["aliases"],
                      "source_layout": table["sources"]}
    out = []
    for m in records:
        t = shared[m["table"]]
        sources = t["sources"]
        if m["coords"] or m["odd_coords"]:
            unknown = sorted(set(m["odd_coords"]) - set(sources))
            if unknown:
                raise ValueError(f"refit metadata exchange: rank {m['rank']} sent mesh coordinates of sources it did "
                                 f"not register: {unknown[:5]}")
            by_layout = dict((k, c) for k, c in m["coords"])
            odd, lids = m["odd_coords"], t["source_layout"]
            sources = {n: {"layout": s["layout"], "coord": odd[n] if n in odd else by_layout.get(lids[n])}
                       for n, s in sources.items()}
        out.append({"rank": m["rank"], "sources": sources, "dests": t["dests"], "scaled": t["scaled"],
                    "aliases": t["aliases"], "errors": m["errors"], "identity": m["identity"]})
    return out


def exchange_metadata(refit: Any, srcs: dict[str, Any], dsts: dict[str, Any], scales: dict[str, Any],
                      errors: list[str]) -> list[dict]:
    """The metadata round of `refit`'s first run: this rank's registration checked (each local tensor against its
    layout, FP8 scales; the problems join `errors`), every rank's registration gathered (`_gather_registrations`),
    in rank order, and the refits' identity agreed (`refit.identity` set). Raises a `ValueError` on every rank when
    ranks run refits of different names, a `CommError` naming the rank that sent malformed metadata."""
    errors = list(errors)
    for name, (_, layout) in refit._sources.items():
        coord = refit._coords.get(name)
        own = refit.rank if coord is None else layout.mesh.ranks[flat_index(coord, layout.mesh.shape)]
        if own not in layout.ranks:
            errors.append(f"source {name!r}: rank {refit.rank} registered it but is not in its layout's ranks")
        elif name in srcs:
            e = check_local(name, srcs[name], layout, own)
            if e:
                errors.append("source " + e)
    for name, (_, d) in refit._dests.items():
        lay = d.components[0][1]
        if refit.rank not in lay.ranks:
            errors.append(f"destination {name!r}: rank {refit.rank} registered it but is not in its layout's "
                          "ranks")
            continue
        e = check_local(name, dsts[name], lay, refit.rank)
        if e:
            errors.append("destination " + e)
        errors.extend(check_scale(name, d, scales.get(name), refit.rank))
    mine = registration(refit.rank, {n: lay for n, (_, lay) in refit._sources.items()}, refit._coords,
                        {n: d.components for n, (_, d) in refit._dests.items()}, list(refit._scales),
                        {"sources": refit._src_aliases, "dests": refit._dst_aliases}, errors,
                        [refit.name, refit._nonce])
    metas = _gather_registrations(refit, mine)
    names = {r: m["identity"][0] for r, m in enumerate(metas)}
    if len(set(names.values())) > 1:
        groups: dict[Any, list[int]] = {}
        for r, n in names.items():
            groups.setdefault(n, []).append(r)
        raise ValueError(f"Refit on rank {refit.rank}: ranks run different refits, nothing was moved: "
                         + "; ".join(f"Refit {n!r} on ranks {rs}" for n, rs in groups.items())
                         + " (call the refits of a group in the same order on every rank)")
    refit.identity = hashlib.sha256("|".join([str(refit.name)] + [m["identity"][1] for m in metas])
                                   .encode()).hexdigest()
    return metas


def _gather_registrations(refit: Any, mine: dict) -> list[dict]:
    """Every rank's `registration`, in rank order, in two rounds (see this module's docstring): every rank's
    record (its own facts and its table's digest) all-gathered, then each distinct table broadcast once by the
    lowest rank holding it. What a rank receives grows with the group only by the records (~150 bytes each)."""
    td = as_timedelta(refit.timeout, default=refit.group.timeout)
    what = "refit metadata exchange"
    record, _, data = split_registration(mine)
    records = all_gather_json(refit.group, record, timeout=td, what=what)
    for r, m in enumerate(records):
        why = check_record(r, m)
        if why:
            raise CommError(f"{what}: {why}")
    tables: dict[str, Any] = {}
    for dg, (owner, size) in table_owners(records).items():
        got = broadcast_bytes(refit.group, data if owner == refit.rank else None, root=owner, size=size,
                              timeout=td, what=f"{what} (table of rank {owner})")
        if hashlib.sha256(got).hexdigest()[:DIGEST_CHARS] != dg:
            raise CommError(f"{what}: rank {owner}'s registration table does not match its digest {dg}")
        try:
            tables[dg] = json.loads(got.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise CommError(f"{what}: rank {owner} sent a malformed registration table: {e}") from None
    try:
        metas = join_registrations(records, tables)
    except ValueError as e:
        raise CommError(str(e)) from None
    for r, m in enumerate(metas):
        if not (isinstance(m["sources"], dict) and isinstance(m["dests"], dict) and aliases_ok(m["aliases"])
                and isinstance(m["scaled"], list)):
            raise CommError(f"{what}: rank {r} sent malformed metadata: {str(m)[:200]}")
    return metas
