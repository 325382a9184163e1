"""Every kernel variant the CUDA launchers pick compiles for Hopper and Blackwell, and the bulk ones do not spill.

`reshard.kernels._variants.kernel_variants()` enumerates the specializations from the launchers' own choices; each
is compiled with `triton.compile` for `GPUTarget("cuda", sm, 32)` on this CPU (Triton's wheel ships ptxas), and
ptxas `-v` gives its registers and spills. The interpreter accepts code the compiler rejects, and register pressure
only shows compiled, so this is the CPU-only check of the compiled path (`perf/bench_compile.py` writes the whole
table). Run under the core environment's Triton and, in the compatibility tier (`make test-compat`), the oldest
supported one, whose compiler needs more registers for the same kernels.

Cost: the bulk set on two targets plus a sample of the rest, 2 to 4 minutes on the 2-core VM with an empty Triton
cache, under 30 s with a warm one (slow): the bulk
variants (aligned 16-byte copies and bf16 <-> fp32 casts at 1-4 dims, bf16 deltas, FP8 128x128) on sm_90 and
sm_100; every other variant at 4 dims (its largest) on sm_90, where a compile error would show.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from reshard.kernels import _variants  # noqa: E402
from reshard.kernels._delta_launch import delta_launch_config  # noqa: E402
from reshard.kernels._tiles import launch_config, max_vec  # noqa: E402

pytestmark = pytest.mark.slow  # 2 to 4 minutes with an empty Triton cache (module docstring)


def _compile(variant: _variants.Variant, sm: int) -> _variants.Compiled:
    try:
        return _variants.compile_variant(variant, sm)
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas in this Triton build
        if "ptxas" in str(e).lower():
            pytest.skip(f"cannot compile for CUDA here: {e}")
        raise


def test_enumeration_follows_the_launchers() -> None:
    # the table is built from the launchers' choices, so it has the BLOCKs, warps and VEC caps they pick
    variants = _variants.kernel_variants()
    labels = [v.label for v in variants]
    assert len(labels) == len(set(labels)), "each variant once"
    for v in variants:
        if v.family == "pack" and v.constexprs["CAST"] == 0:
            word = int(v.signature["tensor_ptr"][2:]) // 8
            assert (v.constexprs["BLOCK"], v.num_warps) == launch_config(word, "cuda", vec=v.constexprs["VEC"]), \
                v.label
            assert v.constexprs["VEC"] <= max_vec(word, word), v.label
        if v.family == "delta":
            assert (v.constexprs["BLOCK"], v.num_warps) == delta_launch_config(2, "cuda"), v.label
    kernels = {v.name for v in variants}
    assert kernels == {"_pack_kernel", "_unpack_kernel", "_delta_count_kernel", "_delta_compact_kernel",
                       "_delta_bits_kernel", "_delta_scatter_kernel", "_quant_block_kernel"}
    bulk = [v for v in variants if v.bulk]
    # aligned 16-byte raw copies (4 words) and 2 bf16 <-> fp32 casts, both ops, 4 dims; bf16 delta count, compact
    # (with and without UPDATE), scatter and bits at 4 dims; FP8 128x128 from 3 input dtypes
    assert len(bulk) == 2 * (4 + 2) * 4 + 5 * 4 + 3, len(bulk)


@pytest.mark.parametrize("sm", [90, 100])
def test_bulk_variants_do_not_spill(sm: int) -> None:
    spilled = []
    for v in _variants.kernel_variants():
        if v.bulk:
            figures = _compile(v, sm)
            if figures.spill_stores or figures.spill_loads or figures.stack_bytes:
                spilled.append(f"{v.label}: {figures}")
    assert not spilled, f"sm_{sm}: bulk variants spill:\n" + "\n".join(spilled)


def test_other_variants_compile() -> None:
    # every non-bulk variant at its largest NUM_DIMS (the others differ only by fewer unrolled dims), on sm_90
    others = [v for v in _variants.kernel_variants() if not v.bulk and v.constexprs.get("NUM_DIMS", 4) == 4]
    assert len(others) > 20
    for v in others:
        figures = _compile(v, 90)
        assert figures.registers > 0, v.label
