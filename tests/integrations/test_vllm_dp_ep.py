"""The `reshard` vLLM backend into a DP2+EP engine (wide EP: Qwen3-MoE, 8 experts, two offline `LLM`s, one per
process, `VLLM_DP_*`; marker `vllm`).

A 2-rank trainer holding the experts split over its ranks refits both DP ranks V1 -> V2 -> V1. Oracles: a DP2+EP
engine of the same config that loaded V2 from a checkpoint with vLLM's own loader (every tensor each rank's forward
reads, bit for bit, and the greedy tokens and log-probs, per DP rank), the live engine's own fresh V1 load, and the
weights themselves for the bytes: each DP rank receives exactly its own 4 experts (the live layers'
`expert_map_manager.get_local_expert_ids()`) and every dense weight whole (TP 1), asserted from its counters. Then
a refused update (a trainer expert tensor one row short) raises on each DP rank's engine, the engines keep
generating V1, and the next good update lands exactly.

Both engines (two processes each) start once for the module.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")

import cloudpickle  # noqa: E402  (ships with vLLM)
import vllm_cases as vc  # noqa: E402

pytestmark = pytest.mark.vllm
cloudpickle.register_pickle_by_value(vc)

V1, V2 = 11, 22
DP, EXPERTS = 2, 8
CFG = vc.moe_config(4, 1000, num_experts=EXPERTS)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """(DP engines at V1, trainers joined to them, want_v1, want_v2: per DP rank)."""
    tmp = tmp_path_factory.mktemp("dpep")
    ck1, ck2 = str(tmp / "v1"), str(tmp / "v2")
    vc.write_checkpoint(ck1, CFG, V1)
    vc.write_checkpoint(ck2, CFG, V2)
    ref = vc.DPEngines(ck2, DP)
    try:
        want_v2 = ref.call("observe")
    finally:
        ref.close()
    trainers = vc.Trainers(2)
    engines = vc.DPEngines(ck1, DP)
    try:
        want_v1 = engines.call("observe")
        assert all(vc.differences(a, b) for a, b in zip(want_v1, want_v2)), "the versions must differ"
        port = vc.free_port()
        trainers.post("init", port, CFG, DP, False)
        engines.call("init", port)
        trainers.wait()
        yield engines, trainers, want_v1, want_v2
        trainers.post("close")
        trainers.wait()
        engines.call("shutdown")
    finally:
        engines.close()
        trainers.close()


def _update(engines: vc.DPEngines, trainers: vc.Trainers, seed: int) -> list:
    trainers.post("send", seed)
    engines.call("update", seed)
    return trainers.wait()


def _assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want):
        vc.assert_same(g, w)


def test_dp2_ep_refit_each_rank_its_experts(session) -> None:
    engines, trainers, want_v1, want_v2 = session
    experts = [workers[0] for workers in engines.call("rpc", "local_experts")]  # per DP rank, per layer
    half = EXPERTS // DP
    assert experts == [[list(range(r * half, (r + 1) * half))] * 2 for r in range(DP)], experts
    first = _update(engines, trainers, V2)
    assert all(r[0] for r in first)
    _assert_same(engines.call("observe"), want_v2)
    got = [workers[0] for workers in engines.call("rpc", "received_bytes")]
    want = [vc.ep_expected_bytes(CFG, V1, experts[r], 1, r) for r in range(DP)]
    assert got == [own for own, _ in want], (got, want)
    assert all(own < whole for own, whole in want)
    second = _update(engines, trainers, V1)
    assert not any(r[0] for r in second)
    _assert_same(engines.call("observe"), want_v1)


def test_dp2_ep_refused_update_then_good(session) -> None:
    engines, trainers, want_v1, want_v2 = session
    name = "model.layers.1.mlp.experts.down_proj.weight"
    trainers.post("narrow", name, True)
    trainers.wait()
    trainers.post("send", V2)
    errors = engines.call("update_error", V2)
    assert all(e is not None and "update_weights failed on 1 of 1 worker" in e and name in e for e in errors), errors
    with pytest.raises(AssertionError, match=name):
        trainers.wait()
    assert engines.call("rpc", "last_error")[0][0] is not None
    _assert_same(engines.call("observe"), want_v1)  # generate works, on the weights it had
    trainers.post("narrow", name, False)
    trainers.wait()
    _update(engines, trainers, V2)
    assert engines.call("rpc", "last_error") == [[None]] * DP
    _assert_same(engines.call("observe"), want_v2)
    _update(engines, trainers, V1)
    _assert_same(engines.call("observe"), want_v1)
