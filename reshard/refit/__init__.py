"""Model refit: whole-model weight sync from a trainer to an inference engine.

Exports `Refit` and `RefitReport`, and `engine_tensors` / `EngineTensor` (how a vLLM-style engine fuses and pads
a HuggingFace model's weights). Each side registers only its own tensors and layouts; `Refit.run()` exchanges
the metadata once, plans the whole model once, and moves every weight on each call.
"""

from reshard.refit._refit import POLICIES, Refit, RefitReport
from reshard.refit._vllm import EngineTensor, engine_tensors

__all__ = ["POLICIES", "EngineTensor", "Refit", "RefitReport", "engine_tensors"]
