"""The plan's input: one global tensor to move (`PlanItem`), and the checks of an item against its layouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reshard.planner import _checks

__all__ = ["PlanItem"]


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One global tensor to move: its source and destination layouts and the local tensors they live in.

    Attributes:
        src, dst: layouts of the same global shape (anything with `shape`, `dtype`, `ranks`, `pieces(rank)`,
            `local_shape(rank)` and `key`, such as `Layout`).
        src_tensor, dst_tensor: index of the local tensor the pieces live in, on the source and destination side.
        name: the tensor's name for messages.
        precision: `"same"` (source and destination dtypes must match) or `"cast"` (values are cast to the
            destination dtype while packing, bit-exact to torch's `.to()`; the wire carries the destination dtype).
    """

    src: Any
    dst: Any
    src_tensor: int = 0
    dst_tensor: int = 0
    name: str | None = None
    precision: str = "same"

    def __post_init__(self) -> None:
        _checks.check_item_fields(self)

    @property
    def label(self) -> str:
        return self.name or getattr(self.dst, "name", None) or getattr(self.src, "name", None) or "tensor"

    @property
    def key(self) -> tuple:
        return (self.src.key, self.dst.key, self.src_tensor, self.dst_tensor, self.name, self.precision)

    @property
    def casts(self) -> bool:
        """Whether stage-0 boxes are cast from the source dtype to the destination dtype while packing."""
        return self.src.dtype != self.dst.dtype


def _check_item(item: PlanItem, index: int) -> None:
    src, dst = item.src, item.dst
    who = f"tensor {item.label!r} (item {index})"
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"{who}: global shapes differ: source {tuple(src.shape)}, destination {tuple(dst.shape)} (expected equal)"
        )
    if item.precision not in ("same", "cast"):
        raise ValueError(f"{who}: precision must be 'same' or 'cast', got {item.precision!r}")
    if src.dtype != dst.dtype and item.precision != "cast":
        raise ValueError(f"{who}: dtypes differ: source {src.dtype}, destination {dst.dtype} (expected equal, or "
                         "precision='cast' to cast while packing)")
    if item.precision == "cast" and not (src.dtype.is_floating_point and dst.dtype.is_floating_point):
        raise ValueError(f"{who}: precision='cast' needs floating-point dtypes, got {src.dtype} -> {dst.dtype}")
