"""Megatron-core trainers as refit sources: `add_sources(refit, model, vocab_size=...)`.

One call on every trainer rank registers that rank's live `GPTModel` chunk (any TP x PP x EP x DP x CP) as `Refit`
sources under Hugging Face names, with layouts read from the model's own `sharded_state_dict()` and
`parallel_state`: the fused `linear_qkv` becomes `q_proj` / `k_proj` / `v_proj` and `linear_fc1` becomes
`gate_proj` / `up_proj`, each a set of pieces of the same local tensor, so every weight moves shard to shard.
Stage-local layer numbers become global ones, expert `j` of EP rank `e` global expert `e * E / ep + j`, padded
vocabulary rows are never sent, and a tied output layer on the last stage is one more holder of the embedding.
See `reshard.integrations.megatron._names` for the name table and docs/megatron.md for what is refused.

megatron-core is imported when `add_sources` is called, not here. Importing this package registers Megatron models
as a model kind of the trainer side (`reshard.integrations.trainer.add_model_kind`): a `GPTModel` given to any
trainer link (`ReshardTrainer.trainer_init(..., source=model)`) is registered by `add_sources`, with the config's
`vocab_size`.
"""

from collections.abc import Mapping
from typing import Any

import torch

from reshard.integrations.megatron._sources import add_sources
from reshard.integrations.trainer import add_model_kind

__all__ = ["add_sources", "is_megatron"]


def is_megatron(source: Any) -> bool:
    """A Megatron-core `GPTModel` (maybe in Megatron's wrappers, or a list of chunks), not a name -> weight source."""
    chunk = source[0] if isinstance(source, (list, tuple)) and source else source
    while isinstance(chunk, torch.nn.Module) and not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return hasattr(chunk, "decoder") and hasattr(chunk, "sharded_state_dict")


def _register(refit: Any, model: Any, config: Any) -> None:
    """Register a Megatron model given to a trainer link, with `config`'s `vocab_size` (the real vocabulary)."""
    vocab = config.get("vocab_size") if isinstance(config, Mapping) else getattr(config, "vocab_size", None)
    add_sources(refit, model, vocab_size=vocab)


add_model_kind("megatron", is_megatron, _register)
