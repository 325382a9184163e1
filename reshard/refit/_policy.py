"""The refit's per-weight method: reshard, or gather-and-broadcast, decided with the whole-model plan.

`policy="auto"` plans every weight by reshard in one whole-model plan first. There, small weights bound for one
peer share messages, so a weight's modelled reshard time is the time of *its bytes* on the busiest link it
loads (`bytes / bandwidth`, no per-message latency: the messages are the plan's, paid once). Its gather-and-broadcast
time is modelled alone (`reshard.cost.gather_broadcast`: a ring all-gather, then a chain broadcast, each with its
own latencies), because gather-and-broadcast weights run one by one after the plan.

A weight goes by gather-and-broadcast only when that is modelled faster, and, when it also moves more bytes than
its reshard does, only when faster by the margin `GB_MARGIN` (a modelled 34.5 us against 34.6 us is no reason to
send 41% more bytes). Every decision is recorded as a `Choice`: a `str` (`"reshard"` / `"gather_broadcast"`) that
also carries the modelled seconds and bytes of both methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from reshard.cost import gather_broadcast
from reshard.planner import LINKS, Plan, PlanItem

GB_MARGIN = 0.25  # gather-and-broadcast must be modelled this much faster to be picked while moving more bytes


class Choice(str):
    """A weight's method (`"reshard"` or `"gather_broadcast"`, the string itself) and the model behind it.

    Attributes:
        reshard_s, gather_broadcast_s: modelled seconds of each method for this weight (None when the method was
            fixed by `policy` / `policies` and nothing was modelled).
        reshard_bytes: bytes this weight moves over links (NVLink + network) in the whole-model plan.
        gather_broadcast_bytes: bytes its gather (all-gather on the trainer) and broadcast would move.
    """

    reshard_s: float | None
    gather_broadcast_s: float | None
    reshard_bytes: int | None
    gather_broadcast_bytes: int | None

    def __new__(cls, method: str, *, reshard_s: float | None = None, gather_broadcast_s: float | None = None,
                reshard_bytes: int | None = None, gather_broadcast_bytes: int | None = None) -> Choice:
        self = super().__new__(cls, method)
        self.reshard_s = reshard_s
        self.gather_broadcast_s = gather_broadcast_s
        self.reshard_bytes = reshard_bytes
        self.gather_broadcast_bytes = gather_broadcast_bytes
        return self

    def describe(self) -> str:
        """`reshard (modelled 12.1 us, 4.0 KiB; gather_broadcast 30.2 us, 9.0 KiB)`."""
        if self.reshard_s is None or self.gather_broadcast_s is None:
            return str(self)
        return (f"{self} (modelled reshard {self.reshard_s * 1e6:.3g} us, {self.reshard_bytes} B; gather_broadcast "
                f"{self.gather_broadcast_s * 1e6:.3g} us, {self.gather_broadcast_bytes} B)")


def item_seconds_and_bytes(plan: Plan, hw: Any) -> list[tuple[float, int]]:
    """Per item of `plan`: its bytes' time on its busiest link (shared messages: no latency) and its link bytes.

    The same as summing each `Transfer` into a `LinkLoads` per item and taking `link_time(...).seconds`, but on the
    plan's transfer columns (`Plan.transfer_columns`): bytes per (item, rank, link, direction) by one sort, then
    each item's largest `bytes / bandwidth`, so a plan of a million transfers costs a few array passes.
    """
    cols = plan.transfer_columns()
    num_items = len(plan.items)
    if not cols.src.size:
        return [(0.0, 0)] * num_items
    local = (cols.link == LINKS.index("local")) | (cols.src == cols.dst)
    # a local copy loads only the receiver's copy engine; a link transfer its sender's and its receiver's link
    link = np.where(local, LINKS.index("local"), cols.link).astype(np.int64)
    num_ranks = int(max(cols.src.max(), cols.dst.max())) + 1
    ends = [(cols.dst, 0, np.ones(local.size, bool)), (cols.src, 1, ~local)]  # (rank, direction, which)
    keys = np.concatenate([((cols.item[w] * num_ranks + r[w]) * len(LINKS) + link[w]) * 2 + d for r, d, w in ends])
    nbytes = np.concatenate([cols.nbytes[w] for _, _, w in ends])
    uniq, inverse = np.unique(keys, return_inverse=True)
    totals = np.bincount(inverse, weights=nbytes.astype(np.float64))  # exact below 2**53 bytes per link
    bandwidth = np.array([float(hw.bandwidth(k)) for k in LINKS])
    seconds = np.zeros(num_items)
    np.maximum.at(seconds, uniq // (2 * len(LINKS) * num_ranks), totals / bandwidth[(uniq // 2) % len(LINKS)])
    moved = np.rint(np.bincount(cols.item[~local], weights=cols.nbytes[~local].astype(np.float64),
                                minlength=num_items)).astype(np.int64)
    return list(zip(seconds.tolist(), moved.tolist()))


def choose(items: Sequence[PlanItem], whole: Plan, hw: Any, domain: Any, first: int = 0) -> list[Choice]:
    """The `auto` method of `items`, which are `whole.items[first:first + len(items)]` (see the module docstring).

    Args:
        items: the weights to decide (planned by reshard in `whole`).
        whole: the whole-model plan with every weight by reshard.
        hw: the cost model's `reshard.cost.Hardware`.
        domain: rank -> NVLink domain.
        first: the index of `items[0]` in `whole.items`.
    """
    per_item = item_seconds_and_bytes(whole, hw)
    memo: dict[tuple, tuple[float, int]] = {}
    out = []
    for k, item in enumerate(items):
        key = (item.src.key, item.dst.key)
        if key not in memo:
            gb = gather_broadcast([(item.src, item.dst, 0)], hw, domain)
            memo[key] = (gb.seconds, gb.gather_bytes + gb.broadcast_bytes)
        gb_s, gb_bytes = memo[key]
        rs_s, rs_bytes = per_item[first + k]
        out.append(decide(rs_s, rs_bytes, gb_s, gb_bytes))
    return out


def decide(reshard_s: float, reshard_bytes: int, gather_broadcast_s: float, gather_broadcast_bytes: int) -> Choice:
    """Gather-and-broadcast when modelled faster, and by `GB_MARGIN` when it moves more bytes; else reshard.

    Example: `decide(34.6e-6, 100, 34.5e-6, 141)` is `"reshard"` (faster by 0.3% while moving 41% more bytes);
    `decide(40e-6, 100, 30e-6, 141)` is `"gather_broadcast"` (faster by a third).
    """
    faster = gather_broadcast_s < reshard_s and (
        gather_broadcast_bytes <= reshard_bytes or gather_broadcast_s * (1 + GB_MARGIN) <= reshard_s)
    return Choice("gather_broadcast" if faster else "reshard", reshard_s=reshard_s,
                  gather_broadcast_s=gather_broadcast_s, reshard_bytes=reshard_bytes,
                  gather_broadcast_bytes=gather_broadcast_bytes)
