"""Layouts written in DTensor notation, for the command line.

Syntax: `"ranks=<ranges> [mesh=<AxB...>] [names=<a,b>] <placements>"`, where
- `<ranges>` is a comma list of ranks and inclusive ranges: `0-7`, `0-3,8-11`;
- `mesh` reshapes those ranks row-major (default: a 1-D mesh of all of them);
- `<placements>` is one per mesh axis, comma separated: `S(d)` (Shard), `R` (Replicate), `_S(d,k)` (_StridedShard
  with split factor `k`).

Example: `"ranks=0-7 mesh=2x4 R,S(0)"` is TP4 x DP2 on ranks 0-7, tensor dim 0 sharded over the second axis.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard.planner._layout import Layout
from reshard.planner._mesh import Mesh

_PLACEMENT = re.compile(r"^(?:(R)|S\((-?\d+)\)|_S\((-?\d+),\s*(\d+)\))$")


def parse_ranks(text: str) -> list[int]:
    """`"0-3,8"` -> `[0, 1, 2, 3, 8]`."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"ranks: cannot read {part!r} in {text!r} (expected e.g. 0-7 or 0-3,8-11)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"ranks: range {part!r} runs backwards")
        out.extend(range(lo, hi + 1))
    return out


def parse_placements(text: str) -> list[Placement]:
    """`"R,S(0),_S(1,2)"` -> `[Replicate(), Shard(0), _StridedShard(1, split_factor=2)]`."""
    out: list[Placement] = []
    for tok in re.findall(r"_S\([^)]*\)|S\([^)]*\)|R", text.replace(" ", "")):
        m = _PLACEMENT.match(tok)
        if not m:
            raise ValueError(f"placements: cannot read {tok!r} (expected R, S(d) or _S(d,k))")
        if m.group(1):
            out.append(Replicate())
        elif m.group(2) is not None:
            out.append(Shard(int(m.group(2))))
        else:
            out.append(_StridedShard(int(m.group(3)), split_factor=int(m.group(4))))
    leftover = re.sub(r"_S\([^)]*\)|S\([^)]*\)|R|,", "", text.replace(" ", ""))
    if leftover or not out:
        raise ValueError(f"placements: cannot read {text!r} (expected e.g. R,S(0) or _S(0,2),S(0))")
    return out


def parse_layout(spec: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, *,
                 name: str | None = None) -> Layout:
    """Build a `Layout` from the notation above.

    Example:
        >>> parse_layout("ranks=0-3 mesh=2x2 S(0),S(1)", (4, 6)).pieces(3)[0].global_box
        Box[2:4, 3:6]
    """
    fields: dict[str, str] = {}
    rest: list[str] = []
    for tok in spec.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            fields[k.strip()] = v.strip()
        else:
            rest.append(tok)
    unknown = set(fields) - {"ranks", "mesh", "names"}
    if unknown:
        raise ValueError(f"layout {spec!r}: unknown fields {sorted(unknown)} (expected ranks=, mesh=, names=)")
    if "ranks" not in fields:
        raise ValueError(f"layout {spec!r}: missing ranks=... (e.g. ranks=0-7)")
    ranks = parse_ranks(fields["ranks"])
    dims = [int(x) for x in fields["mesh"].lower().split("x")] if "mesh" in fields else [len(ranks)]
    size = 1
    for d in dims:
        size *= d
    if size != len(ranks):
        raise ValueError(f"layout {spec!r}: mesh {'x'.join(map(str, dims))} holds {size} ranks, got {len(ranks)}")
    names = fields["names"].split(",") if "names" in fields else None
    mesh = Mesh(torch.tensor(ranks, dtype=torch.int64).reshape(dims), axis_names=names)
    return Layout(shape, mesh, parse_placements(" ".join(rest)), dtype, name=name)
