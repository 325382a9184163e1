"""The engine's model facts (`Refit.declare_facts`): what the served model's config says that shapes cannot show.

A vLLM engine serves the Hugging Face config it loaded (`model_config.hf_text_config`, the text model's for a
multimodal one); its heads, KV heads, head dim, experts, vocabulary and tie are declared for the refit's first run
to compare with the trainer's (see `reshard.refit._facts`).
"""

from __future__ import annotations

from typing import Any

from reshard.integrations.hf import model_facts
from reshard.refit import Refit


def declare_engine_facts(refit: Refit, model_config: Any) -> None:
    """Declare the facts of the config vLLM serves (`model_config`: vLLM's `ModelConfig`) on `refit`."""
    config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    if config is None:
        return
    refit.declare_facts(model_facts(config), who="engine (the config vLLM serves)")
