"""Per-parameter names, shapes and dtypes of real models, generated from architecture hyper-parameters.

Exports `ModelConfig`, `ParamSpec`, `PRESETS`, `param_specs`, `num_params`, `num_active_params` and `get_preset`.

Names follow HuggingFace checkpoints (`model.layers.{i}.self_attn.q_proj.weight`, ...). Each `ParamSpec` carries a
`kind` that says the weight's role, which is what the layout presets use to place it:

| kind | weights | usual tensor-parallel split |
|---|---|---|
| `embedding` | `embed_tokens` | vocab, dim 0 |
| `lm_head` | `lm_head`, MTP `shared_head.head` | vocab, dim 0 |
| `column` | q, gate/up, MLA `q_b_proj`/`kv_b_proj`, shared-expert gate/up | dim 0 |
| `column_kv` | k, v (GQA): split by KV head, each head replicated when TP > `num_key_value_heads` | dim 0 |
| `row` | `o_proj`, `down_proj`, shared-expert down | dim 1 |
| `norm` | every RMSNorm weight | replicated |
| `q_a`, `kv_a` | MLA down projections `q_a_proj`, `kv_a_proj_with_mqa` | replicated |
| `router`, `router_bias` | MoE gate weight and DeepSeek's `e_score_correction_bias` | replicated |
| `expert_w1`, `expert_w3`, `expert_w2` | routed experts' gate, up and down projections | expert-parallel |
| `mtp_proj` | MTP `eh_proj` | replicated |

Example:
    >>> specs = param_specs(PRESETS["qwen3-0.6b"])
    >>> specs[0].name, specs[0].shape, specs[0].kind
    ('model.embed_tokens.weight', (151936, 1024), 'embedding')
    >>> num_params(PRESETS["qwen3-0.6b"])
    596049920
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ParamSpec",
    "get_preset",
    "num_active_params",
    "num_params",
    "param_specs",
]

EXPERT_KINDS = ("expert_w1", "expert_w3", "expert_w2")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, named as in the HuggingFace `config.json` of each family.

    `family` picks the layer structure: `"llama"` (Llama, and Qwen3 dense with `qk_norm=True`), `"qwen3_moe"` or
    `"deepseek_v3"` (MLA attention, DeepSeek-MoE with shared experts; also Kimi K2).
    """

    name: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    dtype: torch.dtype = torch.bfloat16
    # Mixture of experts (qwen3_moe, deepseek_v3).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    # Multi-head latent attention (deepseek_v3).
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Multi-token-prediction layers stored after the decoder layers (DeepSeek-V3's `model.layers.61`).
    num_nextn_predict_layers: int = 0
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.family not in ("llama", "qwen3_moe", "deepseek_v3"):
            raise ValueError(
                f"ModelConfig {self.name!r}: unknown family {self.family!r}; valid: 'llama', 'qwen3_moe', 'deepseek_v3'"
            )
        if self.family != "llama" and self.num_experts <= 0:
            raise ValueError(f"ModelConfig {self.name!r}: family {self.family!r} needs num_experts > 0")

    @property
    def attn_head_dim(self) -> int:
        """Per-head dim of q/k/v for the `llama` and `qwen3_moe` families."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def num_layers_total(self) -> int:
        """Decoder layers plus MTP layers, that is, how many `model.layers.{i}` indices exist."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has routed experts (HF's rule for each family)."""
        if self.family == "qwen3_moe":
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        if self.family == "deepseek_v3":
            return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        return False

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some hyper-parameters changed (for small test models of a real family)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ParamSpec:
    """One weight of a model.

    Attributes:
        name: the HuggingFace parameter name.
        shape: the global shape; `[E, ...]` for stacked experts.
        dtype: the checkpoint dtype.
        kind: the weight's role (see the module docstring), which the layout presets place by.
        layer: the `model.layers.{i}` index, or None for `embed_tokens`, the final norm and `lm_head`.
        expert: the routed expert index of an unstacked expert weight, else None.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    layer: int | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_expert(self) -> bool:
        return self.kind in EXPERT_KINDS


def _attention(c: ModelConfig, p: str, layer: int) -> Iterator[ParamSpec]:
    h, dt = c.hidden_size, c.dtype
    if c.family == "deepseek_v3":
        qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            yield ParamSpec(f"{p}.self_attn.q_proj.weight", (c.num_attention_heads * qk_head, h), dt, "column", layer)
        else:
            yield ParamSpec(f"{p}.self_attn.q_a_proj.weight", (c.q_lora_rank, h), dt, "q_a", layer)
            yield ParamSpec(f"{p}.self_attn.q_a_layernorm.weight", (c.q_lora_rank,), dt, "norm", layer)
            yield ParamSpec(
                f"{p}.self_attn.q_b_proj.weight", (c.num_attention_heads * qk_head, c.q_lora_rank), dt, "column", layer
            )
        yield ParamSpec(
            f"{p}.self_attn.kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h), dt, "kv_a", layer
        )
        yield ParamSpec(f"{p}.self_attn.kv_a_layernorm.weight", (c.kv_lora_rank,), dt, "norm", layer)
        yield ParamSpec(
            f"{p}.self_attn.kv_b_proj.weight",
            (c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            dt,
            "column",
            layer,
        )
        yield ParamSpec(f"{p}.self_attn.o_proj.weight", (h, c.num_attention_heads * c.v_head_dim), dt, "row", layer)
        return
    d = c.attn_head_dim
    yield ParamSpec(f"{p}.self_attn.q_proj.weight", (c.num_attention_heads * d, h), dt, "column", layer)
    yield ParamSpec(f"{p}.self_attn.k_proj.weight", (c.num_key_value_heads * d, h), dt, "column_kv", layer)
    yield ParamSpec(f"{p}.self_attn.v_proj.weight", (c.num_key_value_heads * d, h), dt, "column_kv", layer)
    yield ParamSpec(f"{p}.self_attn.o_proj.weight", (h, c.num_attention_heads * d), dt, "row", layer)
    if c.qk_norm:
        yield ParamSpec(f"{p}.self_attn.q_norm.weight", (d,), dt, "norm", layer)
        yield ParamSpec(f"{p}.self_attn.k_norm.weight", (d,), dt, "norm", layer)


def _dense_mlp(p: str, hidden: int, inter: int, dt: torch.dtype, layer: int) -> Iterator[ParamSpec]:
    yield ParamSpec(f"{p}.gate_proj.weight", (inter, hidden), dt, "column", layer)
    yield ParamSpec(f"{p}.up_proj.weight", (inter, hidden), dt, "column", layer)
    yield ParamSpec(f"{p}.down_proj.weight", (hidden, inter), dt, "row", layer)


def _moe_mlp(c: ModelConfig, p: str, layer: int, stack_experts: bool) -> Iterator[ParamSpec]:
    h, m, e, dt = c.hidden_size, c.moe_intermediate_size, c.num_experts, c.dtype
    yield ParamSpec(f"{p}.mlp.gate.weight", (e, h), dt, "router", layer)
    if c.family == "deepseek_v3":
        # noaux_tc routing keeps this bias in float32 in the released checkpoints.
        yield ParamSpec(f"{p}.mlp.gate.e_score_correction_bias", (e,), torch.float32, "router_bias", layer)
    projs = (("gate_proj", (m, h), "expert_w1"), ("up_proj", (m, h), "expert_w3"), ("down_proj", (h, m), "expert_w2"))
    if stack_experts:
        for proj, shape, kind in projs:
            yield ParamSpec(f"{p}.mlp.experts.{proj}.weight", (e, *shape), dt, kind, layer)
    else:
        for j in range(e):
            for proj, shape, kind in projs:
                yield ParamSpec(f"{p}.mlp.experts.{j}.{proj}.weight", shape, dt, kind, layer, j)
    if c.num_shared_experts:
        yield from _dense_mlp(f"{p}.mlp.shared_experts", h, m * c.num_shared_experts, dt, layer)


def _decoder_layer(c: ModelConfig, layer: int, stack_experts: bool) -> Iterator[ParamSpec]:
    p, h, dt = f"model.layers.{layer}", c.hidden_size, c.dtype
    yield ParamSpec(f"{p}.input_layernorm.weight", (h,), dt, "norm", layer)
    yield from _attention(c, p, layer)
    yield ParamSpec(f"{p}.post_attention_layernorm.weight", (h,), dt, "norm", layer)
    if c.is_moe_layer(layer):
        yield from _moe_mlp(c, p, layer, stack_experts)
    else:
        yield from _dense_mlp(f"{p}.mlp", h, c.intermediate_size, dt, layer)


def _mtp_layer(c: ModelConfig, layer: int, stack_experts: bool) -> Iterator[ParamSpec]:
    """DeepSeek-V3's multi-token-prediction module: a full decoder layer plus its own embedding, norms and head."""
    p, h, dt = f"model.layers.{layer}", c.hidden_size, c.dtype
    yield ParamSpec(f"{p}.embed_tokens.weight", (c.vocab_size, h), dt, "embedding", layer)
    yield ParamSpec(f"{p}.enorm.weight", (h,), dt, "norm", layer)
    yield ParamSpec(f"{p}.hnorm.weight", (h,), dt, "norm", layer)
    yield ParamSpec(f"{p}.eh_proj.weight", (h, 2 * h), dt, "mtp_proj", layer)
    yield from _decoder_layer(c, layer, stack_experts)
    yield ParamSpec(f"{p}.shared_head.norm.weight", (h,), dt, "norm", layer)
    yield ParamSpec(f"{p}.shared_head.head.weight", (c.vocab_size, h), dt, "lm_head", layer)


def param_specs(config: ModelConfig, *, stack_experts: bool = False) -> list[ParamSpec]:
    """Every weight of the model, in checkpoint order.

    Args:
        config: the architecture.
        stack_experts: give each MoE layer's routed experts as three `[E, ...]` tensors
            (`model.layers.{i}.mlp.experts.{gate,up,down}_proj.weight`) instead of `3 * E` per-expert tensors.
            DeepSeek-V3 has 45,395 tensors unstacked and 1,025 stacked.

    Returns:
        A list of `ParamSpec`, names unique.
    """
    h = config.hidden_size
    specs = [ParamSpec("model.embed_tokens.weight", (config.vocab_size, h), config.dtype, "embedding")]
    for layer in range(config.num_hidden_layers):
        specs.extend(_decoder_layer(config, layer, stack_experts))
    specs.append(ParamSpec("model.norm.weight", (h,), config.dtype, "norm"))
    if not config.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (config.vocab_size, h), config.dtype, "lm_head"))
    for layer in range(config.num_hidden_layers, config.num_layers_total):
        specs.extend(_mtp_layer(config, layer, stack_experts))
    return specs


def num_params(config: ModelConfig) -> int:
    """The total parameter count (what a model card calls "total parameters")."""
    return sum(s.numel for s in param_specs(config, stack_experts=True))


def num_active_params(config: ModelConfig) -> int:
    """Parameters used per token: everything but routed experts, plus `num_experts_per_tok / num_experts` of them.

    MTP layers are counted like any other layer; model cards quote activated counts without them.
    """
    total = 0.0
    for s in param_specs(config, stack_experts=True):
        if s.is_expert:
            total += s.numel * config.num_experts_per_tok / config.num_experts
        else:
            total += s.numel
    return round(total)


_DEEPSEEK_V3 = ModelConfig(
    name="deepseek-v3",
    family="deepseek_v3",
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    vocab_size=129280,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=2048,
    num_shared_experts=1,
    first_k_dense_replace=3,
    moe_layer_freq=1,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    notes="deepseek-ai/DeepSeek-V3, main model without the MTP layer",
)

PRESETS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig(
            name="qwen3-0.6b",
            family="llama",
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            qk_norm=True,
            notes="Qwen/Qwen3-0.6B",
        ),
        ModelConfig(
            name="qwen3-32b",
            family="llama",
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            qk_norm=True,
            notes="Qwen/Qwen3-32B",
        ),
        ModelConfig(
            name="qwen3-235b-a22b",
            family="qwen3_moe",
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            qk_norm=True,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=1536,
            notes="Qwen/Qwen3-235B-A22B",
        ),
        ModelConfig(
            name="llama-3.1-8b",
            family="llama",
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            notes="meta-llama/Llama-3.1-8B",
        ),
        _DEEPSEEK_V3,
        _DEEPSEEK_V3.replace(
            name="deepseek-v3-with-mtp",
            num_nextn_predict_layers=1,
            notes="deepseek-ai/DeepSeek-V3 as stored on HF: main model plus the MTP layer model.layers.61",
        ),
        _DEEPSEEK_V3.replace(
            name="kimi-k2",
            num_attention_heads=64,
            num_key_value_heads=64,
            vocab_size=163840,
            num_experts=384,
            first_k_dense_replace=1,
            notes="moonshotai/Kimi-K2-Instruct (DeepseekV3ForCausalLM)",
        ),
    )
}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name`, with a `ValueError` listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid: {sorted(PRESETS)}") from None
