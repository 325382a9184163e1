"""The verl backend's pure parts, in the core environment (no verl, no Ray): buckets, the driver-side topology, and
the constructor's refusals. The backend against verl itself: `tests/test_verl_backend.py` (`make test-frameworks`)."""

from __future__ import annotations

import pytest
import torch

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


def _run_sync(engines: list[ReshardCheckpointEngine], T: int, step: int) -> tuple[list, list[dict]]:
    """One sync as verl's manager runs it, with every worker a thread of this process."""
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
                stream = _ShardExport(step) if step == 1 else iter(_weights(step).items())
                out[i] = asyncio.run(engines[i].send_weights(stream, global_steps=step))
            else:
                async def take() -> dict:
                    return {n: t.clone() async for n, t in engines[i].receive_weights(step)}
                out[i] = asyncio.run(take())
            engines[i].finalize()
        except BaseException as e:  # noqa: BLE001  (a thread must hand every failure to the test, which raises it)
            out[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = [o for o in out if isinstance(o, BaseException)]
    assert not errors, errors
    return out[:T], out[T:]


@pytest.mark.parametrize("domains,rebuild", [("node", False), ("rank", True)])
def test_two_trainers_two_rollouts_in_threads(domains: str, rebuild: bool) -> None:
    """The whole protocol without verl or Ray: 2 trainer + 2 rollout engines in threads, on loopback, three syncs.
    Received tensors byte-equal the sources, in order (the second sync streams an engine's flattened
    `get_per_tensor_param_shard()` export); with `domains="node"` the trainers send the model once
    (the rollout ranks forward), with `"rank"` once per rollout rank; `rebuild_group` builds plans every sync."""
    kw = {"host": "127.0.0.1", "domains": domains, "rebuild_group": rebuild, "timeout_s": 60}
    engines = [ReshardCheckpointEngine(4096, is_master=i == 0, **kw) for i in range(4)]
    for step in range(3):
        metrics, received = _run_sync(engines, 2, step)
        want = _weights(step)
        model = sum(t.nbytes for t in want.values())
        for got in received:
            assert list(got) == list(want)
            for n, t in want.items():
                assert got[n].shape == t.shape and got[n].dtype == t.dtype
                assert torch.equal(got[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n
        sent = [m[f"reshard/rank{r}/bytes_sent"] for r, m in enumerate(metrics)]
        assert sum(sent) == model * (1 if domains == "node" else 2), (sent, model)
        stats = [e.last_sync for e in engines]
        assert all(s.first_plans == (s.buckets if rebuild or step == 0 else 0) for s in stats), stats
        assert all(s.largest_bucket <= 4096 for s in stats)
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
