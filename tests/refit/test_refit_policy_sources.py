"""Single-process checks of the refit's source merging, rank mapping and `auto` policy (no processes started)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard.planner import Layout, Mesh, PlanItem, Topology, plan_many
from reshard.planner._contract import decode_layout, encode_layout
from reshard.refit._policy import GB_MARGIN, decide
from reshard.refit._sources import remap_ranks, source_layouts


def _meta(rank: int, sources: dict) -> dict:
    return {"rank": rank, "sources": {n: {"layout": encode_layout(lay), "coord": c} for n, (lay, c) in
                                      sources.items()}}


def test_layout_metadata_is_json_and_round_trips() -> None:
    import json

    lay = Layout((6, 4), Mesh([[0, 1], [2, 3]], axis_names=("dp", "tp")), [_StridedShard(0, split_factor=2),
                                                                        Shard(0)], torch.bfloat16, name="w")
    spec = json.loads(json.dumps(encode_layout(lay)))
    assert decode_layout(spec) == lay
    assert remap_ranks(decode_layout(spec), {0: 7, 1: 6, 2: 5, 3: 4}).mesh.ranks == (7, 6, 5, 4)


def test_fsdp_sub_meshes_merge_into_one_replicated_layout_in_group_ranks() -> None:
    """FSDP over each TP rank's dp sub-mesh (`[0, 2]`, `[1, 3]` in the trainer's own numbering), the trainer at
    group ranks 4-7: one `[R, S(0)]` layout whose pieces equal each rank's own DTensor pieces."""
    own = {0: Layout((7, 3), Mesh([0, 2]), [Shard(0)], name="norm"), 1: Layout((7, 3), Mesh([1, 3]), [Shard(0)],
                                                                                name="norm")}
    metas = [_meta(r + 4, {"norm": (own[r % 2], [r // 2])}) for r in range(4)]
    layouts, holders, errors = source_layouts(metas)
    assert errors == []
    merged = layouts["norm"]
    assert holders["norm"] == {4, 5, 6, 7}
    assert isinstance(merged, Layout) and merged.placements == (Replicate(), Shard(0))
    for r in range(4):  # the same boxes as DTensor's own layout gives that process
        assert [p.global_box for p in merged.pieces(r + 4)] == [p.global_box for p in own[r % 2].pieces(r)]


def test_copies_with_different_placements_merge_as_explicit() -> None:
    a = Layout((8, 4), Mesh([0, 1]), [Shard(0)], name="w")
    b = Layout((8, 4), Mesh([2, 3]), [Shard(1)], name="w")
    metas = [_meta(r, {"w": (a if r < 2 else b, [r % 2])}) for r in range(4)]
    layouts, _, errors = source_layouts(metas)
    assert errors == []
    assert [p.global_box for p in layouts["w"].pieces(3)] == [p.global_box for p in b.pieces(3)]


def test_conflicting_layouts_show_each_rank_and_the_fix() -> None:
    a = Layout((8, 4), Mesh([0, 1]), [Shard(0)], name="w")
    b = Layout((8, 4), Mesh([0, 1]), [Shard(1)], name="w")
    _, _, errors = source_layouts([_meta(0, {"w": (a, [0])}), _meta(1, {"w": (b, [1])})])
    assert len(errors) == 1
    assert re.search(r"source 'w': ranks disagree on its layout:\n    ranks \[0\]: Layout\('w' \[8, 4\] float32 "
                     r"ranks=0-1 mesh=2 \[S\(0\)\]\)\n    ranks \[1\]: Layout\('w' \[8, 4\] float32 ranks=0-1 mesh=2 "
                     r"\[S\(1\)\]\)\n  rank 0 is in the layout registered by ranks \[0\] and in the one registered by "
                     r"ranks \[1\].*same placements", errors[0], re.S), errors[0]
    c = Layout((8, 5), Mesh([2, 3]), [Shard(0)], name="w")
    _, _, errors = source_layouts([_meta(0, {"w": (a, [0])}), _meta(1, {"w": (a, [1])}),
                                   _meta(2, {"w": (c, [0])}), _meta(3, {"w": (c, [1])})])
    assert "global shape or dtype differs" in errors[0] and "[8, 5]" in errors[0]


def test_rank_mapping_mismatch_names_the_mapping() -> None:
    a = Layout((8, 4), Mesh([0, 1]), [Shard(0)], name="w")
    # group ranks 4 and 5 both claim DTensor rank 0
    _, _, errors = source_layouts([_meta(4, {"w": (a, [0])}), _meta(5, {"w": (a, [0])})])
    assert any("DTensor mesh rank 0 (the DTensors' own numbering) is held by group ranks [4, 5]" in e for e in errors)
    assert any("mapping found: {0 -> 4}" in e for e in errors)
    # only DTensor rank 0 registered: rank 1 of the mesh is no process of the group
    _, _, errors = source_layouts([_meta(4, {"w": (a, [0])})])
    assert errors == ["source 'w': its DTensor mesh ranks [1] (own numbering, mesh [0, 1]) are held by no process of "
                      "the group that registered a DTensor; DTensor rank -> group rank mapping found: {0 -> 4}"]


@pytest.mark.parametrize("rs_s,rs_b,gb_s,gb_b,want", [
    (34.6e-6, 100, 34.5e-6, 141, "reshard"),  # faster by 0.3% with 41% more bytes
    (40e-6, 100, 40e-6 / (1 + GB_MARGIN) * 0.99, 141, "gather_broadcast"),  # just past the margin
    (40e-6, 100, 40e-6 / (1 + GB_MARGIN) * 1.01, 141, "reshard"),  # just short of it
    (40e-6, 100, 39e-6, 100, "gather_broadcast"),  # no more bytes: faster is enough
    (40e-6, 100, 41e-6, 50, "reshard"),  # fewer bytes but slower
])
def test_decide(rs_s: float, rs_b: int, gb_s: float, gb_b: int, want: str) -> None:
    c = decide(rs_s, rs_b, gb_s, gb_b)
    assert c == want and (c.reshard_s, c.gather_broadcast_bytes) == (rs_s, gb_b)


def test_auto_uses_the_whole_model_plan() -> None:
    """A big weight held whole by one trainer rank and wanted by 8 engine ranks without relays: the source NIC
    sends it 8 times, a broadcast chain once per hop, so gather-and-broadcast (same bytes) wins; 32 small norms
    share the plan's messages and stay reshard although alone each would pay a message latency."""
    from reshard.cost import get_hardware
    from reshard.refit._policy import choose

    hw, topo = get_hardware("h100"), Topology(domain_size=8)
    big = PlanItem(Layout((1024, 1024), Mesh([0]), [Replicate()], torch.bfloat16, name="big"),
                   Layout((1024, 1024), Mesh(list(range(8, 16))), [Replicate()], torch.bfloat16, name="big"), 0, 0,
                   name="big")
    smalls = [PlanItem(Layout((64,), Mesh([0, 1, 2, 3]), [Shard(0)], name=f"s{i}"),
                       Layout((64,), Mesh([[8, 9], [10, 11]]), [Replicate(), Replicate()], name=f"s{i}"), 1 + i, 1 + i,
                       name=f"s{i}") for i in range(32)]
    whole = plan_many([big, *smalls], topo, relay=False)
    got = choose([big, *smalls], whole, hw, topo.domain)
    assert got[0] == "gather_broadcast" and got[0].gather_broadcast_bytes == got[0].reshard_bytes == 8 * 2 << 20
    assert all(c == "reshard" and c.reshard_bytes == 4 * 256 for c in got[1:])
    assert got[1].reshard_s < got[1].gather_broadcast_s
    relayed = choose([big, *smalls], plan_many([big, *smalls], topo, relay=True), hw, topo.domain)
    assert relayed[0] == "reshard"  # one network crossing, forwarded over NVLink
