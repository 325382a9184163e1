"""Single-process checks of `reshard.integrations`: every engine tensor's pieces, filled from full tensors, equal the
vLLM slicing rules written out in `test_integrations_hf.expected` (not the library's layout code)."""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("transformers") is None:  # imported where the models are built: collection stays cheap
    pytest.skip("needs transformers", allow_module_level=True)

from hf_cases import SENTINEL, build_model, configs  # noqa: E402
from test_integrations_hf import expected  # noqa: E402

from reshard.integrations import fused, hf  # noqa: E402
from reshard.planner import Layout, Mesh  # noqa: E402

RANKS = (4, 5, 6, 7)


def _fill(t: fused.EngineTensor, rank: int, full: dict) -> torch.Tensor:
    """Rank `rank`'s engine tensor, written piece by piece from the full tensors as `Refit` would."""
    local = torch.full(t.registered_shape(rank), SENTINEL)
    for name, lay in t.fused():
        for p in lay.pieces(rank):
            local[p.local_box.slices()] = full[name][p.global_box.slices()]
    return local.view(t.local_shape(rank))


def _full(kind: str) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in build_model(kind).named_parameters()}


@pytest.mark.parametrize("kind,ep", [("qwen3", 1), ("qwen3_moe", 1), ("qwen3_moe", 4), ("qwen3_moe", 2)])
def test_engine_tensors_match_the_vllm_rules(kind: str, ep: int) -> None:
    full = _full(kind)
    par = hf.EngineParallel(RANKS, tp=2, ep=ep)
    tensors = hf.engine_tensors(build_model(kind), par)
    names = {t.name for t in tensors}
    assert "model.layers.1.self_attn.qkv_proj.weight" in names and "model.layers.0.self_attn.q_proj.weight" not in names
    assert ("lm_head.weight" in names) == (not configs()[kind]["tie_word_embeddings"])
    covered = {g for t in tensors for g, _ in t.components}
    assert covered == set(full)  # every parameter lands in exactly one engine tensor (tied lm_head: deduplicated)
    for t in tensors:
        for i, r in enumerate(RANKS):
            got = _fill(t, r, full)
            want = expected(t.name, full, configs()[kind], i % 2, ep=ep, e=i % ep, like=got)
            assert got.shape == want.shape and torch.equal(got, want), (t.name, r)


def test_per_expert_names_fill_the_same_w13_and_w2() -> None:
    """Older checkpoints' `experts.{e}.{gate,up,down}_proj.weight` give the w13 / w2 of the fused names."""
    fused = _full("qwen3_moe")
    cfg = configs()["qwen3_moe"]
    per = {n: t for n, t in fused.items() if ".mlp.experts." not in n}
    for layer in range(cfg["num_hidden_layers"]):
        gu, d = (fused[f"model.layers.{layer}.mlp.experts.{x}"] for x in ("gate_up_proj", "down_proj"))
        i = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            pre = f"model.layers.{layer}.mlp.experts.{e}."
            per[pre + "gate_proj.weight"], per[pre + "up_proj.weight"] = gu[e, :i], gu[e, i:]
            per[pre + "down_proj.weight"] = d[e]
    for ep in (1, 4):
        par = hf.EngineParallel(RANKS, tp=2, ep=ep)
        tensors = {t.name: t for t in hf.engine_tensors({n: tuple(t.shape) for n, t in per.items()}, par,
                                                         config=cfg, dtype=torch.float32)}
        for name in ("model.layers.0.mlp.experts.w13_weight", "model.layers.1.mlp.experts.w2_weight"):
            t = tensors[name]
            assert len(t.components) == (8 if "w13" in name else 4)
            for k, r in enumerate(RANKS):
                got = _fill(t, r, per)
                assert torch.equal(got, expected(name, fused, cfg, k % 2, ep=ep, e=k % ep, like=got)), (name, r)


def test_deepseek_v3_from_its_config() -> None:
    """A config alone (the model is built on the meta device): MLA weights stay unfused, shared experts fuse."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(vocab_size=200, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              n_routed_experts=4, num_experts_per_tok=2, num_hidden_layers=2, first_k_dense_replace=1,
                              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1)
    tensors = {t.name: t for t in hf.engine_tensors(config, hf.EngineParallel(RANKS, tp=2))}
    assert tensors["model.layers.0.mlp.gate_up_proj.weight"].local_shape(4) == (96, 64)
    assert tensors["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].local_shape(4) == (32, 64)
    assert tensors["model.layers.1.mlp.experts.w13_weight"].local_shape(5) == (4, 32, 64)
    assert tensors["model.layers.1.self_attn.kv_b_proj.weight"].local_shape(4) == (64, 32)  # 4 heads x 32 rows / 2
    assert tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].local_shape(4) == (40, 64)  # replicated
    assert tensors["lm_head.weight"].local_shape(7) == (128, 64)  # 200 padded to 256, over TP2
    assert hf.name_map(list(tensors.values()))["model.layers.1.mlp.experts.gate_up_proj"] == \
        "model.layers.1.mlp.experts.w13_weight"


def test_engine_tensors_keep_the_names_given() -> None:
    """Two layers under custom prefixes do not collide, and a lone `q_proj` keeps its own name."""
    lay = Layout((4, 4), Mesh([0, 1]), [torch.distributed.tensor.Shard(0)])
    weights = [(f"blk{i}.self_attn.{x}_proj.weight", lay) for i in (0, 1) for x in "qkv"]
    weights.append(("solo.self_attn.q_proj.weight", lay))
    ts = fused.engine_tensors(weights)
    assert [t.name for t in ts] == ["blk0.self_attn.qkv_proj.weight", "blk1.self_attn.qkv_proj.weight",
                                    "solo.self_attn.q_proj.weight"]
    assert [g for g, _ in ts[1].components] == [f"blk1.self_attn.{x}_proj.weight" for x in "qkv"]
    assert fused.name_map(ts)["blk1.self_attn.v_proj.weight"] == "blk1.self_attn.qkv_proj.weight"


def test_trainer_name_and_bad_parallelism() -> None:
    assert hf.trainer_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=r"tp=3 must be a positive integer dividing the 4 engine ranks"):
        hf.EngineParallel(RANKS, tp=3)
    with pytest.raises(NotImplementedError, match=r"q_proj.weight' of shape \(64, 64\): dim 0 \(64\) is not divisible "
                       r"by tp=3"):
        hf.engine_tensors(build_model("qwen3_moe"), hf.EngineParallel(range(6), tp=3))
