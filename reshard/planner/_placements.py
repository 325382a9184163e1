"""Ranks and placements written in DTensor notation: `"0-3,8"`, `"R,S(0),_S(1,2)"`. Below `Layout`, which accepts
placements given as such strings, and the command-line layout notation (`_notation.py`)."""

from __future__ import annotations

import re

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

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
