"""The link cost model and hardware presets: pure Python on plans and layouts, no device and no process group.

Used by the refit policy (`policy="auto"` compares the two methods per weight) and by the simulator. Exports
- hardware: `Hardware`, `HARDWARE` (presets `h100`, `gb200`, `gb300`), `get_hardware`;
- link model: `LinkLoads`, `LinkKey`, `Timing`, `link_time`, `plan_loads`, `relay_fill_s`, `lower_bound`,
  `LowerBound`;
- the gather-and-broadcast baseline: `gather_broadcast_bytes` (its bytes for one tensor, the one definition),
  `gather_broadcast` and `GatherBroadcast` (its modelled time for many weights), `ring_allgather_s`,
  `chain_broadcast_s`;
- `print_plan_report`: a plan's statistics beside gather-and-broadcast's bytes for the same tensor (what
  `python -m reshard plan` and the demo print).
"""

from reshard.cost._baseline import (
    GatherBroadcast,
    chain_broadcast_s,
    gather_broadcast,
    gather_broadcast_bytes,
    ring_allgather_s,
)
from reshard.cost._hardware import HARDWARE, Hardware, get_hardware
from reshard.cost._model import LinkKey, LinkLoads, LowerBound, Timing, link_time, lower_bound, plan_loads, relay_fill_s
from reshard.cost._report import print_plan_report

__all__ = [
    "HARDWARE",
    "GatherBroadcast",
    "Hardware",
    "LinkKey",
    "LinkLoads",
    "LowerBound",
    "Timing",
    "chain_broadcast_s",
    "gather_broadcast",
    "gather_broadcast_bytes",
    "get_hardware",
    "link_time",
    "lower_bound",
    "plan_loads",
    "print_plan_report",
    "relay_fill_s",
    "ring_allgather_s",
]
