"""The replica check: copies of a trainer weight that its layout says are equal are compared before sending.

A layout with a `Replicate()` axis (or merged sub-mesh copies) says several ranks hold the same box. The plan
reads each box from one of them, while `full_tensor()` on the trainer would read another: when the copies differ
(a norm whose gradient was not all-reduced over TP), the engine silently gets a different model. With
`Refit(check_replicas=True)` every source rank hashes each box it holds, the digests are exchanged, and any two
holders of the same box that disagree raise a `ValueError` on every rank, naming the weight, the box and the ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from reshard.planner import region_view
from reshard.refit._meta import LayoutLike


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()


def replica_digests(rank: int, layouts: Mapping[str, LayoutLike], locals_: Mapping[str, torch.Tensor]) -> list[list]:
    """`[name, box offsets, box shape, digest]` for every box of a replicated weight this rank holds (JSON values).

    Only weights with more than one copy of some box are hashed (`layout.regular` layouts: copies are whole boxes).
    """
    out: list[list] = []
    for name in sorted(locals_):
        lay = layouts.get(name)
        if lay is None or rank not in lay.ranks or not _replicated(lay):
            continue
        t = locals_[name]
        for p in lay.pieces(rank):
            digest = _digest(region_view(t, p.local_box))
            out.append([name, list(p.global_box.offsets), list(p.global_box.shape), digest])
    return out


def _replicated(lay: LayoutLike) -> bool:
    boxes = [p.global_box for r in lay.ranks for p in lay.pieces(r)]
    return len(set(boxes)) < len(boxes)


def replica_errors(gathered: Sequence[tuple[int, Sequence[Sequence]]]) -> list[str]:
    """Errors for boxes whose copies differ, from every rank's `(rank, replica_digests(...))`."""
    seen: dict[tuple, dict[str, list[int]]] = {}
    for rank, digests in sorted(gathered, key=lambda x: x[0]):
        for name, offsets, shape, d in digests:
            seen.setdefault((name, tuple(offsets), tuple(shape)), {}).setdefault(d, []).append(rank)
    errors = []
    for (name, offsets, shape), by_digest in seen.items():
        if len(by_digest) > 1:
            groups = sorted(by_digest.values())
            box = ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, shape))
            errors.append(f"source {name!r}: copies that its layout says are equal differ in box [{box}]: "
                          + " vs ".join(f"ranks {g}" for g in groups)
                          + " (a replicated weight whose gradient was not reduced over the replicas?)")
    return errors
