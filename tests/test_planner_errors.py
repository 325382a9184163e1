"""Bad input gets a ValueError (or NotImplementedError) naming the tensor, the expected and the actual values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from reshard import Box, Layout, Mesh, Topology, plan


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
