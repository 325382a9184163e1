"""Layouts written in DTensor notation, for the command line.

Syntax: `"ranks=<ranges> [mesh=<AxB...>] [names=<a,b>] <placements>"`, where
- `<ranges>` is a comma list of ranks and inclusive ranges: `0-7`, `0-3,8-11`;
- `mesh` reshapes those ranks row-major (default: a 1-D mesh of all of them);
- `<placements>` is one per mesh axis, comma separated: `S(d)` (Shard), `R` (Replicate), `_S(d,k)` (_StridedShard
  with split factor `k`).

Example: `"ranks=0-7 mesh=2x4 R,S(0)"` is TP4 x DP2 on ranks 0-7, tensor dim 0 sharded over the second axis.
"""

from __future__ import annotations

import torch

from reshard.planner._layout import Layout
from reshard.planner._mesh import Mesh
from reshard.planner._placements import parse_placements, parse_ranks

__all__ = ["parse_layout", "parse_placements", "parse_ranks"]

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
