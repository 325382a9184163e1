"""Layout presets: Megatron-style trainer and vLLM-style inference placements, checked piece by piece."""

from __future__ import annotations

import math

import pytest
from torch.distributed.tensor import Replicate, Shard

from reshard import Box
from reshard.models import PRESETS, param_specs
from reshard.sim import System, model_layouts, pipeline_stage, stage_layer_counts

# A DeepSeek-V3-shaped model small enough to plan in milliseconds: MLA, 8 routed experts + 1 shared, one dense
# layer, 4 decoder layers and the MTP layer.
TINY_DSV3 = PRESETS["deepseek-v3-with-mtp"].replace(
    name="tiny-dsv3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
    num_experts=8,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)
# A Qwen3-MoE-shaped model with 4 KV heads, so TP8 must replicate each KV head twice.
TINY_QWEN_MOE = PRESETS["qwen3-235b-a22b"].replace(
    name="tiny-qwen-moe",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=128,
    num_experts=16,
    moe_intermediate_size=24,
)


def boxes(layout, rank):
    return [p.global_box for p in layout.pieces(rank)]


def by_name(layouts):
    return {w.spec.name: w for w in layouts}


def test_stage_split():
    assert stage_layer_counts(61, 4) == (16, 15, 15, 15)
    assert stage_layer_counts(94, 4) == (24, 24, 23, 23)
    assert stage_layer_counts(4, 2, (1, 3)) == (1, 3)
    with pytest.raises(ValueError, match="sum to 5, expected 4"):
        stage_layer_counts(4, 2, (2, 3))
    specs = {s.name: s for s in param_specs(TINY_DSV3, stack_experts=True)}
    counts = (1, 3)
    assert pipeline_stage(specs["model.embed_tokens.weight"], TINY_DSV3, counts) == 0
    assert pipeline_stage(specs["model.layers.0.mlp.gate_proj.weight"], TINY_DSV3, counts) == 0
    assert pipeline_stage(specs["model.layers.1.mlp.gate.weight"], TINY_DSV3, counts) == 1
    assert pipeline_stage(specs["model.norm.weight"], TINY_DSV3, counts) == 1
    assert pipeline_stage(specs["lm_head.weight"], TINY_DSV3, counts) == 1
    assert pipeline_stage(specs["model.layers.4.eh_proj.weight"], TINY_DSV3, counts) == 1  # MTP: last stage


def test_megatron_dense_placements():
    # TP2 x DP2 x PP2 on ranks 0-7: stage 1 is ranks 4-7, TP fastest, so its dense mesh is [[4, 5], [6, 7]].
    s = System.parse("train=tp2,dp2,pp2 gen=tp4,dp2 domain=8")
    w = by_name(model_layouts(PRESETS["qwen3-0.6b"], s))
    q = w["model.layers.27.self_attn.q_proj.weight"]  # (2048, 1024), column-parallel
    assert q.stage == 1 and q.train.mesh.shape == (2, 2) and q.train.ranks == (4, 5, 6, 7)
    assert q.train.placements == (Replicate(), Shard(0))
    assert boxes(q.train, 5) == boxes(q.train, 7) == [Box((1024, 0), (1024, 1024))]
    assert boxes(q.train, 0) == []  # stage 0 does not hold layer 27
    o = w["model.layers.0.self_attn.o_proj.weight"]  # (1024, 2048), row-parallel
    assert o.stage == 0 and boxes(o.train, 1) == [Box((0, 1024), (1024, 1024))]
    emb = w["model.embed_tokens.weight"]  # vocab-parallel on stage 0, tied (no lm_head)
    assert boxes(emb.train, 3) == [Box((75968, 0), (75968, 1024))]
    norm = w["model.norm.weight"]
    assert norm.stage == 1 and all(boxes(norm.train, r) == [Box((0,), (1024,))] for r in range(4, 8))
    # inference: 2 replicas of TP4 on ranks 8-15 (the next 8-GPU domain)
    assert q.gen.ranks == tuple(range(8, 16)) and boxes(q.gen, 13) == [Box((512, 0), (512, 1024))]


def test_every_weight_is_covered_exactly_per_replica():
    s = System.parse("train=tp2,pp2,ep4 gen=tp4,dp2 domain=8")
    for w in model_layouts(TINY_DSV3, s):
        full = math.prod(w.spec.shape)
        for layout in (w.train, w.gen):
            distinct = {b for r in layout.ranks for b in boxes(layout, r)}
            assert sum(b.numel for b in distinct) == full, w.spec.name
            held = sum(b.numel for r in layout.ranks for b in boxes(layout, r))
            assert held % full == 0, w.spec.name


def test_kv_heads_replicate_when_tp_exceeds_them():
    s = System.parse("train=tp4,dp2 gen=tp8 domain=8")
    w = by_name(model_layouts(TINY_QWEN_MOE, s))
    k = w["model.layers.0.self_attn.k_proj.weight"]  # (4 heads * 16, 64)
    # trainer TP4 = 4 KV heads: one head per rank
    assert [boxes(k.train, r) for r in range(4)] == [[Box((16 * h, 0), (16, 64))] for h in range(4)]
    # inference TP8 on ranks 8-15: rank 8 + i holds head i // 2, as vLLM replicates KV heads
    assert [boxes(k.gen, 8 + i) for i in range(8)] == [[Box((16 * (i // 2), 0), (16, 64))] for i in range(8)]
    q = w["model.layers.0.self_attn.q_proj.weight"]  # (8 heads * 16, 64): plain TP8
    assert boxes(q.gen, 9) == [Box((16, 0), (16, 64))]
    with pytest.raises(ValueError, match="inference: tp=6 must be a multiple of num_key_value_heads=4"):
        model_layouts(TINY_QWEN_MOE, System.parse("train=tp4,dp2 gen=tp6 domain=8"))


def test_kv_heads_must_split_evenly():
    cfg = TINY_QWEN_MOE.replace(num_key_value_heads=6, num_attention_heads=12)
    with pytest.raises(ValueError, match="num_key_value_heads=6 must be a multiple of tp=4"):
        model_layouts(cfg, System.parse("train=tp4 gen=tp2 domain=8"))


def test_stacked_experts_trainer_ep_and_inference_tp():
    # trainer: one stage of TP2 x DP4 = 8 ranks, EP4 -> expert mesh (edp 2, ep 4, etp 1): rank i has ep rank i % 4.
    s = System.parse("train=tp2,dp4,ep4 gen=tp4,dp2 domain=8")
    w = by_name(model_layouts(TINY_QWEN_MOE, s))
    up = w["model.layers.1.mlp.experts.up_proj.weight"]  # (16, 24, 64)
    assert up.train.mesh.shape == (2, 4, 1)
    assert boxes(up.train, 6) == [Box((8, 0, 0), (4, 24, 64))]  # ep rank 2: experts 8..11
    # inference EP1: each expert split like a dense MLP on TP4 (gate/up by rows, down by columns)
    assert boxes(up.gen, 9) == [Box((0, 6, 0), (16, 6, 64))]
    down = w["model.layers.1.mlp.experts.down_proj.weight"]  # (16, 64, 24)
    assert boxes(down.train, 1) == [Box((4, 0, 0), (4, 64, 24))]
    assert boxes(down.gen, 11) == [Box((0, 0, 18), (16, 64, 6))]


def test_expert_tensor_parallel_and_inference_ep():
    s = System.parse("train=tp2,dp2,ep2,etp2 gen=tp2,dp4,ep8 domain=8")
    w = by_name(model_layouts(TINY_QWEN_MOE, s))
    gate = w["model.layers.0.mlp.experts.gate_proj.weight"]  # (16, 24, 64)
    # expert mesh (edp 1, ep 2, etp 2): rank 3 is ep 1, etp 1
    assert boxes(gate.train, 3) == [Box((8, 12, 0), (8, 12, 64))]
    # inference EP8 over all 8 ranks (8-15): rank 8 + i holds experts 2i, 2i+1 whole
    assert boxes(gate.gen, 13) == [Box((10, 0, 0), (2, 24, 64))]


def test_unstacked_experts_match_stacked():
    s = System.parse("train=tp2,dp4,ep4 gen=tp2,dp4,ep8 domain=8")
    stacked = by_name(model_layouts(TINY_QWEN_MOE, s))
    flat = by_name(model_layouts(TINY_QWEN_MOE, s, stack_experts=False))
    big = stacked["model.layers.2.mlp.experts.down_proj.weight"]
    for j in range(TINY_QWEN_MOE.num_experts):
        one = flat[f"model.layers.2.mlp.experts.{j}.down_proj.weight"]
        for side in ("train", "gen"):
            lay_big, lay_one = getattr(big, side), getattr(one, side)
            for r in lay_big.ranks:
                has_j = [b for b in boxes(lay_big, r) if b.offsets[0] <= j < b.offsets[0] + b.shape[0]]
                want = [Box(b.offsets[1:], b.shape[1:]) for b in has_j]
                assert boxes(lay_one, r) == want, (side, j, r)


def test_mla_and_router_weights_are_replicated():
    s = System.parse("train=tp2,pp2,ep4 gen=tp4,dp2 domain=8")
    w = by_name(model_layouts(TINY_DSV3, s))
    for name in (
        "model.layers.1.self_attn.q_a_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.4.eh_proj.weight",
    ):
        for layout in (w[name].train, w[name].gen):
            assert all(p == Replicate() for p in layout.placements), name
    kv_b = w["model.layers.1.self_attn.kv_b_proj.weight"]  # (4 * 32, 16) column-parallel
    assert boxes(kv_b.gen, 9) == [Box((32, 0), (32, 16))]


def test_colocated_and_packed_ranks():
    s = System.parse("train=tp2,dp2 gen=tp4 colocated domain=8")
    q = by_name(model_layouts(PRESETS["qwen3-0.6b"], s))["model.layers.0.self_attn.q_proj.weight"]
    assert q.train.ranks == q.gen.ranks == (0, 1, 2, 3)
    s = System.parse("train=tp2,dp2 gen=tp4 packed domain=8")
    q = by_name(model_layouts(PRESETS["qwen3-0.6b"], s))["model.layers.0.self_attn.q_proj.weight"]
    assert q.gen.ranks == (4, 5, 6, 7)
    with pytest.raises(ValueError, match="domain_size is None"):
        model_layouts(PRESETS["qwen3-0.6b"], System.parse("train=tp2 gen=tp2"))
