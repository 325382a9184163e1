"""Model facts: what tensor shapes cannot show, agreed between the sides of a refit before its first plan.

Two models can have every tensor of the same shape and still differ: 8 attention heads of 32 with 2 KV groups and
4 heads of 64 with 1 KV head give one `qkv_proj` shape, and an engine that serves the second with the first's
weights computes nonsense. So each side may declare the facts its layout depends on (`Refit.declare_facts`): the
trainer from its own config (Hugging Face, Megatron's `TransformerConfig`), the engine from the config it serves.
The first `run()` gathers every rank's declarations (one small all-rank round) and, where two declarations give
one fact different values, raises the same `ValueError` on every rank, naming the fact, each value and who
declared it, before the plan is built and before any data moves. A fact only one side declares is not compared.

Facts (`FACTS`), by their Hugging Face config names: `num_attention_heads`, `num_key_value_heads`, `head_dim`,
`hidden_size`, `num_hidden_layers`, `num_experts` (routed experts; 0 for a dense model), `vocab_size` (the real
vocabulary, not a padded one), `tie_word_embeddings`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from reshard.comm import CommError, all_gather_json

FACTS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "num_hidden_layers", "num_experts",
         "vocab_size", "tie_word_embeddings")
"""The facts a side may declare."""


def checked(facts: Mapping[str, Any], who: str) -> dict[str, int | bool]:
    """`facts` as declared (None values dropped), after checking names and types; raises ValueError naming them."""
    if not isinstance(who, str) or not who:
        raise ValueError(f"Refit.declare_facts: who must be a non-empty string (the side and where the facts come "
                         f"from), got {who!r}")
    unknown = sorted(set(facts) - set(FACTS))
    if unknown:
        raise ValueError(f"Refit.declare_facts ({who}): unknown facts {unknown}; known: {list(FACTS)}")
    out: dict[str, int | bool] = {}
    for k, v in facts.items():
        if v is None:
            continue
        want_bool = k == "tie_word_embeddings"
        if (want_bool and not isinstance(v, bool)) or (not want_bool and (isinstance(v, bool) or not isinstance(
                v, int) or v < 0)):
            raise ValueError(f"Refit.declare_facts ({who}): {k} must be "
                             f"{'a bool' if want_bool else 'an integer >= 0'}, got {v!r}")
        out[k] = v
    return out


def disagreements(declared: Sequence[tuple[int, Sequence[Any]]]) -> list[str]:
    """Every fact that two declarations give different values, described: `(rank, [[who, facts], ...])` per rank."""
    values: dict[str, dict[Any, dict[str, list[int]]]] = {}
    for rank, decls in declared:
        for who, facts in decls:
            for k, v in facts.items():
                values.setdefault(k, {}).setdefault(v, {}).setdefault(who, []).append(rank)
    out = []
    for k in FACTS:
        seen = values.get(k, {})
        if len(seen) > 1:
            parts = [f"{v!r} by " + ", ".join(f"{who} (ranks {rs})" for who, rs in sorted(whos.items()))
                     for v, whos in seen.items()]
            out.append(f"{k}: " + "; ".join(parts))
    return out


def agree(group: Any, rank: int, mine: Sequence[tuple[str, dict]], timeout: datetime.timedelta) -> None:
    """Gather every rank's declarations (collective) and raise a `ValueError`, the same on every rank, if they
    disagree."""
    gathered = all_gather_json(group, [rank, [[w, f] for w, f in mine]], timeout=timeout, what="refit model facts")
    declared = []
    for r, m in enumerate(gathered):
        if not (isinstance(m, list) and len(m) == 2 and m[0] == r and isinstance(m[1], list) and all(
                isinstance(d, list) and len(d) == 2 and isinstance(d[0], str) and isinstance(d[1], dict)
                and all(k in FACTS and isinstance(v, (int, bool)) for k, v in d[1].items()) for d in m[1])):
            raise CommError(f"refit model facts: rank {r} sent malformed facts: {str(m)[:200]}")
        declared.append((r, m[1]))
    errors = disagreements(declared)
    if errors:
        raise ValueError(f"Refit on rank {rank}: the trainer's and the engine's models differ in what the tensor "
                         "shapes cannot show, nothing was moved (the engine would serve the trainer's weights with "
                         "another attention layout, expert count or vocabulary):\n  " + "\n  ".join(errors))
