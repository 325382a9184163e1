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
    BACKEND_ENV: the environment variable (`RESHARD_KERNEL_BACKEND`) that overrides `backend=None`.
    launch_config: the kernels' block size and warp count.
"""

from reshard.kernels._pack import (
    BACKEND_ENV,
    PreparedCopy,
    launch_config,
    pack,
    pack_reference,
    prepare_pack,
    prepare_unpack,
    unpack,
    unpack_reference,
)
from reshard.kernels._spec import packed_nbytes, packed_offsets

__all__ = [
    "BACKEND_ENV",
    "PreparedCopy",
    "launch_config",
    "pack",
    "pack_reference",
    "packed_nbytes",
    "packed_offsets",
    "prepare_pack",
    "prepare_unpack",
    "unpack",
    "unpack_reference",
]
