"""Bytes each inference rank receives in one refit: its own share (reshard: each rank exactly what its layout
holds), against a whole-expert sender (vLLM `nccl_m2n`'s rule for MoE weights: every routed expert whole to every
rank; counted here with everything else as the rank's own share, so it is a lower bound on that rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from reshard.sim._layouts import WeightLayouts


def engine_bytes(layouts: Sequence[WeightLayouts], ranks: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Per inference rank in `ranks`: `(own, whole_expert)` bytes.

    Args:
        layouts: `model_layouts(config, system)` of one model and system.
        ranks: the inference ranks to count (`system.gen_ranks`).

    Returns:
        rank -> (the bytes its inference layouts hold: what reshard sends it, each byte once; the bytes a sender
        that ships every routed expert tensor whole to every rank, and the rest as the rank holds it, sends it).
    """
    out = {r: [0, 0] for r in ranks}
    for w in layouts:
        size = w.spec.dtype.itemsize
        held = set(w.gen.ranks)
        for r in ranks:
            own = sum(math.prod(p.global_box.shape) for p in w.gen.pieces(r)) * size if r in held else 0
            out[r][0] += own
            out[r][1] += w.spec.nbytes if w.spec.is_expert else own
    return {r: (a, b) for r, (a, b) in out.items()}
