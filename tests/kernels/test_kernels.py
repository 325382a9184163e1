"""pack / unpack on both backends, bit-exact against `pack_reference` / `unpack_reference` and plain torch slicing.

Triton runs under its interpreter on CPU tensors, so shapes stay small. `RESHARD_TEST_DEVICE=cuda` runs the same
tests on a GPU with the compiled kernels (`perf/gpu_check.sh` does).

Every tensor here is a view into one `uint8` arena with gaps between tensors, so an unpack test compares the whole
arena: that proves nothing outside the boxes was written, including memory between and around the tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.kernels import (
    _tiles,
    pack,
    pack_reference,
    packed_nbytes,
    packed_offsets,
    prepare_pack,
    prepare_unpack,
    unpack,
    unpack_reference,
)
from reshard.kernels import _pack as pack_module
from reshard.kernels._backend import BACKEND_ENV
from reshard.planner._box import Box
from reshard.testing import device_under_test

DEVICE = device_under_test()
BACKENDS = ["torch", "triton"]
ON_GPU = DEVICE.type == "cuda"

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                      "float8_e8m0fnu") if hasattr(torch, n)]
ALL_DTYPES = [torch.bool, torch.int8, torch.uint8, *FLOAT8, torch.float16, torch.bfloat16, torch.int16, torch.int32,
              torch.float32, torch.int64, torch.float64]
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GAP = 24  # guard bytes between tensors in the arena and around boxes in the buffer


# ---------------------------------------------------------------------------------------------------------------
# Geometry helpers: tensors as views of one arena, and the plain-slicing oracle
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One tensor: `kind` is contiguous, transposed (dims reversed), strided (every other element of a larger
    tensor, from index 1) or expanded (stride 0 along the first dim)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "contiguous"

    def storage_numel(self) -> int:
        if self.kind == "strided":
            return math.prod(2 * s + 1 for s in self.shape)
        if self.kind == "expanded":
            return math.prod(self.shape[1:])
        return math.prod(self.shape)

    def view(self, base: torch.Tensor) -> torch.Tensor:
        """This tensor over `base`, a 1-D tensor of `self.dtype` with at least `storage_numel()` elements."""
        if self.kind == "contiguous":
            return base[: self.storage_numel()].view(self.shape)
        if self.kind == "transposed":
            return base[: self.storage_numel()].view(self.shape[::-1]).permute(*reversed(range(len(self.shape))))
        if self.kind == "strided":
            big = base[: self.storage_numel()].view(tuple(2 * s + 1 for s in self.shape))
            return big[tuple(slice(1, 1 + 2 * s, 2) for s in self.shape)]
        assert self.kind == "expanded" and self.shape
        return base[: self.storage_numel()].view((1, *self.shape[1:])).expand(self.shape)


def make_arena(specs: list[Spec], seed: int, shift: int = 0) -> tuple[torch.Tensor, list[int]]:
    """A random `uint8` arena holding every spec's storage at an 8-aligned start (plus `shift`), with gaps."""
    starts = []
    pos = GAP + shift
    for spec in specs:
        starts.append(pos)
        pos += spec.storage_numel() * spec.dtype.itemsize + GAP
        pos = (pos + 7) // 8 * 8 + shift
    gen = torch.Generator().manual_seed(seed)
    arena = torch.randint(0, 256, (pos + GAP,), dtype=torch.uint8, generator=gen)
    for spec, start in zip(specs, starts):
        if spec.dtype == torch.bool:  # only 0/1 are valid bools
            arena[start: start + spec.storage_numel()] &= 1
    return arena.to(DEVICE), starts


def views(arena: torch.Tensor, specs: list[Spec], starts: list[int]) -> list[torch.Tensor]:
    out = []
    for spec, start in zip(specs, starts):
        nbytes = spec.storage_numel() * spec.dtype.itemsize
        out.append(spec.view(arena[start: start + nbytes].view(spec.dtype)))
    return out


def oracle_pack(buffer: torch.Tensor, tensors, boxes, offsets, dtype=None) -> torch.Tensor:
    """Plain slicing: `buffer` with each box's contiguous bytes written at its offset (cast first if `dtype`)."""
    out = buffer.clone()
    for t, box, off in zip(tensors, boxes, offsets):
        vals = t[box.slices()].reshape(-1).clone(memory_format=torch.contiguous_format)
        if dtype is not None and dtype != t.dtype:
            vals = vals.to(dtype)
        raw = vals.view(torch.uint8)
        out[off: off + raw.numel()] = raw
    return out


def oracle_unpack(buffer: torch.Tensor, offsets, tensors, boxes, dtype=None) -> None:
    """Plain slicing: each box of `tensors` assigned from the buffer bytes at its offset (cast if `dtype`)."""
    for t, box, off in zip(tensors, boxes, offsets):
        bdtype = dtype or t.dtype
        raw = buffer[off: off + box.numel * bdtype.itemsize].clone().view(bdtype).view(box.shape)
        if dtype is not None:
            raw = raw.to(t.dtype)
        t.view(INT_OF_SIZE[t.element_size()])[box.slices()] = raw.view(INT_OF_SIZE[t.element_size()])


def layout_offsets(boxes, dtypes, pattern: str, seed: int = 0) -> tuple[list[int], int]:
    """Buffer offsets: `packed` back to back from 0, `aligned` 16-byte aligned, `odd` with 1..7 byte gaps (none
    aligned past the first), `shuffled` back to back but in reverse order of the boxes."""
    sizes = [b.numel * d.itemsize for b, d in zip(boxes, dtypes)]
    if pattern == "aligned":
        return packed_offsets(boxes, dtypes, align=16)
    if pattern == "shuffled":
        offsets = [0] * len(boxes)
        pos = 0
        for i in reversed(range(len(boxes))):
            offsets[i] = pos
            pos += sizes[i]
        return offsets, pos
    rng = np.random.default_rng(seed)
    offsets, pos = [], 0
    for size in sizes:
        if pattern == "odd":
            pos += int(rng.integers(1, 8))
        offsets.append(pos)
        pos += size
    return offsets, pos


def check_pack_unpack(specs: list[Spec], boxes: list[Box], backend: str, *, pattern: str = "odd", dtype=None,
                      owners: list[int] | None = None, unpack_too: bool = True, seed: int = 0) -> None:
    """Pack box i of tensor owners[i] with `backend`; compare with the reference and the oracle, then unpack
    into a fresh arena and compare the whole arena."""
    owners = list(range(len(boxes))) if owners is None else owners
    arena, starts = make_arena(specs, seed)
    src_views = views(arena, specs, starts)
    tensors = [src_views[k] for k in owners]
    bdtypes = [dtype or specs[k].dtype for k in owners]
    offsets, end = layout_offsets(boxes, bdtypes, pattern, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sentinel = torch.randint(0, 256, (end + GAP,), dtype=torch.uint8, generator=gen).to(DEVICE)

    got = pack(tensors, boxes, sentinel.clone(), offsets, dtype=dtype, backend=backend)
    ref = pack_reference(tensors, boxes, sentinel.clone(), offsets, dtype=dtype)
    expected = oracle_pack(sentinel, tensors, boxes, offsets, dtype)
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.uint8
    assert torch.equal(ref, expected), "pack_reference differs from plain slicing"
    assert torch.equal(got, expected), f"pack ({backend}) differs from plain slicing"
    if not unpack_too:
        return

    dst_arena, _ = make_arena(specs, seed + 2)
    want_arena = dst_arena.clone()
    dst_views, want_views = views(dst_arena, specs, starts), views(want_arena, specs, starts)
    unpack(expected, offsets, [dst_views[k] for k in owners], boxes, dtype=dtype, backend=backend)
    oracle_unpack(expected, offsets, [want_views[k] for k in owners], boxes, dtype)
    assert torch.equal(dst_arena, want_arena), f"unpack ({backend}) differs from plain slicing"
    ref_arena, _ = make_arena(specs, seed + 2)
    ref_views = views(ref_arena, specs, starts)
    unpack_reference(expected, offsets, [ref_views[k] for k in owners], boxes, dtype=dtype)
    assert torch.equal(ref_arena, want_arena), "unpack_reference differs from plain slicing"


# ---------------------------------------------------------------------------------------------------------------
# Chosen geometry: each case says why it is there
# ---------------------------------------------------------------------------------------------------------------

F32, I8, I64 = torch.float32, torch.int8, torch.int64
GEOMETRY = {
    # size 0 and 1 tensors, and prime extents so no tile or word boundary lines up with a row
    "sizes_0_1_primes": (
        [Spec((0,), F32), Spec((1,), F32), Spec((13, 11), F32), Spec((3, 5, 7), F32), Spec((0, 4), F32)],
        [Box((0,), (0,)), Box((0,), (1,)), Box((2, 3), (7, 5)), Box((1, 0, 2), (2, 5, 3)), Box((0, 1), (0, 2))],
    ),
    # empty boxes between non-empty ones, in a tensor that is not empty
    "empty_boxes": (
        [Spec((5, 7), F32)] * 4,
        [Box((1, 1), (3, 0)), Box((0, 0), (5, 7)), Box((4, 6), (0, 1)), Box((2, 3), (1, 1))],
    ),
    # a transposed source: the box's innermost dim has a large stride, so no dims merge
    "transposed": ([Spec((7, 11), F32, "transposed"), Spec((3, 4, 5), I8, "transposed")],
                   [Box((1, 2), (5, 8)), Box((0, 1, 1), (3, 2, 4))]),
    # every other element of a larger tensor: strided along every dim
    "strided": ([Spec((6, 7), I64, "strided"), Spec((2, 3, 5), torch.bfloat16, "strided")],
                [Box((1, 0), (4, 7)), Box((0, 1, 2), (2, 2, 3))]),
    # 0-d tensors: the box is () and holds one element
    "scalars": ([Spec((), F32), Spec((), torch.bool), Spec((), torch.float64)], [Box((), ())] * 3),
    # one raw launch moving several dtypes of several sizes
    "mixed_dtypes": ([Spec((5, 3), torch.bool), Spec((4, 4), torch.float64), Spec((9,), torch.bfloat16),
                      Spec((2, 3, 2), I8)],
                     [Box((1, 0), (3, 3)), Box((0, 1), (4, 2)), Box((2,), (5,)), Box((0, 0, 0), (2, 3, 2))]),
    # boxes of many tiles: rows longer than BLOCK (several column tiles per row), many short rows per tile, and a
    # transposed 3-dim box whose row index is split by division
    "multi_tile": ([Spec((3, 9001), F32), Spec((1500, 5), torch.int16, "strided"), Spec((40, 30, 7), I8, "transposed")],
                   [Box((0, 1), (3, 9000)), Box((3, 0), (1497, 5)), Box((1, 2, 0), (38, 27, 7))]),
    # whole contiguous tensors and full rows: dims merge into one run of words
    "contiguous_merge": ([Spec((4, 8, 16), torch.float16), Spec((6, 10), F32)],
                         [Box((0, 0, 0), (4, 8, 16)), Box((2, 0), (3, 10))]),
}


@pytest.mark.parametrize("pattern", ["odd", "aligned", "shuffled"])
@pytest.mark.parametrize("case", sorted(GEOMETRY))
@pytest.mark.parametrize("backend", BACKENDS)
def test_geometry(backend: str, case: str, pattern: str, max_interpreted_block) -> None:
    max_interpreted_block(4096)  # multi_tile's boxes are several tiles of 4096 (test_interpreter_tiles)
    specs, boxes = GEOMETRY[case]
    check_pack_unpack(specs, boxes, backend, pattern=pattern)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_source_packs(backend: str) -> None:
    # stride 0: every row of the box reads the same memory; the buffer still gets one copy per row
    specs = [Spec((6, 5), F32, "expanded"), Spec((4, 3, 2), torch.int16, "expanded")]
    boxes = [Box((1, 1), (4, 3)), Box((0, 0, 0), (4, 3, 2))]
    check_pack_unpack(specs, boxes, backend, unpack_too=False)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_dtype(backend: str, dtype: torch.dtype) -> None:
    # a transposed and a strided source, with 1..7-byte gaps so most offsets are unaligned for 2/4/8-byte dtypes
    specs = [Spec((5, 6, 3), dtype, "transposed"), Spec((4, 7), dtype, "strided")]
    boxes = [Box((1, 0, 1), (3, 6, 2)), Box((0, 2), (4, 5)), Box((2, 1, 0), (1, 1, 3))]
    check_pack_unpack(specs, boxes, backend, owners=[0, 1, 0])


def random_boxes(specs: list[Spec], num_boxes: int, seed: int) -> tuple[list[Box], list[int]]:
    rng = np.random.default_rng(seed)
    boxes, owners = [], []
    for _ in range(num_boxes):
        k = int(rng.integers(len(specs)))
        offs, shape = [], []
        for n in specs[k].shape:
            a, b = sorted(int(x) for x in rng.integers(0, n + 1, size=2))
            offs.append(a)
            shape.append(b - a)
        boxes.append(Box(tuple(offs), tuple(shape)))
        owners.append(k)
    return boxes, owners


def many_tensors(num: int, seed: int) -> list[Spec]:
    rng = np.random.default_rng(seed)
    kinds = ["contiguous", "transposed", "strided"]
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float64]
    return [Spec(tuple(int(s) for s in rng.integers(1, 9, size=int(rng.integers(1, 4)))),
                 dtypes[i % len(dtypes)], kinds[i % len(kinds)]) for i in range(num)]


@pytest.mark.parametrize(("backend", "num_boxes"), [
    ("triton", 1), ("triton", 10), ("triton", 300), ("torch", 1), ("torch", 10), ("torch", 1000), ("torch", 10_000),
])
def test_many_boxes(backend: str, num_boxes: int) -> None:
    # tables of 1 to 10,000 boxes over 64 tensors of four dtypes and three layouts (the interpreter is too slow
    # for 10,000 Triton programs here; perf/gpu_check.sh runs 10,000 on the GPU through the bench)
    specs = many_tensors(64, seed=num_boxes)
    boxes, owners = random_boxes(specs, num_boxes, seed=num_boxes)
    check_pack_unpack(specs, boxes, backend, owners=owners, pattern="packed", seed=num_boxes)


@st.composite
def geometry(draw: st.DrawFn) -> tuple[list[Spec], list[Box], list[int], str]:
    # non-empty tensors and boxes (the chosen cases above cover empty ones), so every example moves bytes
    num = draw(st.integers(1, 3))
    specs = []
    for _ in range(num):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
        kind = draw(st.sampled_from(["contiguous", "transposed", "strided"] if ndim else ["contiguous"]))
        specs.append(Spec(shape, draw(st.sampled_from([torch.bool, torch.int8, torch.float16, torch.float32,
                                                        torch.int64])), kind))
    num_boxes = draw(st.integers(1, 4))
    owners = [draw(st.integers(0, num - 1)) for _ in range(num_boxes)]
    boxes = []
    for k in owners:
        offs, shape = [], []
        for n in specs[k].shape:
            a = draw(st.integers(0, n - 1))
            offs.append(a)
            shape.append(draw(st.integers(1, n - a)))
        boxes.append(Box(tuple(offs), tuple(shape)))
    return specs, boxes, owners, draw(st.sampled_from(["odd", "packed", "aligned", "shuffled"]))


@pytest.mark.parametrize(("backend", "examples"), [("torch", 150), ("triton", 40)])
def test_random_geometry(backend: str, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(geometry())
    def run(case: tuple[list[Spec], list[Box], list[int], str]) -> None:
        specs, boxes, owners, pattern = case
        check_pack_unpack(specs, boxes, backend, owners=owners, pattern=pattern)

    run()


# ---------------------------------------------------------------------------------------------------------------
# API details
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_tensor_and_tensor_offsets(backend: str) -> None:
    # one tensor for every box, and offsets given as an int64 tensor
    t = torch.arange(30, dtype=torch.int32, device=DEVICE).view(5, 6)
    boxes = [Box((0, 0), (2, 2)), Box((3, 4), (2, 2))]
    buf = torch.zeros(32, dtype=torch.uint8, device=DEVICE)
    assert pack(t, boxes, buf, torch.tensor([0, 16]), backend=backend) is buf
    assert buf.view(torch.int32).tolist() == [0, 1, 6, 7, 22, 23, 28, 29]


def test_packed_sizes() -> None:
    boxes = [Box((0, 0), (2, 3)), Box((1,), (5,)), Box((0,), (0,))]
    assert packed_nbytes(boxes, torch.bfloat16) == 22
    assert packed_nbytes(boxes, [torch.float32, torch.int8, torch.float64]) == 29
    assert packed_offsets(boxes, torch.float32, align=16) == ([0, 32, 64], 64)
    assert packed_offsets(boxes, [torch.int8, torch.int8, torch.int8], start=3) == ([3, 9, 14], 14)
    with pytest.raises(ValueError, match="power of two"):
        packed_offsets(boxes, torch.float32, align=3)
    with pytest.raises(ValueError, match="one dtype per box"):
        packed_nbytes(boxes, [torch.float32])


def build_launch(tensors, boxes, buf, offsets, dtype=None, op="pack"):
    args = pack_module.check_copy_args(op, tensors, boxes, buf, offsets, dtype)
    casts = {c for c in pack_module._casts(op, args)}
    assert len(casts) == 1
    return pack_module._build_launch(op, args, list(range(len(boxes))), casts.pop())


def test_launch_widths() -> None:
    # bf16 boxes whose rows are 16-byte multiples, at 16-byte aligned offsets, move as 8-byte words in 16-byte
    # vectors; an odd offset drops to single bytes; casts vectorize 4 float32 at a time, or write bytes when unaligned
    t = torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE)
    boxes = [Box((0, 0), (8, 16)), Box((2, 8), (3, 8))]
    buf = torch.zeros(512, dtype=torch.uint8, device=DEVICE)
    launch = build_launch(t, boxes, buf, [0, 256])
    assert (launch.tensor_ptr.dtype, launch.vec, launch.num_dims) == (torch.int64, 2, 2)
    launch = build_launch(t, boxes, buf, [0, 264])  # 8-byte aligned only
    assert (launch.tensor_ptr.dtype, launch.vec) == (torch.int64, 1)
    launch = build_launch(t, boxes, buf, [1, 259])
    assert (launch.tensor_ptr.dtype, launch.vec, launch.buffer_bytes) == (torch.uint8, 1, 0)
    f = torch.zeros(8, 16, device=DEVICE)
    launch = build_launch(f, boxes, buf, [0, 256], dtype=torch.bfloat16)
    assert (launch.tensor_ptr.dtype, launch.buffer_ptr.dtype, launch.vec) == (torch.int32, torch.int16, 4)
    launch = build_launch(f, boxes, buf, [1, 259], dtype=torch.bfloat16)
    assert (launch.buffer_ptr.dtype, launch.buffer_bytes, launch.vec) == (torch.uint8, 2, 1)
    launch = build_launch(f.t(), [Box((0, 0), (16, 8))], buf, [0], dtype=torch.bfloat16)
    assert launch.vec == 1  # transposed: the inner stride is not 1


def test_kernels_compile_for_gpu() -> None:
    # Compile (no GPU needed) for sm_90 and check the aligned variants use 16-byte accesses; GPU-only compile
    # errors show up here on CPU-only CI.
    pytest.importorskip("triton")
    from triton.compiler import ASTSource

    kernels = pack_module._kernels(interpret=False)
    ints = ["num_boxes", "num_search_steps", "nan_sign_mask", "nan_base", "nan_payload_mask"]
    cases = [  # kernel, tensor / buffer element type, NUM_DIMS, CAST, BUFFER_BYTES, VEC, BLOCK, expected accesses
        ("_pack_kernel", "i64", "i64", 2, 0, 0, 2, 2048, "v2.b64"),
        ("_unpack_kernel", "i64", "i64", 3, 0, 0, 1, 2048, "b64"),
        ("_pack_kernel", "i32", "i16", 2, 1, 0, 4, 4096, "v4.b32"),
        ("_unpack_kernel", "i16", "i32", 1, 2, 0, 4, 4096, "v4.b32"),
        ("_pack_kernel", "i16", "i8", 2, 3, 4, 1, 4096, "b8"),
        ("_unpack_kernel", "i32", "i8", 2, 4, 2, 1, 4096, "b8"),
    ]
    aligned = {(k,): [["tt.divisibility", 16]] for k in range(4)}
    for name, tensor_ty, buffer_ty, nd, cast, nbytes, vec, block, access in cases:
        signature = {"tensor_ptr": f"*{tensor_ty}", "buffer_ptr": f"*{buffer_ty}", "starts_ptr": "*i64",
                     "table_ptr": "*i64", **dict.fromkeys(ints, "i32"),
                     **dict.fromkeys(["NUM_DIMS", "CAST", "BUFFER_BYTES", "VEC", "BLOCK"], "constexpr")}
        constexprs = {"NUM_DIMS": nd, "CAST": cast, "BUFFER_BYTES": nbytes, "VEC": vec, "BLOCK": block}
        src = ASTSource(fn=getattr(kernels, name), signature=signature, constexprs=constexprs, attrs=aligned)
        assert f"global.{access}" in ptx_for_sm90(src), (name, constexprs)


def ptx_for_sm90(src) -> str:
    """The PTX of a Triton `ASTSource` compiled for sm_90 (no GPU needed); skips where this triton cannot."""
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "enable_fp_fusion": False})
    except RuntimeError as e:  # e.g. no ptxas in this triton build
        if "ptxas" in str(e).lower():
            pytest.skip(f"cannot compile for CUDA here: {e}")
        raise
    return compiled.asm["ptx"]


def test_interpreter_tiles(max_interpreted_block) -> None:
    # the interpreter's BLOCK holds the largest box whole, between 256 and INTERPRETED_MAX_BLOCK; CUDA's depends on
    # the word size only. The multi_tile geometry is several programs per box with tiles of 4096 (the fixture
    # test_geometry uses), one per box without that cap.
    max_interpreted_block(4096)
    assert _tiles.launch_config(4, "cpu", 10) == (256, 1)
    assert _tiles.launch_config(4, "cpu", 257) == (512, 1)
    assert _tiles.launch_config(4, "cpu", 10**9) == (4096, 1)
    assert _tiles.launch_config(4, "cuda", 10) == (4096, 8)
    assert _tiles.launch_config(1, "cuda") == (8192, 8)
    sizes = np.array([[1497, 5], [1, 10], [3, 4096], [3, 4097]], dtype=np.int64)
    assert pack_module.tile_lanes(sizes) == 3 * 8192
    assert pack_module.tile_lanes(sizes[:2]) == 1497 * 8

    specs, boxes = GEOMETRY["multi_tile"]
    arena, starts = make_arena(specs, 0)
    tensors = views(arena.cpu(), specs, starts)  # CPU tensors: the interpreter's tiles
    buf = torch.zeros(sum(b.numel for b in boxes) * 4, dtype=torch.uint8)
    # box 0: 3 rows of 9000 float32 as 4-byte words, 3 tiles of 4096 columns per row; box 1: 1497 x 5 strided int16
    # are 7485 rows of one 2-byte word, 2 tiles of 4096 rows; box 2: 38 x 27 rows of 7 bytes (8 columns), 1026 rows
    # in tiles of 512: 3 tiles
    per_box = [build_launch([t], [b], buf, [0]) for t, b in zip(tensors, boxes)]
    assert [(launch.block, launch.num_tiles) for launch in per_box] == [(4096, 9), (4096, 2), (4096, 3)]
    max_interpreted_block(1 << 16)
    per_box = [build_launch([t], [b], buf, [0]) for t, b in zip(tensors, boxes)]
    assert [(launch.block, launch.num_tiles) for launch in per_box] == [(65536, 1), (8192, 1), (16384, 1)]


def test_merge_dims() -> None:
    sizes = np.array([[4, 3, 2], [4, 3, 2], [1, 1, 1], [2, 1, 3]], dtype=np.int64)
    strides = np.array([[6, 2, 1], [12, 2, 1], [9, 9, 9], [0, 5, 1]], dtype=np.int64)
    got_sizes, got_strides = _tiles.merge_dims(sizes, strides)
    assert got_sizes.tolist() == [[1, 24], [4, 6], [1, 1], [2, 3]]
    assert got_strides.tolist() == [[0, 1], [12, 1], [0, 1], [0, 1]]


# ---------------------------------------------------------------------------------------------------------------
# Bad input: refused before any byte moves, with the box index, tensor shape and box in the message
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [pack, unpack, pack_reference, unpack_reference], ids=lambda f: f.__name__)
def test_bad_input(fn) -> None:
    t = torch.zeros(4, 5, device=DEVICE)
    buf = torch.zeros(64, dtype=torch.uint8, device=DEVICE)
    ok = Box((0, 0), (2, 2))

    def call(tensors, boxes, buffer, offsets, **kw):
        if fn in (pack, pack_reference):
            return fn(tensors, boxes, buffer, offsets, **kw)
        return fn(buffer, offsets, tensors, boxes, **kw)

    with pytest.raises(ValueError, match=r"same length .* got 2 tensors, 1 boxes and 1 offsets"):
        call([t, t], [ok], buf, [0])
    with pytest.raises(ValueError, match=r"box 1 Box\[3:5, 0:2\] does not fit in tensor 1 of shape \(4, 5\)"):
        call([t, t], [ok, Box((3, 0), (2, 2))], buf, [0, 16])
    with pytest.raises(ValueError, match=r"box 0 Box\[0:2\] does not fit in tensor 0 of shape \(4, 5\)"):
        call([t], [Box((0,), (2,))], buf, [0])
    with pytest.raises(ValueError, match=r"buffer too small .* box 1 Box\[0:2, 0:2\] of tensor 1 of shape \(4, 5\)"):
        call([t, t], [ok, ok], buf, [0, 60])
    with pytest.raises(ValueError, match=r"offset out of range .* box 0"):
        call([t], [ok], buf, [-1])
    with pytest.raises(ValueError, match="1-D torch.uint8"):
        call([t], [ok], buf.view(torch.int32), [0])
    with pytest.raises(ValueError, match="1-D torch.uint8"):
        call([t], [ok], buf.view(8, 8), [0])
    with pytest.raises(ValueError, match="contiguous"):
        call([t], [ok], buf[::2], [0])
    with pytest.raises(ValueError, match="dtype torch.complex64 is not supported"):
        call([t.to(torch.complex64)], [ok], buf, [0])
    with pytest.raises(TypeError, match="must be a Box"):
        call([t], [(0, 0)], buf, [0])
    if fn in (pack, pack_reference):
        with pytest.raises(ValueError, match="boxes 0 and 1 overlap in the buffer"):
            call([t, t], [ok, ok], buf, [0, 8])
    else:
        with pytest.raises(ValueError, match="stride 0 along a dim of size > 1"):
            call([torch.zeros(1, 5, device=DEVICE).expand(4, 5)], [ok], buf, [0])


def test_bad_backend() -> None:
    t = torch.zeros(4, device=DEVICE)
    buf = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match=r"backend must be one of \('triton', 'torch'\)"):
        pack(t, [Box((0,), (4,))], buf, [0], backend="cuda")
    with pytest.raises(ValueError, match="backend must be None or 'torch'"):
        pack_reference(t, [Box((0,), (4,))], buf, [0], backend="triton")


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(4, device=DEVICE)
    buf = torch.zeros(16, dtype=torch.uint8, device=DEVICE)
    box = [Box((0,), (4,))]
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert prepare_pack(t, box, buf, [0]).backend == ("triton" if ON_GPU else "torch")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert prepare_pack(t, box, buf, [0]).backend == "triton"
    assert prepare_unpack(buf, [0], t, box).backend == "triton"
    assert prepare_pack(t, box, buf, [0], backend="torch").backend == "torch"  # the argument wins
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert prepare_unpack(buf, [0], t, box).backend == "torch"
    monkeypatch.setenv(BACKEND_ENV, "gpu")
    with pytest.raises(ValueError, match=r"\$RESHARD_KERNEL_BACKEND must be one of"):
        pack(t, box, buf, [0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_copy_runs_again(backend: str) -> None:
    # prepared once, run after the source values change: the copy follows the values, not a snapshot
    src = torch.arange(60, dtype=torch.float32, device=DEVICE).view(6, 10)
    boxes = [Box((1, 2), (3, 4)), Box((0, 9), (6, 1))]
    buf = torch.zeros(73, dtype=torch.uint8, device=DEVICE)
    packer = prepare_pack([src, src.t()], [boxes[0], Box((9, 0), (1, 6))], buf, [1, 49], backend=backend)
    dst = torch.zeros_like(src)
    unpacker = prepare_unpack(buf, [1, 49], [dst, dst.t()], [boxes[0], Box((9, 0), (1, 6))], backend=backend)
    for step in range(3):
        src.add_(step)
        packer.run()
        unpacker.run()
        for box in boxes:
            assert torch.equal(dst[box.slices()], src[box.slices()])
