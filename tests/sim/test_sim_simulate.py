"""The simulator end to end on small models: real plans, byte totals against closed forms, and the outputs."""

from __future__ import annotations

import csv

import pytest
from test_sim_layouts import TINY_DSV3

from reshard.models import PRESETS, param_specs
from reshard.sim import System, format_table, main, simulate

REPLICATED_KINDS = {"norm", "q_a", "kv_a", "router", "router_bias", "mtp_proj"}


def replicated_bytes(config):
    """Bytes of the weights every TP rank holds whole (norms, MLA down-projections, routers, MTP eh_proj)."""
    return sum(s.nbytes for s in param_specs(config, stack_experts=True) if s.kind in REPLICATED_KINDS)


@pytest.fixture(scope="module")
def tiny_moe():
    # trainer PP2 x EP4 (TP1, 4 ranks per stage) on ranks 0-7; inference 2 replicas of TP4 on ranks 8-15; 4-GPU
    # domains, so the inference side spans domains 2 and 3, one replica in each.
    system = System.parse("train=pp2,ep4 gen=tp4,dp2 domain=4")
    return simulate(TINY_DSV3, system, "h100", stack_experts=False)


def test_reshard_network_bytes_meet_the_lower_bound(tiny_moe):
    r = tiny_moe
    reshard, direct = r.method("reshard"), r.method("direct p2p")
    # each inference domain holds one full replica and none of the trainer's bytes: the whole model crosses into
    # each of the 2 domains once
    assert reshard.network_bytes == r.method("lower bound").network_bytes == 2 * r.model_bytes
    # the inference ranks need 2 replicas of the model, plus 3 more copies per replica of what TP4 replicates
    needed = 2 * (r.model_bytes + 3 * replicated_bytes(TINY_DSV3))
    # direct P2P: every inference rank receives all it needs over the network
    assert direct.network_bytes == needed and direct.nvlink_bytes == 0
    # reshard: the replicated weights cross once per domain and are forwarded to the other 3 TP ranks
    assert reshard.nvlink_bytes == needed - reshard.network_bytes == 2 * 3 * replicated_bytes(TINY_DSV3)


def test_order_of_methods(tiny_moe):
    r = tiny_moe
    t = {m.method: m.seconds for m in r.methods}
    assert t["lower bound"] <= t["reshard"] <= t["direct p2p"] < t["gather+bcast"]
    gb = r.gather_broadcast
    assert len(gb.stage_seconds) == 2
    assert gb.broadcast_bytes == 8 * r.model_bytes  # every inference GPU receives the whole model
    assert gb.network_bytes == 2 * r.model_bytes  # entering each inference domain once


def test_relay_forwards_when_replicas_share_a_domain():
    # Qwen3-0.6B, trainer TP2 x DP2 (ranks 0-3) -> inference 4 replicas of TP2 in one 8-GPU domain (ranks 8-15):
    # the model crosses the network once; the rest of what the 8 ranks need is forwarded over NVLink.
    r = simulate("qwen3-0.6b", "train=tp2,dp2 gen=tp2,dp4", "h100")
    reshard, direct = r.method("reshard"), r.method("direct p2p")
    assert r.num_tensors == 310 and r.model_bytes == 1_192_099_840
    norms = replicated_bytes(PRESETS["qwen3-0.6b"])
    assert norms == (2 * 28 + 1) * 1024 * 2 + 2 * 28 * 128 * 2  # layer norms, final norm, q/k norms (bf16)
    needed = 4 * (r.model_bytes + norms)  # 4 replicas, norms on both TP ranks
    assert reshard.network_bytes == r.model_bytes and reshard.nvlink_bytes == needed - r.model_bytes
    assert direct.network_bytes == needed
    lb = r.lower
    assert lb.domain_import_s == pytest.approx(r.model_bytes / (8 * 50e9))
    assert lb.source_egress_s == pytest.approx(r.model_bytes / (4 * 50e9)) == lb.seconds
    assert r.method("reshard").seconds >= lb.seconds
    table = format_table(r)
    assert "reshard" in table and "gather+bcast" in table and "qwen3-0.6b (310 tensors, 1.2 GB)" in table


def test_command_line_writes_csv_and_png(tmp_path, capsys):
    assert (
        main(
            [
                "-m",
                "qwen3-0.6b",
                "-s",
                "train=tp2 gen=tp1,dp2",
                "-H",
                "gb300",
                "--domain-size",
                "2",
                "--no-direct",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "lower bound" in out and "gb300" in out
    rows = list(csv.DictReader((tmp_path / "simulate.csv").open()))
    assert [row["method"] for row in rows] == ["reshard", "gather+bcast", "lower bound"]
    assert rows[0]["model"] == "qwen3-0.6b" and rows[0]["domain_size"] == "2"
    assert len(list(tmp_path.glob("*.png"))) == 1
