"""The layouts of a live vLLM model's weights, read from its own modules (no preset).

`engine_targets(model, replicas)` walks the model once and returns one `Target` per loaded parameter: the tensor
reshard writes (the live parameter, or a loader-format buffer for a layer whose quantization method post-processes
its weights), its global components in HuggingFace naming, and the layout of each over the group's engine ranks.

Where the layouts come from:
- the loader-format shape and dtype of each parameter: vLLM's own record of what `create_weights` made
  (`record_metadata_for_reloading`, taken when the model was built, before any post-processing);
- TP sharding: the layer's class (`QKVParallelLinear`, `MergedColumnParallelLinear`, `ColumnParallelLinear`,
  `RowParallelLinear`, `ReplicatedLinear`), its `tp_size` (1 when `disable_tp`), and the parameter's `output_dim` /
  `input_dim`;
- K/V replication: `QKVParallelLinear.num_kv_head_replicas` (TP ranks that share one KV head);
- vocabulary padding: `VocabParallelEmbedding._get_indices`, evaluated for every TP rank;
- experts: a layer with a `FusedMoEMethodBase` quant method (`RoutedExperts`), as stacked `[E, I, H]` globals named
  by its checkpoint prefix and names (`layer_name`, `ckpt_gate_proj_name`, ...):
  `...mlp.experts.{gate,up,down}_proj.weight`; without expert parallelism all experts on every rank (TP over the
  intermediate dim), with it (`moe_parallel_config.use_ep`) whole experts, each EP rank (DP x TP ranks of a stage)
  its own: vLLM's placement rule (`determine_expert_map`) for every EP rank, checked against the live layer's
  `expert_map_manager.get_local_expert_ids()` on this one; EPLB and redundant experts are refused;
- pipeline stages: a parameter's layout spans the stages that hold it (`engine_targets(stages=...)`);
- fused names: the model's `packed_modules_mapping` (`qkv_proj` -> q, k, v; `gate_up_proj` -> gate, up);
- fused checkpoint tensors: for a model whose checkpoint holds the fused tensor itself and whose loader hands it
  whole to the layer's own `weight_loader` (`FUSED_IN_CHECKPOINT`: Phi-3's `qkv_proj` and `gate_up_proj`, GPT-2's
  `c_attn`), one global under the layer's own name, `[q; k; v]` (or `[gate; up]`) of the whole model, each TP
  rank's local tensor being its q, k and v slices of it (`fused_checkpoint_layout`): what that `weight_loader` does
  with `loaded_shard_id=None`. GPT-2's Conv1D weights are described as vLLM loads them, transposed (`[out, in]`):
  the trainer registers them transposed (`ReshardTrainer` does so for a module's `Conv1D` layers).

A parameter shared by two modules (a tied `lm_head`, vLLM's `tie_weights`) is written once, under the first
module's name; the second's global name is declared a tie of it (`Refit.add_destination(..., aliases=...)`), so a
trainer that ties them too sends it once, one that sends the two as separate weights is refused naming both, and
both layers are re-processed.

A parameter none of these rules covers (an unknown layer class with its own `weight_loader`) is an error that names
it: the refit never skips a weight silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.planner import Box, ExplicitLayout, Layout, LayoutLike, Mesh, Piece, fuse



@dataclass
class Target:
    """One engine parameter that a refit writes.

    Attributes:
        module_name, param_name: where it lives (`model.layers.0.self_attn.qkv_proj`, `weight`).
        module: the live module.
        tensor: what reshard writes: a zero-filled loader-format buffer (`processed`), or a copy of the live
            parameter (`live`), so an update can be staged while the forward reads the live tensors.
        components: `(global name, layout)` in concatenation order along `dim` (one entry when not fused).
        dim: the fused dim of the local tensor.
        processed: whether the layer's `quant_method.process_weights_after_loading` must run after the write.
        alias_of: for a parameter tied to an earlier target's (vLLM's tied `lm_head` shares the embedding's
            parameter), that target's name: this one is not written (it shares the earlier one's `tensor`) but is
            re-processed too, and its global names are the earlier one's aliases.
        live: for a layer without post-processing (norms), the live parameter the commit copies `tensor` into.
        view: the shape the refit writes `tensor` as (a 2-D view of an expert buffer whose components are single
            experts, already placed: `engine_targets(per_expert=True)`); None: `tensor` itself, components fused.
    """

    module_name: str
    param_name: str
    module: torch.nn.Module
    tensor: torch.Tensor
    components: list[tuple[str, LayoutLike]]
    dim: int = 0
    processed: bool = False
    loader_attrs: dict[str, Any] = field(default_factory=dict)
    alias_of: str | None = None
    live: torch.Tensor | None = None
    view: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        return f"{self.module_name}.{self.param_name}" if self.module_name else self.param_name


def _loader_meta(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The loader-format (pre-processing) parameters vLLM recorded for `module` when the model was built."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params, _ = get_layerwise_info(module).restore_metadata
    return dict(params)


def _loader_attrs(meta: torch.Tensor, layer: torch.nn.Module) -> dict[str, Any]:
    """The attributes `create_weights` set on a parameter (`weight_loader`, `output_dim`, ...), with the layer's bound
    methods bound to the layer again (vLLM's record replaces the layer by a sentinel to avoid a reference cycle)."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    attrs = dict(getattr(meta, "__dict__", {}))
    for k, v in attrs.items():
        if isinstance(v, MethodType) and v.__self__ is layer_ref_sentinel:
            attrs[k] = v.__func__.__get__(layer)
    return attrs


def _mesh(replicas: Sequence[Sequence[int]], kv_replicas: int = 1) -> Mesh:
    """`(dp, tp)` mesh of group ranks, or `(dp, tp // kv_replicas, kv_replicas)` for replicated KV heads."""
    if kv_replicas == 1:
        return Mesh([list(r) for r in replicas])
    return Mesh([[list(r[i:i + kv_replicas]) for i in range(0, len(r), kv_replicas)] for r in replicas])


def _sharded(shape: Sequence[int], dim: int | None, tp_size: int, replicas: Sequence[Sequence[int]],
             dtype: torch.dtype, name: str, kv_replicas: int = 1) -> Layout:
    """`shape` split evenly along `dim` over the TP ranks of each replica (`dim=None` or `tp_size == 1`: every
    rank holds it whole)."""
    if dim is None or tp_size == 1:
        return Layout(tuple(shape), _mesh(replicas), [Replicate(), Replicate()], dtype, name=name)
    if kv_replicas == 1:
        return Layout(tuple(shape), _mesh(replicas), [Replicate(), Shard(dim)], dtype, name=name)
    return Layout(tuple(shape), _mesh(replicas, kv_replicas), [Replicate(), Shard(dim), Replicate()], dtype,
                  name=name)


def _unfused_names(model: torch.nn.Module, module_name: str, param_name: str) -> list[str] | None:
    """`...qkv_proj.weight` -> `[...q_proj.weight, ...k_proj.weight, ...v_proj.weight]` by the model's
    `packed_modules_mapping`; None when the module is not a packed one."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    head, _, last = module_name.rpartition(".")
    parts = mapping.get(last)
    if not parts:
        return None
    return [f"{head}.{p}.{param_name}" if head else f"{p}.{param_name}" for p in parts]


# vLLM model class (module, name) -> the fused layers whose checkpoint tensor its `load_weights` passes unchanged (up to
# GPT-2's transpose of its Conv1D weights) to the layer's `weight_loader` with `loaded_shard_id=None`. Read from the
# models' code (vLLM 0.32: `Phi3ForCausalLM` is Llama's loader, whose stacked q/k/v mapping no `qkv_proj` name
# matches; `GPT2LMHeadModel` transposes then loads by name). Not a rule for every self-named packed module: Falcon's
# `query_key_value` maps to itself too, but its loader regroups the checkpoint's rows first.
FUSED_IN_CHECKPOINT: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm.model_executor.models.phi3", "Phi3ForCausalLM"): ("qkv_proj", "gate_up_proj"),
    ("vllm.model_executor.models.gpt2", "GPT2LMHeadModel"): ("c_attn",),
}


def _fused_in_checkpoint(model: torch.nn.Module, module_name: str) -> bool:
    """Whether `model`'s checkpoint holds `module_name`'s fused tensor under the module's own name."""
    layers = FUSED_IN_CHECKPOINT.get((type(model).__module__, type(model).__name__), ())
    return module_name.rpartition(".")[2] in layers


def fused_checkpoint_layout(parts: Sequence[LayoutLike], name: str) -> ExplicitLayout:
    """One global tensor, the `parts` concatenated along dim 0 (`[q; k; v]` of the whole model), laid out as each
    rank's local tensor holds it: `[q_r; k_r; v_r]`, each part's shard at its offset in the rank's fused tensor.

    Args:
        parts: each part's own layout (q `[Hq * d, H]` split over TP, ...), on the same ranks.
        name: the fused global's name (the layer's own: `...qkv_proj.weight`).
    """
    placed = fuse(list(parts), dim=0)
    pieces: dict[int, list[Piece]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    start = 0
    for part, lay in zip(parts, placed):
        for r in lay.ranks:
            shapes[r] = tuple(lay.local_shape(r))
            for p in lay.pieces(r):
                g = p.global_box
                pieces.setdefault(r, []).append(
                    Piece(Box((g.offsets[0] + start, *g.offsets[1:]), g.shape), p.local_box, tensor=name))
        start += int(part.shape[0])
    return ExplicitLayout((start, *parts[0].shape[1:]), parts[0].dtype, pieces, shapes, name=name)


def _vocab_layout(layer: Any, shape: Sequence[int], replicas: Sequence[Sequence[int]], dtype: torch.dtype,
                  name: str) -> ExplicitLayout:
    """Each TP rank's rows of the vocabulary, by the layer's own `_get_indices` (padding rows are never written)."""
    if layer.num_added_embeddings:
        raise NotImplementedError(f"{name}: added (LoRA) vocabulary rows are not supported by the reshard backend")
    per, hidden = int(shape[0]), int(shape[1])  # the local (padded) rows, the same on every TP rank
    vocab = layer.org_vocab_size
    pieces: dict[int, list[Piece]] = {}
    shapes: dict[int, tuple[int, int]] = {}
    for group in replicas:
        for tp_rank, r in enumerate(group):
            if layer.tp_size == 1:
                lo, hi = 0, vocab
            else:
                idx = layer._get_indices(layer.num_embeddings_padded, layer.org_vocab_size_padded,
                                         layer.num_embeddings, layer.org_vocab_size, tp_rank, layer.tp_size)
                lo, hi = idx.org_vocab_start_index, idx.org_vocab_end_index
            pieces[r] = [Piece(Box((lo, 0), (hi - lo, hidden)), Box((0, 0), (hi - lo, hidden)), tensor=name)]
            shapes[r] = (per, hidden)
    return ExplicitLayout((vocab, hidden), dtype, pieces, shapes, name=name)


def _as_loaded(layer: torch.nn.Module, pname: str, param: torch.Tensor) -> torch.Tensor:
    """The loader format of a live parameter that has no restore metadata: a bias is loaded in the layer's
    `params_dtype` and re-processing may keep it in another (vLLM's CPU AMX GEMM path,
    `dispatch_cpu_unquantized_gemm`, turns it to float32), so a `meta` stand-in of that dtype, with the parameter's
    loader attributes (`output_dim`, `weight_loader`, ...)."""
    dtype = getattr(layer, "params_dtype", param.dtype) if pname == "bias" else param.dtype
    if dtype == param.dtype:
        return param
    stand_in = torch.empty(tuple(param.shape), dtype=dtype, device="meta")
    stand_in.__dict__.update(getattr(param, "__dict__", {}))
    return stand_in


def _components(model: torch.nn.Module, module_name: str, layer: Any, pname: str, meta: torch.Tensor,
                replicas: Sequence[Sequence[int]], per_expert: bool = False) -> tuple | str:
    """The global components of one loader-format parameter, or a reason why it cannot be laid out."""
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    full = f"{module_name}.{pname}"
    dtype = meta.dtype
    tp = getattr(layer, "tp_size", 1)
    out_dim = getattr(meta, "output_dim", None)
    in_dim = getattr(meta, "input_dim", None)
    if isinstance(layer, (QKVParallelLinear, MergedColumnParallelLinear)) and _fused_in_checkpoint(model,
                                                                                                    module_name):
        parts = _fused_parts(layer, meta, tp, replicas, [f"{full}[{k}]" for k in range(len(layer.output_sizes))])
        return [(full, fused_checkpoint_layout([lay for _, lay in parts], full))], 0
    if isinstance(layer, QKVParallelLinear):
        names = _unfused_names(model, module_name, pname)
        if names is None or len(names) != 3:
            return f"{type(layer).__name__} without a 3-way packed_modules_mapping entry"
        return _fused_parts(layer, meta, tp, replicas, names), 0
    if isinstance(layer, MergedColumnParallelLinear):
        names = _unfused_names(model, module_name, pname)
        if names is None or len(names) != len(layer.output_sizes):
            return f"{type(layer).__name__} without a packed_modules_mapping entry of {len(layer.output_sizes)}"
        return _fused_parts(layer, meta, tp, replicas, names), 0
    if isinstance(layer, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
        shape = list(meta.shape)
        if isinstance(layer, ReplicatedLinear):
            dim = None
        elif isinstance(layer, ColumnParallelLinear):
            dim = out_dim if out_dim is not None else (0 if pname == "bias" else None)
        else:
            dim = in_dim if pname != "bias" else None
        if dim is not None and tp > 1:
            shape[dim] *= tp
        return [(full, _sharded(shape, dim, tp, replicas, dtype, full))], 0
    if isinstance(layer, VocabParallelEmbedding):
        if pname != "weight":
            return "a vocabulary-parallel parameter other than weight"
        return [(full, _vocab_layout(layer, meta.shape, replicas, dtype, full))], 0
    if isinstance(getattr(layer, "quant_method", None), FusedMoEMethodBase):
        return _expert_components(module_name, layer, pname, meta, replicas, per_expert)
    loader = getattr(meta, "weight_loader", None)
    if loader is not None and getattr(loader, "__name__", "") not in ("default_weight_loader",):
        what = getattr(loader, "__qualname__", loader)
        return f"a {type(layer).__name__} parameter with its own weight_loader ({what})"
    return [(full, _sharded(meta.shape, None, 1, replicas, dtype, full))], 0


def _fused_parts(layer: Any, meta: torch.Tensor, tp: int, replicas: Sequence[Sequence[int]],
                 names: Sequence[str]) -> list[tuple[str, LayoutLike]]:
    """The parts of a QKV (`[q; k; v]`, K/V heads replicated over `num_kv_head_replicas` TP ranks) or merged column
    (`[gate; up]`, `output_sizes`) parallel layer's parameter, each over the TP ranks, named `names`."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    rest, dtype = tuple(meta.shape[1:]), meta.dtype
    if isinstance(layer, QKVParallelLinear):
        q = (layer.total_num_heads * layer.head_size, *rest)
        kv = (layer.total_num_kv_heads * layer.head_size, *rest)
        v = (layer.total_num_kv_heads * layer.v_head_size, *rest)
        rep = layer.num_kv_head_replicas
        return [(names[0], _sharded(q, 0, tp, replicas, dtype, names[0])),
                (names[1], _sharded(kv, 0, tp, replicas, dtype, names[1], rep)),
                (names[2], _sharded(v, 0, tp, replicas, dtype, names[2], rep))]
    return [(n, _sharded((size, *rest), 0, tp, replicas, dtype, n)) for n, size in zip(names, layer.output_sizes)]


def _expert_components(module_name: str, layer: Any, pname: str, meta: torch.Tensor,
                       replicas: Sequence[Sequence[int]], per_expert: bool = False) -> tuple | str:
    """`w13_weight` `[E_local, 2 I_local, H]` = `[gate; up]` along dim 1, `w2_weight` `[E_local, H, I_local]`: without
    expert parallelism every rank holds every expert (TP over I); with it, experts whole, each EP rank its own
    (`_expert_placement`)."""
    pc = layer.moe_config.moe_parallel_config
    prefix = getattr(layer, "layer_name", module_name)  # the experts' checkpoint prefix (`...mlp.experts`)
    gate, up, down = (getattr(layer, f"ckpt_{k}_proj_name", f"{k}_proj") for k in ("gate", "up", "down"))
    if pname not in ("w13_weight", "w2_weight"):
        return f"expert parameter {pname!r} (only w13_weight and w2_weight are supported)"
    names = [f"{prefix}.{k}.weight" for k in ((gate, up) if pname == "w13_weight" else (down,))]
    e, a, b = (int(s) for s in meta.shape)
    if per_expert and not pc.use_ep:
        return "experts named one by one (per_expert) without expert parallelism"
    if pc.use_ep:
        placement = _expert_placement(layer, replicas)
        if isinstance(placement, str):
            return placement
        if per_expert:
            return _per_expert_components(prefix, pname, (gate, up, down), placement, (a, b), meta.dtype)
        rest = (a // 2, b) if pname == "w13_weight" else (a, b)
        return [(n, _expert_layout(placement, layer.global_num_experts, rest, meta.dtype, n)) for n in names], \
            1 if pname == "w13_weight" else 0
    num_experts = getattr(layer, "global_num_experts", None)
    if getattr(layer, "local_num_experts", num_experts) != num_experts:
        return f"experts split over ranks without expert parallelism ({layer.local_num_experts} of {num_experts})"
    tp = pc.tp_size
    if pname == "w13_weight":
        shape = (e, a // 2 * tp, b)
        return [(n, _sharded(shape, 1, tp, replicas, meta.dtype, n)) for n in names], 1
    return [(names[0], _sharded((e, a, b * tp), 2, tp, replicas, meta.dtype, names[0]))], 0


def _per_expert_components(prefix: str, pname: str, names: tuple[str, str, str], placement: dict[int, list[int]],
                           shape: tuple[int, int], dtype: torch.dtype) -> tuple:
    """Experts named one by one, as a Megatron export names them (`{prefix}.{e}.gate_proj.weight` `[I, H]`, ...):
    each a box of the 2-D view of its EP rank's buffer (`w13` `[E_local * 2I, H]`: slot `j`'s gate at rows
    `2jI .. 2jI + I`, its up after; `w2` `[E_local * H, I]`: slot `j`'s down at rows `jH .. jH + H`). Returns
    `(components, 0, view shape)`; the components are placed in the view's coordinates."""
    a, b = shape
    gate, up, down = names
    parts = ((gate, 0, a // 2), (up, a // 2, a // 2)) if pname == "w13_weight" else ((down, 0, a),)
    step = a  # rows of one slot in the view
    out = []
    experts = sorted({g for ids in placement.values() for g in ids})
    for e in experts:
        for proj, offset, rows in parts:
            name = f"{prefix}.{e}.{proj}.weight"
            # every EP rank registers the buffer: each component spans them all, empty where the expert is not
            pieces = {r: [Piece(Box((0, 0), (rows, b)), Box((ids.index(e) * step + offset, 0), (rows, b)),
                                tensor=name)] if e in ids else [] for r, ids in placement.items()}
            shapes = {r: (len(ids) * step, b) for r, ids in placement.items()}
            out.append((name, ExplicitLayout((rows, b), dtype, pieces, shapes, name=name)))
    return out, 0, None  # the view's shape differs per rank: set by the caller from the local buffer


def _expert_placement(layer: Any, replicas: Sequence[Sequence[int]]) -> dict[int, list[int]] | str:
    """Under expert parallelism: group rank -> the global expert ids it holds, in local-slot order, for every EP
    rank of every replica of `layer`; or why it cannot be laid out.

    The EP group of a stage is its DP x TP ranks (`ep_rank = dp_rank * tp + tp_rank`: `replicas` holds each DP
    replica's TP ranks of the stage, `dp_size` consecutive lists per engine). Every EP rank's experts come from
    vLLM's own placement rule (`determine_expert_map` with the layer's placement strategy); this rank's must equal
    what the live layer holds (`expert_map_manager.get_local_expert_ids()`). EPLB (whose map changes at run time)
    and redundant or fused shared experts are refused, naming the feature."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    pc = layer.moe_config.moe_parallel_config
    manager = getattr(layer, "expert_map_manager", None)
    if pc.enable_eplb:
        return "expert parallelism with EPLB (expert-parallel load balancing: the expert map changes at run time)"
    if manager is None:
        return "expert parallelism without an expert_map_manager on the layer"
    if getattr(manager, "num_fused_shared_experts", 0):
        return f"expert parallelism with {manager.num_fused_shared_experts} fused shared experts"
    logical = int(getattr(layer.moe_config, "num_logical_experts", layer.global_num_experts))
    if layer.global_num_experts != logical:
        return (f"expert parallelism with redundant experts ({layer.global_num_experts} physical, {logical} "
                "logical)")
    dp, ep = pc.dp_size, pc.ep_size
    if len(replicas) % dp or any(len(r) * dp != ep for r in replicas):
        return f"an EP group of {ep} ranks over {len(replicas)} TP groups of {[len(r) for r in replicas]}, DP {dp}"
    out: dict[int, list[int]] = {}
    for first in range(0, len(replicas), dp):
        group = [rank for r in replicas[first:first + dp] for rank in r]
        for ep_rank, rank in enumerate(group):
            _, expert_map, _ = determine_expert_map(ep, ep_rank, layer.global_num_experts,
                                                    manager.placement_strategy)
            assert expert_map is not None
            slots = sorted((int(s), g) for g, s in enumerate(expert_map.tolist()) if s >= 0)
            out[rank] = [g for _, g in slots]
            if ep_rank == pc.ep_rank:
                live = [int(g) for g in manager.get_local_expert_ids()]
                if out[rank] != live:
                    return (f"an expert placement vLLM's rule does not give: EP rank {ep_rank} holds {live}, "
                            f"determine_expert_map gives {out[rank]} ({manager.placement_strategy})")
    return out


def _expert_layout(placement: dict[int, list[int]], num: int, rest: tuple[int, int], dtype: torch.dtype,
                   name: str) -> ExplicitLayout:
    """The global `[num, *rest]` expert tensor, each rank holding whole experts `placement[rank]` in its local slots
    (a run of consecutive experts in consecutive slots is one piece)."""
    pieces: dict[int, list[Piece]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for rank, ids in placement.items():
        shapes[rank] = (len(ids), *rest)
        runs: list[list[int]] = []  # [first global, first slot, count]
        for slot, g in enumerate(ids):
            if runs and runs[-1][0] + runs[-1][2] == g:
                runs[-1][2] += 1
            else:
                runs.append([g, slot, 1])
        pieces[rank] = [Piece(Box((g, 0, 0), (n, *rest)), Box((slot, 0, 0), (n, *rest)), tensor=name)
                        for g, slot, n in runs]
    return ExplicitLayout((num, *rest), dtype, pieces, shapes, name=name)


def parameter_names(model: torch.nn.Module) -> list[str]:
    """The names of the live parameters `engine_targets` lays out (`module.param`, a module seen twice once)."""
    return [f"{mn}.{pn}" if mn else pn for mn, layer in model.named_modules()
            for pn, p in layer._parameters.items() if p is not None]


def _stage_replicas(replicas: Sequence[Sequence[int]], stages: Sequence[int], pp: int) -> list[list[int]]:
    """The TP groups (group ranks) of pipeline `stages` in every replica (`replicas[d]`: `pp * tp` group ranks,
    stage-major, as vLLM numbers its workers `pp_rank * tp + tp_rank`): one replicated copy per (replica, stage)."""
    out = []
    for r in replicas:
        tp = len(r) // pp
        out.extend(list(r[s * tp:(s + 1) * tp]) for s in stages)
    return out


def engine_targets(model: torch.nn.Module, replicas: Sequence[Sequence[int]],
                   stages: Mapping[str, Sequence[int]] | None = None, pp: int = 1,
                   per_expert: bool = False) -> list[Target]:
    """One `Target` per loaded parameter of the live `model`, with layouts over the group ranks `replicas`
    (one list of group ranks per engine replica, `pp * tp` of them, stage-major, TP order within a stage).

    Args:
        stages: under pipeline parallelism (`pp > 1`), parameter name (`parameter_names`) -> the pipeline stages
            that hold it (every stage's names, gathered by the caller): a parameter's copies on those stages are
            replicas of one another, and the stages without it receive none of it. Required when `pp > 1`.
        pp: the engine's pipeline-parallel size.
        per_expert: under expert parallelism, declare the experts one by one (`...mlp.experts.{e}.gate_proj.weight`
            `[I, H]`, as Megatron's export names them) instead of stacked (`...mlp.experts.gate_proj.weight`).

    Raises:
        ValueError: listing every parameter that cannot be laid out (nothing is written then).
    """
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if pp > 1 and stages is None:
        raise ValueError("engine_targets: pp > 1 needs the stages holding each parameter")
    targets: list[Target] = []
    problems: list[str] = []
    seen: set[int] = set()
    by_param: dict[int, Target] = {}  # id of a live parameter -> the first target that writes it
    for module_name, layer in model.named_modules():
        if id(layer) in seen:  # one module under two names (lm_head = embed_tokens) is written once
            continue
        seen.add(id(layer))
        live = {n: p for n, p in layer._parameters.items() if p is not None}
        if not live:
            continue
        meta = _loader_meta(layer)
        quant = isinstance(getattr(layer, "quant_method", None), QuantizeMethodBase)
        for pname, param in live.items():
            m = meta.get(pname)
            if m is None:  # built after create_weights (bias): loader format is the live one
                m = _as_loaded(layer, pname, param) if quant else param
            full = f"{module_name}.{pname}" if module_name else pname
            held = _stage_replicas(replicas, stages[full], pp) if pp > 1 else replicas
            got = _components(model, module_name, layer, pname, m, held, per_expert)
            if isinstance(got, str):
                problems.append(f"{full}: cannot lay out {got}")
                continue
            components, dim, *placed = got
            first = by_param.get(id(param))
            if first is not None:  # a parameter tied to an earlier module's (lm_head.weight = embed_tokens.weight)
                if [lay.shape for _, lay in components] != [lay.shape for _, lay in first.components] or \
                        len(components) != 1 or quant != first.processed:
                    problems.append(f"{full}: tied to {first.name} but laid out differently "
                                    f"({[lay.shape for _, lay in components]} vs "
                                    f"{[lay.shape for _, lay in first.components]})")
                    continue
                attrs = _loader_attrs(m, layer) if quant else {}
                targets.append(Target(module_name, pname, layer, first.tensor, components, dim, quant, attrs,
                                      alias_of=first.name))
                continue
            if quant:
                buffer = torch.zeros(tuple(m.shape), dtype=m.dtype, device=param.device)
                attrs = _loader_attrs(m, layer)
                view = None if not placed else (int(m.shape[0]) * int(m.shape[1]), int(m.shape[2]))
                targets.append(Target(module_name, pname, layer, buffer, components, dim, True, attrs, view=view))
                by_param[id(param)] = targets[-1]
            else:
                if tuple(param.shape) != tuple(m.shape) or param.dtype != m.dtype:
                    problems.append(f"{full}: the live parameter ({tuple(param.shape)}, {param.dtype}) differs from "
                                    f"its loader format ({tuple(m.shape)}, {m.dtype}) but its layer has no "
                                    "quant_method to re-run")
                    continue
                targets.append(Target(module_name, pname, layer, param.data.clone(), components, dim, False,
                                      live=param.data))
                by_param[id(param)] = targets[-1]
    if problems:
        raise ValueError(f"reshard vLLM backend: {len(problems)} engine parameter(s) the refit cannot reach:\n  "
                         + "\n  ".join(problems))
    return targets
