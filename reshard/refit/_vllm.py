"""How a vLLM-style engine holds a HuggingFace model's weights: fused tensors and padded vocabularies.

`engine_tensors(weights)` turns per-weight inference layouts (HuggingFace names, one global tensor each) into the
engine's local tensors:
- `self_attn.{q,k,v}_proj.*` -> `self_attn.qkv_proj.*`, `[q_shard; k_shard; v_shard]` along dim 0 on every rank
  (K/V heads replicated across TP ranks when TP exceeds the KV head count, as the layouts already say);
- `mlp.{gate,up}_proj.*` -> `mlp.gate_up_proj.*`, `[gate_shard; up_shard]`;
- stacked experts `mlp.experts.{gate,up}_proj.weight` `[E, I, H]` -> `mlp.experts.w13_weight` `[E_local, 2 I_local,
  H]` (fused along dim 1), `down_proj` -> `w2_weight`;
- `embed_tokens` / `lm_head` -> vocab-parallel with the vocabulary padded to a multiple of 64 (optional);
- everything else keeps its name and layout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reshard.planner import ExplicitLayout, Layout, fuse, vocab_parallel_layout

_FUSIONS = (
    (re.compile(r"^(.*\.self_attn\.)(q|k|v)_proj\.(weight|bias)$"), "{0}qkv_proj.{2}", ("q", "k", "v"), 0),
    (re.compile(r"^(.*\.(?:mlp|shared_experts)\.)(gate|up)_proj\.(weight|bias)$"), "{0}gate_up_proj.{2}",
     ("gate", "up"), 0),
    (re.compile(r"^(.*\.mlp\.experts\.)(gate|up)_proj\.(weight)$"), "{0}w13_{2}", ("gate", "up"), 1),
)
_RENAMES = ((re.compile(r"^(.*\.mlp\.experts\.)down_proj\.weight$"), "{0}w2_weight"),)


@dataclass(frozen=True)
class EngineTensor:
    """One local tensor of the engine: its name and the global tensors fused into it (in order along `dim`)."""

    name: str
    components: tuple[tuple[str, Layout | ExplicitLayout], ...]
    dim: int = 0

    def local_shape(self, rank: int) -> tuple[int, ...]:
        shapes = [lay.local_shape(rank) for _, lay in self.components]
        if len(shapes) == 1:
            return tuple(shapes[0])
        out = list(shapes[0])
        out[self.dim] = sum(s[self.dim] for s in shapes)
        return tuple(out)

    def fused(self) -> list[tuple[str, Layout | ExplicitLayout]]:
        """The components' layouts in the coordinates of this fused local tensor (see `reshard.planner.fuse`)."""
        if len(self.components) == 1:
            return list(self.components)
        return [(n, lay) for (n, _), lay in zip(self.components, fuse([lay for _, lay in self.components],
                                                                       dim=self.dim))]

    @property
    def dtype(self) -> torch.dtype:
        return self.components[0][1].dtype

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.components[0][1].ranks)


def engine_tensors(
    weights: Sequence[tuple[str, Layout | ExplicitLayout]], *, pad_vocab_to: int | None = 64
) -> list[EngineTensor]:
    """Group per-weight inference layouts into the engine's local tensors (see the module docstring).

    Args:
        weights: `(HuggingFace name, inference layout)` per weight.
        pad_vocab_to: pad `embed_tokens` / `lm_head` to a multiple of this (vLLM uses 64); None keeps them as laid
            out.
    """
    fused: dict[str, dict[str, Layout | ExplicitLayout]] = {}
    dims: dict[str, int] = {}
    order: dict[str, tuple[str, ...]] = {}
    out: dict[str, EngineTensor] = {}
    for name, lay in weights:
        for pattern, fmt, parts, dim in _FUSIONS:
            m = pattern.match(name)
            if m:
                target = fmt.format(*m.groups()[:1], None, m.group(3))
                fused.setdefault(target, {})[m.group(2)] = lay
                dims[target], order[target] = dim, parts
                out.setdefault(target, EngineTensor(target, ()))  # keeps first-seen order
                break
        else:
            new_name = name
            for pattern, fmt in _RENAMES:
                m = pattern.match(name)
                if m:
                    new_name = fmt.format(*m.groups())
            if pad_vocab_to and isinstance(lay, Layout) and (name.endswith("embed_tokens.weight")
                                                             or name == "lm_head.weight"):
                lay = _padded_vocab(name, lay, pad_vocab_to)
            out[new_name] = EngineTensor(new_name, ((name, lay),))
    for target, comps in fused.items():
        parts = order[target]
        missing = [p for p in parts if p not in comps]
        if missing:  # e.g. only q_proj given: keep the pieces unfused under their own names
            for p, lay in comps.items():
                out[lay.name or p] = EngineTensor(lay.name or p, ((lay.name or p, lay),))
            del out[target]
            continue
        out[target] = EngineTensor(target, tuple((comps[p].name or p, comps[p]) for p in parts), dims[target])
    return list(out.values())


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
