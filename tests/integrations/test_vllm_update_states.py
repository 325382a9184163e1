"""The vLLM backend's update state machine (`reshard.integrations.engine_side.Updates`) on its own, with a
stand-in refit whose transfer the test controls (no vLLM needed): every transition the real-engine tests
(`test_vllm_lifecycle.py`) do not reach, and what each refusal leaves behind."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from reshard.integrations.engine_side import Refused, Updates, stop


class FakeRefit:
    """`run()` waits for `release` (when given), then fails with `error` or returns a report."""

    def __init__(self, error: BaseException | None = None, release: threading.Event | None = None) -> None:
        self.error, self.release, self.runs = error, release, 0

    def run(self):
        self.runs += 1
        if self.release is not None:
            assert self.release.wait(10)
        if self.error is not None:
            raise self.error
        return SimpleNamespace(seconds={})


def test_stage_then_commit_names_the_versions() -> None:
    u, refit, gate = Updates(), FakeRefit(), threading.Event()
    refit.release = gate
    assert u.begin(refit, "7", "stage") is None
    assert (u.state, u.live_version, u.staged_version) == ("staging", None, "7")
    with pytest.raises(Refused, match=r"'full' update is refused in state 'staging', version '7' staged(.|\n)*"
                                      r"start_weight_update\(\), then(.|\n)*'7'(.|\n)*'commit'"):
        u.begin(refit, "8", "full")
    assert refit.runs == 1 and u.state == "staging"  # the refusal touched nothing
    gate.set()
    applied = []
    u.commit(u.take(refit, "7"), lambda: applied.append(1))
    assert applied == [1] and (u.state, u.live_version, u.staged_version) == ("idle", "7", None)


def test_a_failed_transfer_is_never_applied_and_the_commit_after_is_refused() -> None:
    u = Updates()
    stage = u.begin(FakeRefit(error=RuntimeError("trainer died")), "3", "full")
    with pytest.raises(RuntimeError, match="trainer died"):
        u.commit(stage, lambda: pytest.fail("applied a failed transfer"))
    assert (u.state, u.live_version) == ("failed", None)
    with pytest.raises(Refused, match=r"'commit' is refused in state 'failed': nothing is staged \(the transfer of "
                                      r"version '3' failed\)"):
        u.take(FakeRefit(), "3")


def test_commit_of_another_version_drops_the_stage() -> None:
    u, refit = Updates(), FakeRefit()
    u.begin(refit, "4", "stage")
    with pytest.raises(RuntimeError, match="commit of version '5', but version '4' is staged: it is dropped"):
        u.take(refit, "5")
    assert (u.state, u.staged_version, u.live_version) == ("failed", None, None)


def test_a_stage_of_a_replaced_group_is_never_committed() -> None:
    u, old, new = Updates(), FakeRefit(), FakeRefit()
    u.begin(old, "6", "stage")
    with pytest.raises(Refused, match="belongs to a group that was replaced"):
        u.take(new, "6")
    assert (u.state, u.staged_version) == ("failed", None)


def test_drop_clears_the_staged_version_and_stop_ends_the_thread() -> None:
    u, gate = Updates(), threading.Event()
    u.begin(FakeRefit(release=gate), "9", "stage")
    stage = u.drop("test")
    assert (u.state, u.staged_version) == ("failed", None) and stage is not None and stage.running
    gate.set()  # what closing the group does to the stage's waits
    assert stop(stage, timeout=5) and not stage.running


def test_unversioned_updates_and_a_commit_that_fails_part_way_are_named() -> None:
    u = Updates()
    u.commit(u.begin(FakeRefit(), None, "full"), lambda: None)
    assert u.live_version == "update-1"

    def broken() -> None:
        raise RuntimeError("re-processing failed")

    with pytest.raises(RuntimeError, match="re-processing failed"):
        u.commit(u.begin(FakeRefit(), "2", "full"), broken)
    assert (u.state, u.live_version) == ("failed", "incomplete-2")
