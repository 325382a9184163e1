"""`reshard.sim.engine_bytes`: what each inference rank receives under an EP engine layout (its own experts), against
a whole-expert sender; the oracle is the model's weight list itself (`param_specs`), not the layouts."""

from __future__ import annotations

import pytest

from reshard.models import PRESETS, param_specs
from reshard.sim import System, engine_bytes, model_layouts

TINY_MOE = PRESETS["qwen3-235b-a22b"].replace(
    name="tiny-qwen-moe", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
    num_key_value_heads=4, head_dim=16, vocab_size=128, num_experts=16, moe_intermediate_size=24)


@pytest.mark.parametrize("stack", [True, False])
def test_wide_ep_rank_receives_its_experts(stack: bool) -> None:
    """gen=dp4,ep4 (TP 1, DeepSeek-style wide EP): each rank receives every dense weight whole and a quarter of the
    experts; a whole-expert sender sends it every expert."""
    s = System.parse("train=tp2,ep2 gen=tp1,dp4,ep4 domain=8")
    specs = param_specs(TINY_MOE, stack_experts=stack)
    experts = sum(p.nbytes for p in specs if p.is_expert)
    dense = sum(p.nbytes for p in specs if not p.is_expert)
    got = engine_bytes(model_layouts(TINY_MOE, s, stack_experts=stack), list(s.gen_ranks))
    assert got == {r: (dense + experts // 4, dense + experts) for r in s.gen_ranks}


def test_without_ep_experts_split_like_dense() -> None:
    """gen=tp2 (no EP): the experts are tensor-parallel, each rank half of every expert; the whole-expert sender
    sends every expert whole."""
    s = System.parse("train=tp2 gen=tp2 domain=4")
    specs = param_specs(TINY_MOE)
    experts = sum(p.nbytes for p in specs if p.is_expert)
    got = engine_bytes(model_layouts(TINY_MOE, s), list(s.gen_ranks))
    for own, whole in got.values():
        assert whole - own == experts - experts // 2
