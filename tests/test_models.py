"""`reshard.models` against the real checkpoints' parameter lists and the published parameter counts.

`tests/data/models/*.json.gz` are gzipped copies of the reference safetensors indexes: `{name: {"shape", "dtype"}}`
for every tensor of each HuggingFace checkpoint (DeepSeek-V3 dequantized to BF16, as RL trainers hold it).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from reshard.models import PRESETS, ModelConfig, get_preset, num_active_params, num_params, param_specs

DATA = Path(__file__).parent / "data" / "models"
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32"}

# Published figures, copied from the reference index (model cards and tech reports), with the precision each is
# quoted at: our count must round to the published figure.
# name: (tensors in the checkpoint, exact params as counted from the checkpoint, published total, its precision,
#        published activated or non-embedding figure, which of the two, its precision)
PUBLISHED = {
    # "0.6B total / 0.44B non-embedding" (Qwen3 model card).
    "qwen3-0.6b": (310, 596_049_920, 0.6e9, 0.05e9, 0.44e9, "non_embedding", 0.005e9),
    # "32.8B total / 31.2B non-embedding" (Qwen3-32B model card).
    "qwen3-32b": (707, 32_762_123_264, 32.8e9, 0.05e9, 31.2e9, "non_embedding", 0.05e9),
    # "235B total / 22B activated" (Qwen3 tech report, model card).
    "qwen3-235b-a22b": (36_945, 235_093_634_560, 235e9, 0.5e9, 22e9, "active", 0.5e9),
    # "8B (8.03B as reported by HF)".
    "llama-3.1-8b": (291, 8_030_261_248, 8.03e9, 0.005e9, 8.03e9, "active", 0.005e9),
    # "671B main model, 37B activated" (DeepSeek-V3 README).
    "deepseek-v3": (45_395, 671_026_419_200, 671e9, 0.5e9, 37e9, "active", 1e9),
    # "685B = 671B main + 14B MTP as stored on HF" (DeepSeek-V3 README). Our BF16 count is 684.49B. The HF figure
    # also counts the FP8 checkpoint's `weight_scale_inv` tensors (one float per 128x128 block: 41.5M by our count),
    # which makes 684.53B, and that rounds to 685B; so the tolerance here is 0.6B.
    "deepseek-v3-with-mtp": (46_183, 684_489_845_504, 685e9, 0.6e9, None, None, None),
    # "1T total / 32B activated" (Kimi-K2 README). Our 1.026T rounds to 1.0T; the 32.86B active rounds to 33B,
    # and Moonshot quotes 32B, so the active check allows a whole 1B.
    "kimi-k2": (69_975, 1_026_408_232_448, 1.0e12, 0.05e12, 32e9, "active", 1e9),
}


def _reference(name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    with gzip.open(DATA / f"{name}.json.gz", "rt") as f:
        return {k: (tuple(v["shape"]), v["dtype"]) for k, v in json.load(f).items()}


def test_presets_cover_the_reference_models():
    assert set(PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_names_shapes_dtypes_match_checkpoint(name):
    ref = _reference(name)
    specs = param_specs(PRESETS[name])
    ours = {s.name: (s.shape, DTYPE_NAMES[s.dtype]) for s in specs}
    assert len(ours) == len(specs), "duplicate parameter names"
    assert sorted(set(ours) - set(ref)) == [] and sorted(set(ref) - set(ours)) == []
    wrong = {k: (ours[k], ref[k]) for k in ref if ours[k] != ref[k]}
    assert wrong == {}
    assert len(specs) == PUBLISHED[name][0]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_totals_against_published(name):
    _, exact, total, total_tol, second, which, second_tol = PUBLISHED[name]
    config = PRESETS[name]
    assert num_params(config) == exact
    assert abs(exact - total) <= total_tol
    if which == "non_embedding":
        embedding = sum(s.numel for s in param_specs(config) if s.kind in ("embedding", "lm_head"))
        assert abs(exact - embedding - second) <= second_tol
    elif which == "active":
        assert abs(num_active_params(config) - second) <= second_tol


def test_mtp_adds_one_layer_of_about_14b():
    # The DeepSeek-V3 README: 671B main model + 14B MTP module = 685B on HF. We count 13.46B for the MTP layer
    # (its own embedding and head included, as stored); the README's 14B is 685 - 671 of rounded figures.
    extra = num_params(PRESETS["deepseek-v3-with-mtp"]) - num_params(PRESETS["deepseek-v3"])
    assert extra == 13_463_426_304
    assert abs(extra - 14e9) < 0.6e9
    mtp = [s for s in param_specs(PRESETS["deepseek-v3-with-mtp"], stack_experts=True) if s.layer == 61]
    assert {s.kind for s in mtp} >= {"embedding", "lm_head", "mtp_proj", "expert_w1"}


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "deepseek-v3", "kimi-k2"])
def test_stacked_experts_hold_the_same_weights(name):
    config = PRESETS[name]
    flat = param_specs(config)
    stacked = param_specs(config, stack_experts=True)
    assert sum(s.numel for s in flat) == sum(s.numel for s in stacked)
    assert [s for s in flat if not s.is_expert] == [s for s in stacked if not s.is_expert]
    experts = [s for s in stacked if s.is_expert]
    assert all(s.shape[0] == config.num_experts and s.expert is None for s in experts)
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers_total))
    assert len(experts) == 3 * moe_layers
    # One routed expert, unstacked, is one row of the stacked tensor.
    one = next(s for s in flat if s.is_expert and s.expert == 5)
    same = next(s for s in experts if s.layer == one.layer and s.kind == one.kind)
    assert same.shape[1:] == one.shape and same.name == one.name.replace(".experts.5.", ".experts.")


def test_deepseek_v3_stacked_is_about_1k_tensors():
    assert len(param_specs(PRESETS["deepseek-v3"], stack_experts=True)) == 1025


def test_every_kind_is_known():
    known = {"embedding", "lm_head", "column", "column_kv", "row", "norm", "q_a", "kv_a", "mtp_proj"}
    known |= {"router", "router_bias", "expert_w1", "expert_w2", "expert_w3"}
    for config in PRESETS.values():
        assert {s.kind for s in param_specs(config, stack_experts=True)} <= known


def test_small_variant_and_errors():
    tiny = PRESETS["deepseek-v3"].replace(
        name="tiny-dsv3", hidden_size=64, num_hidden_layers=2, first_k_dense_replace=1, num_experts=4
    )
    assert isinstance(tiny, ModelConfig)
    specs = param_specs(tiny, stack_experts=True)
    assert [s.shape for s in specs if s.kind == "expert_w2"] == [(4, 64, 2048)]
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'.*valid"):
        get_preset("gpt-5")
    with pytest.raises(ValueError, match="unknown family 'mamba'"):
        ModelConfig("x", "mamba", 8, 8, 1, 1, 1, 8)
