"""DeepSpeed trainers as refit sources (`reshard.integrations.deepspeed`, `.venv-trl` with DeepSpeed: `make
test-deepspeed`): real ZeRO-3 (and ZeRO-2) engines on 2 gloo ranks (DS_ACCELERATOR=cpu) into a TP2 bfloat16 engine
laid out as vLLM does, one pool of 4 ranks for the module (3 trainer ranks: `tests/integrations/test_deepspeed3.py`).

Oracle: DeepSpeed's own `GatheredParameters` after every run, cut by vLLM's rules (`tests/vllm_oracle.py`, written
from vLLM's model code) and cast as torch casts: every engine tensor equal bit for bit, padded vocabulary rows
untouched, over a first refit and two optimizer steps each followed by one. The partitions' padding is filled with
NaN first (read, it would show). Each engine byte leaves the trainer once, the trainer ranks sending about equal
shares. Cases: fp32 trainer with every parameter partitioned (threshold 0) and with DeepSpeed's default
persistence (every parameter of this small model kept whole), a bf16 ZeRO-2 trainer; a wrong name and a wrong
shape refused on every rank; a replaced parameter followed (ZeRO-2) or refused (ZeRO-3); a trainer rank lost between
syncs named by the others.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs DeepSpeed (make deepspeed-env; `make test` runs this file there)", allow_module_level=True)

import deepspeed_cases as dc  # noqa: E402  (tests/ is on sys.path: it holds tests/conftest.py)

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed]

RANK_POOL = {"world_size": 4, "timeout_s": 180.0, "start_timeout": 300.0}


def test_zero3_and_zero2_on_2_ranks_refit_bit_exact(pool) -> None:
    out = pool.run_ok(dc.job_refit, 2, dc.CASES[2], timeout=900)
    dc.check(out, 2)
    names = set(out[0][0]["names"]) | set(out[1][0]["names"])
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names


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


def test_a_replaced_parameter_is_followed_or_refused(pool) -> None:
    """ZeRO-2: the new values land, every other tensor as before; ZeRO-3: refused on every rank, naming it."""
    out = pool.run_ok(dc.job_replaced, 2)[:4]
    for o in out[2:]:
        assert o["error"] is None, o["error"]
        assert torch.equal(o["second"]["model.norm.weight"], o["new"].to(torch.bfloat16))
        assert not torch.equal(o["first"]["model.norm.weight"], o["second"]["model.norm.weight"])
        assert all(torch.equal(o["first"][n], t) for n, t in o["second"].items() if n != "model.norm.weight")
    out = pool.run_ok(dc.job_replaced, 3)[:4]
    for o in out:
        assert o["error"] is not None and "'model.norm.weight'" in o["error"], o["error"]
        assert "not ZeRO-3 partitioned" in o["error"], o["error"]
    for o in out[2:]:
        assert all(torch.equal(o["first"][n], t) for n, t in o["second"].items()), "refused: nothing moved"


def test_a_trainer_rank_lost_between_syncs_is_named(pool) -> None:
    outs = pool.run(dc.job_lost, timeout=300)
    assert outs[1].died and not outs[1].ok
    for o in (outs[0], outs[2], outs[3]):
        assert o.ok and o.value["error"] is not None, o
        assert "rank 1" in o.value["error"], o.value["error"]
        assert o.value["seconds"] < 120, o.value
