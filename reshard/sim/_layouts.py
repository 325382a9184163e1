"""Layout presets: where a Megatron-style trainer and a vLLM-style inference engine keep each weight.

Trainer (Megatron-Core conventions):
    - ranks are `tp` fastest, then `cp`, `dp`, `pp`; pipeline stage `s` owns ranks
      `[s * stage_size, (s + 1) * stage_size)`, and each weight lives on its stage's sub-mesh only;
    - decoder layers are split over stages as evenly as possible (earlier stages take the extra layer), or as
      `TrainerParallel.stage_layers` says; `embed_tokens` is on the first stage, the final norm, `lm_head` and MTP
      layers on the last;
    - dense weights: mesh `(dp * cp, tp)`; column-parallel `[R, S(0)]`, row-parallel `[R, S(1)]`, vocabulary
      `[R, S(0)]`, everything else replicated;
    - routed experts, stacked `[E, ...]`: mesh `(edp, ep, etp)`; gate/up `[R, S(0), S(1)]`, down `[R, S(0), S(2)]`.
      Unstacked expert `j` lives on the `(edp, etp)` sub-mesh of expert-parallel rank `j // ceil(E / ep)`.

Inference (vLLM conventions): `dp` replicas of `tp` consecutive ranks, mesh `(dp, tp)`, dense weights split as on
the trainer. Routed experts are tensor-parallel like a dense MLP when `ep == 1`, else spread over mesh
`(tp * dp / ep, ep)` as `[R, S(0)]`.

Both sides: k/v projections are split by KV head; when `tp` exceeds `num_key_value_heads`, the tp axis is viewed as
`(num_kv_heads, tp / num_kv_heads)` with `[S(0), R]`, so each KV head is replicated on consecutive ranks, as vLLM
does. MLA down-projections (`q_a_proj`, `kv_a_proj_with_mqa`), routers and norms are replicated.

Real engines differ in details that change no byte count worth noting here: fused `qkv_proj`/`gate_up_proj`,
padded vocabularies, Megatron's interleaved QKV. The model-refit layer declares those exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from reshard.models import ModelConfig, ParamSpec, param_specs
from reshard.planner import Layout, Mesh
from reshard.sim._system import System

R = Replicate()

_REPLICATED_KINDS = frozenset({"norm", "q_a", "kv_a", "router", "router_bias", "mtp_proj"})
_DIM0_KINDS = frozenset({"embedding", "lm_head", "column", "column_kv"})


@dataclass(frozen=True)
class WeightLayouts:
    """One weight's trainer-side and inference-side layouts.

    Attributes:
        spec: the weight.
        train: its layout on the trainer (on its pipeline stage's ranks).
        gen: its layout on the inference engine.
        stage: the trainer pipeline stage holding it.
    """

    spec: ParamSpec
    train: Layout
    gen: Layout
    stage: int


def stage_layer_counts(num_layers: int, pp: int, stage_layers: Sequence[int] | None = None) -> tuple[int, ...]:
    """Decoder layers per pipeline stage.

    Example:
        >>> stage_layer_counts(61, 4)
        (16, 15, 15, 15)
    """
    if stage_layers is not None:
        if sum(stage_layers) != num_layers:
            raise ValueError(f"stage_layers {tuple(stage_layers)} sum to {sum(stage_layers)}, expected {num_layers}")
        return tuple(stage_layers)
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


def pipeline_stage(spec: ParamSpec, config: ModelConfig, counts: Sequence[int]) -> int:
    """The pipeline stage of `spec` given the per-stage decoder layer counts."""
    last = len(counts) - 1
    if spec.layer is None:
        return 0 if spec.kind == "embedding" else last
    if spec.layer >= config.num_hidden_layers:  # MTP layers follow the last decoder layer
        return last
    return int(np.searchsorted(np.cumsum(counts), spec.layer, side="right"))


def _tp_axes(tp: int, spec: ParamSpec, config: ModelConfig, side: str) -> tuple[tuple[int, ...], tuple[Placement, ...]]:
    """The tp axis shape and placements of a weight split on `dim` 0 or 1 (KV heads may replicate)."""
    if spec.kind in _REPLICATED_KINDS:
        return (tp,), (R,)
    dim = 0 if spec.kind in _DIM0_KINDS else 1
    if spec.kind == "column_kv" and tp > config.num_key_value_heads:
        kv = config.num_key_value_heads
        if tp % kv:
            raise ValueError(
                f"{side}: tp={tp} must be a multiple of num_key_value_heads={kv} to replicate KV heads "
                f"(weight {spec.name!r})"
            )
        return (kv, tp // kv), (Shard(0), R)
    if spec.kind == "column_kv" and config.num_key_value_heads % tp:
        raise ValueError(
            f"{side}: num_key_value_heads={config.num_key_value_heads} must be a multiple of tp={tp} "
            f"(weight {spec.name!r})"
        )
    return (tp,), (Shard(dim),)


def _expert_dim(spec: ParamSpec) -> int:
    """The dim a tensor-parallel split cuts in a 2-D expert weight: gate/up by rows, down by columns."""
    return 1 if spec.kind == "expert_w2" else 0


class _Builder:
    """Builds layouts for one (model, system), caching meshes (Layouts share them)."""

    def __init__(self, config: ModelConfig, system: System) -> None:
        if system.domain_size is None:
            raise ValueError("layouts: system.domain_size is None; fill it in (System.with_domain_size)")
        self.config = config
        self.system = system
        self.counts = stage_layer_counts(config.num_hidden_layers, system.train.pp, system.train.stage_layers)
        self._meshes: dict[tuple, Mesh] = {}

    def mesh(self, ranks: range | Sequence[int], shape: tuple[int, ...]) -> Mesh:
        key = (("range", ranks.start, ranks.stop) if isinstance(ranks, range) else ("ranks", *ranks)), shape
        m = self._meshes.get(key)
        if m is None:
            m = Mesh(np.asarray(ranks, dtype=np.int64).reshape(shape))
            self._meshes[key] = m
        return m

    def train(self, spec: ParamSpec, stage: int) -> Layout:
        t = self.system.train
        base = stage * t.stage_size
        ranks = range(base, base + t.stage_size)
        if spec.is_expert:
            if len(spec.shape) == 3:  # stacked [E, ...]: (edp, ep, etp)
                mesh = self.mesh(ranks, (t.edp, t.ep, t.etp))
                placements: tuple[Placement, ...] = (R, Shard(0), Shard(1 + _expert_dim(spec)))
            else:
                block = math.ceil(self.config.num_experts / t.ep)
                ep_rank = spec.expert // block  # type: ignore[operator]
                grid = np.arange(base, base + t.stage_size).reshape(t.edp, t.ep, t.etp)[:, ep_rank, :]
                mesh = self.mesh(tuple(grid.ravel().tolist()), (t.edp, t.etp))
                placements = (R, Shard(_expert_dim(spec)))
        else:
            tp_shape, tp_placements = _tp_axes(t.tp, spec, self.config, "trainer")
            mesh = self.mesh(ranks, (t.dp * t.cp, *tp_shape))  # type: ignore[operator]
            placements = (R, *tp_placements)
        return Layout(spec.shape, mesh, placements, spec.dtype, name=spec.name)

    def gen(self, spec: ParamSpec) -> Layout:
        g = self.system.gen
        ranks = self.system.gen_ranks
        if spec.is_expert and g.ep > 1:
            if len(spec.shape) == 3:
                mesh = self.mesh(ranks, (g.num_gpus // g.ep, g.ep))  # type: ignore[operator]
                placements: tuple[Placement, ...] = (R, Shard(0))
            else:
                block = math.ceil(self.config.num_experts / g.ep)
                ep_rank = spec.expert // block  # type: ignore[operator]
                grid = np.asarray(ranks).reshape(-1, g.ep)[:, ep_rank]
                mesh = self.mesh(tuple(grid.tolist()), (len(grid),))
                placements = (R,)
        elif spec.is_expert:  # ep == 1: tensor-parallel experts
            dim = _expert_dim(spec) + (1 if len(spec.shape) == 3 else 0)
            mesh = self.mesh(ranks, (g.dp, g.tp))
            placements = (R, Shard(dim))
        else:
            tp_shape, tp_placements = _tp_axes(g.tp, spec, self.config, "inference")
            mesh = self.mesh(ranks, (g.dp, *tp_shape))
            placements = (R, *tp_placements)
        return Layout(spec.shape, mesh, placements, spec.dtype, name=spec.name)


def model_layouts(
    config: ModelConfig, system: System, *, stack_experts: bool = True, specs: Sequence[ParamSpec] | None = None
) -> list[WeightLayouts]:
    """Trainer and inference layouts of every weight of `config` on `system`.

    Args:
        config: the model.
        system: the cluster, with `domain_size` filled in.
        stack_experts: routed experts as `[E, ...]` tensors (about 1k tensors for DeepSeek-V3) or one per expert.
        specs: the weights to place, default `param_specs(config, stack_experts=stack_experts)`.

    Returns:
        One `WeightLayouts` per weight, in `specs` order.

    Example (Qwen3-0.6B, trainer TP2 x DP2 on ranks 0-3, inference TP2 x 2 replicas on ranks 4-7):
        >>> from reshard.models import PRESETS
        >>> from reshard.sim import System
        >>> s = System.parse("train=tp2,dp2 gen=tp2,dp2 domain=4")
        >>> w = model_layouts(PRESETS["qwen3-0.6b"], s)[2]
        >>> w.spec.name, [p.global_box for p in w.train.pieces(1)], [p.global_box for p in w.gen.pieces(5)]
        ('model.layers.0.self_attn.q_proj.weight', [Box[1024:2048, 0:1024]], [Box[1024:2048, 0:1024]])
    """
    b = _Builder(config, system)
    if specs is None:
        specs = param_specs(config, stack_experts=stack_experts)
    out = []
    for spec in specs:
        stage = pipeline_stage(spec, config, b.counts)
        out.append(WeightLayouts(spec, b.train(spec, stage), b.gen(spec), stage))
    return out
