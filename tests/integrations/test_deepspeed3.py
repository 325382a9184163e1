"""DeepSpeed ZeRO-3 on 3 gloo trainer ranks into a TP2 bfloat16 engine (`make test-deepspeed`), as
`tests/integrations/test_deepspeed.py` checks 2: bit-exact against DeepSpeed's own `GatheredParameters` over two optimizer steps,
each byte sent once. Three ranks split every `(63,)`-row weight mid-row into three boxes, and leave rank 2 only
padding of the `(4,)` q/k norms (it sends none of them); a bf16 trainer with tied embeddings and an fp32 one.
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

RANK_POOL = {"world_size": 5, "timeout_s": 180.0, "start_timeout": 300.0}


def test_zero3_on_3_ranks_with_a_padding_only_rank(pool) -> None:
    out = pool.run_ok(dc.job_refit, 3, dc.CASES[3], timeout=900)
    dc.check(out, 3)
    norm = "model.layers.0.self_attn.q_norm.weight"  # (4,) over 3 ranks: ps 2, rank 2 holds [4, 4): padding only
    assert norm in out[0][0]["names"] and norm in out[1][0]["names"] and norm not in out[2][0]["names"]
    assert "lm_head.weight" not in out[0][0]["names"]  # tied: the embedding's alias, sent once


