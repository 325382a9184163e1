"""How a trainer framework's weights become reshard sources: the one home of the stream-item-to-source conversion.

Frameworks hand their weights over in one of three forms, per weight:
- a DTensor (FSDP2, torch TP): registered as it is;
- a local shard with a spec (`(local, spec)`: verl's `ShardSpec`, anything with `full_shape`, `mesh`, `placements`):
  the local tensor in its DTensor local shape (`local_of`), wrapped as a DTensor of that mesh and placements;
- a full tensor that every trainer rank holds (DDP, ZeRO-1/2, a gathered stream): every rank registers its own
  `Shard(0)` row block over the T trainer ranks (`full_layout`), so each rank sends a distinct `1/T` of it and no
  byte is sent twice; a scalar or a tensor with an empty first dim is sent by trainer rank 0 alone.

`stream_source` does the conversion for one item; `full_layout`, `local_of`, `contiguous_stride` are its parts,
for callers that place the local tensors in buffers of their own (verl's bucketed stream).

A whole model given to a trainer link (`reshard.integrations.trainer_link.TrainerLink.join`, which every engine's
trainer side uses) is prepared here too: a model of a registered kind (`add_model_kind`: the Megatron integration
registers Megatron-core models, registered by its `add_sources`) is registered by its kind (`register_source`); a
parameter of a registered partition kind (`add_partition_kind`: the DeepSpeed integration registers ZeRO-3
parameters) becomes a source through it (`parameter_source`). So this home imports no specific integration: each
registers itself when `reshard.integrations` is imported. For the others `prepare_source` finds the ties (`find_ties`: names of one tensor;
`config_ties`: the config's `tie_word_embeddings`) and transposes Hugging Face `Conv1D` weights (`conv1d_weights`,
`transpose_weight`): stored `[in, out]` (GPT-2's `c_attn`, `c_proj`, `c_fc`), they are registered as the engine
holds them, `[out, in]` (vLLM's GPT-2 loader transposes them as it reads the checkpoint; the planner moves boxes,
never transposes), as a transposed *view* of the local tensor (no copy: an optimizer step in place is seen by the
next run) with the layout transposed to match.

Example (T = 2 trainer ranks, a full `[5, 3]` float32 weight): `full_layout("w", (5, 3), torch.float32, rank, 2)`
gives rank 0 rows `[0, 3)` (`start` 0, local shape `(3, 3)`) and rank 1 rows `[3, 5)` (`start` 3, `(2, 3)`),
torch.chunk's split; for T = 8 ranks 5 .. 7 hold no rows (`(0, 3)`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.planner import Box, ExplicitLayout, Layout, Mesh, Piece, is_dtensor

__all__ = ["FullBlock", "add_model_kind", "add_partition_kind", "config_ties", "contiguous_stride", "conv1d_weights",
           "find_ties", "full_layout", "full_mesh", "is_dtensor", "local_of", "model_kind", "parameter_source",
           "prepare_source", "register_source", "source_weights", "spec_dtensor", "stream_source", "transpose_weight",
           "transposed_layout"]

_MODEL_KINDS: dict[str, tuple[Callable[[Any], bool], Callable[[Any, Any, Any], None]]] = {}
_PARTITION_KINDS: dict[str, tuple[Callable[[Any], bool], Callable[[str, Any, int], Any]]] = {}


def add_model_kind(kind: str, detect: Callable[[Any], bool], register: Callable[[Any, Any, Any], None]) -> None:
    """Teach the trainer side a kind of whole model that registers its own sources (Megatron-core models).

    Args:
        kind: the kind's name (`"megatron"`); registering it again replaces it.
        detect: `detect(source)`: whether a source given to a trainer link is a model of this kind.
        register: `register(refit, model, config)`: register the model's sources with `refit` (`config`: the
            model's Hugging Face config, or None).
    """
    _MODEL_KINDS[kind] = (detect, register)


def add_partition_kind(kind: str, detect: Callable[[Any], bool], source: Callable[[str, Any, int], Any]) -> None:
    """Teach the trainer side a kind of partitioned parameter (DeepSpeed ZeRO-3's): `detect(param)` tells one,
    `source(name, param, rank)` gives it as a `(local, layout)` source of trainer rank `rank` (None: it sends none
    of it)."""
    _PARTITION_KINDS[kind] = (detect, source)


def model_kind(source: Any) -> str | None:
    """The registered model kind of `source` (`add_model_kind`), or None for a name -> weight source or a module."""
    return next((k for k, (detect, _) in _MODEL_KINDS.items() if detect(source)), None)


def parameter_source(name: str, param: Any, rank: int) -> Any:
    """`param` as a source of trainer rank `rank`: through its partition kind where one is registered
    (`add_partition_kind`; may be None: nothing to send), else `param` itself."""
    for detect, source in _PARTITION_KINDS.values():
        if detect(param):
            return source(name, param, rank)
    return param


class FullBlock(NamedTuple):
    """A trainer rank's block of a full tensor every trainer rank holds.

    Attributes:
        layout: the tensor's trainer layout (`Shard(0)` over the T ranks, or trainer rank 0 alone).
        start: the first row of this rank's block (0 for a scalar).
        local_shape: this rank's block's shape (`(rows, *shape[1:])`).
    """

    layout: Layout
    start: int
    local_shape: tuple[int, ...]


def full_mesh(shape: Sequence[int], num_ranks: int) -> tuple[Mesh, list[Any]]:
    """The trainer mesh and placements of a full tensor held by every one of `num_ranks` trainer ranks: row blocks
    (`Shard(0)`, torch.chunk's split); a scalar or an empty first dim: trainer rank 0 alone (`Replicate()` on
    `Mesh([0])`)."""
    if len(shape) == 0 or shape[0] == 0:
        return Mesh([0]), [Replicate()]
    return Mesh(list(range(num_ranks))), [Shard(0)]


def full_layout(name: str, shape: Sequence[int], dtype: torch.dtype, rank: int, num_ranks: int) -> FullBlock | None:
    """This trainer rank's `FullBlock` of a full tensor of `shape`, or None where it sends none of it (a scalar on
    a rank other than 0). See the module docstring for a worked example."""
    shape = tuple(int(s) for s in shape)
    mesh, placements = full_mesh(shape, num_ranks)
    layout = Layout(shape, mesh, placements, dtype, name=name)
    if rank not in mesh.ranks:
        return None
    pieces = layout.pieces(rank)
    start = pieces[0].global_box.offsets[0] if pieces and len(shape) else 0
    return FullBlock(layout, int(start), tuple(layout.local_shape(rank)))


def local_of(t: Any, spec: Any) -> torch.Tensor:
    """This rank's local tensor of a DTensor, or of a `(local, spec)` pair in its DTensor local shape (verl's FSDP
    engine flattens the local shard: `local.reshape(-1)`); a plain tensor without a spec is returned as it is.

    Raises:
        ValueError: the local tensor's element count differs from the spec's local shape on this rank.
    """
    if spec is None:
        return t.to_local() if is_dtensor(t) else t
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(torch.Size(spec.full_shape), spec.mesh, list(spec.placements))
    if t.numel() != math.prod(shape):
        raise ValueError(f"reshard send_weights: a local shard of {t.numel()} elements does not match its ShardSpec "
                         f"(full shape {tuple(spec.full_shape)}, placements {tuple(spec.placements)}: local shape "
                         f"{tuple(shape)} on this rank)")
    return t.reshape(shape)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (a zero-sized dim counts as 1, as torch's own)."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def spec_dtensor(local: torch.Tensor, spec_mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> Any:
    """`local` (already in its DTensor local shape) as a DTensor of the global `shape` (contiguous strides)."""
    from torch.distributed.tensor import DTensor

    shape = tuple(int(s) for s in shape)
    return DTensor.from_local(local, spec_mesh, list(placements), run_check=False, shape=torch.Size(shape),
                              stride=contiguous_stride(shape))


def stream_source(name: str, t: Any, spec: Any, rank: int, num_ranks: int) -> Any:
    """One trainer weight as a `Refit` / `ReshardTrainer` source (see the module docstring).

    Args:
        name: the weight's (engine) name.
        t: a DTensor, a local shard (with `spec`), or a full tensor every trainer rank holds.
        spec: None, or the local shard's spec (`full_shape`, `mesh`, `placements`).
        rank, num_ranks: this trainer rank and the T trainer ranks (for full tensors).

    Returns:
        a DTensor, `(local row block, Layout)` (a view of `t`, no copy), or None where this rank sends none of it.
    """
    if spec is not None:
        return spec_dtensor(local_of(t, spec), spec.mesh, spec.placements, spec.full_shape)
    if is_dtensor(t):
        return t
    block = full_layout(name, tuple(t.shape), t.dtype, rank, num_ranks)
    if block is None:
        return None
    local = t.narrow(0, block.start, block.local_shape[0]) if t.dim() else t
    return (local, block.layout)


def prepare_source(source: Any, kind: str | None, transposed: Sequence[str] | None,
                   ties: Mapping[str, Sequence[str]] | None,
                   config: Any) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The weights to register (transposed where asked) and their ties (found, from `config`, from `ties`).

    Args:
        source: a mapping name -> DTensor or `(local, Layout)`, a module, or a model of a registered kind.
        kind: `model_kind(source)`: a model of a registered kind is registered by `register_source`, nothing is
            prepared here.
        transposed: names registered transposed (`transpose_weight`); None: a module's `Conv1D` weights.
        ties: more aliases, name -> other names; config: its `tie_word_embeddings` ties an embedding to `lm_head`.

    Returns:
        `(weights, ties)`: name -> weight (a view where transposed), and name -> its other names.
    """
    weights, found = ({}, {}) if kind is not None else source_weights(source)
    if transposed is None:
        transposed = conv1d_weights(source) if isinstance(source, torch.nn.Module) and kind is None else ()
    for name in transposed:
        if name not in weights:
            raise ValueError(f"ReshardTrainer.trainer_init: transposed names {name!r}, which the source does not "
                             "hold (under its first name)")
        weights[name] = transpose_weight(name, weights[name])
    found = config_ties(weights, found, config if config is not None else getattr(source, "config", None))
    for name, names in (ties or {}).items():
        if name not in weights:
            raise ValueError(f"ReshardTrainer.trainer_init: ties names {name!r}, which the source does not hold")
        found.setdefault(name, [])
        found[name] += [n for n in names if n not in found[name]]
    return weights, found


def register_source(refit: Any, source: Any, weights: Mapping[str, Any], ties: Mapping[str, list[str]],
                    kind: str | None, config: Any) -> None:
    """Register `source` with `refit` (a `reshard.refit.Refit`): a model of a registered kind by its kind's
    `register` (with `config`), anything else with `weights` and `ties` as `prepare_source` gave them (see
    `_register`)."""
    if kind is not None:
        _MODEL_KINDS[kind][1](refit, source, config)
    else:
        _register(refit, source, weights, ties)


def _register(refit: Any, source: Any, weights: Mapping[str, Any], ties: Mapping[str, list[str]]) -> None:
    """Register `source` with `refit`: a module through `Refit.add_module_sources`, which follows the module (a
    replaced parameter is read at the next send, an untied one is refused naming it), with the ties the module
    does not show itself (`ties=`, the config's); a mapping name by name, as given."""
    if isinstance(source, torch.nn.Module):
        held = {n for n, _ in source.named_parameters(remove_duplicate=False)}
        extra = {n: [a for a in names if a not in held] for n, names in ties.items()}
        refit.add_module_sources(source, ties={n: names for n, names in extra.items() if names})
        return
    for name, w in weights.items():
        aliases = ties.get(name, ())
        if isinstance(w, tuple):
            refit.add_source(name, w[0], w[1], aliases=aliases)
        else:
            refit.add_source(name, w, aliases=aliases)


def source_weights(source: Any) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The weights to register (one name per tensor) and the ties found among them (name -> its other names)."""
    if source is None:
        raise ValueError("ReshardTrainer.trainer_init: pass source= (name -> DTensor or (local, Layout), or a "
                         "module with DTensor parameters)")
    if isinstance(source, torch.nn.Module):
        entries = list(source.named_parameters(remove_duplicate=False))
    elif isinstance(source, Mapping):
        entries = list(source.items())
    else:
        raise TypeError(f"ReshardTrainer.trainer_init: source must be a mapping or a torch.nn.Module, got "
                        f"{type(source).__name__}")
    ties = find_ties(entries)
    aliases = {a for names in ties.values() for a in names}
    return {n: w for n, w in entries if n not in aliases}, ties


def find_ties(entries: Sequence[tuple[str, Any]]) -> dict[str, list[str]]:
    """Names that hold one tensor: first name -> the later ones.

    Two entries are one tensor when they are the same object, or views of the same memory with the same shape,
    strides, dtype (and layout, for `(local, Layout)`): a module's tied parameters (`named_parameters(
    remove_duplicate=False)`), a `state_dict()`'s tied entries. Empty tensors are never ties (they share no memory).
    """
    first: dict[Any, str] = {}
    ties: dict[str, list[str]] = {}
    for name, w in entries:
        key = _identity(w)
        if key is None:
            continue
        if key in first:
            ties.setdefault(first[key], []).append(name)
        else:
            first[key] = name
    return ties


def _identity(w: Any) -> Any:
    layout = None
    if isinstance(w, tuple) and len(w) == 2:
        w, layout = w
    if hasattr(w, "to_local") and hasattr(w, "placements"):  # a DTensor: its local tensor, mesh and placements
        layout = (tuple(w.placements), tuple(w.device_mesh.mesh.flatten().tolist()), tuple(w.shape))
        w = w._local_tensor
    if not isinstance(w, torch.Tensor) or w.numel() == 0:
        return None
    return (w.device, w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype,
            repr(layout))


def config_ties(weights: Mapping[str, Any], ties: dict[str, list[str]], config: Any) -> dict[str, list[str]]:
    """With `tie_word_embeddings` in `config`, a source holding `...embed_tokens.weight` and no `lm_head.weight`
    ties them (the usual HuggingFace names)."""
    tied = config.get("tie_word_embeddings") if isinstance(config, Mapping) else getattr(
        config, "tie_word_embeddings", None)
    named = {a for names in ties.values() for a in names} | set(weights)
    if not tied or "lm_head.weight" in named:
        return ties
    embeds = [n for n in weights if n.endswith("embed_tokens.weight")]
    if len(embeds) == 1:
        ties.setdefault(embeds[0], []).append("lm_head.weight")
    return ties


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
