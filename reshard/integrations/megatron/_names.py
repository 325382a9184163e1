"""Megatron-core checkpoint keys -> Hugging Face names, as row segments of each Megatron global tensor (pure).

`sharded_state_dict()` names every weight by its checkpoint key, the same for the local and the TransformerEngine
layer specs (`decoder.layers.self_attention.linear_qkv.layer_norm_weight` is the local spec's `input_layernorm`),
with the layer (and, for experts, the expert) as prepended axes. Each key's global tensor (without those axes) is a
stack of Hugging Face tensors along dim 0; `segments` lists them:

| Megatron key (under `decoder.layers.`)          | Hugging Face name (under `model.layers.{i}.`)                 |
|-------------------------------------------------|---------------------------------------------------------------|
| `self_attention.linear_qkv.weight` / `.bias`    | `self_attn.{q,k,v}_proj.*`: per query group g, its `hpg` query |
|                                                 | heads, then its K head, then its V head                       |
| `self_attention.linear_qkv.layer_norm_weight`   | `input_layernorm.weight`                                      |
| `self_attention.{q,k}_layernorm.weight`         | `self_attn.{q,k}_norm.weight`                                 |
| `self_attention.linear_proj.weight` / `.bias`   | `self_attn.o_proj.*`                                          |
| `mlp.linear_fc1.layer_norm_weight`              | `post_attention_layernorm.weight`                             |
| `mlp.linear_fc1.weight`                         | `mlp.gate_proj.weight` (rows `0:F`), `mlp.up_proj.weight`     |
| `mlp.linear_fc2.weight`                         | `mlp.down_proj.weight`                                        |
| `mlp.router.weight`                             | `mlp.gate.weight`                                             |
| `mlp.router.expert_bias` (a buffer)             | `mlp.gate.e_score_correction_bias` (DeepSeek-V3, GLM-4.5)     |
| `mlp.experts.experts.linear_fc{1,2}.weight`     | `mlp.experts.{e}.{gate,up,down}_proj.weight`                  |
| `mlp.shared_experts.linear_fc{1,2}.weight`      | `mlp.shared_experts.{gate,up,down}_proj.weight`               |

and `embedding.word_embeddings.weight` -> `model.embed_tokens.weight` (rows below the real vocabulary only),
`output_layer.weight` -> `lm_head.weight` (likewise), `decoder.final_layernorm.weight` -> `model.norm.weight`.

Example (2 query groups of 4 heads, head dim 16: `linear_qkv` rows `0:64` are group 0's q, `64:80` its k, `80:96`
its v, then group 1 from row 96):
    >>> segs = segments("self_attention.linear_qkv.weight", Dims(hidden=64, heads=8, groups=2, head_dim=16, ffn=96))
    >>> [(s.name, s.start, s.rows, s.hf_start) for s in segs[:4]]
    [('self_attn.q_proj.weight', 0, 64, 0), ('self_attn.k_proj.weight', 64, 16, 0), \
('self_attn.v_proj.weight', 80, 16, 0), ('self_attn.q_proj.weight', 96, 64, 64)]
"""

from __future__ import annotations

from dataclasses import dataclass

LAYERS = "decoder.layers."
EXPERTS = "mlp.experts.experts."


@dataclass(frozen=True)
class Dims:
    """The sizes of a Megatron `TransformerConfig` that fix its tensors' shapes.

    Attributes:
        hidden, heads, groups (query groups), head_dim (`kv_channels`), ffn (dense FFN size), moe_ffn (per expert),
        shared_ffn (shared experts' size), experts (routed experts, 0 for dense), gated (`[gate; up]` in
        `linear_fc1`), vocab (the real vocabulary), padded (the rows Megatron holds).
    """

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    moe_ffn: int = 0
    shared_ffn: int = 0
    experts: int = 0
    gated: bool = True
    vocab: int = 0
    padded: int = 0


@dataclass(frozen=True)
class Segment:
    """Rows `[start, start + rows)` of a Megatron global tensor are rows `[hf_start, hf_start + rows)` of `name`."""

    name: str
    start: int
    rows: int
    hf_start: int


_SAME = {  # under decoder.layers.: key -> Hugging Face suffix, one segment, shape (rows, cols) from Dims
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",  # a buffer training updates (aux-loss-free)
    EXPERTS + "linear_fc2.weight": "mlp.experts.{e}.down_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_TOP = {
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.final_layernorm.bias": "model.norm.bias",
}
_VOCAB = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight"}
_FC1 = {"mlp.linear_fc1.weight": ("mlp", "ffn"), EXPERTS + "linear_fc1.weight": ("mlp.experts.{e}", "moe_ffn"),
        "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_experts", "shared_ffn")}


def known(key: str) -> bool:
    """Whether `segments` maps this Megatron checkpoint key."""
    if key in _TOP or key in _VOCAB:
        return True
    inner = key[len(LAYERS):] if key.startswith(LAYERS) else None
    return inner is not None and (inner in _SAME or inner in _FC1 or inner.startswith("self_attention.linear_qkv.")
                                  and inner.rsplit(".", 1)[1] in ("weight", "bias"))


def expected_shape(key: str, d: Dims) -> tuple[int, ...]:
    """The global shape (without prepended layer / expert axes) that the config gives Megatron's tensor `key`."""
    if key in _VOCAB:
        return (d.padded, d.hidden)
    if key in _TOP:
        return (d.hidden,)
    inner = key[len(LAYERS):]
    qkv = d.groups * (d.heads // d.groups + 2) * d.head_dim
    if inner.startswith("self_attention.linear_qkv.") and inner.endswith((".weight", ".bias")) and \
            "layer_norm" not in inner:
        return (qkv, d.hidden) if inner.endswith("weight") else (qkv,)
    if inner in _FC1:
        f = getattr(d, _FC1[inner][1])
        return ((2 if d.gated else 1) * f, d.hidden)
    shapes = {
        "self_attention.q_layernorm.weight": (d.head_dim,), "self_attention.k_layernorm.weight": (d.head_dim,),
        "self_attention.linear_proj.weight": (d.hidden, d.heads * d.head_dim),
        "mlp.linear_fc2.weight": (d.hidden, d.ffn), "mlp.router.weight": (d.experts, d.hidden),
        "mlp.router.expert_bias": (d.experts,),
        EXPERTS + "linear_fc2.weight": (d.hidden, d.moe_ffn),
        "mlp.shared_experts.linear_fc2.weight": (d.hidden, d.shared_ffn),
    }
    return shapes.get(inner, (d.hidden,))


def segments(inner: str, d: Dims) -> list[Segment]:
    """The Hugging Face tensors stacked in Megatron's global tensor `inner` (a key, under `decoder.layers.` for a
    layer's weights), as row segments; names under `model.layers.{i}.` for layer weights, with `{e}` for the expert.
    """
    if inner in _VOCAB:
        return [Segment(_VOCAB[inner], 0, d.vocab, 0)]
    if inner in _TOP:
        return [Segment(_TOP[inner], 0, d.hidden, 0)]
    if inner in _SAME:
        rows = expected_shape(LAYERS + inner, d)[0]
        return [Segment(_SAME[inner], 0, rows, 0)]
    if inner in _FC1:
        prefix, size = _FC1[inner]
        f = getattr(d, size)
        return [Segment(f"{prefix}.gate_proj.weight", 0, f, 0), Segment(f"{prefix}.up_proj.weight", f, f, 0)]
    kind = inner.rsplit(".", 1)[1]  # linear_qkv.weight / .bias: per query group [q heads; k; v]
    hpg, hd = d.heads // d.groups, d.head_dim
    out = []
    for g in range(d.groups):
        base = g * (hpg + 2) * hd
        out += [Segment(f"self_attn.q_proj.{kind}", base, hpg * hd, g * hpg * hd),
                Segment(f"self_attn.k_proj.{kind}", base + hpg * hd, hd, g * hd),
                Segment(f"self_attn.v_proj.{kind}", base + (hpg + 1) * hd, hd, g * hd)]
    return out


def hf_shapes(segs: list[Segment], cols: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Each segment name's Hugging Face global shape: the rows its segments cover, Megatron's columns `cols`."""
    rows: dict[str, int] = {}
    for s in segs:
        rows[s.name] = max(rows.get(s.name, 0), s.hf_start + s.rows)
    return {n: (r, *cols) for n, r in rows.items()}
