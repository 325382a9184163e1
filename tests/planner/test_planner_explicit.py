"""Fused and padded destination layouts, executed in-process against local tensors built by hand from full tensors."""

from __future__ import annotations

import pytest
import torch
from test_planner_plan import execute_in_process

from reshard import Layout, Mesh, PlanItem, Replicate, Shard, Topology, plan_many
from reshard.planner import ExplicitLayout, fuse, vocab_parallel_layout
from reshard.testing import dtensor_local

pytestmark = pytest.mark.usefixtures("fake_world")  # the fake default group of dtensor_local, closed after


def test_fused_qkv_with_replicated_kv_heads() -> None:
    """vLLM qkv_proj on TP4 with 2 KV heads: q split 4-ways, each K/V head replicated on 2 TP ranks; the local
    tensor is [q_shard; k_head; v_head]. Trainer: TP2 x DP2 on other ranks, each weight `S(0)` over TP."""
    hidden, head_dim, nq, nkv = 8, 2, 8, 2
    shapes = {"q": (nq * head_dim, hidden), "k": (nkv * head_dim, hidden), "v": (nkv * head_dim, hidden)}
    full = {n: torch.arange(s[0] * s[1], dtype=torch.int64).reshape(s) + 1000 * i
            for i, (n, s) in enumerate(shapes.items())}
    tp = [4, 5, 6, 7]
    q = Layout(shapes["q"], Mesh(tp), [Shard(0)], torch.int64, name="q")
    kv = [Layout(shapes[n], Mesh(torch.tensor(tp).reshape(nkv, 2)), [Shard(0), Replicate()], torch.int64, name=n)
          for n in ("k", "v")]
    fq, fk, fv = fuse([q, *kv])
    trainer_mesh = torch.arange(4).reshape(2, 2)
    items = [PlanItem(Layout(shapes[n], Mesh(trainer_mesh), [Replicate(), Shard(0)], torch.int64, name=n), lay, i, 0)
             for i, (n, lay) in enumerate(zip("qkv", (fq, fk, fv)))]
    p = plan_many(items, Topology(domain_size=4))
    # source locals per rank: three tensors; execute each item separately into the one fused destination
    dst_shapes = {r: fq.local_shape(r) for r in tp}
    dst = {r: torch.full(s, -1, dtype=torch.int64) for r, s in dst_shapes.items()}
    for i, n in enumerate("qkv"):
        src_locals = {r: dtensor_local(full[n], trainer_mesh, [Replicate(), Shard(0)], r, 8) for r in range(4)}
        for t in sorted((t for t in p.transfers if t.item == i), key=lambda t: (t.chunk, t.stage)):
            source = src_locals[t.src_rank] if t.stage == 0 else dst[t.src_rank]
            dst[t.dst_rank][t.dst_box.slices()] = source[t.src_box.slices()]
    for j, r in enumerate(tp):
        q_rows = full["q"][j * 4:(j + 1) * 4]
        head = j // 2  # two TP ranks per KV head
        expected = torch.cat([q_rows, full["k"][head * 2:(head + 1) * 2], full["v"][head * 2:(head + 1) * 2]])
        assert torch.equal(dst[r], expected), r
    # the K/V heads cross the network once into the domain, though two ranks need each
    assert p.stats.network_bytes == sum(s[0] * s[1] for s in shapes.values()) * 8


def test_vocab_parallel_padding_is_never_written() -> None:
    vocab, hidden = 150, 4
    full = torch.arange(vocab * hidden, dtype=torch.int64).reshape(vocab, hidden)
    dst = vocab_parallel_layout(vocab, hidden, [0, 1], dtype=torch.int64, pad_to=64,
                                replicas=[[2, 3], [4, 5]], name="embed")
    src = Layout((vocab, hidden), Mesh([0, 1]), [Shard(1)], torch.int64, name="embed")
    p = plan_many([(src, dst)])
    src_locals = {r: dtensor_local(full, torch.tensor([0, 1]), [Shard(1)], r, 6) for r in (0, 1)}
    got, writes = execute_in_process(p, src_locals, {r: dst.local_shape(r) for r in dst.ranks})
    per = 96  # 150 padded to 192 rows, 96 per rank
    for r, lo in ((2, 0), (3, per), (4, 0), (5, per)):
        n = min(vocab - lo, per)
        assert got[r].shape == (per, hidden)
        assert torch.equal(got[r][:n], full[lo:lo + n])
        assert bool((got[r][n:] == -1).all()) and bool((writes[r][n:] == 0).all())


def test_explicit_layout_rejects_bad_pieces() -> None:
    from reshard import Box, Piece

    with pytest.raises(ValueError, match=r"tensor 'w': rank 0 piece local box Box\[2:5, 0:2\] is outside local shape"):
        ExplicitLayout((5, 2), torch.float32, {0: [Piece(Box((0, 0), (3, 2)), Box((2, 0), (3, 2)))]}, {0: (4, 2)},
                       name="w")
    q = Layout((4, 2), Mesh([0, 1]), [Shard(0)], name="q")
    k = Layout((2, 3), Mesh([0, 1]), [Shard(0)], name="k")
    with pytest.raises(ValueError, match=r"fuse: on rank 0, 'k' has local shape \(1, 3\)"):
        fuse([q, k])


def test_derived_block_layouts_are_shared_per_geometry_but_named_per_weight() -> None:
    """Scale and halo layouts are built once per weight geometry and relabelled: each weight's keeps its own name
    and dtype, and equals a layout built from scratch for that weight."""
    from reshard.planner import relabel
    from reshard.planner._blocks import block_halo_layout, scale_layout
    from reshard.planner._box import Box

    mesh = Mesh([0, 1, 2])
    a, b = (Layout((300, 260), mesh, [Shard(1)], torch.bfloat16, name=n) for n in ("a", "b"))
    sa, sb = scale_layout(a, (128, 128)), scale_layout(b, (128, 128), name="b.weight_scale_inv")
    assert (sa.name, sb.name) == ("a.scale_inv", "b.weight_scale_inv")
    assert sa.key == sb.key and sa.dtype == torch.float32
    assert [sa.pieces(r) for r in sa.ranks] == [sb.pieces(r) for r in sb.ranks]
    ha, hb = block_halo_layout(a, (128, 128)), block_halo_layout(b, (128, 128), dtype=torch.float32)
    assert (ha.name, ha.dtype, hb.name, hb.dtype) == ("a", torch.bfloat16, "b", torch.float32)
    assert hb.key != ha.key
    # S(1) over 3 ranks cuts columns at 87 and 174, inside blocks 0 and 1: halos grow to whole blocks (worked by hand)
    halos = {0: Box((0, 0), (300, 128)), 1: Box((0, 0), (300, 256)), 2: Box((0, 128), (300, 132))}
    scales = {0: Box((0, 0), (3, 1)), 1: Box((0, 0), (3, 2)), 2: Box((0, 1), (3, 2))}
    for lay in (ha, hb):
        assert {r: lay.pieces(r)[0].global_box for r in lay.ranks} == halos
    for lay in (sa, sb):
        assert {r: lay.pieces(r)[0].global_box for r in lay.ranks} == scales
        assert all(lay.local_shape(r) == scales[r].shape for r in lay.ranks)
    assert relabel(hb, dtype=torch.bfloat16).key == ha.key
