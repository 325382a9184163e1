"""Live registrations across 4 gloo ranks: a refit source or destination that changes between two runs either
sends (and lands) the new values, checked bit for bit against the new full tensor cut by hand, or raises a
`ValueError` on every rank before any data moves; never stale bytes, never a stale buffer."""

from __future__ import annotations

import pytest
import torch
from live_cases import ENGINE, TRAIN, full, job_live

pytestmark = pytest.mark.distributed


RANK_POOL = 4  # the `pool` fixture's ranks (tests/conftest.py)


def _landed(out: list, seed: int) -> None:
    """Every engine rank holds its slice of `full(seed)` after run 2, and held `full(1)`'s after run 1."""
    from live_cases import engine_slice

    for r in ENGINE:
        assert torch.equal(out[r]["runs"][0], engine_slice(full(1), r)), r  # run 1 was right
        assert torch.equal(out[r]["runs"][1], engine_slice(full(seed), r)), (r, out[r]["runs"][1])


def test_module_to_float64_raises_on_every_rank_naming_the_weight(pool) -> None:
    out = pool.run_ok(job_live, "to64")
    for r, o in enumerate(out):
        assert o["error"] is not None, (r, "run 2 sent without an error")
        assert "source 'weight' on rank 0 changed since the plan" in o["error"], (r, o["error"])
        assert "dtype torch.float32 -> torch.float64" in o["error"], (r, o["error"])
        assert "source 'weight' on rank 1" in o["error"], (r, o["error"])  # both trainer ranks saw it
    from live_cases import engine_slice

    for r in ENGINE:  # nothing was moved
        assert torch.equal(out[r]["runs"][1], engine_slice(full(1), r)), r


def test_in_place_update_is_sent(pool) -> None:
    """The control: the same job with an in-place update of the values (which also passed before)."""
    out = pool.run_ok(job_live, "inplace")
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    _landed(out, 2)


def test_dtensor_local_tensor_replaced_with_the_same_layout_sends_the_new_values(pool) -> None:
    out = pool.run_ok(job_live, "local")
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    _landed(out, 2)


def test_load_state_dict_assign_on_a_module_source_lands_the_new_values(pool) -> None:
    out = pool.run_ok(job_live, "assign")
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    _landed(out, 2)


def test_load_state_dict_assign_of_another_dtype_raises_on_every_rank(pool) -> None:
    out = pool.run_ok(job_live, "assign_dtype")
    for r, o in enumerate(out):
        assert o["error"] is not None and "source 'weight' on rank 0: its module's parameter 'weight' was replaced " \
            "by one of another layout" in o["error"], (r, o["error"])
        assert "float64" in o["error"], (r, o["error"])


def test_destination_replaced_by_the_engine_writes_the_new_buffer_and_leaves_the_old_one(pool) -> None:
    from live_cases import engine_slice

    out = pool.run_ok(job_live, "dest")
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    _landed(out, 2)
    for r in ENGINE:
        assert torch.equal(out[r]["old"], engine_slice(full(1), r)), (r, "the old buffer was written")


def test_destination_replaced_with_another_dtype_raises_on_every_rank(pool) -> None:
    from live_cases import engine_slice

    out = pool.run_ok(job_live, "dest_dtype")
    for r, o in enumerate(out):
        assert o["error"] is not None, (r, "run 2 wrote without an error")
        assert "destination 'weight' on rank 2 is a view of a tensor that was replaced" in o["error"], (r, o["error"])
        assert "dtype torch.float32 -> torch.float64" in o["error"], (r, o["error"])
    for r in ENGINE:
        assert torch.equal(out[r]["old"], engine_slice(full(1), r)), (r, "the old buffer was written")


def test_update_source_binds_a_new_dtensor_of_the_same_layout(pool) -> None:
    out = pool.run_ok(job_live, "update")
    assert all(o["error"] is None for o in out), [o["error"] for o in out]
    _landed(out, 2)


@pytest.mark.parametrize("case, message", [
    ("update_replicated", "rank 0: update_source: source 'weight' has another layout now"),
    ("update_unknown", "rank 1: update_source: 'bias' is not a registered source"),
    ("refuse", "rank 1: the stream changed on this rank"),
])
def test_refusals_after_the_first_run_raise_on_every_rank_before_data_moves(pool, case, message) -> None:
    out = pool.run_ok(job_live, case)
    from live_cases import engine_slice

    for r, o in enumerate(out):
        assert o["error"] is not None and message in o["error"], (r, o["error"])
    for r in ENGINE:  # nothing was moved
        assert torch.equal(out[r]["runs"][1], engine_slice(full(1), r)), r


@pytest.mark.parametrize("case, message", [
    ("update_replicated_retry", "rank 1: update_source: source 'weight' has another layout now"),
    ("plain_update_dtype_retry", "rank 1: update_source: source tensor 'weight' on rank 1: dtype torch.float64"),
])
def test_a_refused_rebinding_is_refused_again_by_a_retry_for_dtensor_and_plain_sources(pool, case, message) -> None:
    """A rebinding refused on one rank binds nothing and stays refused: the retry (run() again, nothing rebound)
    raises the same reason on every rank and moves nothing, for a DTensor source as for a plain one (before, the
    DTensor branch consumed the refusal and the retry sent the old, step-1 tensor)."""
    out = pool.run_ok(job_live, case)
    from live_cases import engine_slice

    for r, o in enumerate(out):
        assert o["error"] is not None and message in o["error"], (r, o["error"])
        assert o["retry_error"] is not None and message in o["retry_error"], (r, "the retry ran", o["retry_error"])
    for r in ENGINE:  # nothing was moved, by either run
        assert torch.equal(out[r]["runs"][1], engine_slice(full(1), r)), r
        assert torch.equal(out[r]["runs"][2], engine_slice(full(1), r)), r


def test_a_plain_source_rebound_to_a_dtensor_is_refused_on_every_rank_before_any_byte(pool) -> None:
    """A DTensor whose (global) shape equals the plain source's piece: refused by update_source on both trainer
    ranks, raised on every rank, the engine untouched (before, rank 0 failed inside torch's copy, mid-transfer)."""
    out = pool.run_ok(job_live, "plain_update_dtensor")
    from live_cases import engine_slice

    for r, o in enumerate(out):
        assert o["error"] is not None, (r, "run 2 sent without an error")
        for t in TRAIN:
            assert (f"rank {t}: update_source: source 'weight' was registered as a plain local tensor with a layout, "
                    "got a DTensor") in o["error"], (r, o["error"])
    for r in ENGINE:
        assert torch.equal(out[r]["runs"][1], engine_slice(full(1), r)), r
