"""Megatron-core trainers as refit sources: `add_sources(refit, model, vocab_size=...)`.

One call on every trainer rank registers that rank's live `GPTModel` chunk (any TP x PP x EP x DP x CP) as `Refit`
sources under Hugging Face names, with layouts read from the model's own `sharded_state_dict()` and
`parallel_state`: the fused `linear_qkv` becomes `q_proj` / `k_proj` / `v_proj` and `linear_fc1` becomes
`gate_proj` / `up_proj`, each a set of pieces of the same local tensor, so every weight moves shard to shard.
Stage-local layer numbers become global ones, expert `j` of EP rank `e` global expert `e * E / ep + j`, padded
vocabulary rows are never sent, and a tied output layer on the last stage is one more holder of the embedding.
See `reshard.integrations.megatron._names` for the name table and docs/megatron.md for what is refused.

megatron-core is imported when `add_sources` is called, not here.
"""

from reshard.integrations.megatron._sources import add_sources

__all__ = ["add_sources"]
