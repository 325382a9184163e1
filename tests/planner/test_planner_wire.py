"""Layouts on the wire (`reshard.planner._wire`) and dtype names (`reshard.planner._dtypes`).

Oracle: the original layout itself. A decoded layout must compare equal (same key) and give the same pieces and
local shapes on every rank, after a real `json.dumps` / `json.loads` round trip (so encoded values are JSON only).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard.planner import (
    ExplicitLayout,
    Layout,
    Mesh,
    dtype_from_name,
    dtype_name,
    fuse,
    scale_layout,
    vocab_parallel_layout,
)
from reshard.planner._contract import decode_layout, encode_layout


def _layouts() -> list:
    tp = Layout((12, 10), Mesh([0, 1, 2]), [Shard(0)], torch.bfloat16, name="w")  # uneven: 4, 4, 4 rows
    two_d = Layout((7, 5), Mesh([[4, 5], [6, 7]], axis_names=("dp", "tp")), [Replicate(), Shard(1)], torch.float32)
    strided = Layout((16, 3), Mesh([[0, 1], [2, 3]]), [_StridedShard(0, split_factor=2), Shard(0)], torch.float16,
                     name="s")
    q, k = (Layout((n, 8), Mesh([0, 1]), [Shard(0)], torch.bfloat16, name=nm) for n, nm in ((8, "q"), (4, "k")))
    fused = fuse([q, k])  # several global tensors in one local tensor
    vocab = vocab_parallel_layout(100, 8, [2, 3], pad_to=64, name="embed")  # padded rows on the last rank
    scales = scale_layout(Layout((300, 260), Mesh([0, 1, 2]), [Shard(1)], torch.bfloat16, name="w8"), (128, 128))
    fp8 = Layout((4, 4), Mesh([9]), [Replicate()], torch.float8_e4m3fn)
    return [tp, two_d, strided, *fused, vocab, scales, fp8]


@pytest.mark.parametrize("layout", _layouts(), ids=repr)
def test_round_trip_through_json(layout) -> None:
    wire = json.loads(json.dumps(encode_layout(layout)))  # json.dumps fails on anything but JSON values
    back = decode_layout(wire)
    assert type(back) is type(layout) and back == layout and back.key == layout.key
    assert back.name == layout.name and back.dtype == layout.dtype and tuple(back.shape) == tuple(layout.shape)
    assert back.ranks == layout.ranks if isinstance(layout, ExplicitLayout) else back.mesh.ranks == layout.mesh.ranks
    for r in range(12):
        assert back.pieces(r) == layout.pieces(r), r
        assert tuple(back.local_shape(r)) == tuple(layout.local_shape(r)), r


def test_encoding_is_plain_values() -> None:
    enc = encode_layout(Layout((4, 6), Mesh([[0, 1], [2, 3]], axis_names=("a", "b")), [Shard(0), Replicate()],
                               torch.bfloat16, name="x"))
    assert enc == {"kind": "mesh", "name": "x", "shape": [4, 6], "dtype": "bfloat16", "mesh_shape": [2, 2],
                   "ranks": [0, 1, 2, 3], "axis_names": ["a", "b"], "placements": ["S(0)", "R"]}
    with pytest.raises(TypeError, match="expected a Layout or ExplicitLayout, got str"):
        encode_layout("S(0)")


def _mesh_enc() -> dict:
    return encode_layout(Layout((4, 6), Mesh([[0, 1], [2, 3]]), [Shard(0), Replicate()], torch.bfloat16, name="x"))


def _explicit_enc() -> dict:
    return encode_layout(fuse([Layout((8, 8), Mesh([0, 1]), [Shard(0)], name="q"),
                               Layout((4, 8), Mesh([0, 1]), [Shard(0)], name="k")])[0])


def _with(enc: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(enc)
    target = out
    for p in path[:-1]:
        target = target[p]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: [1, 2], "expected a dict, got list"),
        (lambda: _with(_mesh_enc(), ("kind",), "grid"), "kind must be 'mesh' or 'explicit'"),
        (lambda: _with(_mesh_enc(), ("ranks",), KeyError), "fields .* expected"),
        (lambda: {**_mesh_enc(), "extra": 1}, "fields .* expected"),
        (lambda: _with(_mesh_enc(), ("name",), 3), "name must be a string or None"),
        (lambda: _with(_mesh_enc(), ("shape",), "4,6"), "shape: expected a list"),
        (lambda: _with(_mesh_enc(), ("shape", 0), True), "shape: expected an integer, got True"),
        (lambda: _with(_mesh_enc(), ("shape", 1), 6.0), "shape: expected an integer, got 6.0"),
        (lambda: _with(_mesh_enc(), ("shape", 1), -6), "must be >= 0|negative|>= 0"),
        (lambda: _with(_mesh_enc(), ("dtype",), "bfloat17"), "unknown dtype 'bfloat17'"),
        (lambda: _with(_mesh_enc(), ("dtype",), "Tensor"), "unknown dtype 'Tensor'"),
        (lambda: _with(_mesh_enc(), ("dtype",), None), "expected a dtype name"),
        (lambda: _with(_mesh_enc(), ("mesh_shape",), [3, 2]), "does not hold the 4 ranks"),
        (lambda: _with(_mesh_enc(), ("ranks", 3), 0), "distinct"),
        (lambda: _with(_mesh_enc(), ("axis_names",), [1, 2]), "axis_names must be strings"),
        (lambda: _with(_mesh_enc(), ("placements", 0), "S(x)"), "cannot read"),
        (lambda: _with(_mesh_enc(), ("placements", 0), "S(0),R"), "expected one placement"),
        (lambda: _with(_mesh_enc(), ("placements", 0), {"shard": 0}), "expected a placement string"),
        (lambda: _with(_mesh_enc(), ("placements", 0), "P"), "Partial placement"),
        (lambda: _with(_mesh_enc(), ("placements",), ["R"]), "placements|mesh"),  # one per mesh axis
        (lambda: _with(_explicit_enc(), ("per_rank", 0), [0, [6, 8]]), r"must be \[rank, local_shape, pieces\]"),
        (lambda: _with(_explicit_enc(), ("per_rank", 1, 0), 0), "rank 0 appears twice"),
        (lambda: _with(_explicit_enc(), ("per_rank", 0, 2, 0), [[0, 0], [4, 8], [0, 0]]),
         r"expected \[global_offsets, shape, local_offsets, tensor\]"),
        (lambda: _with(_explicit_enc(), ("per_rank", 0, 2, 0, 3), 7), "tensor must be a string or None"),
        (lambda: _with(_explicit_enc(), ("per_rank", 0, 2, 0, 1), [40, 8]), "outside"),
        (lambda: _with(_explicit_enc(), ("per_rank", 0, 2), _explicit_enc()["per_rank"][0][2] * 2), "overlap"),
    ],
)
def test_decode_refuses_malformed(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_layout(make())


def test_dtype_names() -> None:
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.bool):
        assert dtype_from_name(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("torch.bfloat16") is torch.bfloat16 and dtype_from_name("BF16") is torch.bfloat16
    assert dtype_from_name("half") is torch.float16 and dtype_from_name("fp8") is torch.float8_e4m3fn
    for bad in ("float12", "Tensor", "_C", "", "float32 "[:-2] + "x"):
        with pytest.raises(ValueError, match="unknown dtype"):
            dtype_from_name(bad, what="--dtype")
    with pytest.raises(TypeError, match="expected a torch.dtype"):
        dtype_name("bfloat16")


def test_decoded_meshes_are_shared_and_a_cached_mesh_still_checks_its_ranks() -> None:
    """`decode_layout` builds each distinct mesh once (a model repeats a few): the second decode reuses it, and a
    rank list equal to a cached one up to type (`True == 1`, `1.0 == 1`) is still refused."""
    enc = encode_layout(Layout((4, 6), Mesh([[0, 1], [2, 3]]), [Shard(0), Replicate()], torch.bfloat16, name="a"))
    first, second = decode_layout(enc), decode_layout({**enc, "name": "b"})
    assert second.mesh is first.mesh and second.name == "b"
    for bad in (True, 1.0):
        with pytest.raises(ValueError, match="ranks: expected an integer"):
            decode_layout(_with(enc, ("ranks", 1), bad))
