"""How a vLLM-style engine holds a Hugging Face model's weights: fused tensors and padded vocabularies.

`engine_tensors(weights)` turns per-weight inference layouts (one global tensor each, under the names given) into
the engine's local tensors:
- `self_attn.{q,k,v}_proj.*` -> `self_attn.qkv_proj.*`, `[q_shard; k_shard; v_shard]` along dim 0 on every rank
  (K/V heads replicated across TP ranks when TP exceeds the KV head count, as the layouts already say);
- `mlp.{gate,up}_proj.*` (also `shared_experts` / `shared_expert`) -> `mlp.gate_up_proj.*`, `[gate_shard; up_shard]`;
- stacked experts `mlp.experts.{gate,up}_proj.weight` `[E, I, H]` -> `mlp.experts.w13_weight` `[E_local, 2 I_local,
  H]` (fused along dim 1), `mlp.experts.down_proj.weight` -> `w2_weight`;
- transformers 5's fused experts `mlp.experts.gate_up_proj` `[E, 2 I, H]` -> `mlp.experts.w13_weight` (one global
  tensor; its layout says how gate and up halves are split, see `reshard.integrations.hf`), `mlp.experts.down_proj`
  -> `mlp.experts.w2_weight`;
- `embed_tokens` / `lm_head` -> vocab-parallel with the vocabulary padded to a multiple of 64 (optional);
- everything else keeps its name and layout.

Every component keeps the name it was given: that is the name `Refit` matches against the trainer's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard.planner import ExplicitLayout, Layout, LayoutLike, fuse, vocab_parallel_layout

__all__ = ["EngineTensor", "engine_tensors", "name_map"]

_FUSIONS = (
    (re.compile(r"^(.*\.self_attn\.)(q|k|v)_proj\.(weight|bias)$"), "{0}qkv_proj.{1}", ("q", "k", "v"), 0),
    (re.compile(r"^(.*\.(?:mlp|shared_experts|shared_expert)\.)(gate|up)_proj\.(weight|bias)$"),
     "{0}gate_up_proj.{1}", ("gate", "up"), 0),
    (re.compile(r"^(.*\.mlp\.experts\.)(gate|up)_proj\.(weight)$"), "{0}w13_{1}", ("gate", "up"), 1),
)
_RENAMES = (
    (re.compile(r"^(.*\.mlp\.experts\.)down_proj\.weight$"), "{0}w2_weight"),
    (re.compile(r"^(.*\.mlp\.experts\.)gate_up_proj$"), "{0}w13_weight"),
    (re.compile(r"^(.*\.mlp\.experts\.)down_proj$"), "{0}w2_weight"),
)



@dataclass(frozen=True)
class EngineTensor:
    """One local tensor of the engine: its name and the global tensors in it.

    Attributes:
        name: the engine's name for the local tensor (`...qkv_proj.weight`).
        components: `(global name, layout)` per global tensor. Unless `placed`, the layouts describe each global
            tensor's own sharding and are concatenated along `dim` in this order; `placed` layouts are already in
            the coordinates of the registered local tensor.
        dim: the concatenation dim of unplaced components.
        placed: see `components`.
        local_shapes: `(rank, shape)` pairs where the engine's tensor has another shape than the registered one
            (per-expert checkpoints fill `w13_weight` `[E, 2 I, H]` through its `[E * 2 I, H]` view).
        facts: `(fact, value)` pairs of the model the engine serves that shapes cannot show (heads, KV heads, head
            dim, ...: `reshard.refit._facts.FACTS`), declared by `register` (`Refit.declare_facts`, once per refit).
        facts_from: who declares `facts`, for the refit's error.
    """

    name: str
    components: tuple[tuple[str, LayoutLike], ...]
    dim: int = 0
    placed: bool = False
    local_shapes: tuple[tuple[int, tuple[int, ...]], ...] = ()
    facts: tuple[tuple[str, Any], ...] = ()
    facts_from: str = "engine (its config)"

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The engine's local tensor shape on `rank`."""
        for r, s in self.local_shapes:
            if r == rank:
                return s
        return self.registered_shape(rank)

    def registered_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of the tensor `register` hands to `Refit` (the local tensor or its view)."""
        shapes = [lay.local_shape(rank) for _, lay in self.components]
        if len(shapes) == 1 or self.placed:
            return tuple(shapes[0])
        out = list(shapes[0])
        out[self.dim] = sum(s[self.dim] for s in shapes)
        return tuple(out)

    def fused(self) -> list[tuple[str, LayoutLike]]:
        """The components' layouts in the coordinates of this fused local tensor (see `reshard.planner.fuse`)."""
        if len(self.components) == 1 or self.placed:
            return list(self.components)
        return [(n, lay) for (n, _), lay in zip(self.components, fuse([lay for _, lay in self.components],
                                                                       dim=self.dim))]

    def register(self, refit: Any, tensor: torch.Tensor) -> None:
        """`refit.add_destination` for this rank's local tensor `tensor` (written in place by every run), and
        `refit.declare_facts(facts)` where the engine's config gave them (a refit keeps one copy of equal ones)."""
        shape = self.registered_shape(refit.rank)
        view = tensor if tuple(tensor.shape) == shape else tensor.view(shape)
        refit.add_destination(self.name, view, self.fused(), placed=True)
        if self.facts:
            refit.declare_facts(dict(self.facts), who=self.facts_from)

    @property
    def dtype(self) -> torch.dtype:
        return self.components[0][1].dtype

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.components[0][1].ranks)


def engine_tensors(
    weights: Sequence[tuple[str, LayoutLike]], *, pad_vocab_to: int | None = 64
) -> list[EngineTensor]:
    """Group per-weight inference layouts into the engine's local tensors (see the module docstring).

    Args:
        weights: `(global name, inference layout)` per weight, Hugging Face names.
        pad_vocab_to: pad `embed_tokens` / `lm_head` `[R, S(0)]` layouts to a multiple of this (vLLM uses 64); None
            keeps them as laid out.

    Returns:
        One `EngineTensor` per engine tensor, in first-seen order. A fused group with a member missing (only
        `q_proj` given) stays unfused, each weight under its own name.
    """
    fused: dict[str, dict[str, tuple[str, LayoutLike]]] = {}
    dims: dict[str, int] = {}
    order: dict[str, tuple[str, ...]] = {}
    out: dict[str, EngineTensor | None] = {}
    for name, lay in weights:
        for pattern, fmt, parts, dim in _FUSIONS:
            m = pattern.match(name)
            if m:
                target = fmt.format(m.group(1), m.group(3))
                fused.setdefault(target, {})[m.group(2)] = (name, lay)
                dims[target], order[target] = dim, parts
                out.setdefault(target, None)  # keeps first-seen order
                break
        else:
            new_name = name
            for pattern, fmt in _RENAMES:
                m = pattern.match(name)
                if m:
                    new_name = fmt.format(*m.groups())
                    break
            if pad_vocab_to and isinstance(lay, Layout) and (name.endswith("embed_tokens.weight")
                                                             or name.endswith("lm_head.weight")):
                lay = _padded_vocab(name, lay, pad_vocab_to)
            out[new_name] = EngineTensor(new_name, ((name, lay),))
    for target, comps in fused.items():
        parts = order[target]
        if any(p not in comps for p in parts):  # e.g. only q_proj given: keep the pieces unfused, own names
            del out[target]
            for name, lay in comps.values():
                out[name] = EngineTensor(name, ((name, lay),))
            continue
        out[target] = EngineTensor(target, tuple(comps[p] for p in parts), dims[target])
    return [t for t in out.values() if t is not None]


def name_map(tensors: Sequence[EngineTensor]) -> dict[str, str]:
    """Global (trainer) name -> the engine tensor that holds it (`...q_proj.weight` -> `...qkv_proj.weight`)."""
    return {g: t.name for t in tensors for g, _ in t.components}


def _padded_vocab(name: str, lay: Layout, pad_to: int) -> ExplicitLayout | Layout:
    """The vocab-parallel layout of a `[R, S(0)]` (replicas x TP) vocabulary weight; others stay as they are."""
    from torch.distributed.tensor import Replicate, Shard

    pl = lay.placements
    if len(lay.shape) != 2 or not pl or pl[-1] != Shard(0) or any(p != Replicate() for p in pl[:-1]):
        return lay
    tp = lay.mesh.shape[-1]
    ranks = list(lay.mesh.ranks)
    groups = [ranks[i:i + tp] for i in range(0, len(ranks), tp)]
    return vocab_parallel_layout(lay.shape[0], lay.shape[1], groups[0], dtype=lay.dtype, pad_to=pad_to, name=name,
                                 replicas=groups)
