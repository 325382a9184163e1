"""Text for people: byte counts, plan statistics and `Plan.describe()`. Nothing here decides anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard.planner._types import PlanStats

if TYPE_CHECKING:
    from reshard.planner._plan import Plan

__all__ = ["describe_plan", "format_bytes", "format_stats"]

_MAX_ITEMS = 20
"""`describe_plan` lists at most this many items."""


def format_bytes(n: float) -> str:
    """`n` bytes in binary units: `format_bytes(1536) == "1.50 KiB"`, `format_bytes(12) == "12 B"`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_stats(s: PlanStats) -> str:
    """A plan's byte accounting, one quantity a line (indented by two spaces), next to its lower bound."""
    return "\n".join(
        [
            f"  needed by destinations {format_bytes(s.needed_bytes):>12}",
            f"  network                {format_bytes(s.network_bytes):>12}   (lower bound "
            f"{format_bytes(s.network_lower_bound)})",
            f"  nvlink                 {format_bytes(s.nvlink_bytes):>12}",
            f"  local copies           {format_bytes(s.local_bytes):>12}",
            f"  transfers {s.num_transfers}, messages {s.messages}, chunks {s.num_chunks}",
            f"  busiest rank: send {format_bytes(s.max_rank_send_bytes)} (imbalance {s.send_imbalance:.2f}), "
            f"recv {format_bytes(s.max_rank_recv_bytes)} (imbalance {s.recv_imbalance:.2f})",
        ]
    )


def describe_plan(p: Plan, *, max_transfers: int = 200) -> str:
    """The text of `Plan.describe`: the layouts, the statistics, then who sends what to whom, over which link."""
    lines = [f"Plan {p.fingerprint[:12]}: {len(p.items)} tensor(s), {p.topology}, relay={p.relay}"]
    for i, it in enumerate(p.items[:_MAX_ITEMS]):
        lines.append(f"  item {i} {it.label!r}: {it.src!r} -> {it.dst!r}")
    if len(p.items) > _MAX_ITEMS:
        lines.append(f"  ... {len(p.items) - _MAX_ITEMS} more items")
    lines.append(format_stats(p.stats))
    lines.append("transfers (chunk: src -> dst, link, bytes, item, global box, src box -> dst box):")
    transfers = p.transfers
    for t in transfers[:max_transfers]:
        relay = f" relay-stage{t.stage}" if t.stage else ""
        lines.append(
            f"  [{t.chunk}] {t.src_rank:>4} -> {t.dst_rank:<4} {t.link:<7}{relay} {format_bytes(t.nbytes):>10} "
            f"item {t.item} global {t.global_box} src {t.src_box} -> dst {t.dst_box}"
        )
    if len(transfers) > max_transfers:
        lines.append(f"  ... {len(transfers) - max_transfers} more transfers")
    return "\n".join(lines)
