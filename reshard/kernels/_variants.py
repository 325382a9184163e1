"""Every compiled specialization the CUDA launchers can pick, for compiling them ahead of time (no GPU needed).

A launch on CUDA compiles one variant per distinct set of constexprs, element types and `num_warps`. These come
from the launchers' own choices: `_tiles.launch_config` (BLOCK and warps per word size), `_tiles.max_vec` (the
widest VEC per word size), the raw copy's word sizes (`_pack.WORD_BYTES`), the fused casts (`_cast.Cast` and
their bit widths), `_delta_launch.delta_launch_config` for the delta kernels, and `_quant._launch_config` per
FP8 block. `kernel_variants()` lists them; `compile_variant` compiles one for a `GPUTarget` and reads its
registers and spills from ptxas. `perf/bench_compile.py` writes the table, `tests/kernels/test_kernels_compile.py` checks
it.

Dims: after `merge_dims` a box has as many dims as its tensor has non-mergeable ones (plus the byte dim of a raw
copy); 1 to `MAX_COMPILED_DIMS` cover the boxes of weights up to 3 dims (and raw copies of them). A variant with
more dims differs only by one more unrolled divide per element.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

from reshard.kernels import _delta_launch, _pack, _quant
from reshard.kernels._cast import GEOMETRY_BITS, Cast
from reshard.kernels._delta_launch import delta_launch_config
from reshard.kernels._pack import WORD_BYTES
from reshard.kernels._tiles import launch_config, max_vec

MAX_COMPILED_DIMS = 4
"""The largest NUM_DIMS enumerated (see the module docstring)."""

QUANT_BLOCKS: tuple[tuple[int, int], ...] = ((128, 128), (64, 64), (1, 128))
"""FP8 blocks enumerated: the default `(128, 128)` of DeepSeek-V3 / Qwen3 FP8 checkpoints, a smaller square one and
per-token groups of 128."""

_PACK_INTS = ["num_boxes", "num_search_steps", "nan_sign_mask", "nan_base", "nan_payload_mask"]
_ALIGNED = {(k,): [["tt.divisibility", 16]] for k in range(4)}  # the pointers torch allocates: 16-byte aligned


@dataclass(frozen=True)
class Variant:
    """One compiled specialization: kernel `name` in `family` (`pack`, `delta`, `quant`), its argument types
    (`signature`, Triton's notation), constexprs and warps; `bulk` marks those that carry the bulk of a refit (aligned
    bf16/fp32 copies and casts, bf16 deltas, FP8 128x128 quantization: the ones that must not spill); `label` says
    the choice in words (word or dtypes, VEC, dims, block)."""

    family: str
    name: str
    label: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    bulk: bool
    attrs: dict = field(default_factory=dict)


def _int_ty(num_bytes: int) -> str:
    """Triton's name of the `num_bytes`-byte signed int (`i8` .. `i64`)."""
    return f"i{8 * num_bytes}"


def _pack_variants() -> list[Variant]:

    out = []
    for op in ("pack", "unpack"):
        name = f"_{op}_kernel"
        choices = []  # (tensor type, buffer type, CAST, BUFFER_BYTES, unit for BLOCK, vec cap, what, bulk-able)
        for word in WORD_BYTES:
            choices.append((_int_ty(word), _int_ty(word), Cast.NONE, 0, word, max_vec(word, word), f"word {word}",
                            True))
        for cast in Cast:
            if cast == Cast.NONE:
                continue
            src, dst = (b // 8 for b in GEOMETRY_BITS[cast])
            tensor, buffer = (src, dst) if op == "pack" else (dst, src)
            bf16_f32 = cast in (Cast.F32_TO_BF16, Cast.BF16_TO_F32)
            choices.append((_int_ty(tensor), _int_ty(buffer), cast, 0, max(tensor, buffer), max_vec(tensor, buffer),
                            cast.name, bf16_f32))
            choices.append((_int_ty(tensor), "u8", cast, buffer, max(tensor, buffer), 1, f"{cast.name} unaligned",
                            False))
        for tensor_ty, buffer_ty, cast, nbytes, unit, cap, what, bulk_able in choices:
            vec = 1
            while vec <= cap:
                block, warps = launch_config(unit, "cuda", vec=vec, cast=cast)
                for dims in range(1, MAX_COMPILED_DIMS + 1):
                    constexprs = {"NUM_DIMS": dims, "CAST": int(cast), "BUFFER_BYTES": nbytes, "VEC": vec,
                                  "BLOCK": block}
                    signature = {"tensor_ptr": f"*{tensor_ty}", "buffer_ptr": f"*{buffer_ty}", "starts_ptr": "*i64",
                                 "table_ptr": "*i64", **dict.fromkeys(_PACK_INTS, "i32"),
                                 **dict.fromkeys(constexprs, "constexpr")}
                    # the bulk: aligned rows move 16 bytes a lane group (VEC at its cap)
                    out.append(Variant("pack", name, f"{op} {what} VEC {vec} dims {dims} BLOCK {block}", signature,
                                       constexprs, warps, bulk_able and vec == cap and cap > 1, _ALIGNED))
                vec *= 2
    return out


def _delta_variants() -> list[Variant]:

    out = []
    bits_seen: set[tuple[int, int, int]] = set()
    for word in WORD_BYTES:
        elem = f"*{_int_ty(word)}"
        block, warps = delta_launch_config(word, "cuda")
        dec_block, dec_warps = block, warps
        for dims in range(1, MAX_COMPILED_DIMS + 1):
            tile = ["tensor_ptr", "snap_ptr", "starts_ptr", "table_ptr"]
            kernels = [
                ("_delta_count_kernel", tile + ["tile_counts_ptr"], {}, block, warps),
                ("_delta_compact_kernel", tile + ["tile_base_ptr", "out_table_ptr", "values_ptr", "words_ptr"],
                 {"UPDATE": True}, block, warps),
                ("_delta_compact_kernel", tile + ["tile_base_ptr", "out_table_ptr", "values_ptr", "words_ptr"],
                 {"UPDATE": False}, block, warps),
                ("_delta_scatter_kernel", ["tensor_ptr", "table_ptr", "block_box_ptr", "block_first_ptr",
                                           "block_base_ptr", "values_ptr", "words_ptr"], {}, dec_block, dec_warps),
            ]
            if (dims, dec_block, dec_warps) not in bits_seen:  # no element pointer: one variant per BLOCK
                bits_seen.add((dims, dec_block, dec_warps))
                kernels.append(("_delta_bits_kernel", ["table_ptr", "block_box_ptr", "block_first_ptr", "words_ptr",
                                                       "block_counts_ptr"], {}, dec_block, dec_warps))
            bf16_config = delta_launch_config(2, "cuda")
            for name, args, extra, blk, nw in kernels:
                ptr = {"tensor_ptr": elem, "snap_ptr": elem, "values_ptr": elem, "words_ptr": "*i32",
                       "tile_counts_ptr": "*i32", "block_counts_ptr": "*i32"}
                constexprs = {"NUM_DIMS": dims, **extra, "BLOCK": blk}
                signature = {a: ptr.get(a, "*i64") for a in args}
                signature.update(dict.fromkeys(["num_boxes", "num_search_steps"] if "starts_ptr" in args else [],
                                               "i32"))
                signature.update(dict.fromkeys(constexprs, "constexpr"))
                what = " UPDATE" if extra.get("UPDATE") else ""
                out.append(Variant("delta", name, f"{name[7:-7]}{what} word {word} dims {dims} BLOCK {blk}",
                                   signature, constexprs, nw,
                                   word == 2 or (name == "_delta_bits_kernel" and (blk, nw) == bf16_config)))
    return out


def _quant_variants() -> list[Variant]:

    ints = [f"stride_{t}{d}" for t in "xqs" for d in "bmn"] + ["M", "N", "num_block_rows", "num_block_cols"]
    out = []
    for block in QUANT_BLOCKS:
        tile_m, tile_n, warps = _quant._launch_config(block, "cuda")
        for x_ty, in_bits, bf16, what in [("*i32", 32, False, "fp32"), ("*i16", 16, True, "bf16"),
                                          ("*i16", 16, False, "fp16")]:
            constexprs = {"IN_BITS": in_bits, "IN_BF16": bf16, "BLOCK_M": block[0], "BLOCK_N": block[1],
                          "TILE_M": tile_m, "TILE_N": tile_n, "NUM_TILES": -(-block[0] // tile_m)}
            signature = {"x_ptr": x_ty, "q_ptr": "*u8", "s_ptr": "*fp32", **dict.fromkeys(ints, "i64"),
                         **dict.fromkeys(constexprs, "constexpr")}
            out.append(Variant("quant", "_quant_block_kernel", f"quant {what} block {block[0]}x{block[1]} tile "
                               f"{tile_m}x{tile_n}", signature, constexprs, warps, block == (128, 128)))
    return out


def kernel_variants() -> list[Variant]:
    """Every specialization the CUDA launchers can pick (dims up to `MAX_COMPILED_DIMS`, blocks `QUANT_BLOCKS`)."""
    return _pack_variants() + _delta_variants() + _quant_variants()


def _kernel(variant: Variant):
    """The compiled-mode `@triton.jit` function of `variant`."""
    if variant.family == "pack":
        return getattr(_pack._kernels(interpret=False), variant.name)
    if variant.family == "delta":
        return getattr(_delta_launch._device_code(interpret=False), variant.name)
    return getattr(_quant._device_code(interpret=False), variant.name)


@dataclass(frozen=True)
class Compiled:
    """ptxas's figures for one variant on one target: registers per thread, spill stores and loads (bytes), and the
    stack frame (bytes per thread)."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


def compile_variant(variant: Variant, capability: int) -> Compiled:
    """Compile `variant` with `triton.compile` for `GPUTarget("cuda", capability, 32)` (no GPU needed: Triton's
    wheel ships ptxas), then run that ptxas with `-v` on its PTX for the register and spill figures.

    Raises whatever Triton raises for a kernel it cannot compile.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=_kernel(variant), signature=variant.signature, constexprs=variant.constexprs,
                    attrs=variant.attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": variant.num_warps, "enable_fp_fusion": False})
    return _ptxas_figures(compiled.asm["ptx"], capability)


def ptxas_path(capability: int) -> str:
    """The ptxas Triton compiles with for `capability` (its wheel's own, unless `TRITON_PTXAS_PATH` names another);
    the lookup's name and signature differ across Triton releases."""
    from triton.backends.nvidia import compiler

    get = getattr(compiler, "get_ptxas", None)
    if get is None:
        found = compiler._path_to_binary("ptxas")
    else:
        try:
            found = get(capability)
        except TypeError:
            found = get()
    return found.path if hasattr(found, "path") else found[0]


def _ptxas_figures(ptx: str, capability: int) -> Compiled:
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        command = [ptxas_path(capability), "-v", f"--gpu-name={arch}", path, "-o", os.path.join(tmp, "k.cubin")]
        run = subprocess.run(command, capture_output=True, text=True, check=True)
    log = run.stdout + run.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    if registers is None or spills is None or stack is None:
        raise RuntimeError(f"unexpected ptxas -v output: {log[-2000:]}")
    return Compiled(int(registers[1]), int(spills[1]), int(spills[2]), int(stack[1]))
