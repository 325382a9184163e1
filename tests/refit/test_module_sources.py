"""A registered trainer module is followed, not its parameter objects, by `ReshardTrainer.trainer_init(source=
module)` and `Refit.add_module_sources` alike (4 gloo ranks, `module_cases`): a replaced parameter's new values
land at the next send; a re-tied one sends the shared values; an untied one (its own values now) is refused on
every rank, naming it, before anything moves, never sent as the tied values. The oracle: the full tensors of each
seed cut by hand (`live_cases.full`, `engine_slice`)."""

from __future__ import annotations

import socket

import pytest
import torch
from live_cases import ENGINE
from module_cases import expected, job_module

pytestmark = pytest.mark.distributed


RANK_POOL = 4  # the `pool` fixture's ranks (tests/conftest.py)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(out: list, run: int, seeds: dict[str, int]) -> None:
    for r in ENGINE:
        want = expected(r, seeds)
        got = out[r]["runs"][run]
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert not bad, (r, run, bad)


@pytest.mark.parametrize("api", ["trainer", "refit"])
def test_a_replaced_parameter_is_sent(pool, api: str) -> None:
    out = pool.run_ok(job_module, api, "replace", _port())
    assert all(o["error"] is None and "error1" not in o for o in out), out
    tied = {"model.embed_tokens.weight": 1, "model.norm.weight": 2, "lm_head.weight": 1}
    _check(out, 0, tied)
    _check(out, 1, {**tied, "model.norm.weight": 7})  # the new parameter's values, not the old one's


@pytest.mark.parametrize("api", ["trainer", "refit"])
def test_an_untied_parameter_is_refused_on_every_rank(pool, api: str) -> None:
    out = pool.run_ok(job_module, api, "untie", _port())
    assert all("error1" not in o for o in out), out
    tied = {"model.embed_tokens.weight": 1, "model.norm.weight": 2, "lm_head.weight": 1}
    _check(out, 0, tied)  # the tie was sent as the embedding's values
    for r, o in enumerate(out):
        assert o["error"] is not None and "['lm_head.weight'] were tied to 'model.embed_tokens.weight'" in o["error"] \
            and "untied" in o["error"], (r, o["error"])
    _check(out, 1, tied)  # nothing moved: never the embedding's values sent as the untied lm_head


@pytest.mark.parametrize("api", ["trainer", "refit"])
def test_a_retied_parameter_sends_the_shared_values(pool, api: str) -> None:
    out = pool.run_ok(job_module, api, "retie", _port())
    assert all(o["error"] is None and "error1" not in o for o in out), out
    _check(out, 0, {"model.embed_tokens.weight": 1, "model.norm.weight": 2, "lm_head.weight": 3})
    _check(out, 1, {"model.embed_tokens.weight": 1, "model.norm.weight": 2, "lm_head.weight": 1})


@pytest.mark.parametrize("case, reason", [
    ("late", "'model.norm.weight' is a plain tensor; pass its layout too"),
    ("early", "transposed names 'nope', which the source does not hold"),
])
def test_a_trainer_init_error_reaches_every_rank_with_its_reason_within_seconds(pool, case: str, reason: str) -> None:
    """trainer_init fails on both trainer ranks (after the group formed, or before the rendezvous): the trainer
    ranks raise it, and the engine ranks' run() raises it too, naming the trainer rank and the reason, within
    seconds of the 30 s timeout (before, they waited it out: "never reached it", or a rendezvous timeout)."""
    from module_cases import job_init_fails

    out = pool.run_ok(job_init_fails, case, _port())
    for r, o in enumerate(out):
        assert o["error"] is not None and reason in o["error"], (r, o)
        assert o["seconds"] < 15, (r, o)
    for r in ENGINE:
        assert "CommError" in out[r]["error"] and "ReshardTrainer.trainer_init failed" in out[r]["error"], out[r]


def test_model_facts_that_shapes_cannot_show_must_agree(pool) -> None:
    """The trainer's config says 8 heads of 32 in 2 KV groups, the engine's 4 heads of 64 with 1 KV head (or 8
    experts more): every tensor has the same shape, yet the send is refused on every rank, naming each fact with
    both values and who declared it, and nothing lands (before, only shapes were compared and the send ran). The
    control: the same config on both sides sends the trainer's values (cut by hand)."""
    from module_cases import job_facts

    out = pool.run_ok(job_facts, "same", _port())
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    _check([{"runs": [o["engine"]]} for o in out], 0, {"model.embed_tokens.weight": 1, "model.norm.weight": 2,
                                                       "lm_head.weight": 3})
    for engine, facts in (("heads", ["num_attention_heads: 8 by trainer (its config) (ranks [0, 1]); 4 by engine "
                                     "(its config) (ranks [2, 3])", "num_key_value_heads: 2 by trainer",
                                     "head_dim: 32 by trainer"]),
                          ("experts", ["num_experts: 0 by trainer (its config) (ranks [0, 1]); 8 by engine"])):
        out = pool.run_ok(job_facts, engine, _port())
        for r, o in enumerate(out):
            assert o["error"] is not None and all(f in o["error"] for f in facts), (engine, r, o["error"])
            assert all(not t.any() for t in o["engine"].values()), (engine, r, "an engine tensor was written")
