"""How a trainer framework's weights become reshard sources: the one home of the stream-item-to-source conversion.

Frameworks hand their weights over in one of three forms, per weight:
- a DTensor (FSDP2, torch TP): registered as it is;
- a local shard with a spec (`(local, spec)`: verl's `ShardSpec`, anything with `full_shape`, `mesh`, `placements`):
  the local tensor in its DTensor local shape (`local_of`), wrapped as a DTensor of that mesh and placements;
- a full tensor that every trainer rank holds (DDP, ZeRO-1/2, a gathered stream): every rank registers its own
  `Shard(0)` row block over the T trainer ranks (`full_layout`), so each rank sends a distinct `1/T` of it and no
  byte is sent twice; a scalar or a tensor with an empty first dim is sent by trainer rank 0 alone.

`stream_source` does the conversion for one item; `full_layout`, `local_of`, `contiguous_stride` are its parts,
for callers that place the local tensors in buffers of their own (verl's bucketed stream). Tie finding, Megatron
detection and Conv1D transposition belong here too (they still live in `reshard.integrations.vllm`).

Example (T = 2 trainer ranks, a full `[5, 3]` float32 weight): `full_layout("w", (5, 3), torch.float32, rank, 2)`
gives rank 0 rows `[0, 3)` (`start` 0, local shape `(3, 3)`) and rank 1 rows `[3, 5)` (`start` 3, `(2, 3)`),
torch.chunk's split; for T = 8 ranks 5 .. 7 hold no rows (`(0, 3)`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.planner import Layout, Mesh

__all__ = ["FullBlock", "contiguous_stride", "full_layout", "full_mesh", "is_dtensor", "local_of", "spec_dtensor",
           "stream_source"]


class FullBlock(NamedTuple):
    """A trainer rank's block of a full tensor every trainer rank holds.

    Attributes:
        layout: the tensor's trainer layout (`Shard(0)` over the T ranks, or trainer rank 0 alone).
        start: the first row of this rank's block (0 for a scalar).
        local_shape: this rank's block's shape (`(rows, *shape[1:])`).
    """

    layout: Layout
    start: int
    local_shape: tuple[int, ...]


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor (checked by its attributes: no DTensor import needed)."""
    return hasattr(t, "to_local") and hasattr(t, "placements")


def full_mesh(shape: Sequence[int], num_ranks: int) -> tuple[Mesh, list[Any]]:
    """The trainer mesh and placements of a full tensor held by every one of `num_ranks` trainer ranks: row blocks
    (`Shard(0)`, torch.chunk's split); a scalar or an empty first dim: trainer rank 0 alone (`Replicate()` on
    `Mesh([0])`)."""
    if len(shape) == 0 or shape[0] == 0:
        return Mesh([0]), [Replicate()]
    return Mesh(list(range(num_ranks))), [Shard(0)]


def full_layout(name: str, shape: Sequence[int], dtype: torch.dtype, rank: int, num_ranks: int) -> FullBlock | None:
    """This trainer rank's `FullBlock` of a full tensor of `shape`, or None where it sends none of it (a scalar on
    a rank other than 0). See the module docstring for a worked example."""
    shape = tuple(int(s) for s in shape)
    mesh, placements = full_mesh(shape, num_ranks)
    layout = Layout(shape, mesh, placements, dtype, name=name)
    if rank not in mesh.ranks:
        return None
    pieces = layout.pieces(rank)
    start = pieces[0].global_box.offsets[0] if pieces and len(shape) else 0
    return FullBlock(layout, int(start), tuple(layout.local_shape(rank)))


def local_of(t: Any, spec: Any) -> torch.Tensor:
    """This rank's local tensor of a DTensor, or of a `(local, spec)` pair in its DTensor local shape (verl's FSDP
    engine flattens the local shard: `local.reshape(-1)`); a plain tensor without a spec is returned as it is.

    Raises:
        ValueError: the local tensor's element count differs from the spec's local shape on this rank.
    """
    if spec is None:
        return t.to_local() if is_dtensor(t) else t
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, _ = compute_local_shape_and_global_offset(torch.Size(spec.full_shape), spec.mesh, list(spec.placements))
    if t.numel() != math.prod(shape):
        raise ValueError(f"reshard send_weights: a local shard of {t.numel()} elements does not match its ShardSpec "
                         f"(full shape {tuple(spec.full_shape)}, placements {tuple(spec.placements)}: local shape "
                         f"{tuple(shape)} on this rank)")
    return t.reshape(shape)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (a zero-sized dim counts as 1, as torch's own)."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def spec_dtensor(local: torch.Tensor, spec_mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> Any:
    """`local` (already in its DTensor local shape) as a DTensor of the global `shape` (contiguous strides)."""
    from torch.distributed.tensor import DTensor

    shape = tuple(int(s) for s in shape)
    return DTensor.from_local(local, spec_mesh, list(placements), run_check=False, shape=torch.Size(shape),
                              stride=contiguous_stride(shape))


def stream_source(name: str, t: Any, spec: Any, rank: int, num_ranks: int) -> Any:
    """One trainer weight as a `Refit` / `ReshardTrainer` source (see the module docstring).

    Args:
        name: the weight's (engine) name.
        t: a DTensor, a local shard (with `spec`), or a full tensor every trainer rank holds.
        spec: None, or the local shard's spec (`full_shape`, `mesh`, `placements`).
        rank, num_ranks: this trainer rank and the T trainer ranks (for full tensors).

    Returns:
        a DTensor, `(local row block, Layout)` (a view of `t`, no copy), or None where this rank sends none of it.
    """
    if spec is not None:
        return spec_dtensor(local_of(t, spec), spec.mesh, spec.placements, spec.full_shape)
    if is_dtensor(t):
        return t
    block = full_layout(name, tuple(t.shape), t.dtype, rank, num_ranks)
    if block is None:
        return None
    local = t.narrow(0, block.start, block.local_shape[0]) if t.dim() else t
    return (local, block.layout)
