"""A live Megatron-core `GPTModel` chunk registered as `Refit` sources under Hugging Face names.

Where each weight lies is read from what Megatron states, not guessed from names: `model.sharded_state_dict()` gives
every local tensor's checkpoint key, global shape and offset (the layer, and for experts the global expert, as
prepended axes; `linear_fc1`'s gate and up halves as two tensors at their own offsets, which is how its
`partition_stride=2` reads), and `parallel_state` the stage and sizes the chunk is checked against. Each stated
tensor is a view of one parameter; its place in that parameter (the local box) comes from the view's storage
offset. `_names.segments` cuts each Megatron tensor into Hugging Face tensors along its rows, so one parameter
(the fused `linear_qkv`, `linear_fc1`) becomes several sources, each a set of pieces of the same local tensor: no
copy, no gather. Replicas (DP, CP, expert-DP, the last stage's tied output layer) register the same pieces on their
own ranks and are extra holders for the planner, never extra traffic.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from reshard.integrations.megatron._names import EXPERTS, LAYERS, Dims, expected_shape, hf_shapes, known, segments
from reshard.planner import Box, ExplicitLayout, Piece
from reshard.refit import Refit

logger = logging.getLogger(__name__)


def add_sources(refit: Refit, model: Any, *, vocab_size: int | None = None) -> list[str]:
    """Register this rank's Megatron-core `GPTModel` chunk as `refit` sources under Hugging Face names.

    Call it on every trainer rank (TP x PP x EP x DP x CP), after the model is built and before the first
    `refit.run()`; every later run sends the parameters' current values (an optimizer step updates them in place).
    Trained buffers saved with the model are sent like weights: the router's `expert_bias` (aux-loss-free routing)
    as the engine's `mlp.gate.e_score_correction_bias` (an engine without it is refused, naming it); a saved buffer
    with no known Hugging Face name is refused. The model is followed, not its parameter objects (`Refit.follow`):
    a parameter replaced by a new one of the same local shape, dtype and device (`layer.weight = nn.Parameter(...)`,
    `load_state_dict(assign=True)`) is sent from the next run; one that does not fit is refused on every rank,
    naming it, before data moves.

    With Megatron's distributed optimizer and `overlap_param_gather`, pass the `DistributedDataParallel` wrapper
    (not the bare `GPTModel`): the parameter all-gather the optimizer step leaves to the next forward is then
    completed before every run (a bare model gives no way to reach it, and a refit right after `optimizer.step()`
    would send half of each parameter from the step before).

    Args:
        refit: the `Refit` (its group rank is where this rank's pieces are declared).
        model: this rank's `GPTModel` (wrapped in Megatron's `DistributedDataParallel` / `Float16Module` or not), or
            a list of its virtual-pipeline chunks (one chunk only: virtual stages are not supported yet).
        vocab_size: the real vocabulary. A `GPTModel` holds the padded one (e.g. 256 rows for 203 tokens); padded
            rows never move. Required: pass the model's row count for a vocabulary Megatron did not pad.

    Returns:
        The Hugging Face names this rank registered, sorted.

    Raises:
        NotImplementedError: a feature this cannot express yet (virtual pipeline stages, expert tensor parallelism,
            fewer query groups than TP ranks, a non-gated MLP, multi-token prediction, `GroupedMLP` experts), naming
            the parameter and the feature: raised on every rank, as every rank has the same config.
        ValueError: no or an impossible `vocab_size`.

    A problem only this rank can see (a chunk built for another pipeline stage, a parameter whose shape disagrees
    with the config, a weight with no Hugging Face name) is recorded with `refit.refuse`: the first `run()` raises
    it on every rank before any data moves.
    """
    from megatron.core import parallel_state as ps  # lazy: the trainer's own package, absent elsewhere

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    chunk = _unwrap(chunks[0]) if chunks else None
    if chunk is None or not hasattr(chunk, "sharded_state_dict") or not hasattr(chunk, "decoder"):
        raise TypeError(f"megatron.add_sources: expected a Megatron-core GPTModel (or a list of its chunks), got "
                        f"{type(model).__name__}")
    first = next((n for n, _ in chunk.named_parameters()), "<no parameters>")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if len(chunks) > 1 or vpp > 1:
        raise NotImplementedError(f"megatron.add_sources: parameter {first!r}: virtual pipeline stages "
                                  f"({max(len(chunks), vpp)} model chunks per rank) are not supported yet")
    cfg = chunk.config
    _check_features(chunk, cfg, ps)
    dims = _dims(chunk, cfg, vocab_size)
    problems = _check_stage(chunk, cfg, ps)
    params = dict(chunk.named_parameters())
    buffers = dict(chunk.named_buffers())
    seen: set[str] = set()
    entries: dict[str, tuple[torch.Tensor, tuple[int, ...], list[Piece]]] = {}
    for pname, st in _stated(chunk.sharded_state_dict()):
        param = params.get(pname)
        if param is None and pname in buffers:  # a trained buffer (the router's expert_bias): sent like a weight
            if not known(st.key):
                problems.append(f"buffer {pname!r} (Megatron key {st.key!r}) is saved with the model (a trained "
                                "state the engine may need) but no Hugging Face name is known for it")
                continue
            param = buffers[pname]
        if param is None:  # extra state: not a tensor the engine loads
            continue
        seen.add(pname)
        e = _add_pieces(entries, pname, param, st, dims)
        if e:
            problems.append(e)
    for pname in sorted(set(params) - seen):
        problems.append(f"parameter {pname!r} is not in the model's sharded_state_dict(), so its place in the "
                        "global tensor is unknown")
    rank = refit.rank
    pnames = {id(p): n for n, p in params.items()}
    tied = bool(getattr(chunk, "share_embeddings_and_output_weights", False))
    for name, (tensor, shape, pieces) in sorted(entries.items()):
        layout = ExplicitLayout(shape, tensor.dtype, {rank: pieces}, {rank: tuple(tensor.shape)}, name=name)
        aliases = ["lm_head.weight"] if tied and name == "model.embed_tokens.weight" else []
        refit.add_source(name, tensor, layout, aliases=aliases)
        if id(tensor) in pnames:  # a parameter replaced in the model is read at the next run (buffers: in place)
            refit.follow(name, chunk, pnames[id(tensor)])
    refit.declare_facts(_facts(cfg, dims, tied), who="trainer (Megatron's TransformerConfig)")
    _gather_before_run(refit, chunks[0])
    for p in problems:
        refit.refuse(f"megatron.add_sources: {p}")
    logger.debug("megatron.add_sources: rank %d registered %d weights, %d problems", rank, len(entries),
                 len(problems))
    return sorted(entries)


def _gather_before_run(refit: Refit, model: Any) -> None:
    """With Megatron's distributed optimizer and `overlap_param_gather`, `optimizer.step()` updates each DP rank's
    shard of the parameter buffer and leaves the all-gather of the others' to the next forward (its first bucket
    dispatched, not waited for, by `zero_grad()`): a refit right after the step would read half new, half old
    values. So every run first completes that all-gather (`start_param_sync(force_sync=True)`: waits for a
    dispatched one, runs the others; Megatron's next forward then finds it done)."""
    ddps = []
    while model is not None and not hasattr(model, "decoder"):
        if hasattr(model, "start_param_sync") and hasattr(model, "ddp_config"):
            ddps.append(model)
        model = getattr(model, "module", None)
    for ddp in ddps:
        cfg = ddp.ddp_config
        if getattr(cfg, "use_distributed_optimizer", False) and getattr(cfg, "overlap_param_gather", False):
            refit.before_run(lambda d=ddp: d.start_param_sync(force_sync=True))
            logger.debug("megatron.add_sources: rank %d: overlap_param_gather: the parameter all-gather is completed "
                         "before every run", refit.rank)


def _unwrap(model: Any) -> Any:
    """The `GPTModel` inside Megatron's wrappers (`DistributedDataParallel`, `Float16Module`: `.module`)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def _dims(chunk: Any, cfg: Any, vocab_size: int | None) -> Dims:
    padded = int(getattr(chunk, "vocab_size", 0) or 0)
    if vocab_size is None:
        raise ValueError(f"megatron.add_sources: pass vocab_size= (the real vocabulary): the model holds {padded} "
                         "rows, which Megatron pads to a multiple of make_vocab_size_divisible_by x TP; pass "
                         f"vocab_size={padded} if this vocabulary is not padded")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ValueError(f"megatron.add_sources: vocab_size must be an integer in [1, {padded}] (the model's padded "
                         f"vocabulary), got {vocab_size!r}")
    heads = int(cfg.num_attention_heads)
    return Dims(hidden=int(cfg.hidden_size), heads=heads, groups=int(cfg.num_query_groups or heads),
                head_dim=int(cfg.kv_channels or cfg.hidden_size // heads), ffn=int(cfg.ffn_hidden_size or 0),
                moe_ffn=int(getattr(cfg, "moe_ffn_hidden_size", 0) or 0),
                shared_ffn=int(getattr(cfg, "moe_shared_expert_intermediate_size", 0) or 0),
                experts=int(getattr(cfg, "num_moe_experts", 0) or 0), gated=bool(cfg.gated_linear_unit),
                vocab=vocab_size, padded=padded)


def _facts(cfg: Any, dims: Dims, tied: bool) -> dict[str, Any]:
    """What the engine's config must agree with (`Refit.declare_facts`), by Hugging Face config names."""
    return {"num_attention_heads": dims.heads, "num_key_value_heads": dims.groups, "head_dim": dims.head_dim,
            "hidden_size": dims.hidden, "num_hidden_layers": int(cfg.num_layers), "num_experts": dims.experts,
            "vocab_size": dims.vocab, "tie_word_embeddings": tied}


def _param_like(chunk: Any, *parts: str) -> str:
    """The first parameter name containing every part (to name the parameter an unsupported feature concerns)."""
    return next((n for n, _ in chunk.named_parameters() if all(p in n for p in parts)), "<none>")


def _check_features(chunk: Any, cfg: Any, ps: Any) -> None:
    """Raise `NotImplementedError` for what the mapping cannot express yet (every rank: the config is global)."""
    tp = ps.get_tensor_model_parallel_world_size()
    groups = int(cfg.num_query_groups or cfg.num_attention_heads)
    why = []
    if groups < tp:
        why.append((_param_like(chunk, "linear_qkv.weight"), f"fewer query groups ({groups}) than tensor-parallel "
                    f"ranks ({tp}): Megatron then splits a group's heads over ranks"))
    if getattr(cfg, "num_moe_experts", None) and ps.get_expert_tensor_parallel_world_size() > 1:
        why.append((_param_like(chunk, "experts"), f"expert tensor parallelism (ETP = "
                    f"{ps.get_expert_tensor_parallel_world_size()})"))
    if not cfg.gated_linear_unit:
        why.append((_param_like(chunk, "linear_fc1.weight"), "a non-gated MLP (gated_linear_unit=False): its "
                    "Hugging Face names differ per model family"))
    if getattr(cfg, "mtp_num_layers", None):
        why.append((_param_like(chunk, "mtp"), "multi-token prediction layers"))
    grouped = _param_like(chunk, "mlp.experts.weight1")
    if grouped != "<none>":
        why.append((grouped, "GroupedMLP experts (moe_grouped_gemm with the local spec): sharded_state_dict() states "
                    "weight1 [H, E_local * 2F] as transposed copies, not views of the parameter, so they cannot be "
                    "registered live (SequentialMLP experts can)"))
    if why:
        raise NotImplementedError("megatron.add_sources: not supported yet: " + "; ".join(
            f"parameter {p!r}: {w}" for p, w in why))


def _check_stage(chunk: Any, cfg: Any, ps: Any) -> list[str]:
    """Problems with this chunk on this rank: built for another pipeline stage or other parallel sizes."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = []
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    for attr, here in (("pre_process", ps.is_pipeline_first_stage(ignore_virtual=True)),
                       ("post_process", ps.is_pipeline_last_stage(ignore_virtual=True))):
        if bool(getattr(chunk, attr, here)) != here:
            out.append(f"the model chunk has {attr}={getattr(chunk, attr)}, but this rank is pipeline stage {stage} "
                       f"of {pp}: a chunk built for another stage")
    offset = get_transformer_layer_offset(cfg)
    for i, layer in enumerate(getattr(chunk.decoder, "layers", [])):
        number = getattr(layer, "layer_number", None)
        if number is not None and number != offset + i + 1:
            out.append(f"decoder layer {i} of the chunk is global layer {number - 1}, but pipeline stage {stage} "
                       f"of {pp} starts at layer {offset}: a chunk built for another stage")
            break
    for what, size, here in (("tensor", cfg.tensor_model_parallel_size, ps.get_tensor_model_parallel_world_size()),
                             ("pipeline", cfg.pipeline_model_parallel_size, pp)):
        if size != here:
            out.append(f"the model's config says {what}-parallel size {size}, parallel_state says {here}")
    return out


def _stated(sd: Any, outer: str | None = None) -> list[tuple[str, Any]]:
    """`(local parameter name, ShardedTensor)` for every tensor `sharded_state_dict()` states (factories built)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: list[tuple[str, Any]] = []
    items = sd.items() if isinstance(sd, dict) else enumerate(sd) if isinstance(sd, (list, tuple)) else ()
    for k, v in items:
        name = outer if outer is not None else str(k)
        if isinstance(v, ShardedTensorFactory):
            out += _stated(v.build(), name)
        elif isinstance(v, ShardedTensor):
            out.append((name, v))
        elif isinstance(v, (dict, list, tuple)):
            out += _stated(v, name)
    return out


def _locate(param: torch.Tensor, data: torch.Tensor) -> Box | None:
    """The box of `param` that `data` (a view of `param`'s memory, as `sharded_state_dict()` states it) is; None
    when `data` is not such a box (a copy, or a view of other strides)."""
    if data.numel() and data.untyped_storage().data_ptr() != param.untyped_storage().data_ptr():
        return None
    if data.dim() != param.dim() or (data.numel() > 1 and data.stride() != param.stride()):
        return None
    rest = data.storage_offset() - param.storage_offset()
    offsets = [0] * param.dim()
    for d in sorted(range(param.dim()), key=lambda d: -param.stride(d)):
        offsets[d], rest = divmod(rest, param.stride(d)) if param.shape[d] > 1 else (0, rest)
    if rest or not all(0 <= o and o + n <= s for o, n, s in zip(offsets, data.shape, param.shape)):
        return None
    return Box(tuple(offsets), tuple(data.shape))


def _add_pieces(entries: dict[str, tuple[torch.Tensor, tuple[int, ...], list[Piece]]], pname: str,
                param: torch.Tensor, st: Any, dims: Dims) -> str | None:
    """Add the Hugging Face pieces of one stated tensor to `entries`; a problem's description, or None."""
    key, pre = st.key, int(st.prepend_axis_num)
    if st.flattened_range is not None:
        return f"parameter {pname!r} (Megatron key {key!r}): stated as a flattened range, not a box"
    if not known(key):
        return f"parameter {pname!r} (Megatron key {key!r}): no Hugging Face name is known for this weight"
    shape, expected = tuple(st.global_shape[pre:]), expected_shape(key, dims)
    if shape != expected:
        return (f"parameter {pname!r} (Megatron key {key!r}): global shape {shape} (local {tuple(param.shape)}) "
                f"disagrees with the model's config, which gives {expected}")
    local = _locate(param, st.data)
    if local is None:
        return (f"parameter {pname!r} (Megatron key {key!r}): its stated tensor is not a box of the parameter's "
                "memory (a layout this integration cannot read)")
    offsets = tuple(int(o) for o in st.global_offset[pre:])
    layer = int(st.global_offset[0]) if key.startswith(LAYERS) else None
    expert = int(st.global_offset[1]) if key.startswith(LAYERS + EXPERTS) else None
    inner = key[len(LAYERS):] if layer is not None else key
    segs = segments(inner, dims)
    shapes = hf_shapes(segs, shape[1:])
    lo, hi = offsets[0], offsets[0] + local.shape[0]
    for s in segs:
        a, b = max(lo, s.start), min(hi, s.start + s.rows)
        if a >= b:
            continue  # padded vocabulary rows, or a segment another rank holds
        name = (f"model.layers.{layer}." if layer is not None else "") + s.name.format(e=expert)
        g = Box((s.hf_start + a - s.start, *offsets[1:]), (b - a, *local.shape[1:]))
        loc = Box((local.offsets[0] + a - lo, *local.offsets[1:]), (b - a, *local.shape[1:]))
        tensor, _, pieces = entries.setdefault(name, (param, shapes[s.name], []))
        if tensor is not param:
            return (f"parameter {pname!r}: Hugging Face weight {name!r} is also held by another parameter of this "
                    "rank; each weight must come from one parameter per rank")
        pieces.append(Piece(g, loc, tensor=name))
    return None


__all__: Sequence[str] = ["add_sources"]
