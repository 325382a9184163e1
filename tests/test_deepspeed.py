"""DeepSpeed trainers as refit sources (`reshard.integrations.deepspeed`, `.venv-trl` with DeepSpeed: `make
test-deepspeed`): real ZeRO-3 (and ZeRO-2) engines on 2 and 3 gloo ranks (DS_ACCELERATOR=cpu) into a TP2 bfloat16
engine laid out as vLLM does, one pool of 5 ranks for the module.

Oracle: DeepSpeed's own `GatheredParameters` after every run, cut by vLLM's rules (`tests/vllm_oracle.py`, written
from vLLM's model code) and cast as torch casts: every engine tensor equal bit for bit, padded vocabulary rows
untouched, over a first refit and two optimizer steps each followed by one. The partitions' padding is filled with
NaN first (read, it would show). Each engine byte leaves the trainer once, the trainer ranks sending about equal
shares. Cases: fp32 trainer with every parameter partitioned (threshold 0) and with DeepSpeed's default
persistence (every parameter of this small model kept whole), bf16 trainers, tied embeddings, 3 ranks (a rank
holding only padding of the `(4,)` norms), ZeRO-2; a wrong name and a wrong shape refused on every rank; a trainer
rank lost between syncs named by the others.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs DeepSpeed (make deepspeed-env; `make test` runs this file there)", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_cases as dc  # noqa: E402
from vllm_oracle import vllm_local  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed]

RANK_POOL = {"world_size": 5, "timeout_s": 180.0, "start_timeout": 300.0}

CASES = {
    2: [{"stage": 3, "bf16": False, "persistence": 0},
        {"stage": 3, "bf16": False, "persistence": None},  # DeepSpeed's default threshold: every parameter whole
        {"stage": 2, "bf16": True}],
    3: [{"stage": 3, "bf16": True, "persistence": 0, "tie": True},
        {"stage": 3, "bf16": False, "persistence": 0}],
}


def check(out: list, num_trainers: int) -> None:
    for i, case in enumerate(CASES[num_trainers]):
        trainers = [o[i] for o in out[:num_trainers]]
        engines = [o[i] for o in out[num_trainers:num_trainers + dc.ENGINE_TP]]
        oracle = trainers[0]["runs"]
        for run in range(3):
            full = {n: t.to(torch.bfloat16) for n, t in oracle[run].items()}
            if case.get("tie"):
                assert "lm_head.weight" not in full or torch.equal(full["lm_head.weight"],
                                                                   full["model.embed_tokens.weight"])
            bad = []
            for t, e in enumerate(engines):
                for name, local in e["runs"][run].items():
                    want = vllm_local(name, full.__getitem__, tp=dc.ENGINE_TP, t=t, kv_heads=dc.KV_HEADS,
                                      head_dim=dc.HEAD_DIM, padded=torch.full_like(local, dc.SENTINEL))
                    if want.shape != local.shape or not torch.equal(want, local):
                        bad.append(f"case {case} run {run} engine TP rank {t}: {name}")
            assert bad == [], bad[:10]
        changed = [n for n in oracle[0] if not torch.equal(oracle[0][n], oracle[2][n])]
        assert len(changed) == len(oracle[0]), "two optimizer steps changed every weight"
        # each engine byte once (bfloat16 on the wire: cast while packing), split between the trainer ranks
        real = sum(int((t != dc.SENTINEL).sum()) for e in engines for t in e["runs"][2].values())
        for run in range(3):
            sent = [tr["sent"][run] for tr in trainers]
            assert sum(sent) == real * 2, (case, run, sent, real)
            assert max(sent) <= 1.3 * sum(sent) / num_trainers, (case, sent)
        assert {e["moved"] for e in engines} == {real * 2}
        if case["stage"] == 3:
            assert trainers[-1]["poisoned"] > 0, "the last rank's partitions hold the padding (NaN here)"
            for tr in trainers:  # most windows are views of ds_tensor's storage, the rest refreshed copies
                assert tr["views"] >= 0.75 * (tr["views"] + tr["copies"]), tr
        persistent = [tr.get("persistent", 0) for tr in trainers]
        if case.get("persistence") is None and case["stage"] == 3:
            assert persistent[0] == len(oracle[0]), "the default threshold keeps this small model's parameters whole"
        elif case["stage"] == 3:
            assert persistent == [0] * num_trainers


def test_zero3_and_zero2_on_2_ranks_refit_bit_exact(pool) -> None:
    out = pool.run_ok(dc.job_refit, 2, CASES[2], timeout=900)
    check(out, 2)
    names = set(out[0][0]["names"]) | set(out[1][0]["names"])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


def test_zero3_on_3_ranks_with_a_padding_only_rank(pool) -> None:
    out = pool.run_ok(dc.job_refit, 3, CASES[3], timeout=900)
    check(out, 3)
    norm = "model.layers.0.self_attn.q_norm.weight"  # (4,) over 3 ranks: ps 2, rank 2 holds [4, 4): padding only
    assert norm in out[0][0]["names"] and norm in out[1][0]["names"] and norm not in out[2][0]["names"]
    assert "lm_head.weight" not in out[0][0]["names"]  # tied: the embedding's alias, sent once


@pytest.mark.parametrize("what", ["name", "shape"])
def test_a_wrong_name_or_shape_is_refused_on_every_rank(pool, what: str) -> None:
    out = pool.run_ok(dc.job_refused, what)[:4]
    for o in out:
        assert o["error"] is not None, o
        if what == "name":
            assert "model.final_norm.weight" in o["error"], o["error"]
        else:
            assert "mlp.gate_proj.weight" in o["error"] and "36" in o["error"] and "34" in o["error"], o["error"]
        assert o["untouched"]


def test_a_trainer_rank_lost_between_syncs_is_named(pool) -> None:
    outs = pool.run(dc.job_lost, timeout=300)
    assert outs[1].died and not outs[1].ok
    for o in (outs[0], outs[2], outs[3]):
        assert o.ok and o.value["error"] is not None, o
        assert "rank 1" in o.value["error"], o.value["error"]
        assert o.value["seconds"] < 120, o.value
