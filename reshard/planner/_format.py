"""Text for people: byte counts and plan statistics, which `Plan.describe()` (in `_plan_type`) is written with.
Nothing here decides anything."""

from __future__ import annotations

from reshard.planner._types import PlanStats

__all__ = ["format_bytes", "format_stats"]


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
