"""Model refit: whole-model weight sync from a trainer to an inference engine.

Exports `Refit` and `RefitReport`. Each side registers only its own tensors and layouts; `Refit.run()` exchanges
the metadata once, plans the whole model once, and moves every weight on each call.
"""

from reshard.refit._refit import POLICIES, Refit, RefitReport

__all__ = ["POLICIES", "Refit", "RefitReport"]
