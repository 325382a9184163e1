"""The layouts a refit registers, and the checks of a registration: a local tensor against its layout, an FP8
weight's scale tensor, alias lists (as given, and as a peer sent them), a local tensor's geometry against the one
the plan was built for (`changed`: see `reshard.refit._live`).

Layouts travel between ranks as `reshard.planner._wire` encodes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reshard.planner import DEFAULT_BLOCK as BLOCK
from reshard.planner import FP8, LayoutLike, scale_layout

Geometry = tuple[tuple[int, ...], torch.dtype, torch.device]


def geometry(t: torch.Tensor) -> Geometry:
    """What a plan fixes about a local tensor: its shape, dtype and device."""
    return tuple(t.shape), t.dtype, t.device


def changed(kind: str, name: str, rank: int, old: Geometry, new: Geometry) -> str | None:
    """The error for a registered tensor whose geometry differs from the plan's, or None when it does not."""
    diffs = [f"{what} {o} -> {n}" for what, o, n in zip(("local shape", "dtype", "device"), old, new) if o != n]
    if not diffs:
        return None
    return (f"{kind} {name!r} on rank {rank} changed since the plan was built: {', '.join(diffs)}; a refit's "
            "tensors keep their layout (build a new Refit for the new one)")


def check_local(name: str, tensor: Any, layout: LayoutLike, rank: int) -> str | None:
    """Why `tensor` cannot be `rank`'s local tensor of `layout`, or None when it can."""
    if not isinstance(tensor, torch.Tensor):
        return f"tensor {name!r} on rank {rank}: expected a torch.Tensor, got {type(tensor).__name__}"
    expected = tuple(layout.local_shape(rank))
    if tuple(tensor.shape) != expected:
        return (f"tensor {name!r} on rank {rank}: local shape {tuple(tensor.shape)} does not match its layout, "
                f"expected {expected}")
    if tensor.dtype != layout.dtype:
        return f"tensor {name!r} on rank {rank}: dtype {tensor.dtype}, its layout says {layout.dtype}"
    return None


@dataclass(frozen=True)
class Dest:
    """A destination local tensor: its components (global tensor name -> layout in this local tensor's coords)."""

    name: str
    components: tuple[tuple[str, LayoutLike], ...]


def aliases_ok(aliases: Any) -> bool:
    """A peer's `aliases` field is `{"sources": {name: [alias, ...]}, "dests": {...}}` of strings."""
    return (isinstance(aliases, dict) and set(aliases) == {"sources", "dests"}
            and all(isinstance(side, dict) and all(isinstance(n, str) and isinstance(a, list)
                                                    and all(isinstance(x, str) for x in a) for n, a in side.items())
                    for side in aliases.values()))


def check_scale(name: str, d: Dest, scale: torch.Tensor | None, rank: int) -> list[str]:
    """Errors of this rank's scale tensor for destination `name` (FP8 block weights need one, others none)."""
    lay = d.components[0][1]
    if lay.dtype != FP8:
        if scale is not None:
            return [f"destination {name!r} on rank {rank}: a scale tensor was given, but the weight's dtype is "
                    f"{lay.dtype}, not float8_e4m3fn"]
        return []
    if len(d.components) > 1:
        return [f"destination {name!r}: fused FP8 block-quantized tensors are not supported; register each global "
                "tensor on its own"]
    if scale is None:
        return [f"destination {name!r} on rank {rank}: FP8 weight registered without its scale tensor "
                "(weight_scale_inv); pass scale=..."]
    expected = tuple(scale_layout(lay, BLOCK).local_shape(rank))
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        return [f"destination {name!r} on rank {rank}: scale tensor of shape {tuple(scale.shape)} and dtype "
                f"{scale.dtype}, expected {expected} and torch.float32 (one scale per 128x128 block the shard "
                "touches)"]
    return []


def alias_names(what: str, name: str, aliases: Any) -> tuple[str, ...]:
    """`aliases` of `name` as given to `Refit.<what>`, checked (a list of names), less `name` itself."""
    if isinstance(aliases, str) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError(f"Refit.{what}: {name!r}: aliases must be a list of names, got {aliases!r}")
    return tuple(a for a in aliases if a != name)
