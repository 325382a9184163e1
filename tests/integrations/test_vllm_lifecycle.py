"""The update lifecycle of the `reshard` vLLM backend against real vLLM CPU engines (marker `vllm`), on TP 1 (in
process) and TP 2 (vLLM's multiprocess executor, whose RPC replies fall out of step when every worker fails).

One engine per TP size serves every case in order; its oracle is its own fresh load of V1 (bit for bit: tokens,
log-probs, every forward tensor, every GEMM probe) and, at the end, vLLM's own in-place reload of the V2 checkpoint
for the V2 the lifecycle landed. The cases: a re-init over a landed, uncommitted stage drops it (never committed
into the new group's buffers); refusals leave a working next step, and the common caller patterns (`finally:
finish_weight_update()`, a commit after "commit it first") keep vLLM's replies in step; a shutdown during a stage
ends at once with the stage thread gone; the versions always name what the forward reads and what is staged.
"""

from __future__ import annotations

import re
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")

import cloudpickle  # noqa: E402  (ships with vLLM)
import vllm_cases as vc  # noqa: E402

pytestmark = pytest.mark.vllm
cloudpickle.register_pickle_by_value(vc)

V1, V2 = 11, 22  # weight versions (seeds)


def stage_threads(worker) -> list[str]:
    """The names of this worker's live stage threads."""
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("reshard-stage")]


def update_state(worker) -> str:
    return getattr(worker.weight_transfer_engine, "update_state", "?")


@pytest.fixture(scope="module")
def trainers():
    t = vc.Trainers(2)
    yield t
    t.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, tmp_path_factory, trainers):
    """A live engine of V1 (its fresh observation: the oracle) joined to the trainers, shared by the cases."""
    tp = request.param
    cfg = vc.config(4, 1000)
    root = tmp_path_factory.mktemp(f"lifecycle_tp{tp}")
    ck1, ck2 = str(root / "v1"), str(root / "v2")
    vc.write_checkpoint(ck1, cfg, V1)
    vc.write_checkpoint(ck2, cfg, V2)
    with pytest.MonkeyPatch.context() as mp:
        llm = vc.start_engine(ck1, tp, mp, in_process=tp == 1)
        try:
            state = {"llm": llm, "tp": tp, "cfg": cfg, "ck2": ck2, "v1": vc.observe(llm)}
            _join(state, trainers)
            yield state
        finally:
            vc.close_engine(llm)


def _join(state: dict, trainers: vc.Trainers) -> None:
    """A new group: the trainers (re)start their side, the engine calls init_weight_transfer_engine (no shutdown)."""
    port = vc.free_port()
    trainers.post("init", port, state["cfg"], state["tp"], False)
    state["llm"].init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                            "trainer_world_size": 2, "timeout_s": 60.0}})
    trainers.wait()


def _stage(llm, version: str) -> None:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version, "phase": "stage"}})


def _landed(llm) -> None:
    """Wait until every worker's stage thread has finished: the trainers return once their bytes are confirmed, a
    moment before the engine's thread marks the stage landed ('staged')."""
    deadline = time.monotonic() + 60
    while "staging" in llm.collective_rpc(update_state):
        assert time.monotonic() < deadline, "the stage did not land within 60 s of the trainers' send"
        time.sleep(0.05)


def _commit(llm, version: str) -> None:
    llm.update_weights({"update_info": {"version": version, "phase": "commit"}})
    llm.finish_weight_update()


def test_reinit_over_a_landed_stage_drops_it(engine, trainers) -> None:
    """Stage V2, the trainer sends it, the trainer restarts and the engine inits again without a shutdown: the stage
    is dropped (staged_version cleared), a commit of it is refused naming the next call, the engine still serves V1
    bit for bit; the named next step (start, stage, commit) lands V2 through the new group."""
    llm, tp = engine["llm"], engine["tp"]
    _stage(llm, "2")
    trainers.post("send", V2)
    trainers.wait()
    _landed(llm)  # landed in the loader buffers, not committed
    assert llm.collective_rpc(vc.versions) == [(None, "2")] * tp
    trainers.post("close")
    trainers.wait()
    llm.finish_weight_update()
    _join(engine, trainers)  # the trainer restarted: a new group, no shutdown first
    llm.start_weight_update()
    try:
        llm.update_weights({"update_info": {"version": "2", "phase": "commit"}})
        refusal = None
    except Exception as e:  # noqa: BLE001 - checked below, after the engine
        refusal = str(e)
    vc.assert_same(vc.observe(llm), engine["v1"])  # never committed into the new group's (empty) buffers
    dropped = r"'commit' is refused in state 'failed': nothing is staged \(the stage of version '2' was dropped"
    assert refusal is not None and re.search(dropped + r"(.|\n)*start_weight_update\(\)", refusal), refusal
    assert llm.collective_rpc(vc.versions) == [(None, None)] * tp  # the dropped stage is no longer named

    _stage(llm, "2")  # the named next step
    trainers.post("send", V2)
    trainers.wait()
    _commit(llm, "2")
    engine["v2"] = vc.observe(llm)  # checked against vLLM's own reload of V2 at the end
    assert vc.differences(engine["v2"], engine["v1"]), "V2 must differ from V1, or the test could not fail"
    assert llm.collective_rpc(vc.versions) == [("2", None)] * tp
    assert llm.collective_rpc(update_state) == ["idle"] * tp


def test_refusals_keep_replies_in_step_and_name_the_next_call(engine, trainers) -> None:
    """A second stage before the commit is refused naming the commit; `finally: finish_weight_update()` after it is
    refused once, carrying the refusal and the next call (never setting a version); a commit without a new
    `start_weight_update()` is one error naming it; every worker's replies stay in step (a call after each reads
    its own replies); the named next step commits the staged version exactly."""
    llm, tp = engine["llm"], engine["tp"]
    live = llm.collective_rpc(vc.versions)[0][0]
    _stage(llm, "3")
    trainers.post("send", V1)
    trainers.wait()
    _landed(llm)
    refusal = (r"'stage' update is refused in state 'staged', version '3' staged(.|\n)*start_weight_update\(\), "
               r"then update_weights(.|\n)*'3'(.|\n)*'commit'")
    with pytest.raises(Exception, match=r"finish_weight_update called without a matching start_weight_update(.|\n)*"
                                        + refusal + r"(.|\n)*no version is set; next: start_weight_update\(\)"):
        try:
            llm.update_weights({"update_info": {"version": "4", "phase": "stage"}})
        finally:
            llm.finish_weight_update()  # the caller's cleanup: refused once, carrying the refusal and the next call
    assert llm.collective_rpc(vc.versions) == [(live, "3")] * tp  # in step: every worker's own reply
    with pytest.raises(Exception, match=r"start_weight_update must be called before update_weights(.|\n)*"
                                        r"next: start_weight_update\(\)"):
        llm.update_weights({"update_info": {"version": "3", "phase": "commit"}})  # "commit it first", no start
    assert llm.collective_rpc(vc.versions) == [(live, "3")] * tp
    assert llm.collective_rpc(update_state) == ["staged"] * tp
    llm.start_weight_update()  # the named next step
    _commit(llm, "3")
    vc.assert_same(vc.observe(llm), engine["v1"])  # version "3" holds V1's weights
    assert llm.collective_rpc(vc.versions) == [("3", None)] * tp
    with pytest.raises(Exception, match=r"'commit' is refused in state 'idle'"):
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"version": "3", "phase": "commit"}})
        finally:
            llm.finish_weight_update()
    assert llm.collective_rpc(vc.last_error)[0] is not None and len(llm.collective_rpc(vc.last_error)) == tp


def test_update_without_a_version_is_named(engine, trainers) -> None:
    """An update without a version names what the forward reads (`update-<n>`), not None (the checkpoint)."""
    llm, tp = engine["llm"], engine["tp"]
    trainers.post("send", V2)
    llm.start_weight_update()
    llm.update_weights({"update_info": {}})
    llm.finish_weight_update()
    trainers.wait()
    live = llm.collective_rpc(vc.versions)
    assert len(live) == tp and all(v[0] is not None and v[0].startswith("update-") and v[1] is None
                                   for v in live), live
    assert len({v[0] for v in live}) == 1, live
    engine.setdefault("v2", vc.observe(llm))
    vc.assert_same(vc.observe(llm), engine["v2"])


def test_shutdown_during_a_stage_ends_at_once(engine, trainers) -> None:
    """A stage the trainer never sends, then `shutdown_weight_transfer_engine`: it returns within seconds, the stage
    thread is gone on every worker, nothing is staged, and the engine still serves what it served."""
    llm, tp = engine["llm"], engine["tp"]
    before, served = vc.observe(llm), llm.collective_rpc(vc.versions)
    _stage(llm, "5")
    assert llm.collective_rpc(vc.versions)[0][1] == "5"
    llm.finish_weight_update()
    t0 = time.monotonic()
    llm.shutdown_weight_transfer_engine()
    took = time.monotonic() - t0
    assert took < 20, f"shutdown during a stage took {took:.1f} s"
    assert llm.collective_rpc(stage_threads) == [[]] * tp
    assert llm.collective_rpc(vc.versions) == [(served[0][0], None)] * tp
    vc.assert_same(vc.observe(llm), before)
    trainers.post("close")
    trainers.wait()


def test_the_v2_landed_equals_vllms_own_reload(engine) -> None:
    """The oracle for the V2 the lifecycle landed through a new group: vLLM's own in-place reload of the V2
    checkpoint (last: a refit after vLLM's reload is not possible)."""
    if "v2" not in engine:
        pytest.skip("runs after the cases that land V2")
    llm = engine["llm"]
    vc.reload(llm, engine["ck2"])
    vc.assert_same(vc.observe(llm), engine["v2"])
