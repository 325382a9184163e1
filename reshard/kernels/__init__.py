"""Pack strided boxes of many tensors into one contiguous byte buffer, and unpack them: the data path of a reshard.

Exports:
    pack, unpack: one Triton launch per call over a descriptor table (CUDA tensors, or CPU tensors under Triton's
        interpreter), or the torch path (CPU tensors); optional float32 <-> bfloat16 / float16 cast, bit-exact with
        torch's `.to()`.
    prepare_pack, prepare_unpack, PreparedCopy: the same, checked and planned once (descriptor tables uploaded, views
        made) and run many times; what a refit that repeats one plan uses.
    pack_reference, unpack_reference: the pure-torch versions, same signatures; the CPU production path and the
        oracle of the tests.
    packed_nbytes, packed_offsets: buffer sizes and offsets for a list of boxes.
    Box: the box type the functions take (`reshard.planner.Box`, re-exported).
    launch_config: the kernels' block size and warp count.
    kernel_variants, compile_variant: every specialization the CUDA launchers can pick, and one compiled for a GPU
        target with `triton.compile` (no GPU needed), with its register and spill figures.
    checksum, CHECKSUM_STEP: a 64-bit position-sensitive, non-linear hash of a tensor's bytes in row-major order
        (the check of `verify=True`), the same bits on CPU and CUDA, computed in slices of `CHECKSUM_STEP` bytes;
        `cpu_checksum`: the same bits as a Python int, computed with numpy on CPU (about 5 times faster).
    quantize_fp8_block, quantize_fp8_block_reference: DeepSeek-V3 style blockwise FP8: `[..., M, N]` float32 /
        bfloat16 / float16 -> float8_e4m3fn `q` and one float32 `scale_inv` (amax / 448) per 128 x 128 block; one
        Triton launch per call, or the pure-torch reference (the CPU path), bit for bit the same.
    dequantize_fp8_block: `q.float() * scale_inv` over the blocks.
    count_changed, scan_changes, delta_encode, delta_decode (and their `_reference` torch versions), ChangeScan:
        delta encoding of boxes against a snapshot (a pack buffer of what was last sent): count (and locate) the
        elements whose bits changed, encode
        them per box as DENSE, BITMASK + values or INDICES + values behind a self-describing header
        (`DeltaHeader`, with versions), and scatter them into destination boxes; `read_delta_headers` (the headers
        of a received buffer); `delta_encode_dense` (DENSE boxes without a snapshot).
    delta_nbytes, delta_max_nbytes, delta_offsets, choose_delta_format: exact encoded sizes from changed counts,
        the worst case, buffer offsets and the per-box format choice.
    DeltaFormat, DeltaHeader, DeltaVersionError, DELTA_DENSE_FRACTION: the formats, the header, the error a stale
        destination raises and the default dense fallback fraction.
    block_aligned, scale_box: whether a box of a weight covers whole blocks (then it quantizes to its own slice of
        the full quantization), and the box of `scale_inv` that a box of the weight touches (the planner's block
        geometry, re-exported).
"""

from reshard.kernels._checksum import CHECKSUM_STEP, checksum
from reshard.kernels._checksum_numpy import cpu_checksum
from reshard.kernels._delta import (
    count_changed,
    delta_decode,
    delta_encode,
    delta_encode_dense,
    scan_changes,
)
from reshard.kernels._delta_format import (
    DELTA_DENSE_FRACTION,
    ChangeScan,
    DeltaFormat,
    DeltaHeader,
    DeltaVersionError,
    choose_delta_format,
    delta_max_nbytes,
    delta_nbytes,
    delta_offsets,
    read_delta_headers,
)
from reshard.kernels._delta_reference import (
    count_changed_reference,
    delta_decode_reference,
    delta_encode_reference,
    scan_changes_reference,
)
from reshard.kernels._pack import (
    PreparedCopy,
    pack,
    pack_reference,
    prepare_pack,
    prepare_unpack,
    unpack,
    unpack_reference,
)
from reshard.kernels._quant import dequantize_fp8_block, quantize_fp8_block, quantize_fp8_block_reference
from reshard.kernels._spec import packed_nbytes, packed_offsets
from reshard.kernels._tiles import launch_config
from reshard.kernels._variants import compile_variant, kernel_variants
from reshard.planner import Box, block_aligned, scale_box

__all__ = [
    "CHECKSUM_STEP",
    "DELTA_DENSE_FRACTION",
    "Box",
    "ChangeScan",
    "DeltaFormat",
    "DeltaHeader",
    "DeltaVersionError",
    "PreparedCopy",
    "block_aligned",
    "checksum",
    "choose_delta_format",
    "compile_variant",
    "count_changed",
    "count_changed_reference",
    "cpu_checksum",
    "delta_decode",
    "delta_decode_reference",
    "delta_encode",
    "delta_encode_dense",
    "delta_encode_reference",
    "delta_max_nbytes",
    "delta_nbytes",
    "delta_offsets",
    "dequantize_fp8_block",
    "kernel_variants",
    "launch_config",
    "pack",
    "pack_reference",
    "packed_nbytes",
    "packed_offsets",
    "prepare_pack",
    "prepare_unpack",
    "quantize_fp8_block",
    "quantize_fp8_block_reference",
    "read_delta_headers",
    "scale_box",
    "scan_changes",
    "scan_changes_reference",
    "unpack",
    "unpack_reference",
]
