"""A real Megatron-core trainer (TP2 x PP2, tied embeddings, 4 gloo ranks) refits a real vLLM engine (TP2) through the
`reshard` weight-transfer backend, with the model itself as `ReshardTrainer.trainer_init`'s source; and a Megatron
PP2 x EP2 MoE trainer an expert-parallel TP2 + EP engine.

The oracle is vLLM loading a checkpoint of the Megatron model's Hugging Face tensors (rebuilt from every rank's
`sharded_state_dict()` offsets by `megatron_cases`, whose plain forward matches Megatron's logits in
`test_integrations_megatron.py`): an engine that started from other weights must, after one update, give the same
greedy tokens and log-probs and hold the same forward tensors, bit for bit, as a fresh engine loaded from it.
"""

from __future__ import annotations

import threading

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-megatron` runs this in .venv-vllm")
pytest.importorskip("megatron.core", reason="needs megatron-core; `make test-megatron` runs this in .venv-vllm")

import cloudpickle  # noqa: E402  (ships with vLLM)
import megatron_cases as mc  # noqa: E402
import torch  # noqa: E402
import vllm_cases as vc  # noqa: E402

from reshard.testing import RankPool  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.megatron, pytest.mark.distributed]
cloudpickle.register_pickle_by_value(vc)

TP = 2


class _Job:
    """`pool.run_ok(fn, *args)` in a thread, while this thread drives the engine's side of the same step."""

    def __init__(self, pool: RankPool, fn, *args) -> None:
        self.value, self.error = None, None

        def run() -> None:
            try:
                self.value = pool.run_ok(fn, *args)
            except BaseException as e:  # re-raised in join()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


@pytest.mark.parametrize("case, ep", [("dense", False), ("moe", True)], ids=["tp2xpp2-to-tp2", "pp2xep2-to-tp2+ep"])
def test_megatron_tp2_pp2_refits_a_vllm_tp2_engine_exactly(tmp_path, monkeypatch, case: str, ep: bool) -> None:
    """`dense`: Megatron TP2 x PP2 into a TP2 engine; `moe`: Megatron PP2 x EP2 (4 experts split over its EP ranks,
    exported one by one) into a TP2 + EP engine (2 whole experts per rank, declared one by one: `experts`)."""
    pool = RankPool(4)
    llm = None
    try:
        shards = pool.run_ok(mc.job_shards, case)
        hf = mc.hf_from_megatron(mc.megatron_full(shards), case)
        mc.write_checkpoint(str(tmp_path / "oracle"), case, hf)
        g = torch.Generator().manual_seed(5)
        mc.write_checkpoint(str(tmp_path / "other"), case, {n: torch.randn(t.shape, generator=g) * 0.05
                                                            for n, t in hf.items()})
        ref = vc.start_engine(str(tmp_path / "oracle"), TP, monkeypatch, ep=ep)
        want = vc.observe(ref)
        vc.close_engine(ref)
        llm = vc.start_engine(str(tmp_path / "other"), TP, monkeypatch, ep=ep)
        assert vc.differences(vc.observe(llm), want), "the starting weights must differ, or the test could not fail"

        port = vc.free_port()
        job = _Job(pool, mc.job_trainer_init, case, port, TP)
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "trainer_world_size": 4, "timeout_s": 120.0,
                                                       "precision": "cast",
                                                       "experts": "per_expert" if ep else "stacked"}})
        job.join()
        job = _Job(pool, mc.job_send)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": "1"}})
        llm.finish_weight_update()
        assert all(b > 0 for b in job.join())
        got = vc.observe(llm)
        diffs = vc.differences(got, want)
        assert not diffs, f"{len(diffs)} differences from the engine loaded from the oracle:\n" + "\n".join(
            d[:300] for d in diffs)
        pool.run_ok(mc.job_trainer_close)
        llm.shutdown_weight_transfer_engine()
    finally:
        if llm is not None:
            vc.close_engine(llm)
        pool.close()
