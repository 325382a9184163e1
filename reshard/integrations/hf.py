"""Hugging Face models on a vLLM-style engine: every engine tensor's name, local shape and layout, from the model.

`engine_tensors(model, EngineParallel(ranks, tp=..., ep=...))` takes a `transformers` model (or its config, or a
`{name: shape}` mapping with a config) and the engine's parallelism, and gives the engine's local tensors as
vLLM lays them out.

Per Hugging Face weight, the engine tensor and what TP rank `t` of `tp` holds (replicas repeat it):
- `self_attn.{q,k,v}_proj.*` -> `self_attn.qkv_proj.*`: `[q rows t; k rows t; v rows t]`; with fewer KV heads than
  `tp`, KV head `t // (tp / kv_heads)` whole;
- `self_attn.o_proj.weight`, `mlp.down_proj.weight` -> same names: columns `t`;
- `mlp.{gate,up}_proj.weight` (also shared experts) -> `mlp.gate_up_proj.weight`: `[gate rows t; up rows t]`;
- transformers 5's `mlp.experts.gate_up_proj` `[E, 2 I, H]` -> `mlp.experts.w13_weight`: TP `[gate I-chunk t; up
  I-chunk t]` along dim 1 (`_S(1, 2)`), EP experts `S(0)` over the `ep` ranks; `mlp.experts.down_proj` `[E, H, I]`
  -> `mlp.experts.w2_weight`: TP `S(2)`, EP `S(0)`;
- older checkpoints' `mlp.experts.{e}.{gate,up,down}_proj.weight` -> the same `w13_weight` / `w2_weight`, expert
  `e` at its local index;
- `embed_tokens.weight`, `lm_head.weight` -> same names: the vocabulary padded to a multiple of 64, rows split
  evenly;
- anything else (norms, routers, MLA down-projections) -> same name, replicated.

A tied `lm_head` (`tie_word_embeddings`) is the embedding on the engine too: it gets no tensor of its own. Every
component keeps its Hugging Face name, so a trainer registering `model.named_parameters()` needs no name map;
`trainer_name` strips the wrappers (`torch.compile`, activation checkpointing, DDP) that rename parameters.

With expert parallelism (`ep > 1`), experts are split over `ep` consecutive engine ranks (vLLM's
`enable_expert_parallel`: experts are then not tensor-parallel) and replicated over the rest.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard.integrations.fused import EngineTensor
from reshard.integrations.fused import engine_tensors as _fuse_tensors
from reshard.integrations.model_config import config_value, model_facts, trainer_name
from reshard.planner import Box, ExplicitLayout, Layout, LayoutLike, Mesh, Piece, vocab_parallel_layout

__all__ = ["EngineParallel", "engine_layouts", "engine_tensors", "model_facts", "name_map", "trainer_name"]

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True)
class EngineParallel:
    """The engine's parallelism over its ranks (group ranks of the refit).

    Args:
        ranks: every engine rank, replica by replica: `tp` consecutive ranks form one tensor-parallel group.
        tp: tensor-parallel size.
        ep: expert-parallel size (1: experts are tensor-parallel like the rest); experts are split over `ep`
            consecutive ranks, which must divide the ranks evenly.
        pad_vocab_to: the vocabulary is padded to a multiple of this (vLLM: 64).

    Example: `EngineParallel(range(4, 8), tp=2)` is two TP2 replicas, `[4, 5]` and `[6, 7]`.
    """

    ranks: Sequence[int]
    tp: int = 1
    ep: int = 1
    pad_vocab_to: int = 64

    def __post_init__(self) -> None:
        ranks = tuple(int(r) for r in self.ranks)
        object.__setattr__(self, "ranks", ranks)
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"EngineParallel: ranks must be distinct and not empty, got {list(ranks)}")
        for what, v in (("tp", self.tp), ("ep", self.ep)):
            if not isinstance(v, int) or v < 1 or len(ranks) % v:
                raise ValueError(f"EngineParallel: {what}={v!r} must be a positive integer dividing the "
                                 f"{len(ranks)} engine ranks {list(ranks)}")
        if self.pad_vocab_to < 1:
            raise ValueError(f"EngineParallel: pad_vocab_to must be >= 1, got {self.pad_vocab_to}")

    @property
    def mesh(self) -> Mesh:
        """`(replicas, tp)` over the engine ranks."""
        return Mesh(torch.tensor(self.ranks).reshape(-1, self.tp), axis_names=("dp", "tp"))

    @property
    def expert_mesh(self) -> Mesh:
        """`(replicas, ep)` over the engine ranks."""
        return Mesh(torch.tensor(self.ranks).reshape(-1, self.ep), axis_names=("edp", "ep"))

    def groups(self) -> list[list[int]]:
        """The TP groups, in replica order."""
        return [list(self.ranks[i:i + self.tp]) for i in range(0, len(self.ranks), self.tp)]


def _parameters(model: Any, config: Any, dtype: torch.dtype | None) -> tuple[list[tuple[str, tuple, Any]], Any]:
    """`(name, global shape, dtype)` per parameter, and the config."""
    if isinstance(model, torch.nn.Module):
        cfg = config if config is not None else getattr(model, "config", None)
        if cfg is None:
            raise ValueError("hf.engine_tensors: the module has no .config; pass config=")
        return [(trainer_name(n), tuple(p.shape), dtype or p.dtype) for n, p in model.named_parameters()], cfg
    if isinstance(model, Mapping) and not config_value(model, "hidden_size"):
        if config is None:
            raise ValueError("hf.engine_tensors: a {name: shape} mapping needs config= (head counts, tied "
                             "embeddings)")
        dt = dtype or _config_dtype(config)
        out = []
        for n, v in model.items():
            shape, d = (v if len(v) == 2 and isinstance(v[1], torch.dtype) else (v, dt))
            out.append((n, tuple(int(s) for s in shape), d))
        return out, config
    # a config: build the model on the meta device (no memory, no weights) to read its parameter names
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(model, Mapping):  # a config's to_dict()
        rest = {k: v for k, v in model.items() if k != "model_type"}
        model = AutoConfig.for_model(model["model_type"], **rest)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(model)
    dt = dtype or _config_dtype(model)
    return [(n, tuple(p.shape), dt) for n, p in meta.named_parameters()], model


def _config_dtype(config: Any) -> torch.dtype:
    d = config_value(config, "dtype") or (config.get("torch_dtype") if isinstance(config, Mapping) else None)
    d = d or torch.float32  # what transformers builds a model in when the config names no dtype
    return getattr(torch, d) if isinstance(d, str) else d


def engine_layouts(
    model: Any, parallel: EngineParallel, *, config: Any = None, dtype: torch.dtype | None = None
) -> list[tuple[str, LayoutLike]]:
    """`(Hugging Face name, engine layout)` per global tensor, unfused (see the module docstring for the rules).

    Per-expert names of older checkpoints are not listed here: their layouts exist only inside the fused
    `w13_weight` / `w2_weight` (see `engine_tensors`).

    Args:
        model: a `torch.nn.Module` (its `named_parameters()`, global shapes for DTensors, and `.config`), a
            `transformers` config (the model is built on the meta device to read its parameters), or a mapping
            name -> shape (or `(shape, dtype)`) with `config`.
        parallel: the engine's parallelism.
        config: the model's config where `model` does not carry it (a config object or its `to_dict()`).
        dtype: the engine's dtype (default: the parameters' or the config's).
    """
    params, cfg = _parameters(model, config, dtype)
    return [(n, lay) for n, shape, dt in params if not _PER_EXPERT.match(n)
            for lay in [_layout(n, shape, dt, cfg, parallel)] if lay is not None]


def engine_tensors(
    model: Any, parallel: EngineParallel, *, config: Any = None, dtype: torch.dtype | None = None
) -> list[EngineTensor]:
    """The engine's local tensors: names, per-rank local shapes, and the layouts of the global tensors in them.

    Args: as `engine_layouts`.

    Returns:
        One `EngineTensor` per engine tensor. On each engine rank, allocate `t.local_shape(rank)` of `t.dtype` for
        every `t` with `rank in t.ranks` (or take the engine's own parameter) and call `t.register(refit, tensor)`,
        which also declares the config's model facts (`model_facts`: heads, KV heads, head dim, ...), so a trainer
        of other heads with the same shapes is refused on every rank before data moves.

    Example (Qwen3, 2 TP2 replicas on group ranks 4-7):
        >>> ets = engine_tensors(model, EngineParallel(range(4, 8), tp=2))
        >>> [t.name for t in ets][:2]
        ['model.embed_tokens.weight', 'model.layers.0.self_attn.qkv_proj.weight']
    """
    params, cfg = _parameters(model, config, dtype)
    plain = [(n, lay) for n, shape, dt in params if not _PER_EXPERT.match(n)
             for lay in [_layout(n, shape, dt, cfg, parallel)] if lay is not None]
    out = _fuse_tensors(plain, pad_vocab_to=None)
    out.extend(_per_expert_tensors([(n, s, d) for n, s, d in params if _PER_EXPERT.match(n)], parallel))
    # the config's heads, KV heads, head dim, ...: `register` declares them, so a trainer whose every shape matches
    # but whose heads differ (8 x 32 into 4 x 64) is refused on every rank instead of refitting into nonsense
    facts = tuple((k, v) for k, v in model_facts(cfg).items() if v is not None)
    return [replace(t, facts=facts, facts_from="engine (the config given to hf.engine_tensors)") for t in out]


def name_map(tensors: Sequence[EngineTensor]) -> dict[str, str]:
    """Hugging Face (trainer) name -> the engine tensor holding it (`...q_proj.weight` -> `...qkv_proj.weight`)."""
    return {g: t.name for t in tensors for g, _ in t.components}


# ---- per-weight rules -------------------------------------------------------------------------------------------

def _layout(name: str, shape: tuple, dtype: torch.dtype, cfg: Any, par: EngineParallel) -> LayoutLike | None:
    mesh, tp = par.mesh, par.tp
    rep = Replicate()

    def lay(mesh_: Mesh, *placements: Any) -> Layout:
        return Layout(shape, mesh_, list(placements), dtype, name=name)

    def split(dim: int) -> Layout:
        if shape[dim] % tp:
            raise NotImplementedError(f"hf.engine_tensors: {name!r} of shape {shape}: dim {dim} ({shape[dim]}) is not "
                                      f"divisible by tp={tp}, as vLLM's tensor-parallel layers need")
        return lay(mesh, rep, Shard(dim))

    if name.endswith("lm_head.weight") and config_value(cfg, "tie_word_embeddings", default=False):
        return None  # the engine ties it to the embedding
    if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
        return vocab_parallel_layout(shape[0], shape[1], par.groups()[0], dtype=dtype, pad_to=par.pad_vocab_to,
                                     name=name, replicas=par.groups())
    m = re.match(r"^(.*)\.self_attn\.(k|v)_proj\.(weight|bias)$", name)
    if m:
        kv = int(config_value(cfg, "num_key_value_heads", "num_attention_heads"))
        if kv >= tp:
            return split(0)
        return _replicated_kv(name, shape, dtype, kv, par)
    if re.search(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.(weight|bias)$", name) or re.search(
            r"\.(mlp|shared_experts|shared_expert)\.(gate|up)_proj\.(weight|bias)$", name):
        return split(0)
    if re.search(r"\.(self_attn\.o_proj|mlp\.down_proj|shared_experts\.down_proj|shared_expert\.down_proj)\.weight$",
                 name):
        return split(1)
    experts = re.match(r"^.*\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
    if experts and len(shape) == 3:
        if par.ep > 1:
            if shape[0] % par.ep:
                raise NotImplementedError(f"hf.engine_tensors: {name!r}: {shape[0]} experts do not divide over "
                                          f"ep={par.ep} ranks")
            return lay(par.expert_mesh, rep, Shard(0))
        if experts.group(1) == "gate_up_proj":  # [E, 2 I, H]: gate and up halves, each split over TP
            if shape[1] % (2 * tp):
                raise NotImplementedError(f"hf.engine_tensors: {name!r}: intermediate size {shape[1] // 2} is not "
                                          f"divisible by tp={tp}")
            return lay(mesh, rep, _StridedShard(1, split_factor=2))
        return split(2)  # down_proj [E, H, I]
    m = re.match(r"^.*\.mlp\.experts\.(gate|up|down)_proj\.weight$", name)
    if m and len(shape) == 3:  # stacked [E, I, H] / [E, H, I] under per-projection names
        if par.ep > 1:
            return lay(par.expert_mesh, rep, Shard(0))
        return split(2 if m.group(1) == "down" else 1)
    return lay(mesh, rep, rep)


def _replicated_kv(name: str, shape: tuple, dtype: torch.dtype, kv: int, par: EngineParallel) -> ExplicitLayout:
    """K/V with fewer heads than TP ranks: TP rank `t` holds KV head `t // (tp // kv)` whole (vLLM's replication)."""
    tp = par.tp
    if tp % kv:
        raise NotImplementedError(f"hf.engine_tensors: {name!r}: tp={tp} is not a multiple of the {kv} KV heads")
    hd = shape[0] // kv
    rest = tuple(shape[1:])
    pieces, shapes = {}, {}
    for group in par.groups():
        for t, r in enumerate(group):
            h = t // (tp // kv)
            pieces[r] = [Piece(Box((h * hd,) + (0,) * len(rest), (hd, *rest)), Box((0,) * len(shape), (hd, *rest)),
                               tensor=name)]
            shapes[r] = (hd, *rest)
    return ExplicitLayout(shape, dtype, pieces, shapes, name=name)


def _per_expert_tensors(params: Sequence[tuple[str, tuple, torch.dtype]], par: EngineParallel) -> list[EngineTensor]:
    """`w13_weight` / `w2_weight` from per-expert `gate/up/down_proj` `[I, H]` / `[H, I]` weights.

    The engine tensors are `[E_local, 2 I_local, H]` and `[E_local, H, I_local]`; the layouts are in their
    `[E_local * 2 I_local, H]` and `[E_local * H, I_local]` views, where expert `e`'s gate rows start at
    `e_local * 2 I_local`, its up rows `I_local` later, and its down block at `e_local * H`.
    """
    layers: dict[str, dict[int, dict[str, tuple[str, tuple, torch.dtype]]]] = {}
    for n, shape, dt in params:
        m = _PER_EXPERT.match(n)
        assert m is not None
        layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = (n, shape, dt)
    out = []
    for prefix, experts in layers.items():
        num = len(experts)
        if sorted(experts) != list(range(num)) or any(len(v) != 3 for v in experts.values()):
            raise ValueError(f"hf.engine_tensors: {prefix}*: experts {sorted(experts)} do not each have gate, up and "
                             "down projections numbered 0..E-1")
        ep, tp = par.ep, (1 if par.ep > 1 else par.tp)
        if num % ep:
            raise NotImplementedError(f"hf.engine_tensors: {prefix}*: {num} experts do not divide over ep={ep}")
        inter, hidden = experts[0]["gate"][1]
        if inter % tp:
            raise NotImplementedError(f"hf.engine_tensors: {prefix}*: intermediate size {inter} is not divisible by "
                                      f"tp={tp}")
        e_loc, i_loc = num // ep, inter // tp
        dtype = experts[0]["gate"][2]
        w13: dict[str, dict[int, list[Piece]]] = {}
        w2: dict[str, dict[int, list[Piece]]] = {}
        for r in par.ranks:
            pos = par.ranks.index(r)
            e_idx = (pos % ep) if ep > 1 else 0
            t = pos % par.tp if ep == 1 else 0
            for el in range(e_loc):
                e = e_idx * e_loc + el
                for k, proj in enumerate(("gate", "up")):
                    n = experts[e][proj][0]
                    w13.setdefault(n, {})[r] = [Piece(Box((t * i_loc, 0), (i_loc, hidden)),
                                                      Box((el * 2 * i_loc + k * i_loc, 0), (i_loc, hidden)), tensor=n)]
                n = experts[e]["down"][0]
                w2.setdefault(n, {})[r] = [Piece(Box((0, t * i_loc), (hidden, i_loc)), Box((el * hidden, 0),
                                                                                           (hidden, i_loc)), tensor=n)]
        for tname, comps, view, real, order in (
            ("w13_weight", w13, (e_loc * 2 * i_loc, hidden), (e_loc, 2 * i_loc, hidden), ("gate", "up")),
            ("w2_weight", w2, (e_loc * hidden, i_loc), (e_loc, hidden, i_loc), ("down",)),
        ):
            names = [experts[e][p][0] for e in range(num) for p in order]
            layouts = tuple((n, ExplicitLayout(experts[0][order[0]][1], dtype, comps[n], dict.fromkeys(par.ranks, view),
                                               name=n)) for n in names)
            out.append(EngineTensor(prefix + tname, layouts, placed=True,
                                    local_shapes=tuple((r, real) for r in par.ranks)))
    return out

