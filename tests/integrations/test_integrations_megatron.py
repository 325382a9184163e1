"""Real Megatron-core `GPTModel`s (megatron-core 0.16.1, 4 gloo ranks) refit into vLLM-style engines.

The oracle knows nothing of the library's mapping: every rank's `sharded_state_dict()` tensors are placed at their
stated offsets into Megatron's global tensors, cut into Hugging Face tensors by `megatron_cases.hf_from_megatron`,
and a plain-torch forward of those must match Megatron's own forward logits. Every engine tensor must then equal
that oracle cut by this file's own vLLM slicing rules, bit for bit (padded vocabulary rows untouched), after the
first run and after a real optimizer step and a second run; and the plan must move each destination byte once (the
replicas, the tied output layer on the last stage included, add holders, not traffic).

Cases: TP2 x PP2 dense with tied embeddings -> engine TP4; PP2 x EP2 MoE (SequentialMLP, allgather dispatcher) ->
engine TP2 x 2 replicas; TP2 x DP2 -> engine TP1 x 4 replicas. Bad input: a rank registering another stage's chunk,
a parameter whose shape disagrees with the config, unsupported features.
"""

from __future__ import annotations

import importlib.util

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("needs megatron-core (make megatron-env; `make test` runs this file there)", allow_module_level=True)

import megatron_cases as mc  # noqa: E402
from vllm_oracle import vllm_local  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]

ENGINE_TP = {"dense": 4, "moe": 2, "tpdp": 1}


RANK_POOL = {"world_size": 4}  # the `pool` fixture's ranks (tests/conftest.py)


def expected(name: str, hf: dict[str, torch.Tensor], tp: int, t: int, like: torch.Tensor) -> torch.Tensor:
    """Engine tensor `name` on engine TP rank `t` of `tp`, cut from the Hugging Face oracle tensors by vLLM's rules
    (`tests/vllm_oracle.py`)."""
    def experts(layer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # per-expert tensors, stacked
        return tuple(torch.stack([hf[f"{layer}.experts.{e}.{x}_proj.weight"] for e in range(mc.EXPERTS)])
                     for x in ("gate", "up", "down"))

    return vllm_local(name, hf.__getitem__, tp=tp, t=t, kv_heads=mc.GROUPS, head_dim=mc.HEAD_DIM,
                      padded=like.clone().fill_(mc.SENTINEL), experts=experts)


def oracle(out: list[dict], case: str, run: int) -> dict[str, torch.Tensor]:
    return mc.hf_from_megatron(mc.megatron_full([o["runs"][run]["shards"] for o in out]), case)


def check_case(out: list[dict], case: str) -> None:
    tp = ENGINE_TP[case]
    ids = torch.arange(14).reshape(2, 7) * 13 % mc.VOCAB
    first = oracle(out, case, 0)
    ref = [o["logits"] for o in out if o["logits"] is not None]
    assert len(ref) == 1
    # the oracle is Megatron's model: a plain forward of its tensors gives Megatron's own logits
    torch.testing.assert_close(mc.hf_logits(first, case, ids), ref[0], rtol=1e-4, atol=1e-4)
    for run in (0, 1):
        hf = first if run == 0 else oracle(out, case, 1)
        bad = []
        for rank, o in enumerate(out):
            for name, local in o["runs"][run]["engine"].items():
                want = expected(name, hf, tp, rank % tp, local)
                if want.shape != local.shape or not torch.equal(want, local):
                    bad.append(f"engine rank {rank}: {name}")
        assert bad == [], f"run {run}: {bad[:10]}"
    second = oracle(out, case, 1)
    assert all(not torch.equal(first[n], second[n]) for n in first), "the optimizer step changed every weight"
    # each destination byte once: the plan moves exactly the engine's real (non-padding) elements
    real = sum(int((t != mc.SENTINEL).sum()) for o in out for t in o["runs"][1]["engine"].values())
    assert {o["moved_bytes"] for o in out} == {real * 4}


@pytest.mark.parametrize("case", ["dense", "moe", "tpdp"])
def test_megatron_refit_is_exact(pool, case: str) -> None:
    out = pool.run_ok(mc.job_refit, case, ENGINE_TP[case])
    check_case(out, case)
    names = set().union(*(o["names"] for o in out))
    assert "lm_head.weight" in names or mc.CASES[case]["tied"]
    assert not any("experts" in n for n in names) or case == "moe"


def test_a_chunk_of_another_stage_is_refused_on_every_rank(pool) -> None:
    out = pool.run_ok(mc.job_refused, "wrong_stage")
    for o in out:
        assert o["error"] is not None and "rank 2" in o["error"] and "built for another stage" in o["error"], o
        assert o["untouched"]


def test_a_shape_that_disagrees_with_the_config_is_refused_on_every_rank(pool) -> None:
    out = pool.run_ok(mc.job_refused, "bad_shape")
    for o in out:
        assert o["error"] is not None and "rank 1" in o["error"], o
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in o["error"]
        qkv_rows = mc.GROUPS * (mc.HEADS // mc.GROUPS + 2) * mc.HEAD_DIM
        assert "disagrees with the model's config" in o["error"] and f"({qkv_rows}, {mc.HIDDEN})" in o["error"]
        assert o["untouched"]


def test_unsupported_features_raise_at_registration_on_every_rank(pool) -> None:
    for o in pool.run_ok(mc.job_unsupported):
        assert o["no_vocab"].startswith("ValueError") and "vocab_size" in o["no_vocab"], o
        assert o["vpp"].startswith("NotImplementedError") and "virtual pipeline" in o["vpp"], o
        assert o["not_megatron"].startswith("TypeError"), o
        assert o["tp4"].startswith("NotImplementedError") and "linear_qkv.weight" in o["tp4"]
        assert "fewer query groups (2) than tensor-parallel ranks (4)" in o["tp4"], o
        assert o["grouped"].startswith("NotImplementedError") and "mlp.experts.weight1" in o["grouped"], o
        assert "GroupedMLP" in o["grouped"], o


def test_a_replaced_parameter_is_sent(pool) -> None:
    """After run 1, every rank re-creates `decoder.layers.0.mlp.linear_fc2.weight` as a new `nn.Parameter` (new
    values): run 2 lands the new values (the oracle reads them from the model's `sharded_state_dict()`), every other
    weight as before (before, the registration kept the old parameter object and run 2 sent its stale values)."""
    case = "tpdp"
    out = pool.run_ok(mc.job_refit, case, ENGINE_TP[case], "replace")
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    first, second = oracle(out, case, 0), oracle(out, case, 1)
    changed = [n for n in first if not torch.equal(first[n], second[n])]
    assert changed == ["model.layers.0.mlp.down_proj.weight"], changed
    bad = []
    for rank, o in enumerate(out):
        for name, local in o["runs"][1]["engine"].items():
            want = expected(name, second, ENGINE_TP[case], rank % ENGINE_TP[case], local)
            if not torch.equal(want, local):
                bad.append(f"engine rank {rank}: {name}")
    assert bad == [], bad


def test_a_replaced_parameter_of_another_dtype_is_refused_on_every_rank(pool) -> None:
    case = "tpdp"
    out = pool.run_ok(mc.job_refit, case, ENGINE_TP[case], "replace64")
    for rank, o in enumerate(out):
        assert o["error"] is not None and f"its module's parameter {mc.REPLACED!r} was replaced" in o["error"], o
        assert "float64" in o["error"], o["error"]
        assert all(torch.equal(o["runs"][0]["engine"][n], t) for n, t in o["runs"][1]["engine"].items()), rank


def test_the_router_expert_bias_lands_in_the_engines_e_score_correction_bias(pool) -> None:
    """A MoE with `moe_router_enable_expert_bias` (DeepSeek-V3 / GLM-4.5 routing): every engine rank's
    `mlp.gate.e_score_correction_bias` of every layer equals Megatron's `expert_bias` of that layer as
    `sharded_state_dict()` states it, after run 1 and after an in-place update and run 2 (before, the buffer was
    skipped and the engine's tensor refused as missing)."""
    out = pool.run_ok(mc.job_expert_bias, True)
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    for run in (0, 1):
        full = mc.megatron_full([o["runs"][run]["shards"] for o in out])[mc.BIAS]
        assert full.shape == (mc.LAYERS, mc.EXPERTS)
        for rank, o in enumerate(out):
            for i in range(mc.LAYERS):
                got = o["runs"][run]["engine"][f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
                assert torch.equal(got, full[i]), (run, rank, i, got, full[i])
    assert not torch.equal(*(mc.megatron_full([o["runs"][r]["shards"] for o in out])[mc.BIAS] for r in (0, 1)))


def test_an_engine_without_the_expert_bias_is_refused_naming_it(pool) -> None:
    for o in pool.run_ok(mc.job_expert_bias, False):
        assert o["error"] is not None and "model.layers.0.mlp.gate.e_score_correction_bias" in o["error"], o


def test_a_head_layout_that_keeps_every_shape_is_refused_on_every_rank(pool) -> None:
    """Megatron: 8 heads of 32 in 2 query groups; the engine registered by `hf.engine_tensors(..., config=...)`
    with a config of 4 heads of 64, 1 KV head, and no `declare_facts` of its own. Every tensor has the same shape
    (before, the refit ran and the engine computed other logits); now every rank raises, naming each fact with
    Megatron's and the engine's values, and nothing lands."""
    for o in pool.run_ok(mc.job_facts):
        assert o["error"] is not None, o
        for fact in ("num_attention_heads: 8 by trainer (Megatron's TransformerConfig)",
                     "num_key_value_heads: 2 by trainer", "head_dim: 32 by trainer",
                     "64 by engine (the config given to hf.engine_tensors)"):
            assert fact in o["error"], (fact, o["error"])
        assert o["untouched"], o


def test_overlap_param_gather_is_completed_before_a_refit_right_after_the_step(pool) -> None:
    """Megatron's distributed optimizer with `overlap_param_gather` (TP2 x DP2, a real forward, backward and
    `optimizer.step()` on CPU): the step leaves each rank's parameters half updated (the other DP rank's shard
    arrives with the next forward's all-gather: the probe counts the elements that gather changes). A refit right
    after the step must send the whole new step: every engine tensor equals the oracle read once the all-gather ran
    (before, it would have sent the stale half)."""
    case = "tpdp"
    probe = pool.run_ok(mc.job_overlap_param_gather, True)
    assert all(p["changed"] > p["total"] // 3 for p in probe), probe  # the mix the refit must not send
    out = pool.run_ok(mc.job_overlap_param_gather, False)
    for run in (0, 1):
        hf = oracle(out, case, run)
        bad = [f"engine rank {rank}: {name}" for rank, o in enumerate(out)
               for name, local in o["runs"][run]["engine"].items()
               if not torch.equal(expected(name, hf, ENGINE_TP[case], rank % ENGINE_TP[case], local), local)]
        assert bad == [], (run, bad[:10])
    assert any(not torch.equal(a, b) for a, b in zip(oracle(out, case, 0).values(), oracle(out, case, 1).values()))


def test_a_trainer_init_error_reaches_the_engine_with_its_reason(pool) -> None:
    """`trainer_init(source=GPTModel)` without `vocab_size` raises on the 4 trainer ranks after the group formed;
    the engine rank (this process, as reshard's vLLM backend joins) raises it too, with the reason, within seconds
    of its 60 s timeout (before: it waited the timeout out and was told only that ranks never reached it)."""
    import socket
    import threading
    import time

    from reshard.comm import Group
    from reshard.refit import Refit

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine: dict = {}

    def run_engine() -> None:
        try:
            group = Group.rendezvous("127.0.0.1", port, 4, 5, timeout=60)
            t0 = time.monotonic()
            try:
                Refit(group, timeout=60).run()
            except Exception as e:  # noqa: BLE001
                engine["error"], engine["seconds"] = f"{type(e).__name__}: {e}", time.monotonic() - t0
            finally:
                group.close()
        except Exception as e:  # noqa: BLE001
            engine["error"], engine["seconds"] = f"rendezvous: {type(e).__name__}: {e}", None

    thread = threading.Thread(target=run_engine, daemon=True)
    thread.start()
    trainers = pool.run_ok(mc.job_trainer_init_fails, port)
    thread.join(90)
    assert not thread.is_alive(), "the engine rank hangs"
    for t in trainers:
        assert t is not None and t.startswith("ValueError") and "pass vocab_size=" in t, t
    assert "CommError" in engine["error"] and "pass vocab_size=" in engine["error"], engine
    assert engine["seconds"] < 15, engine
