"""`pack` / `unpack`: many strided boxes <-> one contiguous byte buffer, in one Triton launch or in torch.

Layout of this file: constants, the launcher of the Triton kernels (the kernels themselves are in `_triton.py`,
which is loaded once compiled and once interpreted; the tile geometry and descriptor tables in `_tiles.py`), the
public functions, then the pure-torch references `pack_reference` / `unpack_reference`, which are also the CPU
production path.
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
from reshard.kernels._tiles import launch_config, lowest_bit, max_vec, merge_dims, tile_lanes, tile_table
from reshard.planner import Box, LocalRegion, region_strides, region_view

logger = logging.getLogger(__name__)

WORD_BYTES = (1, 2, 4, 8)  # the words a raw copy moves: the widest int Triton loads natively is 8 bytes
_MAX_WORD_BYTES = WORD_BYTES[-1]
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
            starts_elem[k], box_strides = region_strides(t.stride(), box)
            sizes[k, ndim - n: ndim] = box.shape
            strides[k, ndim - n: ndim] = box_strides
    tensor_abs = ptr + starts_elem * itemsize
    buffer_abs = args.buffer.data_ptr() + np.array([args.offsets[i] for i in idx], dtype=np.int64)
    tensor_storage = tensors[0].untyped_storage().data_ptr()
    buffer_storage = args.buffer.untyped_storage().data_ptr()
    if raw:
        strides[:, :ndim] *= itemsize[:, None]
        sizes[:, ndim] = itemsize
        strides[:, ndim] = 1
    sizes, strides = merge_dims(sizes, strides)
    buffer_bytes = 0
    if raw:
        # The innermost dim is a run of contiguous bytes, unless 1-byte elements are strided (their byte dim had
        # size 1 and was dropped): then no word wider than a byte fits inside the box.
        contiguous = strides[:, -1] == 1
        outer = strides[:, :-1][sizes[:, :-1] > 1]
        word = lowest_bit(np.concatenate([tensor_abs, buffer_abs, outer, sizes[:, -1],
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
    vec = 1
    if not buffer_bytes and (strides[:, -1] == 1).all():
        # Widest group of elements (at most 16 bytes on either side) that every base, stride and row length keeps
        # together and aligned: the kernels then use 16-byte loads and stores (see _triton._locate_tile).
        tensor_base = (tensor_abs - tensor_storage) // tensor_unit
        buffer_base = (buffer_abs - buffer_storage) // buffer_unit
        outer = strides[:, :-1][sizes[:, :-1] > 1]
        cap = max_vec(tensor_unit, buffer_unit)
        if cap > 1:
            vec = lowest_bit(np.concatenate([tensor_base, buffer_base, outer, sizes[:, -1]]), cap)
    block, num_warps = launch_config(tensor_unit if raw else max(tensor_unit, buffer_itemsize), device.type,
                                      tile_lanes(sizes), vec=vec, cast=cast)
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

    def __call__(self, t: torch.Tensor, box: LocalRegion) -> torch.Tensor:
        base = self.cache.get(id(t))
        if base is None:
            base = self.cache[id(t)] = t.view(INT_DTYPE_BY_SIZE[t.element_size()])
        return region_view(base, box)


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
