"""What a Hugging Face config and parameter names say, shared by both sides of every integration.

- `model_facts(config)`: the facts of a config that tensor shapes cannot show (heads, KV heads, head dim, experts,
  vocabulary, tie), for `Refit.declare_facts`; the trainer side declares its config's, the engine side the config
  it serves (`reshard.integrations.engine_side.declare_engine_facts`), and the first run compares them.
- `trainer_name(name)`: a parameter's Hugging Face name without the prefixes wrappers add.
- `config_value(config, *names)`: the first of `names` a config (object or dict) gives.

`reshard.integrations.hf` re-exports both (its public names).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["config_value", "model_facts", "trainer_name"]

_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module|module)\.")


def trainer_name(name: str) -> str:
    """A parameter's Hugging Face name, without the prefixes wrappers add (`_orig_mod.`, `_checkpoint_wrapped_module.`,
    `module.`): `model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight` -> `model.layers.0.mlp.up_proj.weight`.
    Use it as `Refit(name_map=trainer_name)`."""
    return _WRAPPERS.sub(r"\1", name)


def model_facts(config: Any) -> dict[str, Any]:
    """The facts of a Hugging Face config that tensor shapes cannot show, for `Refit.declare_facts`: heads, KV heads,
    head dim, hidden size, layers, routed experts (`num_experts` / `num_local_experts` / `n_routed_experts`; 0 for
    a dense model), vocabulary and tie (a multimodal config's text config). A config object or its `to_dict()`;
    a fact the config does not give is None (not compared)."""
    text = config.get("text_config") if isinstance(config, Mapping) else getattr(config, "text_config", None)
    cfg = text if text is not None else config
    heads = config_value(cfg, "num_attention_heads")
    hidden = config_value(cfg, "hidden_size")
    head_dim = config_value(cfg, "head_dim", default=hidden // heads if heads and hidden else None)
    return {"num_attention_heads": heads, "num_key_value_heads": config_value(cfg, "num_key_value_heads", default=heads),
            "head_dim": head_dim, "hidden_size": hidden, "num_hidden_layers": config_value(cfg, "num_hidden_layers"),
            "num_experts": config_value(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0),
            "vocab_size": config_value(cfg, "vocab_size"),
            "tie_word_embeddings": config_value(cfg, "tie_word_embeddings", default=config_value(config, "tie_word_embeddings"))}


def config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` that `config` (a config object or its `to_dict()`) gives not None, else `default`."""
    for n in names:
        v = config.get(n) if isinstance(config, Mapping) else getattr(config, n, None)
        if v is not None:
            return v
    return default
