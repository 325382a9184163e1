"""Rank jobs for tests/integrations/test_deepspeed.py: real DeepSpeed ZeRO engines (DS_ACCELERATOR=cpu, gloo) as refit sources.

Ranks `0 .. T-1` are the trainer (their own default world, DeepSpeed's), the next 2 a TP2 bfloat16 engine laid out
as vLLM does (`reshard.integrations.hf.engine_tensors`); all meet in a fresh `reshard` group per case. The model is
a tiny random Qwen3 of odd sizes: hidden 63, vocabulary 101, intermediate 34, 8 heads of 4 (2 KV heads), so ZeRO-3
ranges split rows mid-row, and the `(4,)` q/k norms over 3 ranks leave rank 2 only padding. The oracle is
DeepSpeed's own `GatheredParameters`, read on the trainer after every run.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vllm_oracle import vllm_local

os.environ.setdefault("DS_ACCELERATOR", "cpu")

SENTINEL = -7.0  # engine tensors start filled with it; padded vocabulary rows must keep it
ENGINE_TP = 2
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 4


CASES = {
    2: [{"stage": 3, "bf16": False, "persistence": 0},
        {"stage": 3, "bf16": False, "persistence": None},  # DeepSpeed's default threshold: every parameter whole
        {"stage": 2, "bf16": True}],
    3: [{"stage": 3, "bf16": True, "persistence": 0, "tie": True},
        {"stage": 3, "bf16": False, "persistence": 0}],
}
"""The refit cases per trainer size: ZeRO stage, trainer dtype, persistence threshold (None: DeepSpeed's default),
tied embeddings."""


def config(*, intermediate: int = 34, tie: bool = False) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=101, hidden_size=63, intermediate_size=intermediate, num_hidden_layers=2,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                       tie_word_embeddings=tie, max_position_embeddings=64)


def build_engine(stage: int, *, bf16: bool, persistence: int | None, tie: bool, seed: int = 0) -> Any:
    """A DeepSpeed engine over this rank's default world (the trainer ranks) of the tiny Qwen3."""
    import deepspeed
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config(tie=tie))
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3 and persistence is not None:
        zero["stage3_param_persistence_threshold"] = persistence
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": zero,
                 "bf16": {"enabled": bf16}, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    return engine


def train_step(engine: Any, step: int) -> None:
    ids = (torch.arange(12).reshape(1, 12) * (7 + step)) % 101
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def gathered(engine: Any) -> dict[str, torch.Tensor]:
    """The oracle: DeepSpeed's own all-gather of every parameter (ZeRO-3), or the whole parameters (ZeRO-0/1/2)."""
    import deepspeed

    from reshard.integrations.hf import trainer_name

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {trainer_name(n): p.detach().clone() for n, p in engine.module.named_parameters()}


def poison_padding(engine: Any) -> int:
    """Fill every ZeRO-3 partition's padding with NaN (a value the oracle never has): read, it would show."""
    count = 0
    for p in engine.module.parameters():
        if hasattr(p, "ds_tensor"):
            ps = p.ds_tensor.numel()
            valid = max(0, min(ps, p.ds_numel - p.ds_zero_partition_rank * ps))
            if valid < ps:
                p.ds_tensor[valid:].fill_(float("nan"))
                count += 1
    return count


def engine_side(refit: Any, rank: int, num_trainers: int, cfg: Any) -> dict[str, torch.Tensor]:
    from reshard.integrations import hf

    par = hf.EngineParallel(range(num_trainers, num_trainers + ENGINE_TP), tp=ENGINE_TP)
    locals_ = {}
    for t in hf.engine_tensors(cfg, par, dtype=torch.bfloat16):
        if rank in t.ranks:
            locals_[t.name] = torch.full(t.local_shape(rank), SENTINEL, dtype=torch.bfloat16)
            t.register(refit, locals_[t.name])
    refit.declare_facts(hf.model_facts(cfg), who="engine (its config)")
    return locals_


def _trainer_world(worker: Any, num_trainers: int) -> None:
    """Make ranks `0 .. num_trainers - 1` DeepSpeed's world, once per pool (DeepSpeed keeps its world's groups: a
    module's jobs all use one trainer size)."""
    import deepspeed

    if worker.scratch.get("trainers") == num_trainers:
        return
    assert "trainers" not in worker.scratch, "one trainer size per pool"
    worker.init_world("ds-trainers/", worker.rank, num_trainers)
    # what a launcher sets (DeepSpeed reads them even with the default world up)
    os.environ.update(RANK=str(worker.rank), LOCAL_RANK=str(worker.rank), WORLD_SIZE=str(num_trainers),
                      LOCAL_WORLD_SIZE=str(num_trainers))
    deepspeed.init_distributed(dist_backend="gloo")
    worker.scratch["trainers"] = num_trainers


def job_refit(worker: Any, num_trainers: int, cases: list[dict]) -> list[dict] | None:
    """Per case (`stage`, `bf16`, `persistence`, `tie`): build the engine, register, refit, two optimizer steps each
    followed by a refit. Returns per case and run: the oracle (trainer rank 0) or the engine tensors (engine ranks),
    and per trainer rank the bytes it sent and its windows that are views of the partition storage."""
    from reshard.integrations import deepspeed as ds_sources
    from reshard.refit import Refit

    size = num_trainers + ENGINE_TP
    if worker.rank >= size:
        return None
    trainer = worker.rank < num_trainers
    if trainer:
        _trainer_world(worker, num_trainers)
    out = []
    for i, case in enumerate(cases):
        group = worker.new_group(f"ds{num_trainers}-{i}", ranks=size, timeout=120.0)
        refit = Refit(group, timeout=120, precision="cast", policy="reshard")
        res: dict[str, Any] = {"runs": [], "sent": [], "names": None}
        if trainer:
            engine = build_engine(case["stage"], bf16=case["bf16"], persistence=case.get("persistence"),
                                  tie=case.get("tie", False), seed=i)
            res["names"] = ds_sources.add_sources(refit, engine)
            res["poisoned"] = poison_padding(engine)
            res["views"], res["copies"] = _windows(refit, engine)
            res["persistent"] = sum(bool(getattr(p, "ds_persist", False)) for p in engine.module.parameters())
        else:
            locals_ = engine_side(refit, worker.rank, num_trainers, config(tie=case.get("tie", False)))
        for run in range(3):
            if run and trainer:
                train_step(engine, run)
            report = refit.run()
            ex = report.execution
            res["sent"].append(ex.bytes_sent if ex is not None else 0)
            if trainer:
                full = gathered(engine)  # a collective of the trainer ranks
                res["runs"].append(full if worker.rank == 0 else None)
            else:
                res["runs"].append({n: t.clone() for n, t in locals_.items()})
        res["moved"] = report.network_bytes + report.nvlink_bytes + report.local_bytes
        group.close()
        out.append(res)
    return out


def _windows(refit: Any, engine: Any) -> tuple[int, int]:
    """How many registered windows are views of their partition's storage, and how many are copies."""
    storages = {p.ds_tensor.untyped_storage().data_ptr() if hasattr(p, "ds_tensor") else
                p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    views = sum(t.untyped_storage().data_ptr() in storages for t, _ in refit._sources.values())
    return views, len(refit._sources) - views


class _Side:
    """One rank's part of a 2-trainer case: its group and `Refit`, and its DeepSpeed engine (trainer ranks) or
    engine tensors (engine ranks)."""

    def __init__(self, worker: Any, tag: str, timeout: float, *, stage: int = 3, bf16: bool = False,
                 names: dict | None = None, intermediate: int = 34) -> None:
        from reshard.integrations import deepspeed as ds_sources
        from reshard.refit import Refit

        self.trainer = worker.rank < 2
        if self.trainer:
            _trainer_world(worker, 2)
        self.group = worker.new_group(tag, ranks=4, timeout=timeout)
        self.refit = Refit(self.group, timeout=timeout, precision="cast")
        self.locals: dict[str, torch.Tensor] = {}
        self.engine = None
        if self.trainer:
            self.engine = build_engine(stage, bf16=bf16, persistence=0, tie=False)
            ds_sources.add_sources(self.refit, self.engine, names=names)
        else:
            self.locals = engine_side(self.refit, worker.rank, 2, config(intermediate=intermediate))

    def run(self) -> str | None:
        """A run; its `ValueError` (every rank raises the same one), or None."""
        try:
            self.refit.run()
        except ValueError as e:
            return str(e)
        return None

    def engine_copy(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.locals.items()}


def job_refused(worker: Any, what: str) -> dict | None:
    """A wrong name (`name`: the trainer maps `model.norm.weight` elsewhere) or shape (`shape`: the engine serves
    intermediate size 36): the first run raises the same ValueError on every rank, the engine untouched."""
    if worker.rank >= 4:
        return None
    side = _Side(worker, f"refused-{what}", 60.0,
                 names={"model.norm.weight": "model.final_norm.weight"} if what == "name" else None,
                 intermediate=36 if what == "shape" else 34)
    error = side.run()
    side.group.close()
    return {"error": error, "untouched": all(bool((t == SENTINEL).all()) for t in side.locals.values())}


def job_replaced(worker: Any, stage: int) -> dict | None:
    """After the first run both trainer ranks replace `model.norm.weight` by a new `nn.Parameter` of new values:
    under ZeRO-2 (whole parameters) the second run sends them; under ZeRO-3 the new parameter is no partition
    (DeepSpeed never saw it), so the second run is refused on every rank, naming it."""
    if worker.rank >= 4:
        return None
    side = _Side(worker, f"replaced-{stage}", 60.0, stage=stage)
    new = torch.arange(63, dtype=torch.float32) * 0.25 - 3.0
    assert side.run() is None
    first = side.engine_copy()
    if side.trainer:
        side.engine.module.model.norm.weight = torch.nn.Parameter(new.clone())
    error = side.run()
    side.group.close()
    return {"error": error, "new": new, "first": first, "second": side.engine_copy()}


def job_lost(worker: Any) -> dict | None:
    """Trainer rank 1 dies after the first refit, before the second: the others' second run raises naming it."""
    import time

    if worker.rank >= 4:
        return None
    side = _Side(worker, "lost", 20.0, bf16=True)
    side.refit.run()
    if worker.rank == 1:
        os._exit(3)
    t0 = time.perf_counter()
    try:
        side.refit.run()
        error = None
    except Exception as e:  # noqa: BLE001 - what the test asserts on
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.perf_counter() - t0}


def check(out: list, num_trainers: int) -> None:
    for i, case in enumerate(CASES[num_trainers]):
        trainers = [o[i] for o in out[:num_trainers]]
        engines = [o[i] for o in out[num_trainers:num_trainers + ENGINE_TP]]
        oracle = trainers[0]["runs"]
        for run in range(3):
            full = {n: t.to(torch.bfloat16) for n, t in oracle[run].items()}
            if case.get("tie"):
                assert "lm_head.weight" not in full or torch.equal(full["lm_head.weight"],
                                                                   full["model.embed_tokens.weight"])
            bad = []
            for t, e in enumerate(engines):
                for name, local in e["runs"][run].items():
                    want = vllm_local(name, full.__getitem__, tp=ENGINE_TP, t=t, kv_heads=KV_HEADS,
                                      head_dim=HEAD_DIM, padded=torch.full_like(local, SENTINEL))
                    if want.shape != local.shape or not torch.equal(want, local):
                        bad.append(f"case {case} run {run} engine TP rank {t}: {name}")
            assert bad == [], bad[:10]
        changed = [n for n in oracle[0] if not torch.equal(oracle[0][n], oracle[2][n])]
        assert len(changed) == len(oracle[0]), "two optimizer steps changed every weight"
        # each engine byte once (bfloat16 on the wire: cast while packing), split between the trainer ranks
        real = sum(int((t != SENTINEL).sum()) for e in engines for t in e["runs"][2].values())
        for run in range(3):
            sent = [tr["sent"][run] for tr in trainers]
            assert sum(sent) == real * 2, (case, run, sent, real)
            assert max(sent) <= 1.3 * sum(sent) / num_trainers, (case, sent)
        assert {e["moved"] for e in engines} == {real * 2}
        print(f"T={num_trainers} {case}: windows (views, copies) per rank "
              f"{[(tr['views'], tr['copies']) for tr in trainers]}, bytes sent per rank "
              f"{[tr['sent'][0] for tr in trainers]}")
        if case["stage"] == 3:
            assert trainers[-1]["poisoned"] > 0, "the last rank's partitions hold the padding (NaN here)"
            for tr in trainers:  # most windows are views of ds_tensor's storage, the rest refreshed copies
                assert tr["views"] >= 0.75 * (tr["views"] + tr["copies"]), tr
        persistent = [tr.get("persistent", 0) for tr in trainers]
        if case.get("persistence") is None and case["stage"] == 3:
            assert persistent[0] == len(oracle[0]), "the default threshold keeps this small model's parameters whole"
        elif case["stage"] == 3:
            assert persistent == [0] * num_trainers
