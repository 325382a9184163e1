"""`pack` / `unpack`: many strided boxes <-> one contiguous byte buffer, in one Triton launch or in torch.

Layout of this file: constants, the descriptor-table builder and launcher of the Triton kernels (the kernels
themselves are in `_triton.py`, which is loaded once compiled and once interpreted), the public functions, then the
pure-torch references `pack_reference` / `unpack_reference`, which are also the CPU production path.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from reshard.kernels._backend import choose_backend
from reshard.kernels._cast import SUPPORTED_CASTS, Cast, cast_code, nan_policy
from reshard.kernels._loader import launch_in_mode, load_device_module
from reshard.kernels._spec import INT_DTYPE_BY_SIZE, CopyArgs, OffsetArg, TensorArg, check_copy_args
from reshard.planner import Box

logger = logging.getLogger(__name__)

_MAX_WORD_BYTES = 8  # widest int Triton loads natively; a raw copy moves words of 1, 2, 4 or 8 bytes
_TABLE_HEAD = 5  # columns before the sizes in a descriptor row (see _triton.py)


INTERPRETED_MAX_BLOCK = 1 << 16
"""The largest BLOCK under Triton's interpreter (CPU tensors); a box of up to this many tile lanes is one program."""
_INTERPRETED_MIN_BLOCK = 256


def launch_config(word_bytes: int, device_type: str, lanes: int | None = None) -> tuple[int, int]:
    """`(BLOCK, num_warps)` for kernels moving `word_bytes`-byte elements: the one place these are chosen.

    On CUDA a program moves about 16 KiB (BLOCK elements), so the grid is large enough to fill the GPU and each
    thread has several independent loads in flight. Not autotuned: no GPU measurement has been made yet.

    The interpreter (any other device) runs programs one after another in Python, and a program costs about the same
    (6 to 8 ms on the 2-core dev VM) whatever its tile holds up to about 16,384 lanes; past that numpy's work on the
    lanes adds up (about +6 ms at 65,536). So there BLOCK is the smallest power of two >= `lanes`, the most lanes one
    box's tile needs (`tile_lanes`), between 256 and `INTERPRETED_MAX_BLOCK`: most boxes are one program, and a
    large box is few (measured: 2**20 float32 elements in 1.26 s with BLOCK 1024, 0.33 s with 4096, 0.09 s with
    2**18). Without `lanes`, `INTERPRETED_MAX_BLOCK`.

    Example: `launch_config(4, "cpu", 10)` is `(256, 1)`; `launch_config(4, "cuda")` is `(4096, 8)`.
    """
    if device_type != "cuda":
        if lanes is None:
            return INTERPRETED_MAX_BLOCK, 1
        return min(INTERPRETED_MAX_BLOCK, max(_INTERPRETED_MIN_BLOCK, 1 << max(int(lanes) - 1, 0).bit_length())), 1
    block = min(8192, max(1024, 16384 // word_bytes))
    return block, 8 if block >= 4096 else 4


def tile_lanes(sizes: np.ndarray) -> int:
    """The lanes a tile needs to hold the largest of these boxes whole (`sizes`: `[num_boxes, D]` from
    `_merge_dims`): its rows times the power of two >= its row length, as `tile_table` lays rows out. 0 for none.

    Example: sizes `[[1497, 5], [1, 10]]` -> 1497 rows of 8 columns, 11,976 lanes.
    """
    if not sizes.size:
        return 0
    return int(((np.int64(1) << _ceil_log2(sizes[:, -1])) * _num_rows(sizes)).max())


def _ceil_log2(n: np.ndarray) -> np.ndarray:
    """Per entry of `n` (int64, each >= 1) the smallest `k` with `2**k >= n`: the bit length of `n - 1`, which
    `frexp` gives exactly below 2**53 (larger entries give 53)."""
    return np.frexp(np.minimum(n - 1, 1 << 52).astype(np.float64))[1].astype(np.int64)


def _num_rows(sizes: np.ndarray) -> np.ndarray:
    """Per box of `sizes` (`[num_boxes, D]`) its rows: the product of every size but the last."""
    return np.prod(sizes[:, :-1], axis=1) if sizes.shape[1] > 1 else np.ones(len(sizes), dtype=np.int64)


# ---------------------------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------------------------

def _kernels(interpret: bool) -> ModuleType:
    """`_triton.py` loaded with Triton's interpreter on (CPU tensors) or off (CUDA tensors), once per process."""
    name = f"reshard.kernels._triton_{'interpreted' if interpret else 'compiled'}"
    return load_device_module(os.path.join(os.path.dirname(__file__), "_triton.py"), name, interpret)


def _storage_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D `dtype` tensor over all of `t`'s storage, starting at the storage's first byte."""
    storage = t.untyped_storage()
    out = torch.empty(0, dtype=dtype, device=t.device)
    return out.set_(storage, 0, (storage.nbytes() // dtype.itemsize,), (1,))


def _merge_dims(sizes: np.ndarray, strides: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop size-1 dims and merge each dim into the next inner one where `stride[d] == stride[d+1] * size[d+1]`.

    Args:
        sizes, strides: `[num_boxes, D]` int64, outermost dim first; every size >= 1.

    Returns:
        `(sizes, strides)` of shape `[num_boxes, D']`, outermost first, left-padded with size 1 / stride 0. Row-major
        order of the elements is unchanged, so the buffer side of each box stays contiguous.

    Example: sizes (4, 3, 2), strides (6, 2, 1) -> sizes (24,), strides (1,); with strides (12, 2, 1) -> sizes
    (4, 6), strides (12, 1).
    """
    num, dims = sizes.shape
    out_sizes = np.ones((num, dims), dtype=np.int64)  # innermost first while building
    out_strides = np.zeros((num, dims), dtype=np.int64)
    cur = np.full(num, -1, dtype=np.int64)
    rows = np.arange(num)
    for d in range(dims - 1, -1, -1):
        size, stride = sizes[:, d], strides[:, d]
        at = np.maximum(cur, 0)
        merge = (size != 1) & (cur >= 0) & (out_strides[rows, at] * out_sizes[rows, at] == stride)
        new = (size != 1) & ~merge
        out_sizes[rows[merge], at[merge]] *= size[merge]
        cur = cur + new
        out_sizes[rows[new], cur[new]] = size[new]
        out_strides[rows[new], cur[new]] = stride[new]
    out_strides[cur < 0, 0] = 1  # a single element: one dim of size 1
    used = int(max(cur.max(initial=0), 0)) + 1
    return out_sizes[:, :used][:, ::-1].copy(), out_strides[:, :used][:, ::-1].copy()


def _lowest_bit(values: np.ndarray, cap: int) -> int:
    """The largest power of two <= cap dividing every value (the OR's lowest set bit)."""
    acc = int(np.bitwise_or.reduce(values)) if values.size else 0
    return cap if acc == 0 else min(cap, acc & -acc)


@dataclass
class _Launch:
    """One kernel launch: pointers, descriptor table and constexprs, ready to run (and to run again)."""

    op: str
    tensor_ptr: torch.Tensor
    buffer_ptr: torch.Tensor
    starts: torch.Tensor
    table: torch.Tensor
    num_boxes: int
    num_tiles: int
    nan: tuple[int, int, int]
    num_dims: int
    cast: Cast
    buffer_bytes: int
    vec: int
    block: int
    num_warps: int

    def run(self) -> None:
        interpret = self.tensor_ptr.device.type != "cuda"
        kernel = getattr(_kernels(interpret), "_pack_kernel" if self.op == "pack" else "_unpack_kernel")
        launch = kernel[(self.num_tiles,)]
        params = (self.tensor_ptr, self.buffer_ptr, self.starts, self.table, self.num_boxes,
                  max(self.num_boxes - 1, 0).bit_length(), *self.nan)
        constexprs = {"NUM_DIMS": self.num_dims, "CAST": int(self.cast), "BUFFER_BYTES": self.buffer_bytes,
                      "VEC": self.vec, "BLOCK": self.block, "num_warps": self.num_warps,
                      "enable_fp_fusion": False}  # no fused multiply-adds: casts stay bit-exact
        launch_in_mode(launch, interpret, *params, **constexprs)


def tile_table(sizes: np.ndarray, strides: np.ndarray, tensor_base: np.ndarray, buffer_base: np.ndarray, block: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, np.ndarray]:
    """The tiles of merged boxes and their descriptor table (columns in `_triton.py`), uploaded to `device`.

    Args:
        sizes, strides: `[num_boxes, D]` int64 from `_merge_dims` (every size >= 1).
        tensor_base, buffer_base: `[num_boxes]` int64, table columns 0 and 1.
        block: the kernels' BLOCK.

    Returns:
        `(starts, table, num_tiles, tiles)`: the first tile of each box and the table as device tensors (one
        upload), the total number of tiles and the tiles per box (numpy).
    """
    num = sizes.shape[0]
    log_block = block.bit_length() - 1
    row_len = sizes[:, -1]
    num_rows = _num_rows(sizes)
    log2_cols = np.minimum(_ceil_log2(row_len), log_block)  # smallest power of two >= row_len, capped at BLOCK
    num_col_tiles = -(-row_len // (np.int64(1) << log2_cols))
    rows_per_tile = np.int64(block) >> log2_cols
    tiles = num_col_tiles * -(-num_rows // rows_per_tile)
    starts = np.concatenate([[0], np.cumsum(tiles)[:-1]]).astype(np.int64)

    num_dims = sizes.shape[1]
    table = np.empty((num, _TABLE_HEAD + 2 * num_dims), dtype=np.int64)
    table[:, 0] = tensor_base
    table[:, 1] = buffer_base
    table[:, 2] = log2_cols
    table[:, 3] = num_col_tiles
    table[:, 4] = num_rows
    table[:, _TABLE_HEAD: _TABLE_HEAD + num_dims] = sizes
    table[:, _TABLE_HEAD + num_dims:] = strides
    # one upload; `starts` padded to an even length keeps the table 16-byte aligned, so the pointer's alignment
    # never adds a compiled variant
    pad = num % 2
    packed = torch.from_numpy(np.concatenate([starts, np.zeros(pad, dtype=np.int64), table.ravel()])).to(device)
    return packed[:num], packed[num + pad:], int(tiles.sum()), tiles


def _build_launch(op: str, args: CopyArgs, idx: list[int], cast: Cast) -> _Launch:
    """Descriptor table for boxes `idx` (all non-empty), which share `cast`; see `_triton.py` for its columns.

    Raw copies (`Cast.NONE`) treat every element as bytes: each box gets an innermost dim of `itemsize` bytes with
    stride 1, dims are merged, and the copy moves words of the widest size (<= 8 bytes) dividing every address,
    stride and row length. So any dtype mix shares one launch, and an odd buffer offset only narrows the word to
    bytes. Casts address the tensor in its elements and the buffer in elements of the buffer dtype, or in bytes when
    some buffer offset is not a multiple of that size.
    """
    tensors = [args.tensors[i] for i in idx]
    boxes = [args.boxes[i] for i in idx]
    device = args.device
    ndim = max(1, max(b.ndim for b in boxes))
    raw = cast == Cast.NONE
    dims = ndim + 1 if raw else ndim
    sizes = np.ones((len(idx), dims), dtype=np.int64)
    strides = np.zeros((len(idx), dims), dtype=np.int64)
    starts_elem = np.zeros(len(idx), dtype=np.int64)
    itemsize = np.array([t.element_size() for t in tensors], dtype=np.int64)
    ptr = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    for k, (t, box) in enumerate(zip(tensors, boxes)):
        n = box.ndim
        if n:
            sizes[k, ndim - n: ndim] = box.shape
            strides[k, ndim - n: ndim] = t.stride()
            starts_elem[k] = sum(o * s for o, s in zip(box.offsets, t.stride()))
    tensor_abs = ptr + starts_elem * itemsize
    buffer_abs = args.buffer.data_ptr() + np.array([args.offsets[i] for i in idx], dtype=np.int64)
    tensor_storage = tensors[0].untyped_storage().data_ptr()
    buffer_storage = args.buffer.untyped_storage().data_ptr()
    if raw:
        strides[:, :ndim] *= itemsize[:, None]
        sizes[:, ndim] = itemsize
        strides[:, ndim] = 1
    sizes, strides = _merge_dims(sizes, strides)
    buffer_bytes = 0
    if raw:
        # The innermost dim is a run of contiguous bytes, unless 1-byte elements are strided (their byte dim had
        # size 1 and was dropped): then no word wider than a byte fits inside the box.
        contiguous = strides[:, -1] == 1
        outer = strides[:, :-1][sizes[:, :-1] > 1]
        word = _lowest_bit(np.concatenate([tensor_abs, buffer_abs, outer, sizes[:, -1],
                                           np.array([tensor_storage, buffer_storage], dtype=np.int64)]),
                           _MAX_WORD_BYTES if contiguous.all() else 1)
        tensor_unit = buffer_unit = word
        tensor_dtype = buffer_dtype = INT_DTYPE_BY_SIZE[word]
        strides //= word
        strides[:, -1] = np.where(contiguous, 1, strides[:, -1])
        sizes[:, -1] //= word
    else:
        tensor_unit = tensors[0].element_size()
        tensor_dtype = INT_DTYPE_BY_SIZE[tensor_unit]
        buffer_itemsize = args.buffer_dtypes[idx[0]].itemsize
        if ((tensor_abs - tensor_storage) % tensor_unit).any() or tensor_storage % tensor_unit:
            raise NotImplementedError(f"{op}: a tensor's storage is not aligned to its {tensor_unit}-byte elements; "
                                      "the Triton backend cannot address it, use backend='torch'")
        aligned = not (np.bitwise_or.reduce(buffer_abs) | buffer_storage) % buffer_itemsize
        buffer_unit = buffer_itemsize if aligned else 1
        buffer_bytes = 0 if aligned else buffer_itemsize
        buffer_dtype = INT_DTYPE_BY_SIZE[buffer_itemsize] if aligned else torch.uint8
    block, num_warps = launch_config(tensor_unit if raw else max(tensor_unit, buffer_itemsize), device.type,
                                      tile_lanes(sizes))
    vec = 1
    if not buffer_bytes and (strides[:, -1] == 1).all():
        # Widest group of elements (at most 16 bytes on either side) that every base, stride and row length keeps
        # together and aligned: the kernels then use 16-byte loads and stores (see _triton._locate_tile).
        tensor_base = (tensor_abs - tensor_storage) // tensor_unit
        buffer_base = (buffer_abs - buffer_storage) // buffer_unit
        outer = strides[:, :-1][sizes[:, :-1] > 1]
        cap = 16 // max(tensor_unit, buffer_unit)
        if cap > 1:
            vec = _lowest_bit(np.concatenate([tensor_base, buffer_base, outer, sizes[:, -1]]), cap)
    starts_t, table_t, num_tiles, _ = tile_table(sizes, strides, (tensor_abs - tensor_storage) // tensor_unit,
                                                 (buffer_abs - buffer_storage) // buffer_unit, block, device)
    num_dims = sizes.shape[1]
    return _Launch(
        op=op,
        tensor_ptr=_storage_view(tensors[0], tensor_dtype),
        buffer_ptr=_storage_view(args.buffer, buffer_dtype),
        starts=starts_t,
        table=table_t,
        num_boxes=len(idx),
        num_tiles=num_tiles,
        nan=nan_policy(cast, device.type),
        num_dims=num_dims,
        cast=cast,
        buffer_bytes=buffer_bytes,
        vec=vec,
        block=block,
        num_warps=num_warps,
    )


def _casts(op: str, args: CopyArgs) -> list[Cast | None]:
    """The kernel cast of every box (`None` where the kernels have none)."""
    out = []
    for t, bdtype in zip(args.tensors, args.buffer_dtypes):
        out.append(cast_code(t.dtype, bdtype) if op == "pack" else cast_code(bdtype, t.dtype))
    return out


def _launches(op: str, args: CopyArgs, casts: list[Cast | None]) -> list[_Launch]:
    """One launch per distinct cast (a single launch for raw copies of any dtype mix); empty boxes are skipped."""
    groups: dict[Cast, list[int]] = {}
    for i, (cast, numel) in enumerate(zip(casts, args.numels)):
        if numel:
            assert cast is not None
            groups.setdefault(cast, []).append(i)
    return [_build_launch(op, args, idx, cast) for cast, idx in groups.items()]


def _choose_backend(op: str, args: CopyArgs, backend: str | None) -> tuple[str, list[Cast | None]]:
    """Resolve `backend` (see `_backend.choose_backend`) and the casts it needs."""
    # only an explicit argument makes an unfusable cast an error
    backend, explicit = choose_backend(op, args.device, backend)
    if backend == "torch":
        return backend, []
    casts = _casts(op, args)
    bad = [i for i, c in enumerate(casts) if c is None and args.numels[i]]
    if bad:
        i = bad[0]
        pair = ((args.tensors[i].dtype, args.buffer_dtypes[i]) if op == "pack"
                else (args.buffer_dtypes[i], args.tensors[i].dtype))
        if not explicit:
            logger.debug("%s: the Triton kernels cannot cast %s -> %s; using the torch backend", op, *pair)
            return "torch", []
        raise NotImplementedError(f"{op}: the Triton kernels cannot cast {pair[0]} -> {pair[1]} (box {i}); they "
                                  f"cast {', '.join(SUPPORTED_CASTS)}; use backend='torch' for other casts")
    for cast in set(casts) - {None, Cast.NONE}:
        try:
            nan_policy(cast, args.device.type)
        except NotImplementedError:
            if explicit:
                raise
            logger.warning("%s: torch's NaN bits for %s on %s follow no rule the kernels implement; using the "
                           "torch backend", op, cast.name, args.device.type)
            return "torch", []
    return backend, casts


# ---------------------------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------------------------


class PreparedCopy:
    """A `pack` or `unpack` whose arguments are checked and whose copies are planned once, to run many times.

    On the Triton backend the descriptor tables are built and uploaded to the device here, so `run()` is only the
    kernel launches (one per distinct cast). On the torch backend the box views and staging tensors are made here,
    so `run()` is one `torch._foreach_copy_` plus the whole-run copies. A refit that moves the same boxes every step
    prepares once per plan.

    It holds addresses and views, and references to the tensors and the buffer, so they stay allocated; they must
    also keep their storage (no `resize_`, `set_` or `untyped_storage().resize_()`) while it is used, which is not
    checked. Their values may change freely between runs.
    """

    def __init__(self, op: str, args: CopyArgs, backend: str | None) -> None:
        self.op = op
        self.backend, casts = _choose_backend(op, args, backend)
        self.device = args.device
        self._args = args  # keeps every tensor and the buffer alive: the tables hold their addresses
        self._launches = _launches(op, args, casts) if self.backend == "triton" else []
        self._torch = _torch_program(op, args) if self.backend == "torch" else None

    @torch.no_grad()
    def run(self) -> None:
        """Move the bytes: box views -> buffer (pack) or buffer -> box views (unpack)."""
        if self._torch is not None:
            self._torch.run()
        elif self.device.type == "cuda":
            with torch.cuda.device(self.device):
                for launch in self._launches:
                    launch.run()
        else:
            for launch in self._launches:
                launch.run()


def prepare_pack(
    tensors: TensorArg,
    boxes: Sequence[Box],
    buffer: torch.Tensor,
    offsets: OffsetArg,
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> PreparedCopy:
    """`pack`, checked and planned now, run by `.run()` as often as wanted; arguments as in `pack`."""
    return PreparedCopy("pack", check_copy_args("pack", tensors, boxes, buffer, offsets, dtype), backend)


def prepare_unpack(
    buffer: torch.Tensor,
    offsets: OffsetArg,
    tensors: TensorArg,
    boxes: Sequence[Box],
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> PreparedCopy:
    """`unpack`, checked and planned now, run by `.run()` as often as wanted; arguments as in `unpack`."""
    return PreparedCopy("unpack", check_copy_args("unpack", tensors, boxes, buffer, offsets, dtype), backend)


def pack(
    tensors: TensorArg,
    boxes: Sequence[Box],
    buffer: torch.Tensor,
    offsets: OffsetArg,
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Write box `i` of `tensors[i]`, row-major and contiguous, into `buffer` at byte `offsets[i]`.

    Args:
        tensors: one tensor per box (or one tensor for all boxes), any strided view: non-contiguous, transposed,
            expanded (stride 0). Dtypes of 1, 2, 4 or 8 bytes; they may differ between boxes.
        boxes: `Box` per tensor, inside its shape.
        buffer: 1-D contiguous `torch.uint8`, on the tensors' device.
        offsets: byte offset of each box in `buffer` (ints or a 1-D int tensor); any alignment. Box `i` occupies
            `boxes[i].numel * itemsize` bytes, `itemsize` of `dtype` if given, else of `tensors[i].dtype`. Ranges
            must not overlap.
        dtype: if given, values are cast to it while packing, bit for bit as torch's `.to(dtype)` on a contiguous
            tensor of the same device. Without it the copy is of raw bits, whatever the dtype (bool, float8, ...).
        backend: `"triton"`, `"torch"` or `None` (`$RESHARD_KERNEL_BACKEND`, else Triton for CUDA tensors and torch
            for CPU tensors). Triton on CPU tensors runs under its interpreter. With `None` (even when the variable
            says `triton`), a cast the kernels do not fuse (they fuse float32 <-> bfloat16 / float16) falls back to
            torch; with `backend="triton"` it raises `NotImplementedError`.

    Returns:
        `buffer`. Bytes of `buffer` outside the boxes' ranges are not touched.

    Raises:
        ValueError: bad input (see `check_copy_args`), naming the box index, the tensor shape and the box.

    Example:
        >>> t = torch.arange(12, dtype=torch.int16).view(3, 4)
        >>> buf = torch.zeros(8, dtype=torch.uint8)
        >>> _ = pack([t], [Box((1, 1), (2, 2))], buf, [0])
        >>> buf.view(torch.int16).tolist()
        [5, 6, 9, 10]
    """
    prepare_pack(tensors, boxes, buffer, offsets, dtype=dtype, backend=backend).run()
    return buffer


def unpack(
    buffer: torch.Tensor,
    offsets: OffsetArg,
    tensors: TensorArg,
    boxes: Sequence[Box],
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> None:
    """Overwrite box `i` of `tensors[i]` from `buffer` at byte `offsets[i]`: the inverse of `pack`.

    Args:
        buffer: 1-D contiguous `torch.uint8`, on the tensors' device.
        offsets: byte offset of each box's row-major elements in `buffer`; any alignment.
        tensors: destination per box (or one for all), any strided view without stride 0 along a dim of size > 1.
        boxes: `Box` per tensor, inside its shape. Boxes of one tensor must not overlap (the result would depend
            on the order of writes); this is not checked.
        dtype: the dtype of the elements in `buffer`, if it differs from the tensor's; they are cast to the
            tensor's dtype as a contiguous torch `.to()` would. Without it the copy is of raw bits.
        backend: as in `pack`.

    Nothing outside the boxes is written, in the tensors or in memory around them.

    Example:
        >>> t = torch.zeros(3, 4, dtype=torch.int16)
        >>> buf = torch.tensor([5, 6, 9, 10], dtype=torch.int16).view(torch.uint8)
        >>> unpack(buf, [0], [t], [Box((1, 1), (2, 2))])
        >>> t[1:].tolist()
        [[0, 5, 6, 0], [0, 9, 10, 0]]
    """
    prepare_unpack(buffer, offsets, tensors, boxes, dtype=dtype, backend=backend).run()


# ---------------------------------------------------------------------------------------------------------------
# Pure-torch reference (also the CPU production path)
# ---------------------------------------------------------------------------------------------------------------


def _runs(args: CopyArgs) -> list[list[int]]:
    """Maximal runs of consecutive non-empty boxes with one tensor dtype whose buffer ranges are back to back.

    A run is one contiguous region of the buffer, so it needs one view of the buffer (and one cast, one staging
    copy for an unaligned region) however many boxes it has.
    """
    runs: list[list[int]] = []
    end = -1
    prev_dtype = None
    for i, (t, off, numel, bdtype) in enumerate(zip(args.tensors, args.offsets, args.numels, args.buffer_dtypes)):
        if not numel:
            continue
        if runs and off == end and t.dtype == prev_dtype:
            runs[-1].append(i)
        else:
            runs.append([i])
        end = off + numel * bdtype.itemsize
        prev_dtype = t.dtype
    return runs


class _Views:
    """Box views of the call's tensors as the same-width int dtype (a copy between them is a bit copy)."""

    def __init__(self) -> None:
        self.cache: dict[int, torch.Tensor] = {}

    def __call__(self, t: torch.Tensor, box: Box) -> torch.Tensor:
        base = self.cache.get(id(t))
        if base is None:
            base = self.cache[id(t)] = t.view(INT_DTYPE_BY_SIZE[t.element_size()])
        stride = base.stride()
        start = base.storage_offset() + sum(o * s for o, s in zip(box.offsets, stride))
        return base.as_strided(box.shape, stride, start)


@functools.lru_cache(maxsize=4096)
def _row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _slots(flat: torch.Tensor, boxes: list[Box]) -> list[torch.Tensor]:
    """Consecutive row-major views of `flat` (1-D, contiguous) shaped as `boxes`."""
    out = []
    pos = flat.storage_offset()
    for box in boxes:
        out.append(flat.as_strided(box.shape, _row_major_strides(box.shape), pos))
        pos += box.numel
    return out


def _typed(region: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`region` (1-D `uint8`) viewed as `dtype`, or `None` when its start is not aligned to `dtype`."""
    size = dtype.itemsize
    if region.data_ptr() % size or region.storage_offset() % size:
        return None
    return region.view(dtype)


@dataclass
class _TorchProgram:
    """The torch path of one call: plain copies before, one `torch._foreach_copy_`, plain copies after.

    `pre` / `post` hold whole-run copies: staging of unaligned runs and the contiguous casts. The foreach moves
    every box between its strided view and its slot of a contiguous run, as same-width ints (a bit copy).
    """

    pre: list[tuple[torch.Tensor, torch.Tensor]]
    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    post: list[tuple[torch.Tensor, torch.Tensor]]

    def run(self) -> None:
        for dst, src in self.pre:
            dst.copy_(src)
        if self.dst:
            torch._foreach_copy_(self.dst, self.src)
        for dst, src in self.post:
            dst.copy_(src)


def _torch_program(op: str, args: CopyArgs) -> _TorchProgram:
    """Views, staging tensors and copies of the torch path; casts always run contiguous -> contiguous, so NaN bits are
    those of a contiguous `.to()` (see `_cast.py`)."""
    views = _Views()
    prog = _TorchProgram([], [], [], [])
    for run in _runs(args):
        first = args.tensors[run[0]]
        bdtype = args.buffer_dtypes[run[0]]
        word = INT_DTYPE_BY_SIZE[first.element_size()]
        total = sum(args.numels[i] for i in run)
        region = args.buffer.narrow(0, args.offsets[run[0]], total * bdtype.itemsize)
        raw = bdtype == first.dtype
        boxes = [args.boxes[i] for i in run]
        box_views = [views(args.tensors[i], args.boxes[i]) for i in run]
        if op == "pack":
            out = _typed(region, word) if raw else None
            staging = out if out is not None else torch.empty(total, dtype=word, device=region.device)
            prog.dst += _slots(staging, boxes)
            prog.src += box_views
            if not raw:
                out = _typed(region, bdtype)
                if out is None:
                    out = torch.empty(total, dtype=bdtype, device=region.device)
                    prog.post.append((out, staging.view(first.dtype)))
                    prog.post.append((region, out.view(torch.uint8)))
                else:
                    prog.post.append((out, staging.view(first.dtype)))
            elif out is None:
                prog.post.append((region, staging.view(torch.uint8)))
        else:
            in_dtype = word if raw else bdtype
            flat = _typed(region, in_dtype)
            if flat is None:
                flat = torch.empty(total, dtype=in_dtype, device=region.device)
                prog.pre.append((flat.view(torch.uint8), region))
            if not raw:
                cast = torch.empty(total, dtype=first.dtype, device=region.device)
                prog.pre.append((cast, flat))
                flat = cast.view(word)
            prog.dst += box_views
            prog.src += _slots(flat, boxes)
    return prog


@torch.no_grad()
def pack_reference(
    tensors: TensorArg,
    boxes: Sequence[Box],
    buffer: torch.Tensor,
    offsets: OffsetArg,
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Pure-torch `pack`, same signature and semantics; the CPU production path. `backend` must be None/"torch".

    Consecutive boxes of one dtype whose buffer ranges are back to back form a run: one `torch._foreach_copy_` from
    the box views into consecutive views of the buffer (or of a staging tensor when the run is unaligned or cast).
    Casts go through a contiguous copy first (see `_cast.py`).
    """
    if backend not in (None, "torch"):
        raise ValueError(f"pack_reference: backend must be None or 'torch', got {backend!r}")
    _torch_program("pack", check_copy_args("pack", tensors, boxes, buffer, offsets, dtype)).run()
    return buffer


@torch.no_grad()
def unpack_reference(
    buffer: torch.Tensor,
    offsets: OffsetArg,
    tensors: TensorArg,
    boxes: Sequence[Box],
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> None:
    """Pure-torch `unpack`, same signature and semantics; the CPU production path. `backend` must be None/"torch".

    Each run of back-to-back boxes is one view of the buffer (cast contiguously first if `dtype` is given), copied
    into the box views with one `torch._foreach_copy_`.
    """
    if backend not in (None, "torch"):
        raise ValueError(f"unpack_reference: backend must be None or 'torch', got {backend!r}")
    _torch_program("unpack", check_copy_args("unpack", tensors, boxes, buffer, offsets, dtype)).run()
