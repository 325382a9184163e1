"""Model refit: whole-model weight sync from a trainer to an inference engine.

Exports `Refit`, `RefitReport` and `Choice` (a weight's method in `RefitReport.choices`, with the modelled times),
`POLICIES`, `PLANNINGS` and `LOCAL_PLANNING_RANKS` (what `Refit(planning=...)` takes, and where `"auto"` turns
rank-local), and `NameMap` (the type of `Refit(name_map=...)`). Each side registers only its own tensors and
layouts; `Refit.run()` exchanges the metadata once, plans the whole model once, and moves every weight on each
call. Engine-side layouts of real engines (fused `qkv_proj`, `gate_up_proj`, experts, padded vocabularies) are in
`reshard.integrations`.
"""

from reshard.refit._names import NameMap
from reshard.refit._policy import Choice
from reshard.refit._refit import LOCAL_PLANNING_RANKS, PLANNINGS, POLICIES, Refit, RefitReport

__all__ = ["LOCAL_PLANNING_RANKS", "PLANNINGS", "POLICIES", "Choice", "NameMap", "Refit", "RefitReport"]
