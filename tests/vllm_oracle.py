"""vLLM's engine layouts written out by hand: which slice of a model's full tensors each engine rank holds.

The tests' one oracle for an engine's local tensors (`tests/refit_cases.py`, `tests/integrations/test_integrations_hf.py`,
`tests/integrations/test_integrations_megatron.py`): the rules below are vLLM's tensor-parallel loading rules as its model code
applies them, written from the model definitions, not from the library's layout code:

- `qkv_proj`: the rows of q, then k, then v, each split evenly over TP ranks; with fewer KV heads than TP ranks, TP
  rank `t` holds KV head `t // (tp / kv_heads)` whole (each KV head replicated on `tp / kv_heads` ranks);
- `gate_up_proj`: gate's rows of the rank, then up's;
- `experts.w13_weight` `[E, 2I, H]`: per expert, gate's then up's rows of the rank (split over `I`), or with
  expert parallelism the rank's experts whole; `experts.w2_weight` `[E, H, I]`: split over `I`, or its experts;
- `o_proj`, `down_proj`: split over columns; `q_proj`, `q_b_proj`, `kv_b_proj` (MLA): split over rows;
- `embed_tokens`, `lm_head`: the vocabulary padded to a multiple of 64 and split evenly; the padding rows keep what
  the engine tensor held before (the caller's `padded`);
- anything else (norms, routers, MLA down-projections): replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

VOCAB_MULTIPLE = 64
"""vLLM pads the vocabulary of `embed_tokens` / `lm_head` to a multiple of this before splitting it."""

Experts = Callable[[str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""`layer prefix -> (gate [E, I, H], up [E, I, H], down [E, H, I])`: a layer's stacked expert weights."""


def vllm_local(name: str, full: Callable[[str], torch.Tensor], *, tp: int, t: int, kv_heads: int, head_dim: int,
               padded: torch.Tensor, experts: Experts | None = None, ep: int = 1, e: int = 0) -> torch.Tensor:
    """Engine tensor `name` on TP rank `t` of `tp` (EP rank `e` of `ep`), cut from the full tensors.

    Args:
        name: the engine's parameter name (`model.layers.0.self_attn.qkv_proj.weight`).
        full: the full (trainer-side, Hugging Face named) tensor of a name.
        kv_heads, head_dim: the model's KV heads and head size (for `qkv_proj`).
        padded: the engine's local tensor as it was before the refit (shape and padding values of `embed_tokens`
            and `lm_head`; not read for other names).
        experts: the stacked expert weights of a layer prefix (needed for MoE models).
        ep, e: expert parallelism: `ep > 1` gives each EP rank `E / ep` whole experts.
    """
    def rows(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        n = x.shape[dim] // tp
        return x.narrow(dim, t * n, n)

    m = re.match(r"^(.*)\.qkv_proj\.weight$", name)
    if m:
        q, k, v = (full(f"{m.group(1)}.{x}_proj.weight") for x in "qkv")
        if kv_heads < tp:  # KV head t // (tp / kv_heads) whole on TP rank t
            h = t // (tp // kv_heads)
            k, v = k[h * head_dim:(h + 1) * head_dim], v[h * head_dim:(h + 1) * head_dim]
        else:
            k, v = rows(k), rows(v)
        return torch.cat([rows(q), k, v])
    m = re.match(r"^(.*)\.gate_up_proj\.weight$", name)
    if m:
        return torch.cat([rows(full(f"{m.group(1)}.gate_proj.weight")), rows(full(f"{m.group(1)}.up_proj.weight"))])
    m = re.match(r"^(.*)\.experts\.(w13|w2)_weight$", name)
    if m:
        assert experts is not None, f"{name}: a MoE weight needs the layer's experts"
        gate, up, down = experts(m.group(1))
        if ep > 1:
            per = gate.shape[0] // ep
            gate, up, down = gate[e * per:(e + 1) * per], up[e * per:(e + 1) * per], down[e * per:(e + 1) * per]
            return torch.cat([gate, up], dim=1) if m.group(2) == "w13" else down
        return torch.cat([rows(gate, 1), rows(up, 1)], dim=1) if m.group(2) == "w13" else rows(down, 2)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        x = full(name)
        per = -(-x.shape[0] // VOCAB_MULTIPLE) * VOCAB_MULTIPLE // tp
        assert padded.shape[0] == per, f"{name}: the engine holds {padded.shape[0]} vocabulary rows, vLLM {per}"
        out = padded.clone()
        part = x[t * per:(t + 1) * per]
        out[:part.shape[0]] = part
        return out
    if re.search(r"\.(o_proj|down_proj)\.weight$", name):
        return rows(full(name), 1)
    if re.search(r"\.(q_proj|q_b_proj|kv_b_proj)\.weight$", name):
        return rows(full(name))
    return full(name)
