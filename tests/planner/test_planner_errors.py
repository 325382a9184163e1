"""Bad input gets a ValueError (TypeError for a wrong type, NotImplementedError for a valid but unsupported layout)
naming the tensor, the expected and the actual values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard import Box, Layout, Mesh, Piece, PlanItem, Topology, plan, plan_many
from reshard.planner import ExplicitLayout, fuse


def test_partial_is_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor 'w'.*Partial placement on mesh axis 1.*reduce"):
        Layout((4, 4), Mesh([[0, 1]]), [Replicate(), Partial()], name="w")


def test_placements_length_must_match_mesh() -> None:
    with pytest.raises(ValueError, match=r"tensor 'w'.*expected 2 placements.*mesh shape \(1, 2\).*got 1"):
        Layout((4, 4), Mesh([[0, 1]]), [Shard(0)], name="w")


def test_shard_dim_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"tensor 'b'.*S\(2\).*out of range for a 2-D tensor of shape \(4, 4\)"):
        Layout((4, 4), Mesh([0, 1]), [Shard(2)], name="b")
    with pytest.raises(ValueError, match=r"out of range for a 0-D tensor"):
        Layout((), Mesh([0, 1]), [Shard(0)])


def test_shape_and_dtype_mismatch_between_sides() -> None:
    a = Layout((4, 4), Mesh([0, 1]), [Shard(0)], name="w")
    b = Layout((4, 5), Mesh([2, 3]), [Shard(0)], name="w")
    with pytest.raises(ValueError, match=r"tensor 'w'.*global shapes differ: source \(4, 4\), destination \(4, 5\)"):
        plan(a, b)
    c = Layout((4, 4), Mesh([2, 3]), [Shard(0)], torch.bfloat16, name="w")
    with pytest.raises(ValueError,
                       match=r"tensor 'w'.*dtypes differ: source torch.float32, destination torch.bfloat16"):
        plan(a, c)


def test_duplicate_ranks() -> None:
    with pytest.raises(ValueError, match=r"duplicate ranks \[1\]"):
        Mesh([[0, 1], [1, 2]])


def test_negative_sizes_and_ranks() -> None:
    with pytest.raises(ValueError, match=r"tensor 'w'.*sizes >= 0.*\(4, -1\)"):
        Layout((4, -1), Mesh([0]), [Replicate()], name="w")
    with pytest.raises(ValueError, match=r"ranks must be >= 0.*\[-3\]"):
        Mesh([0, -3])
    with pytest.raises(ValueError, match=r"shape must be >= 0"):
        Box((0,), (-1,))


def test_rank_must_be_an_integer() -> None:
    with pytest.raises(ValueError, match=r"ranks must be integers, got 1.5"):
        Mesh([0, 1.5])
    with pytest.raises(ValueError, match=r"ranks must be integers.*float"):
        Mesh(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"ranks must be integers.*float"):
        Mesh(np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"rank must be an integer, got '3'"):
        Layout((4,), Mesh([0, 1]), [Shard(0)]).pieces("3")  # type: ignore[arg-type]


def test_ragged_mesh_and_bad_topology() -> None:
    with pytest.raises(ValueError, match=r"rectangular"):
        Mesh([[0, 1], [2]])
    with pytest.raises(ValueError, match=r"domain_size must be a positive integer, got 0"):
        Topology(domain_size=0)
    lay = Layout((4,), Mesh([0, 1]), [Shard(0)])
    with pytest.raises(ValueError, match=r"rank 1 has no domain in domain_of"):
        plan(lay, Layout((4,), Mesh([1, 0]), [Shard(0)]), Topology(domain_of={0: "a"}))


def _pair(name: str | None = None) -> tuple[Layout, Layout]:
    return (Layout((4,), Mesh([0]), [Replicate()], name=name), Layout((4,), Mesh([1]), [Replicate()], name=name))


def test_a_layout_that_is_not_a_layout() -> None:
    src, dst = _pair()
    with pytest.raises(TypeError, match=r"PlanItem: src must be a layout .*got None \(NoneType, which lacks shape"):
        plan(None, dst)
    with pytest.raises(TypeError, match=r"PlanItem: dst must be a layout .*got \(4,\) \(tuple"):
        plan(src, (4,))
    with pytest.raises(TypeError, match=r"PlanItem: src must be a layout"):
        plan_many([(None, dst)])


def test_topology_must_be_a_topology() -> None:
    src, dst = _pair()
    with pytest.raises(TypeError, match=r"topology must be a reshard.Topology or None, got 4 \(int\).*"
                                        r"Topology\(domain_size=4\)"):
        plan(src, dst, topology=4)
    with pytest.raises(TypeError, match=r"topology must be a reshard.Topology or None, got 'node'"):
        plan(src, dst, topology="node")


def test_relay_must_be_a_bool() -> None:
    src, dst = _pair()
    with pytest.raises(TypeError, match=r"relay must be a bool \(True or False\), got 'no' \(str\)"):
        plan(src, dst, relay="no")
    with pytest.raises(TypeError, match=r"relay must be a bool.*got 0 \(int\)"):
        plan(src, dst, relay=0)


def test_placements_in_dtensor_notation_are_parsed() -> None:
    """Strings are read with the notation parser, one per mesh axis or the whole list as one string; the layout
    equals the one built from DTensor's classes (same key, same pieces)."""
    mesh = Mesh([[0, 1], [2, 3]])
    want = Layout((6, 4), mesh, [Replicate(), _StridedShard(0, split_factor=2)])
    for placements in (["R", "_S(0,2)"], "R,_S(0, 2)", [Replicate(), "_S(0,2)"]):
        got = Layout((6, 4), mesh, placements)
        assert got == want and got.placements == want.placements
        assert [got.pieces(r) for r in range(4)] == [want.pieces(r) for r in range(4)]
    with pytest.raises(ValueError, match=r"placements: cannot read 'S\(x\)'"):
        Layout((6, 4), mesh, ["R", "S(x)"])
    with pytest.raises(ValueError, match=r"placement string 'R,S\(0\)' in a list must name one placement, got 2"):
        Layout((6, 4), mesh, ["R,S(0)", "R"])
    with pytest.raises(TypeError, match=r"placement 0 on mesh axis 1 is a int, not a placement.*'S\(0\)'"):
        Layout((6, 4), mesh, [Replicate(), 0])


def test_a_bool_is_not_a_size() -> None:
    with pytest.raises(TypeError, match=r"tensor 'w': shape \(True, 4\): each size must be an integer, got the bool"):
        Layout((True, 4), Mesh([0]), [Replicate()], name="w")
    with pytest.raises(TypeError, match=r"shape must be a sequence of integers, got 4"):
        Layout(4, Mesh([0]), [Replicate()])
    with pytest.raises(TypeError, match=r"Box: shape \(True,\).*got the bool True"):
        Box((0,), (True,))
    with pytest.raises(TypeError, match=r"tensor 'e': shape \(4, True\).*got the bool True"):
        ExplicitLayout((4, True), torch.float32, {}, {}, name="e")
    with pytest.raises(TypeError, match=r"tensor 'e': rank 0 local shape \(2.5,\).*got 2.5 \(float\)"):
        ExplicitLayout((4,), torch.float32, {}, {0: (2.5,)}, name="e")
    with pytest.raises(TypeError, match=r"src_tensor.*must be an integer, got the bool True"):
        PlanItem(*_pair(), src_tensor=True)


def test_strided_split_factor_must_be_a_positive_integer() -> None:
    """torch's own `_StridedShard(0, split_factor=1.5)` stores 1 (its C++ constructor truncates, before reshard
    sees the value), so a fractional factor can only be refused where reshard reads it: the notation."""
    with pytest.raises(ValueError, match=r"placements: cannot read '_S\(0,1.5\)'"):
        Layout((8,), Mesh([0, 1]), ["_S(0,1.5)"])
    with pytest.raises(ValueError, match=r"_S\(0, 0\) on mesh axis 0 needs split_factor >= 1, got 0"):
        Layout((8,), Mesh([0, 1]), ["_S(0,0)"])


def test_an_empty_mesh_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Mesh: ranks must name at least one rank, got an empty mesh of shape \(0,\)"):
        Mesh([])
    with pytest.raises(ValueError, match=r"empty mesh of shape \(2, 0\)"):
        Mesh(torch.zeros(2, 0, dtype=torch.int64))


def test_a_source_that_holds_nothing_is_refused() -> None:
    """An explicit source with no pieces (the layout of an empty mesh) would plan 0 transfers for 16 needed bytes."""
    src = ExplicitLayout((4,), torch.float32, {}, {}, name="w")
    dst = Layout((4,), Mesh([1]), [Replicate()], name="w")
    with pytest.raises(ValueError, match=r"tensor 'w' \(item 0\): the source layout holds 0 of the 4 elements the "
                                         r"destination layout needs"):
        plan(src, dst)
    half = ExplicitLayout((4,), torch.float32, {0: [Piece(Box((0,), (2,)), Box((0,), (2,)))]}, {0: (2,)}, name="w")
    with pytest.raises(ValueError, match=r"holds 2 of the 4 elements"):
        plan(half, dst)


def test_two_items_writing_one_destination_are_refused() -> None:
    src, dst = _pair()
    items = [PlanItem(src, dst, 0, 0, name="x"), PlanItem(src, dst, 1, 0, name="y")]
    with pytest.raises(ValueError, match=r"tensor 'x' \(item 0\) and tensor 'y' \(item 1\) both write destination "
                                         r"tensor 0 on rank 1: local boxes Box\[0:4\] and Box\[0:4\] overlap"):
        plan_many(items)
    # negative control: fused layouts write disjoint parts of one destination tensor
    q, k = (Layout((n, 2), Mesh([0, 1]), [Shard(0)], name=nm) for n, nm in ((4, "q"), (2, "k")))
    fq, fk = fuse([Layout((4, 2), Mesh([2, 3]), [Shard(0)], name="q"), Layout((2, 2), Mesh([2, 3]), [Shard(0)],
                                                                                   name="k")])
    p = plan_many([PlanItem(q, fq, 0, 0), PlanItem(k, fk, 1, 0)])
    assert p.stats.needed_bytes == 6 * 2 * 4


def test_a_negative_tensor_index_is_refused_when_the_item_is_built() -> None:
    src, dst = _pair("w")
    with pytest.raises(ValueError, match=r"PlanItem 'w': src_tensor must be >= 0 .*got -1"):
        PlanItem(src, dst, src_tensor=-1, name="w")
    with pytest.raises(ValueError, match=r"PlanItem: dst_tensor must be >= 0 .*got -2"):
        PlanItem(src, dst, dst_tensor=-2)
    with pytest.raises(TypeError, match=r"dst_tensor.*must be an integer, got 1.0 \(float\)"):
        PlanItem(src, dst, dst_tensor=1.0)


def test_a_cached_plan_keeps_the_names_it_is_asked_for() -> None:
    """Two tensors of one geometry under different names: each plan carries its own name (the cache key has the
    layout names), and asking again returns the cached plan."""
    first = plan(*_pair("first"))
    second = plan(*_pair("second"))
    assert (first.items[0].label, second.items[0].label) == ("first", "second")
    assert "'second'" in second.describe() and "'first'" not in second.describe()
    assert plan(*_pair("first")) is first
