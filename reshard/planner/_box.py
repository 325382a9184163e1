"""The n-D half-open box: the one region type of the planner.

A `Box` is `[offsets[d], offsets[d] + shape[d])` along every dim `d` of some tensor. The same type names a region
of a global tensor (a piece's `global_box`) and a region of a rank's local tensor (`local_box`); which one is
always said by the attribute that holds it.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass


def _as_int(value: object, what: str) -> int:
    """`value` as an int; a `TypeError` naming `what` for anything else, `bool` included (`True` is not a size)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})") from None


def _as_int_tuple(values: object, name: str) -> tuple[int, ...]:
    try:
        items = tuple(values)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"Box: {name} must be a sequence of integers, got {values!r}") from None
    out = tuple(_as_int(v, f"Box: {name} {values!r}: each entry") for v in items)
    if any(v < 0 for v in out):
        raise ValueError(f"Box: {name} must be >= 0, got {out}")
    return out


@dataclass(frozen=True, slots=True)
class Box:
    """An n-D half-open index box.

    Args:
        offsets: start index per dim, each `>= 0`.
        shape: extent per dim, each `>= 0`. A 0-D box (`offsets == shape == ()`) holds one element (a scalar).

    Example:
        >>> Box((2, 0), (3, 4)).stops
        (5, 4)
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets = _as_int_tuple(self.offsets, "offsets")
        shape = _as_int_tuple(self.shape, "shape")
        if len(offsets) != len(shape):
            raise ValueError(f"Box: offsets {offsets} and shape {shape} must have the same length")
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "shape", shape)

    @classmethod
    def _make(cls, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Box:
        """Build without validation: for the planner's inner loops, whose values are already checked ints."""
        box = object.__new__(cls)
        object.__setattr__(box, "offsets", offsets)
        object.__setattr__(box, "shape", shape)
        return box

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    @property
    def empty(self) -> bool:
        return any(s == 0 for s in self.shape)

    def slices(self) -> tuple[slice, ...]:
        """Index with these to read the box from a tensor: `t[box.slices()]`."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + t <= a + s for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape)
        )

    def translate(self, delta: tuple[int, ...]) -> Box:
        """The same box moved by `delta` (which may be negative per dim, as long as the result is not)."""
        return Box(tuple(o + d for o, d in zip(self.offsets, delta)), self.shape)

    def __repr__(self) -> str:
        inner = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.shape))
        return f"Box[{inner}]"


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of the same rank, or `None` when it is empty.

    Example:
        >>> intersect(Box((0, 0), (4, 4)), Box((2, 3), (4, 4)))
        Box[2:4, 3:4]
    """
    # the planner's hottest function: plain index loops, no generators
    ao, ash, bo, bsh = a.offsets, a.shape, b.offsets, b.shape
    offsets = []
    shape = []
    for i in range(len(ao)):
        x, y = ao[i], bo[i]
        hi = x + ash[i]
        bhi = y + bsh[i]
        if bhi < hi:
            hi = bhi
        lo = x if x > y else y
        if hi <= lo:
            return None
        offsets.append(lo)
        shape.append(hi - lo)
    return Box._make(tuple(offsets), tuple(shape))


def subtract(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as a list of disjoint boxes (at most `2 * ndim`), in a fixed order.

    The split functions below build their results with `Box._make`: every value comes from boxes already checked.

    The cut peels slabs off `a` dim by dim, outermost first, so the result is deterministic.

    Example:
        >>> subtract(Box((0,), (10,)), Box((3,), (4,)))
        [Box[0:3], Box[7:10]]
    """
    inter = intersect(a, b)
    if inter is None:
        return [a]
    out: list[Box] = []
    offsets = list(a.offsets)
    shape = list(a.shape)
    for d in range(a.ndim):
        lo, hi = inter.offsets[d], inter.offsets[d] + inter.shape[d]
        if lo > offsets[d]:
            s = list(shape)
            s[d] = lo - offsets[d]
            out.append(Box._make(tuple(offsets), tuple(s)))
        if hi < offsets[d] + shape[d]:
            o = list(offsets)
            s = list(shape)
            o[d] = hi
            s[d] = offsets[d] + shape[d] - hi
            out.append(Box._make(tuple(o), tuple(s)))
        offsets[d] = lo
        shape[d] = hi - lo
    return out


def split_box(box: Box, num_parts: int) -> list[Box]:
    """Split `box` into at most `num_parts` near-equal, non-empty slabs along its outermost dim of extent > 1.

    Slabs along the outermost dim keep each part contiguous in a row-major tensor.

    Example:
        >>> split_box(Box((0, 0), (5, 2)), 2)
        [Box[0:3, 0:2], Box[3:5, 0:2]]
    """
    if num_parts <= 1 or box.numel <= 1:
        return [box]
    for d, extent in enumerate(box.shape):
        if extent > 1:
            break
    parts = min(num_parts, box.shape[d])
    step, rem = divmod(box.shape[d], parts)
    out: list[Box] = []
    start = box.offsets[d]
    for i in range(parts):
        n = step + (1 if i < rem else 0)
        o = list(box.offsets)
        s = list(box.shape)
        o[d] = start
        s[d] = n
        out.append(Box._make(tuple(o), tuple(s)))
        start += n
    return out


def split_to_fit(box: Box, max_numel: int) -> list[Box]:
    """Split `box` into row-major-ordered boxes of at most `max_numel` elements each (`max_numel >= 1`).

    The outermost dim is cut first; a dim is cut only when one slab of the dims inside it is already too big.

    Example:
        >>> split_to_fit(Box((0, 0), (3, 4)), 8)
        [Box[0:2, 0:4], Box[2:3, 0:4]]
    """
    if box.numel <= max_numel:
        return [box]
    inner = 1
    # find the outermost dim d such that one slice along d (the product of dims after d) fits
    d = box.ndim - 1
    inner_sizes = [1] * box.ndim
    for k in range(box.ndim - 1, -1, -1):
        inner_sizes[k] = inner
        inner *= box.shape[k]
    for k in range(box.ndim):
        if inner_sizes[k] <= max_numel:
            d = k
            break
    rows = max(1, max_numel // inner_sizes[d])
    out: list[Box] = []
    # iterate over every index of dims before d (each is cut to extent 1), then cut d in `rows` steps
    outer_shape = box.shape[:d]
    outer_count = 1
    for s in outer_shape:
        outer_count *= s
    for flat in range(outer_count):
        idx = []
        rem = flat
        for s in reversed(outer_shape):
            idx.append(rem % s)
            rem //= s
        idx.reverse()
        for start in range(0, box.shape[d], rows):
            n = min(rows, box.shape[d] - start)
            o = [box.offsets[k] + idx[k] for k in range(d)] + [box.offsets[d] + start] + list(box.offsets[d + 1 :])
            s = [1] * d + [n] + list(box.shape[d + 1 :])
            out.append(Box._make(tuple(o), tuple(s)))
    return out
