"""Cluster-scale refit simulator: the project's real plans, timed on modelled H100 / GB200 / GB300 clusters.

Pure Python: no device and no process group; built on `reshard.planner` and `reshard.cost` (the hardware presets
and the link cost model: import them from `reshard.cost`). Exports
- systems: `System`, `TrainerParallel`, `InferenceParallel`, `load_system`, `system_config_names` (NCCL M2N's
  system-config JSON, shipped copies in `reshard/sim/configs/`, or the command-line form);
- layouts: `model_layouts`, `WeightLayouts`, `stage_layer_counts`, `pipeline_stage` (Megatron-style trainer and
  vLLM-style inference layouts per weight);
- bytes per inference rank: `engine_bytes` (its own share, against a whole-expert sender);
- the simulator: `simulate`, `SimResult`, `MethodResult`, `plan_items`; outputs `format_table`, `csv_rows`,
  `write_csv`, `plot`, and `main`, the command line of `python -m reshard simulate` and `perf/simulate.py`.
"""

from reshard.sim._engine_bytes import engine_bytes
from reshard.sim._layouts import WeightLayouts, model_layouts, pipeline_stage, stage_layer_counts
from reshard.sim._report import csv_rows, format_table, main, plot, write_csv
from reshard.sim._simulate import MethodResult, SimResult, plan_items, simulate
from reshard.sim._system import InferenceParallel, System, TrainerParallel, load_system, system_config_names

__all__ = [
    "InferenceParallel",
    "MethodResult",
    "SimResult",
    "System",
    "TrainerParallel",
    "WeightLayouts",
    "csv_rows",
    "engine_bytes",
    "format_table",
    "load_system",
    "main",
    "model_layouts",
    "pipeline_stage",
    "plan_items",
    "plot",
    "simulate",
    "stage_layer_counts",
    "system_config_names",
    "write_csv",
]
