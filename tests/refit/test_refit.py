"""Model refit across 8 gloo ranks (4 trainer + 4 inference), checked bit for bit against vLLM-style shards cut
from the full model by hand."""

from __future__ import annotations

import pytest
from refit_cases import job_precision, job_refit, job_refit_error, job_refit_mixed_planning

pytestmark = pytest.mark.distributed

QWEN_SYSTEM = "train=tp2,dp2 gen=tp2,dp2 domain=4"  # trainer ranks 0-3, inference ranks 4-7
MOE_SYSTEM = "train=ep2,dp2 gen=tp2,dp2 domain=4"


RANK_POOL = {"world_size": 8, "timeout_s": 240}  # the `pool` fixture's ranks (tests/conftest.py)


@pytest.mark.slow  # a Qwen3-0.6B-shaped refit on 8 ranks, twice: ~45 s
def test_qwen3_refit_is_bit_exact_and_second_run_reuses_the_plan(pool) -> None:
    out = pool.run_ok(job_refit, "qwen3-0.6b", QWEN_SYSTEM, 1, 2)
    for r, o in enumerate(out):
        assert o["mismatches"] == [], o["mismatches"]
        assert o["first_run"] == [True, False]
        assert o["metadata_s"][1] == 0.0  # no metadata exchange on the second run
    assert sum(o["checked"] for o in out[4:]) == 4 * out[4]["checked"] > 0
    assert out[0]["choices"] == ["reshard"]
    # fused tensors: qkv_proj and gate_up_proj each take several global tensors
    assert out[4]["num_items"] > out[4]["checked"]


def test_deepseek_style_moe_from_ep2_to_tp2(pool) -> None:
    out = pool.run_ok(job_refit, "tiny-deepseek", MOE_SYSTEM, 3)
    for o in out:
        assert o["mismatches"] == [], o["mismatches"]
    assert out[4]["checked"] > 0


def test_gather_broadcast_policy_is_also_exact(pool) -> None:
    """Every weight by gather-and-broadcast (to a root, then whole to every destination): same result, more bytes."""
    out = pool.run_ok(job_refit, "tiny-deepseek", MOE_SYSTEM, 5, None, policy="gather_broadcast")
    for o in out:
        assert o["mismatches"] == [], o["mismatches"]
        assert o["choices"] == ["gather_broadcast"] and o["num_items"] == 0
    resharded = pool.run_ok(job_refit, "tiny-deepseek", MOE_SYSTEM, 5)
    assert out[0]["gather_broadcast_bytes"] > resharded[0]["network_bytes"] > 0


@pytest.mark.parametrize("delta", [False, True])
def test_rank_local_planning_is_bit_exact_and_moves_the_global_plans_bytes(pool, delta: bool) -> None:
    """`planning="local"`: each rank plans its own part (no whole-model plan); two runs (new weights in between),
    every engine tensor bit for bit, and the bytes per rank sum to the global plan's."""
    local = pool.run_ok(job_refit, "tiny-deepseek", MOE_SYSTEM, 7, 8, planning="local", delta=delta)
    for o in local:
        assert o["mismatches"] == [], o["mismatches"]
        assert o["first_run"] == [True, False]
        assert o["choices"] == ["reshard"]  # `auto` weights reshard: the per-weight model needs the whole plan
    whole = pool.run_ok(job_refit, "tiny-deepseek", MOE_SYSTEM, 7, None, planning="global", policy="reshard")
    assert sum(o["network_bytes"] for o in local) == whole[0]["network_bytes"] > 0


def test_ranks_planning_differently_are_refused_on_every_rank(pool) -> None:
    """Even ranks plan the whole model, odd ranks their own part: every rank of the plan refuses, naming how each
    planned (ranks 2 and 3, trainer replicas that send nothing in this plan, take no part and return)."""
    outs = pool.run(job_refit_mixed_planning)
    refused = {o.rank for o in outs if not o.ok}
    assert refused == {0, 1, 4, 5, 6, 7}, [(o.rank, o.ok, o.error) for o in outs]
    for o in outs:
        if not o.ok:
            assert "planning: rank 0 has 'global', rank 1 has 'local'" in o.error, o.error
            assert "nothing was moved" in o.error, o.error


@pytest.mark.parametrize("case,pattern", [
    ("unmapped", r"have no inference name \(unmapped\).*input_layernorm"),
    ("extra", r"map to names no inference tensor declares \(extra\).*post_attn_norm"),
    ("shape", r"o_proj.weight.*global shape \(64, 64\) on the trainer, \(64, 66\) on the inference side"),
    ("refused", r"rank 1: the model chunk is another stage's"),  # Refit.refuse on one rank stops every rank
])
def test_refit_errors_raise_on_every_rank(pool, case: str, pattern: str) -> None:
    import re

    out = pool.run(job_refit_error, "tiny-deepseek", MOE_SYSTEM, case)
    for r, o in enumerate(out):
        assert not o.ok and o.error_type == "ValueError", (r, o)
        assert re.search(pattern, o.message, re.S), (r, o.message[:2000])


@pytest.mark.parametrize("planning", ["global", "local"])
def test_precision_fp8_block_and_cast_are_bit_exact(pool, planning: str) -> None:
    """FP8 block weights equal quantizing the full tensor and slicing it, whether quantized on the source
    (block-aligned trainer shards) or on the destination (a trainer cut inside a block), with an inference TP3 that
    cuts blocks (boundary blocks' scales on both ranks); a float32 -> bfloat16 cast weight equals torch's `.to()`
    with NaN, Inf, subnormals and ties. With the whole plan on every rank, and with each rank planning its part."""
    out = pool.run_ok(job_precision, planning=planning)
    for o in out:
        assert o["bad"] == [], o["bad"]
    choices = out[0]["choices"]
    assert choices["experts.w1"].endswith("source") and choices["dense.aligned"].endswith("source")
    assert choices["dense.uneven"].endswith("destination")


@pytest.mark.parametrize("case,pattern", [
    ("missing_scale", r"'dense.uneven' on rank \d: FP8 weight registered without its scale tensor"),
    ("bad_scale", r"'dense.uneven' on rank \d: scale tensor of shape .* expected"),
])
def test_precision_scale_errors_raise_on_every_rank(pool, case: str, pattern: str) -> None:
    import re

    out = pool.run(job_precision, case)
    for r, o in enumerate(out):
        assert not o.ok and o.error_type == "ValueError", (r, o)
        assert re.search(pattern, o.message), (r, o.message[:2000])


class _SizedGroup:
    """What `Refit.__init__` reads of a group: its size and rank, and the refit ordinal."""

    def __init__(self, size: int) -> None:
        self.size, self.rank = size, 0

    def next_ordinal(self, kind: str) -> int:
        return 1


@pytest.mark.parametrize("size,want", [(8, "global"), (511, "global"), (512, "local"), (4096, "local")])
def test_planning_auto_is_local_on_large_groups(size: int, want: str) -> None:
    from reshard import Refit
    from reshard.refit._refit import LOCAL_PLANNING_RANKS

    assert LOCAL_PLANNING_RANKS == 512
    assert Refit(_SizedGroup(size)).planning == want
    assert Refit(_SizedGroup(size), planning="global").planning == "global"
    assert Refit(_SizedGroup(size), planning="local").planning == "local"


def test_the_local_planning_threshold_is_an_argument_and_the_exported_constant_is_read_at_call_time(
        monkeypatch) -> None:
    import reshard.refit
    from reshard import Refit

    assert Refit(_SizedGroup(8), local_planning_ranks=8).planning == "local"
    assert Refit(_SizedGroup(8), local_planning_ranks=9).planning == "global"
    monkeypatch.setattr(reshard.refit, "LOCAL_PLANNING_RANKS", 4)  # what a user sets: the exported name
    assert Refit(_SizedGroup(8)).planning == "local"
    assert Refit(_SizedGroup(8), local_planning_ranks=16).planning == "global"  # the argument wins
    with pytest.raises(ValueError, match=r"local_planning_ranks must be an integer >= 1, got 0"):
        Refit(_SizedGroup(8), local_planning_ranks=0)


def test_an_unknown_planning_is_refused() -> None:
    from reshard import Refit

    with pytest.raises(ValueError, match=r"planning must be one of \('auto', 'global', 'local'\), got 'rank'"):
        Refit(_SizedGroup(8), planning="rank")
