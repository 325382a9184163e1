"""Trainer weights stored `[in, out]` (Hugging Face `Conv1D`: GPT-2's `c_attn`, `c_proj`, `c_fc`), registered as
the engine holds them, `[out, in]`.

vLLM's GPT-2 loader transposes these weights as it reads the checkpoint, so the engine describes them transposed
(`reshard.integrations.vllm._layouts`); the planner moves boxes, never transposes, so the trainer side registers a
transposed *view* of its local tensor (no copy: an optimizer step in place is seen by the next run) with the layout
transposed to match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from reshard.planner import Box, ExplicitLayout, Piece


def conv1d_weights(module: torch.nn.Module) -> list[str]:
    """The names of `module`'s Hugging Face `Conv1D` weights (by class: `transformers.pytorch_utils.Conv1D`)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # no transformers: no Conv1D layers either
        return []
    return [f"{n}.weight" if n else "weight" for n, m in module.named_modules(remove_duplicate=False)
            if isinstance(m, Conv1D)]


def _flip(box: Box) -> Box:
    return Box(tuple(reversed(box.offsets)), tuple(reversed(box.shape)))


def transposed_layout(layout: Any) -> ExplicitLayout:
    """`layout` (a 2-D `Layout` or `ExplicitLayout`) of the transposed tensor: every piece's boxes and every rank's
    local shape with their two dims swapped."""
    if len(layout.shape) != 2:
        raise ValueError(f"tensor {layout.name!r}: only a 2-D weight can be registered transposed, got shape "
                         f"{tuple(layout.shape)}")
    return ExplicitLayout(tuple(reversed(layout.shape)), layout.dtype,
                          {r: [Piece(_flip(p.global_box), _flip(p.local_box), p.tensor) for p in layout.pieces(r)]
                           for r in layout.ranks},
                          {r: tuple(reversed(layout.local_shape(r))) for r in layout.ranks}, name=layout.name)


def transpose_weight(name: str, weight: Any) -> Any:
    """`weight` (a DTensor, or `(local tensor, layout)`) as its transpose: a view of the same memory."""
    if isinstance(weight, tuple) and len(weight) == 2:
        local, layout = weight
        if not isinstance(local, torch.Tensor) or local.dim() != 2:
            raise ValueError(f"ReshardTrainer.trainer_init: transposed weight {name!r} must be a 2-D tensor, got "
                             f"{type(local).__name__} of shape {tuple(getattr(local, 'shape', ()))}")
        return local.t(), transposed_layout(layout)
    if getattr(weight, "dim", lambda: 0)() != 2:
        raise ValueError(f"ReshardTrainer.trainer_init: transposed weight {name!r} must be 2-D, got shape "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    return weight.detach().t()  # a DTensor: its local tensor becomes the transposed view, its placements swapped


__all__: Sequence[str] = ["conv1d_weights", "transpose_weight", "transposed_layout"]
