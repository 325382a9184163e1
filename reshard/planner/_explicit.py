"""Layouts that DTensor placements cannot say: fused local tensors, padded vocabularies, any explicit piece list.

An inference engine often holds one local tensor built from pieces of several global tensors: vLLM's `qkv_proj`
is `[q_shard; k_shard; v_shard]` along dim 0 on every TP rank, `gate_up_proj` is `[gate_shard; up_shard]`, a MoE
`w13` is `[w1; w3]` per expert. Each *global* tensor then has its own layout whose pieces land at an offset inside
the fused local tensor. `ExplicitLayout` holds such a layout as plain per-rank pieces; `fuse` builds them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from reshard.planner._box import Box, _as_int
from reshard.planner._dtypes import dtype_name
from reshard.planner._index import _pairwise_disjoint
from reshard.planner._layout import Layout, Piece, _shared_cache
from reshard.planner._mesh import _rank_ranges


class ExplicitLayout:
    """A layout given as explicit pieces per rank, with each rank's local shape.

    Args:
        shape: global shape of the tensor the pieces come from.
        dtype: element type.
        pieces: rank -> pieces (`global_box` in the global tensor, `local_box` in the rank's local tensor).
        local_shapes: rank -> shape of the local tensor the pieces live in. It may be larger than the pieces
            cover (padding, or other tensors fused in); elements no piece covers are never written.
        name: the global tensor's name.

    Example (rows 0:3 of a `(5, 2)` tensor at rows 1:4 of rank 0's `(4, 2)` local tensor):
        >>> lay = ExplicitLayout((5, 2), torch.float32, {0: [Piece(Box((0, 0), (3, 2)), Box((1, 0), (3, 2)))]},
        ...                      {0: (4, 2)})
        >>> lay.local_shape(0), lay.pieces(1)
        ((4, 2), ())
    """

    def __init__(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        pieces: Mapping[int, Sequence[Piece]],
        local_shapes: Mapping[int, Sequence[int]],
        *,
        name: str | None = None,
    ) -> None:
        who = f"tensor {name!r}" if name else "ExplicitLayout"
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{who}: dtype must be a torch.dtype, got {dtype!r}")
        self.shape = _sizes(shape, f"{who}: shape")
        self.dtype = dtype
        self.name = name
        self._pieces = {_as_int(r, f"{who}: pieces: rank"): tuple(_piece(p, who) for p in ps)
                        for r, ps in pieces.items()}
        self._pieces = {r: tuple(p for p in ps if p.global_box.numel) for r, ps in self._pieces.items()}
        self._local_shapes = {_as_int(r, f"{who}: local_shapes: rank"): _sizes(ls, f"{who}: rank {r} local shape")
                              for r, ls in local_shapes.items()}
        negative = sorted(r for r in self._local_shapes if r < 0)
        if negative:
            raise ValueError(f"{who}: ranks must be >= 0, got {negative}")
        missing = sorted(set(self._pieces) - set(self._local_shapes))
        if missing:
            raise ValueError(f"{who}: ranks {missing} have pieces but no local shape")
        full = Box((0,) * len(self.shape), self.shape)
        for r, ps in self._pieces.items():
            local = Box((0,) * len(self._local_shapes[r]), self._local_shapes[r])
            for p in ps:
                if p.global_box.shape != p.local_box.shape:
                    raise ValueError(f"{who}: rank {r} piece {p} has different global and local shapes")
                if not full.contains(p.global_box):
                    raise ValueError(f"{who}: rank {r} piece global box {p.global_box} is outside shape {self.shape}")
                if not local.contains(p.local_box):
                    raise ValueError(
                        f"{who}: rank {r} piece local box {p.local_box} is outside local shape {self._local_shapes[r]}"
                    )
            if not _pairwise_disjoint([p.local_box for p in ps]):
                raise ValueError(f"{who}: rank {r} has pieces that overlap in its local tensor")
        self.ranks: tuple[int, ...] = tuple(sorted(self._local_shapes))
        unique = sorted({p.global_box for ps in self._pieces.values() for p in ps}, key=lambda b: (b.offsets, b.shape))
        # identical-or-disjoint pieces across ranks let the planner skip partial-overlap checks
        self.regular = _pairwise_disjoint(unique)
        self.key = (
            "explicit",
            self.shape,
            str(dtype),
            tuple((r, self._local_shapes[r], tuple((p.global_box, p.local_box) for p in self._pieces.get(r, ())))
                  for r in self.ranks),
        )
        self.geometry_id = _shared_cache(self.key)[0]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        return self._pieces.get(rank, ())

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self._local_shapes.get(rank, (0,))

    def _relabeled(self, name: str | None, dtype: torch.dtype) -> ExplicitLayout:
        """This layout under another name and dtype, without checking the pieces again (they were)."""
        out = object.__new__(ExplicitLayout)
        out.shape, out.dtype, out.name = self.shape, dtype, name
        out._pieces, out._local_shapes = self._pieces, self._local_shapes
        out.ranks, out.regular = self.ranks, self.regular
        out.key = self.key if dtype == self.dtype else self.key[:2] + (str(dtype),) + self.key[3:]
        out.geometry_id = self.geometry_id if dtype == self.dtype else _shared_cache(out.key)[0]
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExplicitLayout) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        dt = dtype_name(self.dtype)
        nm = f"{self.name!r} " if self.name else ""
        return f"ExplicitLayout({nm}{list(self.shape)} {dt} ranks={_rank_ranges(self.ranks)})"


def _sizes(values: Sequence[int], what: str) -> tuple[int, ...]:
    """A shape as a tuple of ints >= 0: `TypeError` for anything but integers (`bool` included)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what} must be a sequence of integers, got {values!r}")
    out = tuple(_as_int(v, f"{what} {tuple(values)!r}: each size") for v in values)
    if any(v < 0 for v in out):
        raise ValueError(f"{what} must have sizes >= 0, got {out}")
    return out


def _piece(p: object, who: str) -> Piece:
    if not isinstance(p, Piece):
        raise TypeError(f"{who}: pieces must be reshard.Piece(global_box, local_box), got {p!r}")
    return p


def relabel(layout: Layout | ExplicitLayout, *, name: str | None = None,
            dtype: torch.dtype | None = None) -> Layout | ExplicitLayout:
    """The same layout (same pieces on the same ranks) under another name and/or element type.

    Example: the FP8 weight of a bfloat16 layout is `relabel(layout, dtype=torch.float8_e4m3fn)`.
    """
    name = layout.name if name is None else name
    dtype = layout.dtype if dtype is None else dtype
    if name == layout.name and dtype == layout.dtype:
        return layout
    if isinstance(layout, Layout):
        return Layout(layout.shape, layout.mesh, layout.placements, dtype, name=name)
    if isinstance(layout, ExplicitLayout):
        return layout._relabeled(name, dtype)
    return ExplicitLayout(layout.shape, dtype, {r: layout.pieces(r) for r in layout.ranks},
                          {r: layout.local_shape(r) for r in layout.ranks}, name=name)


def fuse(parts: Sequence[Layout | ExplicitLayout], *, dim: int = 0) -> list[ExplicitLayout]:
    """Layouts of several global tensors whose local shards are concatenated along `dim` on every rank.

    Args:
        parts: the component layouts in concatenation order (for vLLM's `qkv_proj`: q, k, v), on the same ranks.
            Their local shapes must agree on every dim but `dim`.
        dim: the local dim along which the shards are concatenated.

    Returns:
        One `ExplicitLayout` per component, in the coordinates of the fused local tensor: on rank `r`, component
        `k`'s pieces are shifted along `dim` by the local sizes of components `0..k-1` on `r`.

    Example (q `(4, 2)` and k `(2, 2)`, both `S(0)` on ranks 0, 1: rank 1's local tensor is `[q[2:4]; k[1:2]]`):
        >>> q = Layout((4, 2), Mesh([0, 1]), [Shard(0)], name="q")
        >>> k = Layout((2, 2), Mesh([0, 1]), [Shard(0)], name="k")
        >>> fq, fk = fuse([q, k])
        >>> fk.pieces(1)[0].local_box, fk.local_shape(1)
        (Box[2:3, 0:2], (3, 2))
    """
    if not parts:
        raise ValueError("fuse: no parts")
    ranks = sorted(set().union(*[set(p.ranks) for p in parts]))
    pieces: list[dict[int, list[Piece]]] = [{} for _ in parts]
    local_shapes: dict[int, tuple[int, ...]] = {}
    for r in ranks:
        offset = 0
        fused_shape: list[int] | None = None
        for k, part in enumerate(parts):
            if r not in part.ranks:
                raise ValueError(f"fuse: rank {r} holds {_label(parts[0])} but not {_label(part)}; fused parts must "
                                 "share their ranks")
            ls = part.local_shape(r)
            if not 0 <= dim < len(ls):
                raise ValueError(f"fuse: dim {dim} out of range for {_label(part)} of local shape {ls}")
            if fused_shape is None:
                fused_shape = list(ls)
            elif [s for d, s in enumerate(ls) if d != dim] != [s for d, s in enumerate(fused_shape) if d != dim]:
                raise ValueError(
                    f"fuse: on rank {r}, {_label(part)} has local shape {ls}, which does not match {tuple(fused_shape)}"
                    f" outside dim {dim}"
                )
            shift = tuple(offset if d == dim else 0 for d in range(len(ls)))
            pieces[k][r] = [Piece(p.global_box, p.local_box.translate(shift), tensor=part.name)
                            for p in part.pieces(r)]
            offset += ls[dim]
        assert fused_shape is not None
        fused_shape[dim] = offset
        local_shapes[r] = tuple(fused_shape)
    return [
        ExplicitLayout(part.shape, part.dtype, pieces[k], local_shapes, name=part.name)
        for k, part in enumerate(parts)
    ]


def _label(layout: Layout | ExplicitLayout) -> str:
    return repr(layout.name) if layout.name else repr(layout)


def vocab_parallel_layout(
    vocab_size: int, hidden: int, tp_ranks: Sequence[int], *, dtype: torch.dtype = torch.bfloat16,
    pad_to: int = 64, name: str | None = None, replicas: Sequence[Sequence[int]] | None = None,
) -> ExplicitLayout:
    """vLLM's `VocabParallelEmbedding` / `ParallelLMHead` layout of a `(vocab_size, hidden)` weight.

    vLLM pads the vocabulary up to a multiple of `pad_to` and splits the padded rows evenly over the `tp` ranks:
    rank `i` holds padded rows `[i * per, (i + 1) * per)`, of which only those below `vocab_size` are real. Every
    local tensor has `per` rows; the padding rows are never written.

    Args:
        tp_ranks: the TP group, in TP order. With `replicas`, a list of TP groups (one per engine replica).
    """
    groups = [list(g) for g in replicas] if replicas is not None else [list(tp_ranks)]
    tp = len(groups[0])
    padded = -(-vocab_size // pad_to) * pad_to
    per = -(-padded // tp)
    pieces: dict[int, list[Piece]] = {}
    shapes: dict[int, tuple[int, int]] = {}
    for group in groups:
        if len(group) != tp:
            raise ValueError(f"vocab_parallel_layout: replica groups of different sizes {[len(g) for g in groups]}")
        for i, r in enumerate(group):
            lo, hi = min(i * per, vocab_size), min((i + 1) * per, vocab_size)
            pieces[r] = [Piece(Box((lo, 0), (hi - lo, hidden)), Box((0, 0), (hi - lo, hidden)), tensor=name)]
            shapes[r] = (per, hidden)
    return ExplicitLayout((vocab_size, hidden), dtype, pieces, shapes, name=name)
