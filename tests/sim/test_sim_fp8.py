"""The simulator's fp8_block refit: its network bytes against a closed form from the parameter list."""

from __future__ import annotations

import math

from reshard.models import PRESETS, param_specs
from reshard.sim import simulate
from reshard.sim._simulate import FP8_KINDS


def test_fp8_refit_bytes_match_closed_form() -> None:
    """Qwen3-0.6B, trainer TP2 x DP2 -> inference TP2 x 2 in one 4-GPU domain: every trainer shard is
    block-aligned, so the domain imports each linear weight once in FP8 (1 byte per element) plus one float32
    scale per 128 x 128 block, and everything else once in bfloat16."""
    r = simulate("qwen3-0.6b", "train=tp2,dp2 gen=tp2,dp2 domain=4", "h100", direct=False, fp8=True)
    expected = 0
    for s in param_specs(PRESETS["qwen3-0.6b"]):
        n = math.prod(s.shape)
        if s.kind in FP8_KINDS:
            expected += n + 4 * math.ceil(s.shape[-2] / 128) * math.ceil(s.shape[-1] / 128)
        else:
            expected += n * s.dtype.itemsize
    fp8 = r.method("reshard fp8_block")
    assert fp8.network_bytes == expected
    assert fp8.network_bytes < r.method("reshard").network_bytes
    assert 0 < fp8.seconds < r.method("reshard").seconds
