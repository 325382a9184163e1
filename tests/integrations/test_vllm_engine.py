"""The `reshard` vLLM weight-transfer backend against a real vLLM engine (marker `vllm`; `make test-vllm` runs these
in their own environment, with the CPU build of vLLM where there is no GPU).

A trainer of 2 processes (HuggingFace names; TP-style and FSDP-style shards, unlike the engine's) refits a live
engine twice, through vLLM's own `init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
`finish_weight_update`: from the V1 checkpoint it loaded to V2, then back to V1. The oracle is vLLM itself, loading
the same weights from a safetensors checkpoint: after each update the engine's greedy tokens and log-probs, and
every tensor its forward reads (parameters, buffers, the CPU GEMM closures' tensors), equal the oracle's, bit for
bit. V1's oracle is the engine's own fresh load. V2's oracle is vLLM's in-place reload (`reload_weights`: its loader,
then its weight post-processing) of the V2 checkpoint into the same engine after the refits, checked sound in the
same session: vLLM's reload of V1 then gives the fresh V1 state back, bit for bit. (A refit after vLLM's reload is
not possible: the reload drops the loader-format records the backend reads the layouts from.) For the MoE model the
reload is no oracle (it leaves the experts' prepacked CPU kernels on the old weights), so there V2's oracle is a
second engine that loads the V2 checkpoint fresh.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these in .venv-vllm")

import cloudpickle  # noqa: E402  (ships with vLLM)
import vllm_cases as vc  # noqa: E402

pytestmark = pytest.mark.vllm
cloudpickle.register_pickle_by_value(vc)

V1, V2 = 11, 22  # weight versions (seeds)


@pytest.fixture(scope="module")
def trainers():
    t = vc.Trainers(2)
    yield t
    t.close()


def _update(llm, trainers: vc.Trainers, seed: int) -> list:
    trainers.post("send", seed)
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": str(seed)}})
    llm.finish_weight_update()
    return trainers.wait()


def _session(tmp_path, monkeypatch, trainers, *, kv_heads: int = 4, vocab: int = 1000, tp: int,
             negative: bool = False, moe: bool = False, family: str | None = None, gemm: str | None = None,
             faults: bool = False, record_property=None, planning: str = "auto"):
    """Refit a live engine V1 -> V2 -> V1 and compare it with vLLM's own loading of each version (module docstring).

    Args:
        family: a `vllm_cases.FAMILIES` model, built by `transformers` and saved by its `save_pretrained` (else the
            hand-written Qwen3 of `kv_heads`, `vocab`, `moe`); the backend's engine tensors must also be the ones
            `reshard.integrations.hf` names for it.
        gemm: (TP 1, in process) one of `vllm_cases.GEMM_FORCINGS`: the engines load and re-process every Linear
            layer on the CPU GEMM branch this forcing leaves the dispatch on this processor (`vc.forced_branch`),
            checked on the live engine; else on the branches the processor takes by default, whichever they are.
        record_property: pytest's fixture, to report the GEMM branches the engine took in the run's summary.
        faults: after the refits, a bad update (a float32 norm) then a good one, and an engine whose init fails
            (a parameter no rule covers) with the trainer hearing why (`_faults`).
        planning: `Refit`'s planning on both sides (`"local"`: each rank plans only its own part).
    """
    if family is not None:
        cfg = vc.family_config(family)
        write = vc.write_hf_checkpoint
    else:
        cfg = vc.moe_config(kv_heads, vocab) if moe else vc.config(kv_heads, vocab)
        write = vc.write_checkpoint
    ck1, ck2 = str(tmp_path / "v1"), str(tmp_path / "v2")
    write(ck1, cfg, V1)
    write(ck2, cfg, V2)
    if gemm is not None:
        assert tp == 1, "a forced GEMM branch needs the engine in this process"
        forced = vc.forced_branch(gemm)
        vc.force_gemm(monkeypatch, gemm)
    want_v2 = None
    # vLLM's reload is no oracle for MoE (it leaves the experts' prepacked kernels on the old weights) nor for a tied
    # embedding (a second reload left the tied lm_head's GEMM unlike a fresh load's): V2 gets an engine of its own
    if moe or cfg.get("tie_word_embeddings"):
        ref = vc.start_engine(ck2, tp, monkeypatch, in_process=tp == 1)
        want_v2 = vc.observe(ref)  # a fresh load of V2: the oracle for V2
        vc.close_engine(ref)
    llm = vc.start_engine(ck1, tp, monkeypatch, in_process=tp == 1)
    want_v1 = vc.observe(llm)  # a fresh load of V1: the oracle for V1, and the state the refit starts from
    branches = {b for worker in llm.collective_rpc(vc.gemm_branches) for b in worker.values()}
    if record_property is not None:
        record_property(vc.NOTE, f"GEMM branches taken: {sorted(branches)}")
    if gemm is not None:  # the forcing reached every Linear layer of the live engine
        assert branches == {forced}, (gemm, forced, branches)

    try:
        port = vc.free_port()
        trainers.post("init", port, cfg, tp, family is not None, False, planning)
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "trainer_world_size": 2, "timeout_s": 120.0,
                                                       "planning": planning}})
        trainers.wait()
        if family is not None and family not in vc.HF_INTEGRATION_DIFFERS:
            # the backend and reshard.integrations.hf name the same engine tensors
            live = llm.collective_rpc(vc.engine_names)[0]
            assert live == vc.hf_engine_tensors(cfg, tp, first_rank=2), (live, vc.hf_engine_tensors(cfg, tp, 2))

        first = _update(llm, trainers, V2)
        assert all(r[0] for r in first)
        got_v2 = vc.observe(llm)  # compared with V2's oracle: at once (MoE) or after the refits (vLLM's reload)
        if want_v2 is not None:
            assert vc.differences(want_v1, want_v2), "the two versions must differ, or the test could not fail"
            vc.assert_same(got_v2, want_v2)
        report = llm.collective_rpc(vc.last_report)[0]
        assert report.first_run and report.seconds["process"] > 0 and report.network_bytes > 0
        want = "global" if planning == "auto" else planning  # `auto` is global on groups this small
        assert llm.collective_rpc(vc.planning) == [want] * tp

        second = _update(llm, trainers, V1)
        assert not any(r[0] for r in second)  # the plan is cached
        got_v1 = vc.observe(llm)
        vc.assert_same(got_v1, want_v1)

        if negative:
            # an update whose commit (re-processing, the norms' copy) never runs reaches no tensor the forward reads
            llm.collective_rpc(vc.skip_reprocessing, args=(True,))
            _update(llm, trainers, V2)
            stale = vc.differences(vc.observe(llm), got_v2)
            # exactly the layers the live engine says its commit writes are stale (the re-processed ones by their
            # GEMM probes at least, on any processor), and no other
            asked = llm.collective_rpc(vc.reprocessed_layers)
            reprocessed = {n for worker in asked for n in worker[0]}
            layers = {n for worker in asked for n in worker[1]}
            stale_layers = {vc.module_of(d.partition(": ")[2]) for d in stale if d.startswith("worker")}
            assert reprocessed <= layers and any("qkv_proj" in n for n in reprocessed), (reprocessed, layers)
            assert stale_layers == layers and any(d.startswith("tokens") for d in stale), (sorted(layers), stale)
            llm.collective_rpc(vc.skip_reprocessing, args=(False,))
            _update(llm, trainers, V2)
            vc.assert_same(vc.observe(llm), got_v2)
            # a parameter no layout rule covers is an error that names it, never a silent no-op
            errors = llm.collective_rpc(vc.unreachable_error)
            assert all("model.layers.0.mlp.router_bias" in e for e in errors), errors
            _update(llm, trainers, V1)
        if faults:
            _faults(llm, trainers, cfg, tp, got_v2, want_v1)
        else:
            trainers.post("close")
            trainers.wait()
            llm.shutdown_weight_transfer_engine()
        if want_v2 is None:
            # V2's oracle: vLLM's own in-place reload of the V2 checkpoint, into this engine after the refits; then
            # its reload of V1 must give back the fresh V1 state bit for bit, so the reload is as good as a fresh
            # load (and no refit left a tensor the reload does not write changed)
            vc.reload(llm, ck2)
            want_v2 = vc.observe(llm)
            assert vc.differences(want_v1, want_v2), "the two versions must differ, or the test could not fail"
            vc.assert_same(got_v2, want_v2)
            vc.reload(llm, ck1)
            vc.assert_same(vc.observe(llm), want_v1)
    finally:
        vc.close_engine(llm)


def test_refit_tp1_4_kv_heads_uneven_vocab(tmp_path, monkeypatch, trainers, record_property) -> None:
    _session(tmp_path, monkeypatch, trainers, kv_heads=4, vocab=1000, tp=1, negative=True,
             record_property=record_property)


def test_refit_tp2_1_kv_head_replicated(tmp_path, monkeypatch, trainers, record_property) -> None:
    _session(tmp_path, monkeypatch, trainers, kv_heads=1, vocab=1000, tp=2, faults=True,
             record_property=record_property)


def _faults(llm, trainers: vc.Trainers, cfg: dict, tp: int, got_v2, want_v1) -> None:
    """A failed update keeps vLLM's RPCs in step and the engine on its weights; a failed init reaches the trainer
    with the engine's reason within seconds. Starts with the engine at V1; ends with the transfer engine shut down."""
    import time

    name = "model.norm.weight"
    trainers.post("retype", name, "float32")  # the trainer's norm becomes float32: refused before data moves
    trainers.wait()
    trainers.post("send", V2)
    llm.start_weight_update()
    with pytest.raises(Exception, match=rf"update_weights failed on {tp} of {tp} worker(.|\n)*model\.norm\.weight"):
        llm.update_weights({"update_info": {"version": "bad"}})
    with pytest.raises(AssertionError, match=r"ValueError(.|\n)*model\.norm\.weight(.|\n)*float32"):
        trainers.wait()
    errors = llm.collective_rpc(vc.last_error)  # every worker's reply, in order: the RPCs are in step
    assert len(errors) == tp and all("model.norm.weight" in e for e in errors), errors
    vc.assert_same(vc.observe(llm), want_v1)  # nothing was moved
    trainers.post("retype", name, "bfloat16")
    trainers.wait()
    _update(llm, trainers, V2)  # the next update is accepted by every worker and lands
    assert llm.collective_rpc(vc.last_error) == [None] * tp
    vc.assert_same(vc.observe(llm), got_v2)
    _update(llm, trainers, V1)
    trainers.post("close")
    trainers.wait()
    llm.shutdown_weight_transfer_engine()  # no stale reply or error from the failed update

    # an init the engine refuses (a parameter no layout rule covers): the trainer hears the engine's reason
    llm.collective_rpc(vc.add_unreachable, args=(True,))
    try:
        port = vc.free_port()
        trainers.post("init", port, cfg, tp, False)
        with pytest.raises(Exception, match=rf"init_weight_transfer_engine failed on {tp} of {tp}(.|\n)*router_bias"):
            llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                           "trainer_world_size": 2, "timeout_s": 120.0}})
        trainers.wait()
        t0 = time.monotonic()
        trainers.post("send", V2)
        with pytest.raises(AssertionError, match=r"CommError(.|\n)*router_bias"):
            trainers.wait()
        assert time.monotonic() - t0 < 30, "the trainer must hear the engine's reason, not wait out the timeout"
        trainers.post("close")
        trainers.wait()
    finally:
        llm.collective_rpc(vc.add_unreachable, args=(False,))
    assert len(llm.collective_rpc(vc.last_error)) == tp


@pytest.mark.parametrize("family,tp", [("llama-tied", 2), ("qwen2-tied", 2), ("qwen3-tied", 1), ("mistral", 1),
                                       ("gemma", 1), ("phi3", 2), ("gpt2", 1)])
def test_family_refit(tmp_path, monkeypatch, trainers, record_property, family: str, tp: int) -> None:
    """The sweep: each family from a tiny random `transformers` config, saved by `save_pretrained` (a tied model
    stores its embedding once), refit from a trainer holding the model's own parameters (a tied one under both
    names, as a `state_dict` has them)."""
    _session(tmp_path, monkeypatch, trainers, family=family, tp=tp, record_property=record_property)


def test_refit_tp1_other_gemm_branches(tmp_path, monkeypatch, trainers, record_property) -> None:
    """Every CPU GEMM branch this processor can run besides its default one (vLLM's dispatch forced onto it through
    its own switches; `vc.other_gemm_branches`) refits bit-exactly too, negative control included: each engine's
    every Linear layer runs that branch. Where the processor runs no other branch (e.g. `F.linear` only), the summary
    says so and the case runs on the default branch, so it never goes unrun."""
    others = vc.other_gemm_branches()
    if not others:
        record_property(vc.NOTE, f"no other CPU GEMM branch can run on this processor (default: "
                                 f"{vc.dispatched_branch()}): this case ran on the default branch")
    for gemm in others or [None]:
        with monkeypatch.context() as mp:
            _session(tmp_path / str(gemm), mp, trainers, kv_heads=2, vocab=1000, tp=1, gemm=gemm, negative=True,
                     record_property=record_property)


def test_refit_tp2_moe(tmp_path, monkeypatch, trainers, record_property) -> None:
    """Also the TP2 case of 4 KV heads (2 per rank) and the uneven vocabulary. Experts split over the trainer's
    ranks (`S(0)` of stacked `[E, I, H]`), TP over the intermediate dim in the engine (`w13_weight`
    `[E, 2 I / 2, H]`, `w2_weight` `[E, H, I / 2]`), router `ReplicatedLinear`."""
    _session(tmp_path, monkeypatch, trainers, kv_heads=4, vocab=1000, tp=2, moe=True, record_property=record_property)


def test_refit_tp2_moe_planned_rank_locally(tmp_path, monkeypatch, trainers, record_property) -> None:
    """The TP2 MoE refit with `planning="local"` on both sides: each trainer rank and engine worker plans only its
    own part (`reshard.planner.plan_local`); the engine must equal vLLM's own loading of each version all the same."""
    _session(tmp_path, monkeypatch, trainers, kv_heads=4, vocab=1000, tp=2, moe=True, record_property=record_property,
             planning="local")


def test_plugin_entry_point_registers_the_backend() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "reshard"]
    ep.load()()
    ep.load()()  # vLLM loads plugins in every process, some more than once
    from reshard.integrations.vllm import ReshardTrainer, ReshardWeightTransferEngine

    assert WeightTransferEngineFactory._registry["reshard"]() is ReshardWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["reshard"]() is ReshardTrainer


def test_init_info_ranks_and_bad_values() -> None:
    from reshard.integrations.vllm import ReshardInitInfo, ReshardTrainerInitInfo

    last = ReshardTrainerInitInfo(rank=1, world_size=2, engine_world_size=4, trainer_ranks="last")
    assert last.group_rank == 5  # after engine ranks 0..3
    assert ReshardInitInfo(**last.engine_init_info()).rank_offset == 0
    first = ReshardTrainerInitInfo(rank=1, world_size=2, engine_world_size=4)
    assert first.group_rank == 1 and ReshardInitInfo(**first.engine_init_info()).rank_offset == 2
    with pytest.raises(ValueError, match="trainer_ranks must be one of"):
        ReshardTrainerInitInfo(rank=0, trainer_ranks="middle")
    with pytest.raises(ValueError, match="planning must be one of"):
        ReshardTrainerInitInfo(rank=0, planning="each")
    assert ReshardInitInfo(**ReshardTrainerInitInfo(rank=0, planning="local").engine_init_info()).planning == "local"
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\), got 2"):
        ReshardTrainerInitInfo(rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank_offset 3 disagrees"):
        ReshardInitInfo(master_address="h", master_port=1, trainer_world_size=2, rank_offset=3)
    # several engines in one group (verl's replicas), the token and the store prefix
    keyed = ReshardTrainerInitInfo(rank=0, world_size=2, engine_world_size=4, token="s3cret", prefix="p/2")
    info = keyed.engine_init_info()
    assert info["token"] == "s3cret" and info["prefix"] == "p/2"
    engine = ReshardInitInfo(**info, engines=2, engine_index=1)
    assert "s3cret" not in repr(engine) and "s3cret" not in repr(keyed)
    assert "token" not in ReshardTrainerInitInfo(rank=0).engine_init_info()  # from RESHARD_TOKEN on each side
    for bad, match in (({"engines": 0}, "engines must be an integer >= 1"),
                       ({"engines": 2, "engine_index": 2}, r"engine_index must be an integer in \[0, 2\)"),
                       ({"prefix": ""}, "prefix must be a non-empty string"),
                       ({"planning": "rank"}, r"planning must be one of \('auto', 'global', 'local'\)")):
        with pytest.raises(ValueError, match=match):
            ReshardInitInfo(master_address="h", master_port=1, trainer_world_size=2, **bad)


def _stage(llm, version: str) -> None:
    """Start an update and stage `version` (the call returns while the transfer runs)."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version, "phase": "stage"}})


def _staged_update(llm, trainers: vc.Trainers, version: str, weights: vc.Version) -> list:
    """Stage `version`, let the trainer send `weights`, commit; the trainer ranks' results."""
    _stage(llm, version)
    trainers.post("send", weights)
    sent = trainers.wait()
    _commit(llm, version)
    return sent


def _commit(llm, version: str) -> None:
    llm.update_weights({"update_info": {"version": version, "phase": "commit"}})
    llm.finish_weight_update(weight_version=version)


def _served_by(llm) -> list:
    """The weight versions vLLM reports for the tokens of one greedy request (one span per version)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=vc.PROMPTS[0])], SamplingParams(max_tokens=4, temperature=0.0),
                          use_tqdm=False)
    return [span.version for span in out.outputs[0].weight_versions or []]


def test_stage_while_serving_commit_delta_and_faults(tmp_path, monkeypatch) -> None:
    """Two-phase updates on a live engine (TP 1, in process), with delta after the first: while a stage is in
    flight, and after it landed but before its commit, the engine serves the old version bit for bit; after the
    commit, the new one, and vLLM reports that version for the tokens; a delta update sends fewer bytes and lands
    the same bytes as a fresh load; a bad update and a trainer rank that dies during a stage are refused before the
    commit and leave the engine on its version; the update after them is full."""
    cfg = vc.config(4, 1000)
    v1, v2, v3 = V1, (V1, (1e-2, 5)), (V1, (1e-2, 5), (1e-5, 6))  # v3: one small step after v2
    want = {}
    for name, version in (("v1", v1), ("v2", v2), ("v3", v3)):
        vc.write_checkpoint(str(tmp_path / name), cfg, version)
        if name != "v1":  # fresh loads of v2 and v3: their oracles
            ref = vc.start_engine(str(tmp_path / name), 1, monkeypatch, in_process=True)
            want[name] = vc.observe(ref)
            vc.close_engine(ref)
    llm = vc.start_engine(str(tmp_path / "v1"), 1, monkeypatch, in_process=True)
    want["v1"] = vc.observe(llm)
    assert vc.differences(want["v2"], want["v3"]) and vc.differences(want["v1"], want["v2"])
    trainers = vc.Trainers(2)
    try:
        port = vc.free_port()
        trainers.post("init", port, cfg, 1, False, True)  # delta on both sides
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "trainer_world_size": 2, "timeout_s": 60.0, "delta": True}})
        trainers.wait()

        # stage v2 while serving v1: before the trainer sends, while it sends, after it landed: still v1
        _stage(llm, "2")
        assert llm.collective_rpc(vc.versions) == [(None, "2")]
        vc.assert_same(vc.observe(llm), want["v1"])
        trainers.post("send", v2)
        vc.assert_same(vc.observe(llm), want["v1"])
        first = trainers.wait()
        vc.assert_same(vc.observe(llm), want["v1"])  # landed in the loader buffers, not yet committed
        assert _served_by(llm) == ["default"]  # vLLM's name for the version it loaded
        _commit(llm, "2")
        vc.assert_same(vc.observe(llm), want["v2"])
        assert _served_by(llm) == ["2"]
        assert llm.collective_rpc(vc.versions) == [("2", None)]

        # a delta update: the small step v2 -> v3 sends a fraction of the bytes and lands exactly v3
        delta = _staged_update(llm, trainers, "3", v3)
        vc.assert_same(vc.observe(llm), want["v3"])
        full_bytes = first[0][1]  # the whole plan's network bytes
        sent = sum(r[2] for r in delta)
        assert not any(r[0] for r in delta) and 0 < sent < full_bytes / 4, (sent, full_bytes)

        # a bad update (a float32 norm) is refused before the commit; v3 stays
        trainers.post("retype", "model.norm.weight", "float32")
        trainers.wait()
        _stage(llm, "bad")
        trainers.post("send", v2)
        with pytest.raises(AssertionError, match="model.norm.weight"):
            trainers.wait()
        with pytest.raises(Exception, match=r"update_weights failed(.|\n)*model\.norm\.weight"):
            _commit(llm, "bad")
        vc.assert_same(vc.observe(llm), want["v3"])
        trainers.post("retype", "model.norm.weight", "bfloat16")
        trainers.wait()
        # the next update is full: the engine's buffers are of unknown version after a failed one
        after = _staged_update(llm, trainers, "1", v1)
        vc.assert_same(vc.observe(llm), want["v1"])
        assert sum(r[2] for r in after) >= sum(r[3] for r in after) > 0, after  # every box whole

        # a trainer rank that dies during a stage: the engine keeps serving v1, the commit refuses
        _stage(llm, "2")
        trainers.post("die", 1, v2)
        survivor = trainers.results.get(timeout=120)
        assert "Error" in str(survivor[2]), survivor
        vc.assert_same(vc.observe(llm), want["v1"])
        with pytest.raises(Exception, match=r"update_weights failed"):
            _commit(llm, "2")
        vc.assert_same(vc.observe(llm), want["v1"])
        assert llm.collective_rpc(vc.versions) == [("1", None)]
        llm.shutdown_weight_transfer_engine()
    finally:
        for p in trainers.procs:
            p.kill()
        vc.close_engine(llm)


def test_killed_trainer_under_nccl_rules_leaves_the_engine_on_its_weights(tmp_path, monkeypatch) -> None:
    """The group's data backend obeys NCCL's rules (`reshard_nccl_rules`: a dead peer is a stall, never an error).
    v2 lands; then a trainer rank dies during the stage of the next update: the engine keeps serving v2 bit for bit
    and the commit refuses with a `CommError` naming the dead rank; the next update, on a new group with new
    trainer ranks, lands v1 again, as vLLM's own load of v1 serves it."""
    from reshard.testing import NCCL_RULES

    cfg = vc.config(4, 1000)
    v1, v2 = V1, (V1, (1e-2, 5))
    for name, version in (("v1", v1), ("v2", v2)):
        vc.write_checkpoint(str(tmp_path / name), cfg, version)
    ref = vc.start_engine(str(tmp_path / "v2"), 1, monkeypatch, in_process=True)
    want_v2 = vc.observe(ref)
    vc.close_engine(ref)
    llm = vc.start_engine(str(tmp_path / "v1"), 1, monkeypatch, in_process=True)
    want_v1 = vc.observe(llm)

    def connect(trainers: vc.Trainers) -> None:
        port = vc.free_port()
        trainers.post("init", port, cfg, 1, False, False, "auto", NCCL_RULES)
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "trainer_world_size": 2, "timeout_s": 30.0,
                                                       "comm_backend": NCCL_RULES}})
        trainers.wait()

    trainers = vc.Trainers(2)
    try:
        connect(trainers)
        _staged_update(llm, trainers, "2", v2)
        vc.assert_same(vc.observe(llm), want_v2)
        _stage(llm, "3")
        trainers.post("die", 1, v1)
        survivor = trainers.results.get(timeout=120)
        assert "CommError" in str(survivor[2]), survivor
        vc.assert_same(vc.observe(llm), want_v2)
        with pytest.raises(Exception, match=r"update_weights failed") as refused:
            _commit(llm, "3")
        assert "CommError" in str(refused.value) and "rank 1 failed" in str(refused.value), refused.value
        vc.assert_same(vc.observe(llm), want_v2)
        llm.shutdown_weight_transfer_engine()
    finally:
        for p in trainers.procs:
            p.kill()
    trainers = vc.Trainers(2)  # the next refit: new trainer ranks, a new group
    try:
        connect(trainers)
        _staged_update(llm, trainers, "3", v1)
        vc.assert_same(vc.observe(llm), want_v1)
        llm.shutdown_weight_transfer_engine()
    finally:
        for p in trainers.procs:
            p.kill()
        vc.close_engine(llm)
