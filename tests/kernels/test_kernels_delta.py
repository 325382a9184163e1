"""Delta encoding (`count_changed`, `delta_encode`, `delta_decode`): bit-exact round trips, sizes and versions.

The oracle of a round trip is the source itself: after `delta_decode`, every destination box holds the current
source values bit for bit (compared as same-width ints, so -0.0 vs 0.0 and NaN payloads count), and nothing outside
the boxes changed: destinations are views into one arena compared whole, and the encoded buffer is filled with a
sentinel outside the encoded ranges. Changed counts are checked against numpy on the raw bytes, sizes against
values worked by hand, and the byte layout against a numpy parse of the buffer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from reshard.kernels import (
    DeltaFormat,
    DeltaVersionError,
    choose_delta_format,
    count_changed,
    count_changed_reference,
    delta_decode,
    delta_decode_reference,
    delta_encode,
    delta_encode_reference,
    delta_max_nbytes,
    delta_nbytes,
    delta_offsets,
    pack_reference,
    packed_offsets,
    read_delta_headers,
    scan_changes,
)
from reshard.kernels._delta_format import DELTA_HEADER_BYTES, walk_delta_offsets
from reshard.planner._box import Box
from reshard.testing import device_under_test

DEVICE = device_under_test()
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
DTYPES = [torch.bool, torch.uint8, *FLOAT8, torch.bfloat16, torch.float16, torch.int32, torch.float32, torch.int64,
          torch.float64]
FORMATS = [None, DeltaFormat.DENSE, DeltaFormat.BITMASK, DeltaFormat.INDICES]
SENTINEL = 0xA5


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` as its same-width int dtype (a bit-level view; compare with torch.equal)."""
    return t.view(INT_OF_SIZE[t.element_size()])


def make_view(shape: tuple[int, ...], dtype: torch.dtype, kind: str, gen: torch.Generator) -> torch.Tensor:
    """A tensor of `shape` with random bits: contiguous, transposed (dims reversed) or strided (every other element
    of a larger tensor, from index 1)."""
    if kind == "transposed":
        full = tuple(reversed(shape))
    elif kind == "strided":
        full = tuple(2 * s + 1 for s in shape)
    else:
        full = shape
    nbytes = max(math.prod(full), 1) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    base = raw.view(dtype)[: math.prod(full)].view(full).to(DEVICE)
    if kind == "transposed":
        return base.permute(tuple(reversed(range(len(shape)))))
    if kind == "strided":
        return base[tuple(slice(1, 1 + 2 * s, 2) for s in shape)]
    return base


def change_bits(t: torch.Tensor, frac: float, gen: torch.Generator) -> int:
    """Flip one bit of about `frac` of `t`'s elements in place (bool: flip the value); return how many changed."""
    n = t.numel()
    k = n if frac >= 1 else round(frac * n)
    if not k:
        return 0
    pick = torch.randperm(n, generator=gen)[:k]
    flat = bits(t).cpu().reshape(-1).clone()
    if t.dtype == torch.bool:
        flat[pick] ^= 1
    else:
        flat[pick] ^= torch.tensor(1, dtype=flat.dtype) << torch.randint(0, 8 * t.element_size() - 1, (k,),
                                                                          generator=gen).to(flat.dtype)
    bits(t).copy_(flat.view(t.shape).to(t.device))
    return k


class Case:
    """Source tensors (current values), a snapshot of the previous values, and destinations holding those values in
    their own layout, as views of one destination arena."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype, str, Box, float]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.sources, self.boxes, self.dests = [], [], []
        self.changed = []
        for shape, dtype, kind, box, frac in specs:
            src = make_view(shape, dtype, kind, gen)
            self.sources.append(src)
            self.boxes.append(box)
        self.dtypes = [t.dtype for t in self.sources]
        self.snap_offsets, end = packed_offsets(self.boxes, self.dtypes, align=8)
        self.snapshot = torch.zeros(end, dtype=torch.uint8, device=DEVICE)
        pack_reference(self.sources, self.boxes, self.snapshot, self.snap_offsets)
        # destinations: a differently laid out copy of the previous values, in one arena with gaps
        dest_kinds = {"contiguous": "transposed", "transposed": "strided", "strided": "contiguous"}
        self.dest_arena_parts = []
        for src, (shape, dtype, kind, _box, _frac) in zip(self.sources, specs):
            dst = make_view(shape, dtype, dest_kinds[kind], gen)
            dst.copy_(src)
            self.dests.append(dst)
        for (_, _, _, box, frac), src in zip(specs, self.sources):
            region = bits(src)[box.slices()] if box.ndim else bits(src)
            self.changed.append(change_bits(region, frac, gen) if region.numel() else 0)

    def dest_state(self) -> list[torch.Tensor]:
        """Every destination's whole storage (gaps of strided views included), as bytes."""
        return [torch.empty(0, dtype=torch.uint8, device=d.device).set_(d.untyped_storage()).cpu().clone()
                for d in self.dests]

    def expected_dest_state(self, before: list[torch.Tensor]) -> list[torch.Tensor]:
        """`before` with each box overwritten by the current source values (computed with plain slicing)."""
        out = []
        for d, src, box, raw in zip(self.dests, self.sources, self.boxes, before):
            shadow = raw.clone()
            if d.numel():
                view = torch.empty(0, dtype=d.dtype).set_(shadow.view(d.dtype).untyped_storage(), d.storage_offset(),
                                                          d.shape, d.stride())
                sl = box.slices() if box.ndim else ()
                bits(view)[sl] = bits(src.cpu())[sl]
            out.append(shadow)
        return out


def round_trip(case: Case, formats=None, *, version: int = 0, threshold: float = 0.5, scan: bool = False,
               backend: str = "torch", decode_backend: str | None = None):
    """count (or scan) -> offsets -> encode (buffer filled with a sentinel) -> decode; checks everything; returns
    the headers. With `backend="triton"` the encode also runs on the torch reference, on copies of the snapshot
    and buffer, and both must write the same bytes."""
    before = case.dest_state()
    counts = count_changed(case.sources, case.boxes, case.snapshot, case.snap_offsets, backend=backend)
    assert counts == case.changed
    if scan:
        counts = scan_changes(case.sources, case.boxes, case.snapshot, case.snap_offsets, backend=backend)
        assert list(counts.counts) == case.changed
    offsets, end = delta_offsets(case.boxes, case.dtypes, counts, formats, threshold=threshold, start=8)
    buf = torch.full((end + 16,), SENTINEL, dtype=torch.uint8, device=DEVICE)
    if backend != "torch":
        ref_buf, ref_snap = buf.clone(), case.snapshot.clone()
        ref_counts = counts.counts if scan else counts
        delta_encode_reference(case.sources, case.boxes, ref_snap, case.snap_offsets, ref_buf, offsets,
                               counts=ref_counts, base_version=version, version=version + 1, formats=formats,
                               threshold=threshold)
    headers = delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf, offsets, counts=counts,
                           base_version=version, version=version + 1, formats=formats, threshold=threshold,
                           backend=backend)
    if backend != "torch":
        assert torch.equal(buf, ref_buf)
        assert torch.equal(case.snapshot, ref_snap)
    # the encoded boxes exactly fill [offsets[i], offsets[i] + nbytes); the rest is untouched
    assert [offsets[i] + h.nbytes for i, h in enumerate(headers)] == offsets[1:] + [end]
    assert (buf[:8] == SENTINEL).all() and (buf[end:] == SENTINEL).all()
    # the snapshot now holds the current values
    fresh = torch.zeros_like(case.snapshot)
    pack_reference(case.sources, case.boxes, fresh, case.snap_offsets)
    assert torch.equal(fresh, case.snapshot)
    assert walk_delta_offsets(buf, len(case.boxes), start=8) == (offsets, end)  # the receiver's view
    got = delta_decode(buf, offsets, case.dests, case.boxes, versions=version,
                       backend=backend if decode_backend is None else decode_backend)
    assert got == headers
    for after, want in zip(case.dest_state(), case.expected_dest_state(before)):
        assert torch.equal(after, want)
    for d, s, box in zip(case.dests, case.sources, case.boxes):
        sl = box.slices() if box.ndim else ()
        assert torch.equal(bits(d)[sl], bits(s)[sl])
    return headers


# ---------------------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: "auto" if f is None else f.name)
@pytest.mark.parametrize("frac", [0.0, 0.03, 1.0])
@pytest.mark.parametrize(("scan", "backend"), [(False, "torch"), (True, "torch"), (False, "triton")],
                         ids=["counts", "scan", "triton"])
def test_round_trip_dtypes_formats(dtype: torch.dtype, fmt: DeltaFormat | None, frac: float, scan: bool,
                                   backend: str) -> None:
    """Every dtype width, every format forced and chosen, 0%, a few and 100% changed, over odd geometry: a
    transposed 2-D box not at the origin, a strided 3-D box, a 1-element box, a prime-length box, an empty box."""
    case = Case([
        ((13, 7), dtype, "transposed", Box((2, 1), (11, 5)), frac),  # 55 elements, not at the origin
        ((3, 5, 4), dtype, "strided", Box((0, 1, 1), (3, 4, 3)), frac),  # strided source, 36 elements
        ((1,), dtype, "contiguous", Box((0,), (1,)), frac),
        ((131,), dtype, "contiguous", Box((0,), (131,)), frac),  # prime
        ((5, 4), dtype, "contiguous", Box((2, 0), (0, 4)), frac),  # empty
    ], seed=DTYPES.index(dtype) * 100 + int(frac * 100))
    # the Triton decode at a few percent changed only (its 0% and 100% boxes are header-only or dense): test time
    decode = backend if frac == 0.03 else "torch"
    headers = round_trip(case, fmt, scan=scan, backend=backend, decode_backend=decode)
    for h, box, k in zip(headers, case.boxes, case.changed):
        assert h.numel == box.numel
        if fmt is not None:
            assert h.format == fmt
        assert h.count == (box.numel if h.format == DeltaFormat.DENSE else k)


def test_scalar_box_and_repeated_steps() -> None:
    """A 0-d tensor's box, and three steps in a row: each delta is against the previous step's values."""
    case = Case([((), torch.float32, "contiguous", Box((), ()), 1.0),
                 ((64, 3), torch.bfloat16, "contiguous", Box((0, 0), (64, 3)), 0.05)])
    round_trip(case, version=0)
    gen = torch.Generator().manual_seed(5)
    for step in (1, 2):
        case.changed = [change_bits(bits(case.sources[0]).view(1), 1.0, gen),
                        change_bits(bits(case.sources[1]), 0.1, gen)]
        headers = round_trip(case, version=step)
        assert [h.version for h in headers] == [step + 1] * 2


def test_nan_payloads_and_signed_zero_are_changes() -> None:
    """Bits, not values: NaN with another payload, -0.0 vs 0.0, and a flipped NaN sign are changes; an identical
    NaN is not."""
    old = torch.tensor([0x7FC00000, 0x00000000, 0x7FC00001, 0x3F800000, 0x7FC00000], dtype=torch.int32)
    new = torch.tensor([0x7FC00001, -0x80000000, 0x7FC00001, 0x3F800000, -0x00400000], dtype=torch.int32)
    src = new.view(torch.float32).to(DEVICE)
    snap = old.view(torch.uint8).clone().to(DEVICE)
    box = [Box((0,), (5,))]
    assert count_changed([src], box, snap, [0]) == [3]
    dst = old.view(torch.float32).clone().to(DEVICE)
    offsets, end = delta_offsets(box, torch.float32, [3])
    buf = torch.empty(end, dtype=torch.uint8, device=DEVICE)
    (h,) = delta_encode([src], box, snap, [0], buf, offsets, counts=[3], base_version=0, version=1)
    assert h.format == DeltaFormat.DENSE  # 3 of 5 > half
    offsets, end = delta_offsets(box, torch.float32, [3], DeltaFormat.INDICES)
    buf = torch.empty(end, dtype=torch.uint8, device=DEVICE)
    (h,) = delta_encode([src], box, old.view(torch.uint8).clone().to(DEVICE), [0], buf, offsets, counts=[3],
                        base_version=0, version=1, formats=DeltaFormat.INDICES)
    assert buf[40:52].view(torch.int32).tolist() == [0, 1, 4]
    delta_decode(buf, offsets, [dst], box, versions=0)
    assert torch.equal(bits(dst).cpu(), new)


def test_many_boxes_of_one_tensor() -> None:
    """Disjoint boxes of one strided tensor in one call, each with its own format."""
    gen = torch.Generator().manual_seed(3)
    src = make_view((10, 9), torch.float16, "strided", gen)
    dst = src.clone().t().contiguous().t()  # column-major copy
    boxes = [Box((0, 0), (5, 9)), Box((5, 0), (5, 4)), Box((5, 4), (5, 5))]
    offs, end = packed_offsets(boxes, torch.float16, align=8)
    snap = torch.empty(end, dtype=torch.uint8, device=DEVICE)
    pack_reference(src, boxes, snap, offs)
    change_bits(bits(src)[0:5], 0.05, gen)
    change_bits(bits(src)[5:, 0:4], 1.0, gen)
    counts = count_changed(src, boxes, snap, offs)
    fmts = [DeltaFormat.BITMASK, None, DeltaFormat.INDICES]
    offsets, end2 = delta_offsets(boxes, torch.float16, counts, fmts)
    buf = torch.empty(end2, dtype=torch.uint8, device=DEVICE)
    headers = delta_encode(src, boxes, snap, offs, buf, offsets, counts=counts, base_version=4, version=5,
                           formats=fmts)
    assert [h.format for h in headers] == [DeltaFormat.BITMASK, DeltaFormat.DENSE, DeltaFormat.INDICES]
    assert counts[2] == 0 and headers[2].nbytes == DELTA_HEADER_BYTES
    delta_decode(buf, offsets, dst, boxes, versions=4)
    assert torch.equal(bits(dst), bits(src))


# ---------------------------------------------------------------------------------------------------------------
# Sizes and the choice, worked by hand
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("numel", "count", "itemsize", "fmt", "nbytes"), [
    # bfloat16, 1000 elements: DENSE 40 + 2000 = 2040; BITMASK 40 + 128 (125 -> 128) + round8(2c);
    # INDICES 40 + round8(4c) + round8(2c)
    (1000, 0, 2, DeltaFormat.INDICES, 40),  # BITMASK would be 168
    (1000, 20, 2, DeltaFormat.INDICES, 160),  # 40 + 80 + 40; BITMASK 208
    (1000, 100, 2, DeltaFormat.BITMASK, 368),  # 40 + 128 + 200; INDICES 640
    (1000, 500, 2, DeltaFormat.BITMASK, 1168),  # exactly half: not above the threshold
    (1000, 501, 2, DeltaFormat.DENSE, 2040),  # above half: dense fallback (BITMASK would be 1176)
    (10, 1, 8, DeltaFormat.BITMASK, 56),  # int64: BITMASK 40 + 8 + 8 ties INDICES 40 + 8 + 8 -> the simpler
    (10, 0, 8, DeltaFormat.INDICES, 40),
    (64, 8, 1, DeltaFormat.BITMASK, 56),  # 1 byte: DENSE 104, INDICES 40 + 32 + 8 = 80
    (3, 1, 4, DeltaFormat.DENSE, 56),  # DENSE 40 + 16, BITMASK 40 + 8 + 8, INDICES 40 + 8 + 8: a tie -> DENSE
    (0, 0, 4, DeltaFormat.DENSE, 40),  # empty box: header only
    (1, 1, 2, DeltaFormat.DENSE, 48),  # 1 of 1 changed, above half
])
def test_chosen_format_and_size_by_hand(numel: int, count: int, itemsize: int, fmt: DeltaFormat, nbytes: int) -> None:
    assert choose_delta_format(numel, count, itemsize) == fmt
    assert delta_nbytes(numel, count, itemsize) == nbytes
    assert delta_nbytes(numel, count, itemsize) <= delta_max_nbytes(numel, itemsize)


def test_threshold_and_forced_sizes() -> None:
    assert choose_delta_format(1000, 501, 2, threshold=1.0) == DeltaFormat.BITMASK
    assert choose_delta_format(1000, 1, 2, threshold=0.0) == DeltaFormat.DENSE
    assert delta_max_nbytes(1000, 2) == 2040
    assert delta_nbytes(1000, 1000, 2, format=DeltaFormat.INDICES) == 40 + 4000 + 2000  # forced: above the worst
    assert delta_nbytes(1000, 7, 2, format=DeltaFormat.DENSE) == 2040
    # offsets: back to back from an 8-aligned start, worst case without counts
    assert delta_offsets([Box((0,), (1000,)), Box((0,), (3,))], torch.bfloat16, [20, 3], start=5) == ([8, 168], 216)
    assert delta_offsets([Box((0,), (1000,)), Box((0,), (3,))], torch.bfloat16) == ([0, 2040], 2088)


def test_chosen_format_is_smallest_exhaustively() -> None:
    """For every count of small boxes, the choice with threshold 1.0 has the minimum size of the three formats,
    each size counted here from the layout (header, mask, indices, values, each rounded up to 8 bytes)."""
    def r8(n: int) -> int:
        return -(-n // 8) * 8

    for itemsize in (1, 2, 4, 8):
        for numel in (1, 2, 7, 8, 9, 33, 100):
            for count in range(numel + 1):
                sizes = {DeltaFormat.DENSE: 40 + r8(numel * itemsize),
                         DeltaFormat.BITMASK: 40 + r8(-(-numel // 8)) + r8(count * itemsize),
                         DeltaFormat.INDICES: 40 + r8(4 * count) + r8(count * itemsize)}
                chosen = choose_delta_format(numel, count, itemsize, threshold=1.0)
                assert sizes[chosen] == min(sizes.values()), (itemsize, numel, count, chosen)
                assert delta_nbytes(numel, count, itemsize, threshold=1.0) == sizes[chosen]


def test_byte_layout_parsed_by_numpy() -> None:
    """The header words, mask bits, indices and values of a tiny int16 box, read back with numpy."""
    old = torch.arange(20, dtype=torch.int16)
    new = old.clone()
    new[[0, 9, 17]] = torch.tensor([-1, 500, 77], dtype=torch.int16)
    for fmt in (DeltaFormat.BITMASK, DeltaFormat.INDICES):
        snap = old.view(torch.uint8).clone()
        offsets, end = delta_offsets([Box((0,), (20,))], torch.int16, [3], fmt)
        buf = torch.zeros(end, dtype=torch.uint8)
        delta_encode([new], [Box((0,), (20,))], snap, [0], buf, offsets, counts=[3], base_version=7, version=8,
                     formats=fmt)
        raw = buf.numpy()
        words = raw[:40].view(np.int64)
        assert words.tolist() == [0x4C44 | int(fmt) << 16 | 2 << 24, 20, 3, 7, 8]
        if fmt == DeltaFormat.BITMASK:
            assert end == 40 + 8 + 8
            assert raw[40:43].tolist() == [0b00000001, 0b00000010, 0b00000010]  # bits 0, 9, 17
            assert (raw[43:48] == 0).all()
            values = raw[48:54].view(np.int16)
        else:
            assert end == 40 + 16 + 8
            assert raw[40:52].view(np.int32).tolist() == [0, 9, 17]
            values = raw[56:62].view(np.int16)
        assert values.tolist() == [-1, 500, 77]
        assert read_delta_headers(buf, offsets)[0].format == fmt


# ---------------------------------------------------------------------------------------------------------------
# Versions and errors
# ---------------------------------------------------------------------------------------------------------------


def _encoded(fmt=None, frac=0.05, base_version=3):
    case = Case([((40,), torch.float32, "contiguous", Box((0,), (40,)), frac),
                 ((6, 6), torch.bfloat16, "transposed", Box((1, 1), (5, 5)), frac)], seed=11)
    counts = count_changed(case.sources, case.boxes, case.snapshot, case.snap_offsets)
    offsets, end = delta_offsets(case.boxes, case.dtypes, counts, fmt)
    buf = torch.empty(end, dtype=torch.uint8, device=DEVICE)
    headers = delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf, offsets, counts=counts,
                           base_version=base_version, version=base_version + 1, formats=fmt)
    return case, buf, offsets, headers


def test_stale_destination_is_refused_before_any_write() -> None:
    case, buf, offsets, headers = _encoded()
    assert all(h.format != DeltaFormat.DENSE for h in headers)
    before = case.dest_state()
    with pytest.raises(DeltaVersionError, match=r"box 1 .*delta from version 3 but the destination holds version 2"):
        delta_decode(buf, offsets, case.dests, case.boxes, versions=[3, 2])
    with pytest.raises(DeltaVersionError, match="holds version None"):
        delta_decode(buf, offsets, case.dests, case.boxes, versions=None)
    for a, b in zip(case.dest_state(), before):
        assert torch.equal(a, b)  # box 0 matched but nothing was written
    # negative control: the right version applies
    delta_decode(buf, offsets, case.dests, case.boxes, versions=3)
    assert torch.equal(bits(case.dests[0]), bits(case.sources[0]))


def test_dense_box_applies_to_any_version() -> None:
    case, buf, offsets, _ = _encoded(DeltaFormat.DENSE)
    delta_decode(buf, offsets, case.dests, case.boxes, versions=None)
    for d, s, box in zip(case.dests, case.sources, case.boxes):
        assert torch.equal(bits(d)[box.slices()], bits(s)[box.slices()])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_counts_stale_after_a_change_raise_before_writing(backend: str) -> None:
    case = Case([((40,), torch.float32, "contiguous", Box((0,), (40,)), 0.1)])
    counts = count_changed(case.sources, case.boxes, case.snapshot, case.snap_offsets)
    case.sources[0][0] = case.sources[0][0] + 1  # changes after counting (element 0 may already be changed)
    offsets, end = delta_offsets(case.boxes, case.dtypes, [counts[0] + 1])
    buf = torch.full((end,), SENTINEL, dtype=torch.uint8, device=DEVICE)
    snap_before = case.snapshot.clone()
    actual = count_changed(case.sources, case.boxes, case.snapshot, case.snap_offsets)[0]
    wrong = counts[0] if actual != counts[0] else counts[0] + 1
    with pytest.raises(ValueError, match=rf"counts\[0\] = {wrong} but box 0 .* has {actual} changed"):
        delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf, offsets, counts=[wrong],
                     base_version=0, version=1, backend=backend)
    assert (buf == SENTINEL).all() and torch.equal(case.snapshot, snap_before)


def test_bad_input_errors() -> None:
    case, buf, offsets, headers = _encoded()
    with pytest.raises(ValueError, match="multiple of 8 bytes"):
        delta_decode(buf, [offsets[0] + 4, offsets[1]], case.dests, case.boxes, versions=3)
    corrupt = buf.clone()
    corrupt[offsets[1]] ^= 0xFF
    with pytest.raises(ValueError, match="box 1 .* has no delta header"):
        delta_decode(corrupt, offsets, case.dests, case.boxes, versions=3)
    with pytest.raises(ValueError, match=r"box 0 .* torch.float64 tensor .* header for 40 elements of 4 bytes"):
        delta_decode(buf, offsets, [case.dests[0].double(), case.dests[1]], case.boxes, versions=3)
    with pytest.raises(ValueError, match="needs bytes"):
        delta_decode(buf[: offsets[1] + 48], offsets, case.dests, case.boxes, versions=3)
    with pytest.raises(ValueError, match=r"walk_delta_offsets: box 1 at byte \d+ .* but the buffer has"):
        walk_delta_offsets(buf[: offsets[1] + 48], 2)
    counts = [h.count for h in headers]
    with pytest.raises(ValueError, match="needs bytes"):
        delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf[:-8], offsets, counts=counts,
                     base_version=3, version=4)
    with pytest.raises(ValueError, match="overlap"):
        delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf, [0, 8], counts=counts,
                     base_version=3, version=4)
    with pytest.raises(TypeError, match="int64 version"):
        delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf, offsets, counts=counts,
                     base_version=3.0, version=4)
    with pytest.raises(ValueError, match="backend must be one of"):
        count_changed(case.sources, case.boxes, case.snapshot, case.snap_offsets, backend="cuda")
    with pytest.raises(ValueError, match="count <= numel"):
        choose_delta_format(10, 11, 2)


def test_update_snapshot_false_keeps_it() -> None:
    case = Case([((40,), torch.int32, "contiguous", Box((0,), (40,)), 0.2)])
    snap = case.snapshot.clone()
    counts = count_changed(case.sources, case.boxes, case.snapshot, case.snap_offsets)
    offsets, end = delta_offsets(case.boxes, case.dtypes, counts)
    buf = torch.empty(end, dtype=torch.uint8, device=DEVICE)
    delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf, offsets, counts=counts,
                 base_version=0, version=1, update_snapshot=False)
    assert torch.equal(case.snapshot, snap)
    assert count_changed(case.sources, case.boxes, case.snapshot, case.snap_offsets) == counts


def test_scan_of_other_tensors_is_refused_and_a_late_change_is_sent_next_step() -> None:
    case = Case([((50,), torch.bfloat16, "contiguous", Box((0,), (50,)), 0.1)])
    scan = scan_changes(case.sources, case.boxes, case.snapshot, case.snap_offsets)
    offsets, end = delta_offsets(case.boxes, case.dtypes, scan)
    buf = torch.empty(end, dtype=torch.uint8, device=DEVICE)
    other = [case.sources[0].clone()]
    with pytest.raises(ValueError, match="ChangeScan of other tensors"):
        delta_encode(other, case.boxes, case.snapshot, case.snap_offsets, buf, offsets, counts=scan, base_version=0,
                     version=1)
    # an element changed after the scan is not sent now; snapshot and destination stay equal, the next step sends it
    unchanged = next(i for i in range(50) if i not in set(scan.positions[0].tolist()))
    bits(case.sources[0])[unchanged] ^= 1
    delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf, offsets, counts=scan,
                 base_version=0, version=1)
    delta_decode(buf, offsets, case.dests, case.boxes, versions=0)
    assert torch.equal(case.snapshot.view(torch.int16), bits(case.dests[0]))
    case.changed = [1]
    round_trip(case, version=1, scan=True)


@pytest.mark.parametrize("fmt", [None, DeltaFormat.BITMASK, DeltaFormat.INDICES],
                         ids=lambda f: "auto" if f is None else f.name)
def test_triton_boxes_of_many_tiles(fmt: DeltaFormat | None, max_interpreted_block) -> None:
    """Boxes of several tiles (BLOCK 4096 under the interpreter here, as on a GPU): a prime-length box (3 tiles of
    rows), a box whose rows are longer than a tile (tiles along the row, from a transposed source) and one of many
    short rows (16-column tiles of 256 rows): a changed element's rank crosses tiles, and bitmask words are shared
    by tiles. The decode's blocks differ by element size (512, 4096 and 512 elements for INDICES)."""
    max_interpreted_block(4096)
    case = Case([
        ((10007,), torch.bfloat16, "contiguous", Box((0,), (10007,)), 0.03),
        ((3, 4099), torch.float32, "transposed", Box((0, 0), (3, 4099)), 0.2),
        ((700, 13), torch.uint8, "strided", Box((1, 0), (699, 13)), 0.05),
    ], seed=21)
    round_trip(case, fmt, backend="triton")


@pytest.mark.parametrize("fmt", [DeltaFormat.BITMASK, DeltaFormat.INDICES, None],
                         ids=lambda f: "auto" if f is None else f.name)
def test_triton_decode_equals_reference(fmt: DeltaFormat | None, max_interpreted_block) -> None:
    """The Triton scatter-apply writes the same bytes as `delta_decode_reference` into the same destinations (two
    identical cases from one seed, whole storages compared, gaps included), over strided and transposed
    destinations, several element sizes in one call, several blocks of 256 per box (the last partly masked) and a
    box changed at 0%."""
    max_interpreted_block(256)
    specs = [
        ((300, 7), torch.bfloat16, "transposed", Box((3, 1), (290, 6)), 0.05),
        ((9, 5, 40), torch.float32, "strided", Box((1, 0, 2), (8, 5, 37)), 0.3),
        ((513,), torch.uint8, "contiguous", Box((0,), (513,)), 0.02),
        ((77,), torch.int64, "contiguous", Box((0,), (77,)), 0.0),
    ]
    a, b = Case(specs, seed=5), Case(specs, seed=5)
    counts = count_changed(a.sources, a.boxes, a.snapshot, a.snap_offsets)
    offsets, end = delta_offsets(a.boxes, a.dtypes, counts, fmt)
    buf = torch.zeros(end, dtype=torch.uint8, device=DEVICE)
    delta_encode(a.sources, a.boxes, a.snapshot, a.snap_offsets, buf, offsets, counts=counts, base_version=1,
                 version=2, formats=fmt)
    want = delta_decode_reference(buf, offsets, a.dests, a.boxes, versions=1)
    got = delta_decode(buf, offsets, b.dests, b.boxes, versions=1, backend="triton")
    assert got == want
    for x, y in zip(a.dest_state(), b.dest_state()):
        assert torch.equal(x, y)
    assert any(h.format != DeltaFormat.DENSE and h.count for h in got)


def test_triton_decode_refuses_corrupt_sparse_boxes_before_writing() -> None:
    """A bitmask with an extra bit set, and an index out of the box: ValueError, destinations untouched."""
    for fmt in (DeltaFormat.BITMASK, DeltaFormat.INDICES):
        case = Case([((200,), torch.float32, "contiguous", Box((0,), (200,)), 0.1)], seed=9)
        counts = count_changed(case.sources, case.boxes, case.snapshot, case.snap_offsets)
        offsets, end = delta_offsets(case.boxes, case.dtypes, counts, fmt)
        buf = torch.zeros(end, dtype=torch.uint8, device=DEVICE)
        delta_encode(case.sources, case.boxes, case.snapshot, case.snap_offsets, buf, offsets, counts=counts,
                     base_version=0, version=1, formats=fmt)
        if fmt == DeltaFormat.BITMASK:
            buf[offsets[0] + 40 + 24] ^= 0x80  # bit 199: set or cleared, the popcount no longer matches
        else:
            buf[offsets[0] + 40: offsets[0] + 44].view(torch.int32).fill_(200)
        before = case.dest_state()
        with pytest.raises(ValueError, match="corrupt box"):
            delta_decode(buf, offsets, case.dests, case.boxes, versions=0, backend="triton")
        for x, y in zip(before, case.dest_state()):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32], ids=str)
def test_word_compare_fast_path_equals_elementwise(dtype: torch.dtype) -> None:
    """Contiguous boxes of whole aligned 8-byte words take the word-at-a-time comparison on CPU: its positions equal
    the elementwise `view != snapshot` ones (neighbours in one word, the first and the last element changed), and
    a round trip through it is exact."""
    from reshard.kernels._delta_format import _slot
    from reshard.kernels._delta_reference import _box_view, _changed_positions, _word_positions

    case = Case([((64, 32), dtype, "contiguous", Box((0, 0), (64, 32)), 0.05),
                 ((16, 8), dtype, "contiguous", Box((4, 0), (8, 8)), 0.3)], seed=3)
    for t, box, off in zip(case.sources, case.boxes, case.snap_offsets):
        view = _box_view(t, box)
        snap = _slot(case.snapshot, off, box.numel, view.dtype)
        bits(t).view(-1)[0] ^= 1
        bits(t).view(-1)[-1] ^= 1
        fast = _word_positions(view, snap)
        assert fast is not None or DEVICE.type != "cpu"
        if fast is not None:
            assert torch.equal(fast, _changed_positions(view != snap.view(view.shape)))
    case.changed = count_changed_reference(case.sources, case.boxes, case.snapshot, case.snap_offsets)
    round_trip(case, scan=True)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64], ids=str)
def test_word_compare_of_strided_rows_equals_elementwise(dtype: torch.dtype) -> None:
    """A box whose rows are whole aligned words inside a wider tensor (a column block of a row-major weight, the
    shard a source sends to a column-sharded destination) is compared a word at a time too: positions and values
    equal the elementwise `view != snapshot` ones (first and last element of the box changed, neighbours in one
    word), and a round trip of such boxes through the scan is exact. A box whose rows are not whole words takes
    the elementwise path (None)."""
    from reshard.kernels._delta_format import _slot
    from reshard.kernels._delta_reference import _box_view, _changed_positions, _word_changes

    per = 8 // dtype.itemsize
    case = Case([((16, 12 * per), dtype, "contiguous", Box((2, 4 * per), (9, 4 * per)), 0.1),
                 ((4, 6, 4 * per), dtype, "contiguous", Box((1, 2, per), (3, 3, 2 * per)), 0.2)], seed=5)
    for t, box, off in zip(case.sources, case.boxes, case.snap_offsets):
        view = _box_view(t, box)
        assert not view.is_contiguous()
        snap = _slot(case.snapshot, off, box.numel, view.dtype)
        first = tuple(box.offsets)
        last = tuple(o + s - 1 for o, s in zip(box.offsets, box.shape))
        bits(t)[first] ^= 1
        bits(t)[last] ^= 1
        got = _word_changes(view, snap)
        assert got is not None or DEVICE.type != "cpu"
        if got is not None:
            changed = view != snap.view(view.shape)
            want = _changed_positions(changed)
            assert torch.equal(got[0], want)
            assert torch.equal(got[1], view.reshape(-1)[want.long()])
    if dtype.itemsize < 8:  # rows of 3 elements of a 1-, 2- or 4-byte dtype are not whole words
        t = make_view((4, 8 * per), dtype, "contiguous", torch.Generator().manual_seed(1))
        view = _box_view(t, Box((0, 0), (4, 3)))
        assert _word_changes(view, torch.zeros(12 * dtype.itemsize, dtype=torch.uint8).view(view.dtype)) is None
    case.changed = count_changed_reference(case.sources, case.boxes, case.snapshot, case.snap_offsets)
    round_trip(case, scan=True)


@pytest.mark.parametrize("kind", ["contiguous", "strided"])
def test_dense_encoding_without_snapshot_equals_delta_encode(kind: str) -> None:
    """`delta_encode_dense` writes the bytes `delta_encode(..., formats=DENSE)` writes (header with base version 0,
    every value, zero padding), reads no snapshot, and decodes onto a destination of any version; overlapping or
    out-of-range boxes are refused before anything is written."""
    from reshard.kernels import delta_encode_dense

    case = Case([((7, 5), torch.bfloat16, kind, Box((1, 0), (5, 5)), 0.3),
                 ((9,), torch.float32, kind, Box((2,), (7,)), 0.3),
                 ((3, 3), torch.uint8, kind, Box((0, 0), (3, 3)), 0.5)], seed=7)
    offsets, end = delta_offsets(case.boxes, case.dtypes, None)
    want = torch.full((end,), SENTINEL, dtype=torch.uint8, device=DEVICE)
    delta_encode(case.sources, case.boxes, case.snapshot.clone(), case.snap_offsets, want, offsets,
                 counts=[0] * 3, base_version=0, version=[11, 12, 13], formats=DeltaFormat.DENSE, backend="torch")
    got = torch.full((end,), SENTINEL, dtype=torch.uint8, device=DEVICE)
    headers = delta_encode_dense(case.sources, case.boxes, got, offsets, version=[11, 12, 13])
    assert torch.equal(got, want)
    assert [h.version for h in headers] == [11, 12, 13] and all(h.format == DeltaFormat.DENSE for h in headers)
    delta_decode(got, offsets, case.dests, case.boxes, versions=None)
    for d, s, box in zip(case.dests, case.sources, case.boxes):
        assert torch.equal(bits(d)[box.slices()], bits(s)[box.slices()])
    spare = got.clone()
    with pytest.raises(ValueError, match="overlap"):
        delta_encode_dense(case.sources, case.boxes, got, [offsets[0], offsets[0], offsets[2]], version=1)
    with pytest.raises(ValueError, match="buffer has"):
        delta_encode_dense(case.sources, case.boxes, got[: end - 8], offsets, version=1)
    assert torch.equal(got, spare)


def test_delta_kernels_compile_for_gpu() -> None:
    """Compile the four delta kernels for sm_90 (no GPU needed), so GPU-only compile errors (the compiled-mode
    combine function, the atomic OR of the mask words, the box the tile locator returns) show on CPU-only CI.
    Element widths differ between the kernels (all four take the same code path for every width)."""
    pytest.importorskip("triton")
    from test_kernels import ptx_for_sm90
    from triton.compiler import ASTSource

    from reshard.kernels._delta_launch import _device_code

    code = _device_code(interpret=False)
    cases = [  # kernel, element type, its arguments in order (pointers then ints), constexprs
        ("_delta_count_kernel", "i16", ["tensor_ptr", "snap_ptr", "starts_ptr", "table_ptr", "tile_counts_ptr",
                                        "num_boxes", "num_search_steps"], {"NUM_DIMS": 3, "BLOCK": 1024}),
        ("_delta_compact_kernel", "i32", ["tensor_ptr", "snap_ptr", "starts_ptr", "table_ptr", "tile_base_ptr",
                                          "out_table_ptr", "values_ptr", "words_ptr", "num_boxes",
                                          "num_search_steps"], {"NUM_DIMS": 2, "UPDATE": True, "BLOCK": 1024}),
        ("_delta_bits_kernel", "i8", ["table_ptr", "block_box_ptr", "block_first_ptr", "words_ptr",
                                      "block_counts_ptr"], {"NUM_DIMS": 2, "BLOCK": 1024}),
        ("_delta_scatter_kernel", "i64", ["tensor_ptr", "table_ptr", "block_box_ptr", "block_first_ptr",
                                          "block_base_ptr", "values_ptr", "words_ptr"], {"NUM_DIMS": 3, "BLOCK": 1024}),
    ]
    for name, elem, args, constexprs in cases:
        ptr = {"tensor_ptr": f"*{elem}", "snap_ptr": f"*{elem}", "values_ptr": f"*{elem}", "words_ptr": "*i32",
               "tile_counts_ptr": "*i32", "block_counts_ptr": "*i32"}
        signature = {a: (ptr.get(a, "*i64") if a.endswith("_ptr") else "i32") for a in args}
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        ptx = ptx_for_sm90(ASTSource(fn=getattr(code, name), signature=signature, constexprs=constexprs))
        assert "ld.global" in ptx, name
        if name == "_delta_compact_kernel":
            assert "atom.global" in ptx and ".or" in ptx, "the mask words' atomic OR"
