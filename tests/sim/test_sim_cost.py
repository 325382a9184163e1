"""The cost model on cases worked by hand: a single link, a relay fan-out, ring all-gather, a broadcast tree,
gather-and-broadcast bytes against closed forms, and the lower bound."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from reshard import Layout, Mesh, Topology, gather_broadcast_bytes, plan
from reshard.cost import (
    HARDWARE,
    Hardware,
    LinkKey,
    LinkLoads,
    chain_broadcast_s,
    gather_broadcast,
    get_hardware,
    link_time,
    lower_bound,
    plan_loads,
    relay_fill_s,
    ring_allgather_s,
)

# Round numbers so every expected time is easy to check by hand: NVLink 400 GB/s, network 50 GB/s, 8-GPU domains,
# 2 us per NVLink message and 10 us per network message.
HW = Hardware(
    "test",
    nvlink_bytes_per_s=400e9,
    network_bytes_per_s=50e9,
    domain_size=8,
    nvlink_latency_s=2e-6,
    network_latency_s=10e-6,
    copy_bytes_per_s=1e12,
)
DOMAIN = Topology(domain_size=8).domain
MB = 10**6


def test_single_link():
    loads = LinkLoads()
    loads.add_transfer(0, 8, "network", 100 * MB)
    t = link_time(loads, HW)
    # 100 MB / 50 GB/s = 2 ms, plus one 10 us message; sender and receiver tie, the lower rank is named.
    assert t.seconds == pytest.approx(2e-3 + 10e-6)
    assert t.bottleneck == LinkKey(0, "network", "send")
    assert (t.bottleneck_bytes, t.bottleneck_messages) == (100 * MB, 1)
    assert t.per_link_s == {"network": pytest.approx(2.01e-3)}


def test_nothing_moves_and_local_copies():
    assert link_time(LinkLoads(), HW).seconds == 0.0
    loads = LinkLoads()
    loads.add_transfer(3, 3, "local", 500 * MB)  # a copy on one device: 0.5 ms at 1 TB/s, no message
    t = link_time(loads, HW, fill_s=1e-3)
    assert t.seconds == pytest.approx(0.5e-3 + 1e-3)
    assert t.bottleneck == LinkKey(3, "local", "recv") and t.bottleneck_messages == 0


def test_relay_fan_out_by_hand():
    # 120 MB cross the network to rank 8, which forwards them over NVLink to ranks 9..15 (7 copies = 840 MB).
    loads = LinkLoads()
    loads.add_transfer(0, 8, "network", 120 * MB)
    for r in range(9, 16):
        loads.add_transfer(8, r, "nvlink", 120 * MB)
    t = link_time(loads, HW)
    # network: 120 MB / 50 GB/s = 2.4 ms + 10 us; rank 8's NVLink out: 840 MB / 400 GB/s = 2.1 ms + 7 * 2 us.
    assert t.per_link_s["network"] == pytest.approx(2.41e-3)
    assert t.per_link_s["nvlink"] == pytest.approx(2.114e-3)
    assert t.seconds == pytest.approx(2.41e-3) and t.bottleneck.link == "network"
    assert loads.total_bytes("network") == 120 * MB and loads.total_bytes("nvlink") == 840 * MB


def test_relay_fan_out_from_a_real_plan():
    # A 6 MB tensor on rank 0 (domain 0), needed whole by ranks 8, 9, 10 (domain 1). The planner cuts it into 3
    # parts of 2 MB, sends each across the network once, to a different receiver, which forwards it to the others.
    src = Layout((3, 1000, 1000), Mesh([0]), [Replicate()], torch.float16)
    dst = Layout((3, 1000, 1000), Mesh([8, 9, 10]), [Replicate()], torch.float16)
    p = plan(src, dst, Topology(domain_size=8))
    loads = plan_loads(p)
    assert loads.bytes[LinkKey(0, "network", "send")] == 6 * MB
    assert loads.messages[LinkKey(0, "network", "send")] == 3
    for r in (8, 9, 10):
        assert loads.bytes[LinkKey(r, "network", "recv")] == 2 * MB
        assert loads.bytes[LinkKey(r, "nvlink", "send")] == 4 * MB
        assert loads.bytes[LinkKey(r, "nvlink", "recv")] == 4 * MB
    t = link_time(loads, HW)
    # rank 0's NIC: 6 MB / 50 GB/s = 120 us, plus 3 messages of 10 us.
    assert t.seconds == pytest.approx(120e-6 + 30e-6)
    # Two chunks of forwarding remain after the last arrival: 2 * 4 MB / 400 GB/s = 20 us.
    assert relay_fill_s(p, HW, chunk_lag=2) == pytest.approx(20e-6)
    direct = plan(src, dst, Topology(domain_size=8), relay=False)
    assert relay_fill_s(direct, HW, chunk_lag=2) == 0.0
    assert link_time(plan_loads(direct), HW).bottleneck_bytes == 18 * MB  # rank 0 sends it 3 times


def test_ring_allgather():
    # 8 ranks of one domain gather 80 MB: 7 steps of 10 MB over NVLink.
    assert ring_allgather_s(80 * MB, range(8), HW, DOMAIN) == pytest.approx(70 * MB / 400e9 + 7 * 2e-6)
    # the same ring across two domains runs at the network's pace
    assert ring_allgather_s(80 * MB, range(4, 12), HW, DOMAIN) == pytest.approx(70 * MB / 50e9 + 7 * 10e-6)
    assert ring_allgather_s(80 * MB, [5], HW, DOMAIN) == 0.0


def test_broadcast_tree():
    # Root 0 (domain 0) broadcasts 100 MB to ranks 8..23 (domains 1 and 2). The chain enters each domain once over
    # the network (2 network hops) and walks each domain over NVLink (7 + 7 hops); pipelined, the slowest hop sets
    # the pace: 100 MB / 50 GB/s = 2 ms.
    t = chain_broadcast_s(100 * MB, 0, list(range(8, 24)), HW, DOMAIN)
    assert t == pytest.approx(2e-3 + 2 * 10e-6 + 14 * 2e-6)
    # all inside the root's domain: NVLink pace, 7 hops
    assert chain_broadcast_s(100 * MB, 0, list(range(1, 8)), HW, DOMAIN) == pytest.approx(100 * MB / 400e9 + 14e-6)
    assert chain_broadcast_s(100 * MB, 0, [0], HW, DOMAIN) == 0.0


@pytest.mark.parametrize(("n", "m"), [(1, 1), (2, 1), (4, 2), (3, 3)])
def test_gather_broadcast_bytes_closed_form(n, m):
    # A (12, 10) bf16 tensor (B = 240 bytes), sharded n ways on dim 0 and replicated m times on ranks 0..n*m-1;
    # G = 5 inference GPUs in domain 2 (TP5 on dim 1: the destination layout does not change the broadcast).
    B = 12 * 10 * 2
    ranks = torch.arange(n * m).reshape(m, n)
    train = Layout((12, 10), Mesh(ranks), [Replicate(), Shard(0)], torch.bfloat16)
    gen = Layout((12, 10), Mesh(list(range(16, 21))), [Shard(1)], torch.bfloat16)
    gb = gather_broadcast([(train, gen, 0)], HW, DOMAIN)
    assert gb.gather_bytes == m * (n - 1) * B
    assert gb.broadcast_bytes == 5 * B
    assert gb.network_bytes == B  # one inference domain, entered once
    assert gather_broadcast_bytes(train, gen) == {
        "gather": gb.gather_bytes,
        "broadcast": gb.broadcast_bytes,
        "total": gb.gather_bytes + gb.broadcast_bytes,
    }
    expected = ring_allgather_s(B, list(range(n)), HW, DOMAIN) + chain_broadcast_s(B, 0, range(16, 21), HW, DOMAIN)
    assert gb.seconds == pytest.approx(expected)


def test_gather_broadcast_stages_run_concurrently():
    # Two stages (ranks 0-1 and 2-3), each with one 40 MB weight in TP2, broadcast to 8 GPUs in domain 1.
    gen = Layout((20, 10**6), Mesh(list(range(8, 16))), [Replicate()], torch.bfloat16)
    weights = []
    for stage in range(2):
        train = Layout((20, 10**6), Mesh([2 * stage, 2 * stage + 1]), [Shard(0)], torch.bfloat16)
        weights.append((train, gen, stage))
    gb = gather_broadcast(weights, HW, DOMAIN)
    one = ring_allgather_s(40 * MB, [0, 1], HW, DOMAIN) + chain_broadcast_s(40 * MB, 0, range(8, 16), HW, DOMAIN)
    assert gb.stage_seconds == (pytest.approx(one), pytest.approx(one))
    assert gb.seconds == pytest.approx(one)
    assert gb.gather_bytes == 2 * 2 * 20 * MB and gb.broadcast_bytes == 2 * 8 * 40 * MB


def test_lower_bound_and_reshard_network_bytes():
    # 4 trainer ranks (domain 0) hold a 64 MB tensor in 4 row shards; domains 1 and 2 each hold 2 TP4 replicas
    # (ranks 8..15, 16..23). Each destination domain needs the whole tensor once: network lower bound 128 MB.
    src = Layout((64, 10**6), Mesh([0, 1, 2, 3]), [Shard(0)], torch.uint8)
    dst = Layout((64, 10**6), Mesh(torch.arange(8, 24).reshape(4, 4)), [Replicate(), Shard(0)], torch.uint8)
    p = plan(src, dst, Topology(domain_size=8))
    assert p.stats.network_bytes == p.stats.network_lower_bound == 2 * 64 * MB
    lb = lower_bound(p, HW)
    # domain import: 64 MB over 8 NICs; rank ingress: 16 MB over 450 GB/s; source egress: 128 MB over 4 NICs.
    assert lb.domain_import_s == pytest.approx(64 * MB / (8 * 50e9))
    assert lb.rank_ingress_s == pytest.approx(16 * MB / 450e9)
    assert lb.source_egress_s == pytest.approx(128 * MB / (4 * 50e9))
    assert lb.seconds == lb.source_egress_s
    t = link_time(plan_loads(p), HW)
    assert t.seconds >= lb.seconds
    # each source rank sends its 16 MB shard once per destination domain: the bound plus message latencies
    assert t.per_link_s["network"] == pytest.approx(32 * MB / 50e9 + t.bottleneck_messages * 10e-6)


def test_hardware_presets_and_errors():
    h100, gb200, gb300 = (get_hardware(n) for n in ("h100", "GB200", "gb300"))
    assert (h100.nvlink_bytes_per_s, h100.network_bytes_per_s, h100.domain_size) == (450e9, 50e9, 8)
    assert (gb200.nvlink_bytes_per_s, gb200.network_bytes_per_s, gb200.domain_size) == (900e9, 50e9, 72)
    assert (gb300.nvlink_bytes_per_s, gb300.network_bytes_per_s, gb300.domain_size) == (900e9, 100e9, 72)
    assert all(h.source for h in HARDWARE.values())
    assert gb200.replace(domain_size=4).domain_size == 4
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu'.*valid"):
        get_hardware("tpu")
    with pytest.raises(ValueError, match="network_bytes_per_s must be > 0"):
        Hardware("x", 1.0, 0.0, 8)
    with pytest.raises(ValueError, match="unknown link kind 'pcie'"):
        HW.bandwidth("pcie")


def test_gather_broadcast_bytes_when_groups_overlap():
    # Worked by hand: a (4, 4) float32 tensor (64 bytes) as S(0) on ranks 0-1 -> R on ranks 1-3. The all-gather
    # gives ranks 0 and 1 the 32 bytes each lacks (64); rank 1 then holds the full tensor, so the broadcast reaches
    # ranks 2 and 3 only (2 x 64 = 128). The modelled baseline counts the same bytes (one definition).
    train = Layout((4, 4), Mesh([0, 1]), [Shard(0)], torch.float32)
    gen = Layout((4, 4), Mesh([1, 2, 3]), [Replicate()], torch.float32)
    assert gather_broadcast_bytes(train, gen) == {"gather": 64, "broadcast": 128, "total": 192}
    gb = gather_broadcast([(train, gen, 0)], HW, DOMAIN)
    assert (gb.gather_bytes, gb.broadcast_bytes) == (64, 128)
    # colocated: every destination rank took part in the all-gather, nothing is broadcast
    same = Layout((4, 4), Mesh([0, 1]), [Replicate()], torch.float32)
    assert gather_broadcast_bytes(train, same) == {"gather": 64, "broadcast": 0, "total": 64}
    assert gather_broadcast([(train, same, 0)], HW, DOMAIN).broadcast_seconds == (0.0,)
