"""The plan's stored form: `PlanData`, what the planner built and `Plan` takes, and `UnitSpan`, a span of its units."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from reshard.planner._chunks import _Transfers
from reshard.planner._item import PlanItem
from reshard.planner._topology import Topology

__all__ = ["PlanData", "UnitSpan"]


class UnitSpan(NamedTuple):
    """Units `rows[first_row:stop_row]` and the forwards of parts `first_part..stop_part - 1` of a `_Transfers`."""

    first_row: int
    stop_row: int
    first_part: int
    stop_part: int


@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity: it holds arrays
class PlanData:
    """What the planner built, as `Plan` takes it: the inputs, every transfer unit and its chunk.

    `Plan(data)` checks all of it (see `Plan`), so a `PlanData` that disagrees with itself or with its layouts
    never becomes a plan.

    Attributes:
        items, topology, relay, staging_bytes, min_split_bytes: the planner's inputs.
        units: every transfer unit, in plan order (stage 0 before the forwards that depend on it).
        chunks: `(N,)` int64, the chunk of each of the N units.
        network_lower_bound: bytes that must cross into the destination domains (see `PlanStats`).
        needed_bytes: bytes the destination ranks hold when done.
        planned: the spans (`UnitSpan`) of the units planned from scratch, when
            every other unit replays one of them (same geometry, same boxes): the box checks then look at these
            only. None checks every unit.
    """

    items: tuple[PlanItem, ...]
    topology: Topology
    relay: bool
    staging_bytes: int
    min_split_bytes: int
    units: _Transfers
    chunks: np.ndarray
    network_lower_bound: int
    needed_bytes: int
    planned: tuple[UnitSpan, ...] | None = None
