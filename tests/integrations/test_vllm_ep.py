"""The `reshard` vLLM backend into an expert-parallel engine (Qwen3-MoE, 8 experts, TP 2 + EP; marker `vllm`).

A 2-rank trainer holding the experts split over its ranks (and the rest TP-style and FSDP-style) refits a live
TP2+EP engine V1 -> V2 -> V1. Oracles: an engine of the same parallel config that loaded V2 from a checkpoint with
vLLM's own loader (every tensor each worker's forward reads, bit for bit, and the greedy tokens and log-probs), the
live engine's own fresh V1 load, and the weights themselves for the bytes: each EP rank receives exactly its own
experts (the live layers' `expert_map_manager.get_local_expert_ids()`: 0-3 and 4-7) and its TP share of the rest,
asserted from the workers' counters, half of what a whole-expert sender (vLLM `nccl_m2n`'s rule) sends. Then a
refused update (a trainer tensor one row short: the wrong shape) raises once, vLLM's replies stay in step, the
engine keeps generating on its weights, and the next good update lands exactly.

Both engines start once for the module (84-114 s each on this 2-core machine).
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")

import cloudpickle  # noqa: E402  (ships with vLLM)
import vllm_cases as vc  # noqa: E402

pytestmark = pytest.mark.vllm
cloudpickle.register_pickle_by_value(vc)

V1, V2 = 11, 22
TP, EXPERTS = 2, 8
CFG = vc.moe_config(4, 1000, num_experts=EXPERTS)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """(engine at V1, trainers joined to it, want_v1, want_v2); both engines start once for the module."""
    yield from vc.engine_session(tmp_path_factory.mktemp("ep"), CFG, (V1, V2),
                                 lambda path, mp: vc.start_engine(path, TP, mp, ep=True))


def test_tp2_ep_refit_each_rank_its_experts(session) -> None:
    llm, trainers, want_v1, want_v2 = session
    experts = llm.collective_rpc(vc.local_experts)  # per worker, per layer
    half = EXPERTS // TP
    assert experts == [[list(range(r * half, (r + 1) * half))] * 2 for r in range(TP)], experts  # linear placement
    first = vc.update(llm, trainers, V2)
    assert all(r[0] for r in first)
    vc.assert_same(vc.observe(llm), want_v2)
    got = llm.collective_rpc(vc.received_bytes)
    want = [vc.ep_expected_bytes(CFG, V1, experts[r], TP, r) for r in range(TP)]
    assert got == [own for own, _ in want], (got, want)
    assert all(own < whole for own, whole in want)
    second = vc.update(llm, trainers, V1)
    assert not any(r[0] for r in second)
    vc.assert_same(vc.observe(llm), want_v1)


def test_tp2_ep_refused_update_then_good(session) -> None:
    """A refused update (the trainer's layer-1 down experts one row short: the wrong shape) keeps vLLM's replies in
    step and the engine serving its weights."""
    llm, trainers, want_v1, want_v2 = session
    name = "model.layers.1.mlp.experts.down_proj.weight"
    vc.refused_then_good(llm, trainers, ("narrow", name, True), ("narrow", name, False), name, TP, (V1, V2),
                         (want_v1, want_v2))
