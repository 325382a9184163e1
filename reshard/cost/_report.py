"""The plan report that `python -m reshard plan` and the demo print: a plan's statistics beside gather-and-broadcast's
bytes for the same tensor."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from reshard.cost._baseline import gather_broadcast_bytes
from reshard.planner import Topology, format_bytes, plan
from reshard.planner._contract import format_stats


def print_plan_report(src: Any, dst: Any, topology: Topology, *, relay: bool, describe: bool,
                      out: TextIO | None = None, staging_bytes: int | None = None) -> None:
    """Plan `src -> dst` and print its statistics beside gather-and-broadcast's bytes (to `out`, default stdout);
    `describe` also lists every transfer."""
    out = out if out is not None else sys.stdout
    kwargs = {"staging_bytes": staging_bytes} if staging_bytes else {}
    t0 = time.perf_counter()
    p = plan(src, dst, topology, relay=relay, **kwargs)
    dt = time.perf_counter() - t0
    gb = gather_broadcast_bytes(src, dst)
    moved = p.stats.network_bytes + p.stats.nvlink_bytes
    print(f"source      {src!r}", file=out)
    print(f"destination {dst!r}", file=out)
    print(f"topology    {topology}, relay={relay}; planned in {dt * 1e3:.1f} ms", file=out)
    print("reshard plan:", file=out)
    print(format_stats(p.stats), file=out)
    print("gather-and-broadcast:", file=out)
    print(f"  all-gather on the source ranks {format_bytes(gb['gather']):>12}", file=out)
    print(f"  broadcast to destination ranks {format_bytes(gb['broadcast']):>12}", file=out)
    print(f"  total                          {format_bytes(gb['total']):>12}", file=out)
    if moved:
        print(f"reshard moves {gb['total'] / moved:.1f}x fewer bytes over links "
              f"({format_bytes(moved)} vs {format_bytes(gb['total'])})", file=out)
    if describe:
        print(p.describe(max_transfers=10**9), file=out)
