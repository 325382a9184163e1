"""Cluster-scale refit simulator: the project's real plans, timed on modelled H100 / GB200 / GB300 clusters.

Pure Python: no device and no process group; built on `reshard.planner` and `reshard.cost`, whose hardware presets
and cost model it re-exports. Exports
- hardware: `Hardware`, `HARDWARE` (presets `h100`, `gb200`, `gb300`), `get_hardware`;
- systems: `System`, `TrainerParallel`, `InferenceParallel`, `load_system`, `system_config_names` (NCCL M2N's
  system-config JSON, shipped copies in `reshard/sim/configs/`, or the command-line form);
- layouts: `model_layouts`, `WeightLayouts`, `stage_layer_counts`, `pipeline_stage` (Megatron-style trainer and
  vLLM-style inference layouts per weight);
- cost model: `LinkLoads`, `LinkKey`, `Timing`, `link_time`, `plan_loads`, `relay_fill_s`, `ring_allgather_s`,
  `chain_broadcast_s`, `gather_broadcast`, `GatherBroadcast`, `lower_bound`, `LowerBound`;
- bytes per inference rank: `engine_bytes` (its own share, against a whole-expert sender);
- the simulator: `simulate`, `SimResult`, `MethodResult`, `plan_items`; outputs `format_table`, `csv_rows`,
  `write_csv`, `plot`, and `main`, the command line of `python -m reshard simulate` and `perf/simulate.py`.
"""

from reshard.cost import (
    HARDWARE,
    GatherBroadcast,
    Hardware,
    LinkKey,
    LinkLoads,
    LowerBound,
    Timing,
    chain_broadcast_s,
    gather_broadcast,
    get_hardware,
    link_time,
    lower_bound,
    plan_loads,
    relay_fill_s,
    ring_allgather_s,
)
from reshard.sim._engine_bytes import engine_bytes
from reshard.sim._layouts import WeightLayouts, model_layouts, pipeline_stage, stage_layer_counts
from reshard.sim._report import csv_rows, format_table, main, plot, write_csv
from reshard.sim._simulate import MethodResult, SimResult, plan_items, simulate
from reshard.sim._system import InferenceParallel, System, TrainerParallel, load_system, system_config_names

__all__ = [
    "HARDWARE",
    "GatherBroadcast",
    "Hardware",
    "InferenceParallel",
    "LinkKey",
    "LinkLoads",
    "LowerBound",
    "MethodResult",
    "SimResult",
    "System",
    "Timing",
    "TrainerParallel",
    "WeightLayouts",
    "chain_broadcast_s",
    "csv_rows",
    "engine_bytes",
    "format_table",
    "gather_broadcast",
    "get_hardware",
    "link_time",
    "load_system",
    "lower_bound",
    "main",
    "model_layouts",
    "pipeline_stage",
    "plan_items",
    "plan_loads",
    "plot",
    "relay_fill_s",
    "ring_allgather_s",
    "simulate",
    "stage_layer_counts",
    "system_config_names",
    "write_csv",
]
