"""The verl backend's pure parts, in the core environment (no verl, no Ray): buckets, the driver-side topology, and
the constructor's refusals. The backend against verl itself: `tests/integrations/test_verl_backend.py` (`make test-frameworks`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from reshard.comm import CommError
from reshard.integrations.verl import DOMAINS, ReshardCheckpointEngine
from reshard.integrations.verl import _buckets as bk

BUCKET = 1 << 20


def test_buckets_split_in_order_and_oversized_alone() -> None:
    # a: 128 B, b: 64 B (192 together); c: 320 B > 256, alone; d: 4 B (rounded up to 64) starts a new bucket
    items = [("a", (8, 4)), ("b", (16,)), ("c", (80,)), ("d", (1,))]
    assert bk.plan_buckets(items, dict.fromkeys("abcd", 4), 256) == [[0, 1], [2], [3]]
    assert bk.plan_buckets([], {}, 256) == []
    # exactly full: 4 x 64 B = 256 B fits one bucket
    assert bk.plan_buckets([(n, (16,)) for n in "wxyz"], dict.fromkeys("wxyz", 4), 256) == [[0, 1, 2, 3]]


def test_entries_offsets_aligned_and_views_exact() -> None:
    rows = [bk.manifest_row("w", (3, 5), torch.bfloat16, "full"), bk.manifest_row("s", (), torch.float32, "full"),
            bk.manifest_row("e", (0, 7), torch.float8_e4m3fn, "shard"),
            bk.manifest_row("b", (9,), torch.int8, "dtensor")]
    entries = bk.layout_entries(rows)
    assert [e.offset for e in entries] == [0, 64, 128, 128]  # 30 B -> 64; 4 B -> 64; 0 B -> 0; 9 B
    assert bk.buffer_bytes(entries) == 192
    buf = torch.arange(192, dtype=torch.uint8)
    w = bk.view(buf, entries[0])
    assert w.shape == (3, 5) and w.dtype == torch.bfloat16
    assert torch.equal(w.reshape(-1).view(torch.uint8), buf[:30])
    assert torch.equal(bk.view(buf, entries[3]), buf[128:137].view(torch.int8))
    with pytest.raises(ValueError, match="kind 'gathered'"):
        bk.layout_entries([["x", [1], "float32", "gathered"]])


def _meta(T: int, R: int) -> list[dict]:
    master = {"host": "10.0.0.1", "port": 1234, "token": "t", "generation": 3, "rebuild_group": False}
    meta = [{"format": 1, "backend": "reshard", "node": f"n{i // 2}", "session": None, "master": None}
            for i in range(T + R)]
    meta[0]["master"] = master
    return meta


def test_build_topology_ranks_domains_and_reuse() -> None:
    meta = _meta(2, 3)
    tkw, rkw = ReshardCheckpointEngine.build_topology(2, 3, meta)
    assert tkw["rank"] == [0, 1] and rkw["rank"] == [2, 3, 4]
    assert tkw["world_size"] == [5, 5] and rkw["num_trainers"] == [2, 2, 2]
    assert tkw["master"][0] == {"host": "10.0.0.1", "port": 1234, "token": "t", "prefix": "reshard-verl/4"}
    # domains: (side, node): a trainer and a rollout worker on one node would still be two domains
    assert tkw["domains"][0] == [("trainer", "n0"), ("trainer", "n0"), ("rollout", "n1"), ("rollout", "n1"),
                                 ("rollout", "n2")]
    # every worker reports the live group of generation 3 with its rank: kept
    for i, m in enumerate(meta):
        m["session"] = {"prefix": "reshard-verl/3", "rank": i, "world_size": 5, "num_trainers": 2}
    assert ReshardCheckpointEngine.build_topology(2, 3, meta)[0]["master"][0]["prefix"] == "reshard-verl/3"
    meta[4]["session"] = None  # one worker without it (a new replica): a new group
    assert ReshardCheckpointEngine.build_topology(2, 3, meta)[0]["master"][0]["prefix"] == "reshard-verl/4"


def test_build_topology_refuses() -> None:
    with pytest.raises(ValueError, match=r"metadata from 5 workers, but .* 2 \+ rollout_world_size 2 = 4"):
        ReshardCheckpointEngine.build_topology(2, 2, _meta(2, 3))
    with pytest.raises(ValueError, match="rollout_world_size must be an integer >= 1, got 0"):
        ReshardCheckpointEngine.build_topology(2, 0, _meta(2, 0))
    meta = _meta(2, 2)
    meta[0]["master"], meta[2]["master"] = None, {"host": "h"}
    with pytest.raises(ValueError, match=r"exactly the first trainer worker must be the master .* positions \[2\]"):
        ReshardCheckpointEngine.build_topology(2, 2, meta)
    meta = _meta(2, 2)
    meta[3]["format"] = 2
    with pytest.raises(ValueError, match=r"workers \[3\] did not report reshard checkpoint-engine metadata"):
        ReshardCheckpointEngine.build_topology(2, 2, meta)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"bogus": 1}, TypeError, r"unknown engine_kwargs \['bogus'\]; valid keys .* \['host', 'port'"),
    ({"timeout_s": -1}, ValueError, "timeout_s must be seconds > 0, got -1"),
    ({"timeout_s": True}, ValueError, "timeout_s must be seconds > 0, got True"),
    ({"port": 70000}, ValueError, r"port must be an integer in \[0, 65536\), got 70000"),
    ({"domains": "rack"}, ValueError, r"domains must be one of \('node', 'rank'\), got 'rack'"),
    ({"rebuild_group": "yes"}, ValueError, "rebuild_group must be true or false, got 'yes'"),
    ({"device": "tpu"}, ValueError, "device must be one of"),
    ({"staging_bytes": 0}, ValueError, "staging_bytes must be a positive integer or null, got 0"),
])
def test_constructor_refuses_bad_kwargs(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ReshardCheckpointEngine(BUCKET, **kwargs)


def _weights(step: int) -> dict[str, torch.Tensor]:
    """Full tensors of odd shapes: 7 rows over 2 trainer ranks (4 + 3), a 1-row tensor (rank 1 holds nothing), a
    scalar (trainer rank 0 alone), an empty tensor, bf16 and int8, one larger than the 4 KiB bucket."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(7, 5, generator=g), "row": torch.randn(1, 3, generator=g),
            "scalar": torch.randn((), generator=g), "empty": torch.empty(0, 4),
            "half": torch.randn(33, 2, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-100, 100, (10,), generator=g, dtype=torch.int8),
            "big": torch.randn(40, 40, generator=g)}  # 6400 B > 4096 B: a bucket of its own


class _ShardExport:
    """A stand-in for a verl engine: `get_per_tensor_param_shard()` of unsharded parameters, flattened as verl's FSDP
    engine exports them (`ShardSpec` without a mesh)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def get_per_tensor_param_shard(self) -> tuple:
        from types import SimpleNamespace

        def spec(t: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(full_shape=tuple(t.shape), mesh=None, placements=None, place=None)

        return ((n, t.reshape(-1), spec(t)) for n, t in _weights(self.step).items()), None


HEADER_ROW = 32
"""Bytes of one trainer rank's row of a bucket's header (4 int64), sent with every bucket to every rollout domain."""


async def _take(engine: ReshardCheckpointEngine, step: int) -> dict[str, torch.Tensor]:
    return {n: t.clone() async for n, t in engine.receive_weights(step)}


class _FullExport:
    """A stand-in for a verl engine without a shard export: `get_per_tensor_param()` only."""

    def __init__(self, step: int) -> None:
        self.step = step

    def get_per_tensor_param(self) -> tuple:
        return iter(_weights(self.step).items()), None


def _run_sync(engines: list[ReshardCheckpointEngine], T: int, step: int, streams: Any = None,
              consume: Any = _take) -> tuple[list, list]:
    """One sync as verl's manager runs it, with every worker a thread of this process. `streams(rank)`: trainer
    rank's stream (default: `_weights(step)`, the second sync through a flattened shard export); `consume(engine,
    step)`: a rollout worker's consumer (default: a copy of every tensor)."""
    import asyncio
    import threading

    meta = [e.prepare() for e in engines]
    tkw, rkw = ReshardCheckpointEngine.build_topology(T, len(engines) - T, meta)
    kw = [{k: v[i] for k, v in tkw.items()} for i in range(T)] + \
         [{k: v[i] for k, v in rkw.items()} for i in range(len(engines) - T)]
    out: list = [None] * len(engines)

    def work(i: int) -> None:
        try:
            engines[i].init_process_group(**kw[i])
            if i < T:
                stream = streams(i) if streams is not None else _ShardExport(step) if step == 1 else \
                    _FullExport(step) if step == 2 else iter(_weights(step).items())
                out[i] = asyncio.run(engines[i].send_weights(stream, global_steps=step))
            else:
                out[i] = asyncio.run(consume(engines[i], step))
            engines[i].finalize()
        except BaseException as e:  # noqa: BLE001  (a thread must hand every failure to the test, which raises it)
            out[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker hangs"
    return out[:T], out[T:]


def _engines(n: int = 4, bucket: int = 4096, **kw: Any) -> list[ReshardCheckpointEngine]:
    kw = {"host": "127.0.0.1", "timeout_s": 60, **kw}
    return [ReshardCheckpointEngine(bucket, is_master=i == 0, **kw) for i in range(n)]


def _assert_received(received: list, want: dict[str, torch.Tensor]) -> None:
    errors = [o for o in received if isinstance(o, BaseException)]
    assert not errors, errors
    for got in received:
        assert list(got) == list(want)
        for n, t in want.items():
            assert got[n].shape == t.shape and got[n].dtype == t.dtype
            assert torch.equal(got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n


@pytest.mark.parametrize("domains,rebuild", [("node", False), ("rank", True)])
def test_two_trainers_two_rollouts_in_threads(domains: str, rebuild: bool) -> None:
    """The whole protocol without verl or Ray: 2 trainer + 2 rollout engines in threads, on loopback, three syncs.
    Received tensors byte-equal the sources, in order (the second sync streams an engine's flattened
    `get_per_tensor_param_shard()` export, the third an engine's `get_per_tensor_param()`); with `domains="node"`
    the trainers send the model once (the rollout ranks forward), with `"rank"` once per rollout rank;
    `rebuild_group` builds plans every sync.
    A steady sync (the same stream on the same group) takes exactly one all-rank round on every rank."""
    engines = _engines(domains=domains, rebuild_group=rebuild)
    for step in range(3):
        metrics, received = _run_sync(engines, 2, step)
        want = _weights(step)
        _assert_received(received, want)
        model = sum(t.nbytes for t in want.values())
        stats = [e.last_sync for e in engines]
        buckets = stats[0].buckets
        sent = [m[f"reshard/rank{r}/bytes_sent"] for r, m in enumerate(metrics)]
        copies = 1 if domains == "node" else 2
        assert sum(sent) == (model + HEADER_ROW * 2 * buckets) * copies, (sent, model, buckets)
        assert all(s.first_plans == (s.buckets if rebuild or step == 0 else 0) for s in stats), stats
        assert all(s.largest_bucket <= 4096 and s.buckets == buckets for s in stats)
        steady = step > 0 and not rebuild
        assert all((s.rounds == 1) == steady and s.replanned == -1 for s in stats), [s.rounds for s in stats]
        if not steady:  # per bucket a manifest round, the plan's metadata, agreement and completion; one commit
            assert all(s.rounds == 4 * buckets + 1 for s in stats), [s.rounds for s in stats]
    for e in engines:
        e._close_group()


def _twelve(step: int) -> dict[str, torch.Tensor]:
    """12 float32 tensors of 1 KiB: 4 per 4 KiB bucket, 3 buckets."""
    g = torch.Generator().manual_seed(100 + step)
    return {f"t{i}": torch.randn(16, 16, generator=g) for i in range(12)}


def test_a_changed_stream_is_replanned_on_every_rank() -> None:
    """A steady group whose stream changes: a tensor renamed in the third bucket, a tensor added (a fourth bucket),
    dropped again (the third bucket is the last again: no replanning needed), a reshaped tensor in the first
    bucket. Every rank finds the change at the same bucket, every engine gets exactly the new stream byte for byte
    (nothing moved by a kept plan for a changed bucket reaches it), and the next sync of the same stream is steady
    again: one all-rank round on every rank."""
    def renamed(step: int) -> dict[str, torch.Tensor]:
        return {("t9.renamed" if n == "t9" else n): t for n, t in _twelve(step).items()}

    def reshaped(step: int) -> dict[str, torch.Tensor]:
        return dict(renamed(step), t0=_twelve(step)["t0"].reshape(8, 32))

    def more(step: int) -> dict[str, torch.Tensor]:
        return dict(renamed(step), more=torch.full((16, 16), float(step)))

    # (stream, the bucket where every rank must find a change (-1: none), all-rank rounds per rank)
    cases = [(_twelve, -1, 4 * 3 + 1), (_twelve, -1, 1), (renamed, 2, None), (renamed, -1, 1), (more, 3, None),
             (renamed, -1, 1), (reshaped, 0, None), (reshaped, -1, 1)]
    engines = _engines()
    for step, (make, replanned, rounds) in enumerate(cases):
        want = make(step)
        _, received = _run_sync(engines, 2, step, streams=lambda rank, w=want: iter(w.items()))
        _assert_received(received, want)
        stats = [e.last_sync for e in engines]
        assert [s.replanned for s in stats] == [replanned] * 4, (step, [s.replanned for s in stats])
        if rounds is not None:
            assert [s.rounds for s in stats] == [rounds] * 4, (step, [s.rounds for s in stats])
    for e in engines:
        e._close_group()


def test_trainer_ranks_that_disagree_in_a_steady_sync_fail_every_rank() -> None:
    """A steady group where trainer rank 1 streams a renamed tensor in the second bucket and rank 0 does not: no
    per-bucket round would catch it, but the bucket's header does: every rank raises (the rollout ranks before
    the engine gets that bucket), none hangs, and the next sync builds a new group and delivers exactly."""
    engines = _engines(timeout_s=30)
    for step in range(2):
        _, received = _run_sync(engines, 2, step, streams=lambda rank, s=step: iter(_twelve(s).items()))
        _assert_received(received, _twelve(step))

    def stream(rank: int) -> object:
        w = _twelve(2)
        return iter(w.items() if rank == 0 else {("t5.other" if n == "t5" else n): t for n, t in w.items()}.items())

    seen: list[int] = []

    async def count(engine: ReshardCheckpointEngine, step: int) -> int:
        async for _ in engine.receive_weights(step):
            seen.append(1)
        return len(seen)

    metrics, received = _run_sync(engines, 2, 2, streams=stream, consume=count)
    errors = metrics + received
    assert all(isinstance(e, CommError) for e in errors), errors
    assert any("headers" in str(e) for e in errors), errors
    assert len(seen) <= 2 * 4  # at most the first bucket (4 tensors) reached each engine
    _, received = _run_sync(engines, 2, 3, streams=lambda rank: iter(_twelve(3).items()))
    _assert_received(received, _twelve(3))
    for e in engines:
        e._close_group()


def test_a_stream_that_fails_in_a_steady_sync_fails_every_rank() -> None:
    """In a steady sync (no per-bucket round to fail in), trainer rank 1's stream raises after 6 tensors: that rank
    raises its own error, every other rank a `CommError` naming the failure, none waits out its timeout; the next
    sync builds a new group and delivers exactly."""
    import time

    engines = _engines(timeout_s=60)
    for step in range(2):
        _, received = _run_sync(engines, 2, step, streams=lambda rank, s=step: iter(_twelve(s).items()))
        _assert_received(received, _twelve(step))

    def stream(rank: int) -> object:
        for i, item in enumerate(_twelve(2).items()):
            if rank == 1 and i == 6:
                raise RuntimeError("the framework's stream failed (a test fault)")
            yield item

    t0 = time.perf_counter()
    metrics, received = _run_sync(engines, 2, 2, streams=stream)
    assert time.perf_counter() - t0 < 30  # far below the 60 s timeout: the fault was seen, not waited out
    assert isinstance(metrics[1], RuntimeError), metrics
    others = [metrics[0], *received]
    assert all(isinstance(e, CommError) and "stream failed" in str(e) for e in others), others
    _, received = _run_sync(engines, 2, 3, streams=lambda rank: iter(_twelve(3).items()))
    _assert_received(received, _twelve(3))
    for e in engines:
        e._close_group()


def test_an_engine_that_fails_before_the_last_bucket_fails_every_rank() -> None:
    """Rollout rank 1's engine refuses a tensor of the second of three buckets after the last bucket has arrived
    in the background: the commit round waits for every engine to have taken every bucket but the last, so every
    rank raises (no trainer reports a sync one engine did not load), and the next sync is exact."""
    import asyncio

    engines = _engines(timeout_s=30)
    for step in range(2):
        _, received = _run_sync(engines, 2, step, streams=lambda rank, s=step: iter(_twelve(s).items()))
        _assert_received(received, _twelve(step))

    async def refuse(engine: ReshardCheckpointEngine, step: int) -> int:
        n = 0
        async for name, _ in engine.receive_weights(step):
            if engine is engines[3] and name == "t6":
                await asyncio.sleep(0.5)  # the third bucket is received meanwhile
                raise RuntimeError("the engine refused t6 (a test fault)")
            n += 1
        return n

    metrics, received = _run_sync(engines, 2, 2, streams=lambda rank: iter(_twelve(2).items()), consume=refuse)
    assert isinstance(received[1], RuntimeError), received
    assert all(isinstance(e, CommError) for e in [*metrics, received[0]]), [*metrics, received[0]]
    _, received = _run_sync(engines, 2, 3, streams=lambda rank: iter(_twelve(3).items()))
    _assert_received(received, _twelve(3))
    for e in engines:
        e._close_group()


def test_views_live_until_the_bucket_after_the_next_is_asked_for() -> None:
    """The documented lifetime of a yielded view: a consumer that holds every view (as one that buffers a layer
    across buckets does) finds each still equal to the source while it takes the tensors of the next bucket,
    i.e. until it asks for the first tensor of the bucket after the next. 12 tensors in 4 KiB buckets, two syncs
    (the second steady: the kept plans and buffers). Checked against the sources, not the engine's own output."""
    import asyncio

    bucket_of = {f"t{i}": i // 4 for i in range(12)}
    stale: list[str] = []

    async def hold(engine: ReshardCheckpointEngine, step: int) -> dict[str, torch.Tensor]:
        want, held = _twelve(step), {}
        async for name, view in engine.receive_weights(step):
            held[name] = view
            await asyncio.sleep(0.05)  # the next bucket's receive runs meanwhile (and lands, if it may)
            for n, v in held.items():
                if bucket_of[n] >= bucket_of[name] - 1 and not torch.equal(v, want[n]):
                    stale.append(f"sync {step}: {n} (bucket {bucket_of[n]}) while taking {name}")
        return {n: v.clone() for n, v in held.items()}

    engines = _engines()
    for step in range(2):
        assert bk.plan_buckets([(n, (16, 16)) for n in bucket_of], dict.fromkeys(bucket_of, 4), 4096) == \
            [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        _, received = _run_sync(engines, 2, step, streams=lambda rank, s=step: iter(_twelve(s).items()), consume=hold)
        errors = [o for o in received if isinstance(o, BaseException)]
        assert not errors, errors
        assert not stale, stale[:5]
    for e in engines:
        e._close_group()


SECRET = "9f3c1d7ab2e84c05a6d1f0e2b3c4d5e6"


def _no_secret(texts: list[str], records: list) -> None:
    """No text, no log record (message, arguments, exception text) holds the token."""
    import logging

    fmt = logging.Formatter()
    seen = list(texts) + [fmt.format(r) for r in records] + [repr(r.args) for r in records]
    leaks = [t[:300] for t in seen if SECRET in t]
    assert not leaks, leaks


def test_no_token_in_build_topology_refusals(caplog) -> None:
    """Trainer rank 0 (the master, whose metadata holds the token) reports metadata of another format: the driver's
    error names the workers and what they sent, the token hidden (before, the whole metadata was printed)."""
    import logging

    caplog.set_level(logging.DEBUG)
    texts = []
    for bad in ({"format": 2}, {"backend": "nccl"}):
        meta = _meta(2, 2)
        meta[0]["master"]["token"] = SECRET
        meta[0].update(bad)
        with pytest.raises(ValueError, match=r"workers \[0\] did not report reshard") as e:
            ReshardCheckpointEngine.build_topology(2, 2, meta)
        assert "<hidden>" in str(e.value) and "10.0.0.1" in str(e.value), e.value
        texts += [str(e.value), repr(e.value)]
    _no_secret(texts, caplog.records)


def test_no_token_in_any_message_of_a_failing_sync(caplog) -> None:
    """A sync whose trainer stream fails on rank 1, with a token: every error every worker raised and every log
    record of the run (DEBUG included) is free of the token."""
    import logging

    caplog.set_level(logging.DEBUG)
    engines = _engines(timeout_s=60, token=SECRET)

    def stream(rank: int) -> object:
        for i, item in enumerate(_twelve(0).items()):
            if rank == 1 and i == 6:
                raise RuntimeError("the framework's stream failed (a test fault)")
            yield item

    metrics, received = _run_sync(engines, 2, 0, streams=stream)
    errors = [o for o in metrics + received if isinstance(o, BaseException)]
    assert len(errors) == 4, [metrics, received]
    _no_secret([str(e) for e in errors] + [repr(e) for e in errors] + [repr(x) for x in engines], caplog.records)
    for e in engines:
        e._close_group()


def test_constructor_refuses_bad_bucket_and_keeps_the_token_secret() -> None:
    with pytest.raises(ValueError, match="bucket_size must be an integer number of bytes >= 64, got 0"):
        ReshardCheckpointEngine(0)
    with pytest.raises(ValueError, match="token must be a string or null, got '<hidden>'"):
        ReshardCheckpointEngine(BUCKET, token=12345)
    e = ReshardCheckpointEngine(BUCKET, domains=DOMAINS[1], timeout_s=5)
    assert e.wire_format == "named_tensors" and e.timeout_s == 5.0
    with pytest.raises(ValueError, match="send_weights before init_process_group"):
        e._require("send_weights", trainer=True)


def _sync_into_engines(precision: str | None) -> tuple[list, list]:
    """`EngineShardManager`'s trainer side without verl: 2 trainer checkpoint engines (threads) target 2 engine
    ranks that join as reshard's vLLM backend does (a `Refit` of the `init_info` they are given, bfloat16
    destinations `Shard(1)`), and send one float32 weight. Returns (trainer results, engine results): an exception
    or, on an engine rank, its tensor."""
    import asyncio
    import threading

    from reshard import Layout, Mesh, Shard
    from reshard.comm import Group
    from reshard.refit import Refit

    kw = {} if precision is None else {"precision": precision}
    trainers = [ReshardCheckpointEngine(BUCKET, is_master=i == 0, host="127.0.0.1", timeout_s=30, **kw)
                for i in range(2)]
    master = trainers[0].prepare()["master"]
    address = {"host": master["host"], "port": master["port"], "token": master["token"], "prefix": "reshard-vllm/1"}
    infos = [t.target_engines(rank=i, world_size=2, engine_world_size=2, master=address)
             for i, t in enumerate(trainers)]
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7.0
    out: list = [None] * 4

    def trainer(i: int) -> None:
        try:
            out[i] = asyncio.run(trainers[i].send_weights([("w", full)], global_steps=1))
        except BaseException as e:  # noqa: BLE001
            out[i] = e

    def engine(k: int) -> None:
        info = infos[0]
        try:
            group = Group.rendezvous(info["master_address"], info["master_port"], 2 + k, 4, prefix=info["prefix"],
                                     token=info.get("token"), timeout=30)
            refit = Refit(group, precision=info["precision"], timeout=30)
            local = torch.zeros(8, 3, dtype=torch.bfloat16)
            refit.add_destination("w", local, Layout((8, 6), Mesh([2, 3]), [Shard(1)], torch.bfloat16, name="w"))
            try:
                refit.run()
                out[2 + k] = local
            finally:
                group.close()
        except BaseException as e:  # noqa: BLE001
            out[2 + k] = e

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=engine, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    for t in trainers:
        t._close_link()
    return out[:2], [(o, full[:, 3 * k: 3 * k + 3].to(torch.bfloat16)) for k, o in enumerate(out[2:])]


def test_a_dtype_change_into_engines_is_refused_with_advice_a_verl_user_can_follow() -> None:
    """float32 trainer weights into bfloat16 engines: refused on every rank; the trainers' error names the verl
    setting (`...engine_kwargs.reshard.precision=cast`), not `precision='cast'`, which verl users cannot pass
    (before, the only advice). With that setting the weight lands, cast bit-exact to `torch.Tensor.to`."""
    from reshard.integrations.verl._names import PRECISION_KEY

    trainers, engines = _sync_into_engines(None)
    for e in trainers:
        assert isinstance(e, ValueError) and f"set {PRECISION_KEY}=cast" in str(e), e
        assert "use precision='cast'" not in str(e), e
    for e, _ in engines:
        assert isinstance(e, ValueError) and "dtype torch.float32 on the trainer" in str(e), e
    trainers, engines = _sync_into_engines("cast")
    assert all(isinstance(m, dict) for m in trainers), trainers
    for got, want in engines:
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), (got, want)
