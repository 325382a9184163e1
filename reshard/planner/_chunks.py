"""How a plan stores its transfers, and which chunk each goes in.

`_Transfers` holds every transfer unit (`Unit`) of a plan in plan order (rows, then relay forwards as columns);
`_Columns` is their numeric fields as arrays; `_assign_chunks` places them in chunks within a staging budget. Pure
Python and numpy on plain values, like the rest of the planner.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import numpy as np

from reshard.planner._box import Box
from reshard.planner._types import LINKS, PIPELINE_DEPTH, Link

RELAY_CHUNK_LAG = PIPELINE_DEPTH
"""A relay forwards a box at least this many chunks after the box arrives, so the executor can pack chunk i+1
while chunk i is in flight without waiting for the arrival to be unpacked (see `PIPELINE_DEPTH`)."""


_LINK_CODE = {link: code for code, link in enumerate(LINKS)}
_LOCAL = _LINK_CODE["local"]


class Member(NamedTuple):
    """One tensor a transfer unit moves its boxes of."""

    item: int
    src_tensor: int
    dst_tensor: int


Members = tuple[Member, ...]
"""The tensors a transfer unit moves the same boxes of (one for a lone item; several for items of equal geometry,
batched so they move together)."""


class Unit(NamedTuple):
    """The same boxes of each member tensor moving from `src` to `dst`: one `Transfer` per member once chunked.

    `src_box`, `dst_box`, `global_box`, `nbytes`, `link` and `stage` mean what they mean on a `Transfer` (`nbytes`
    per member); `dep` is the plan-order index of the arrival a relay forward waits for, or -1.
    """

    src: int
    dst: int
    src_box: Box
    dst_box: Box
    global_box: Box
    nbytes: int
    link: Link
    stage: int
    members: Members
    dep: int = -1


_FIELD = {name: i for i, name in enumerate(Unit._fields)}  # column extraction reads rows with itemgetter (fast)
_SHAPE, _OFFSETS = operator.attrgetter("shape"), operator.attrgetter("offsets")
_new_unit = tuple.__new__  # `_new_unit(Unit, values)`: a Unit without `Unit.__new__`'s argument parsing (hot)


@dataclass(frozen=True, slots=True)
class _Columns:
    """The numeric fields of a plan's N transfer units as arrays (entry i is unit i in plan order): what chunk
    assignment and statistics need, extracted once."""

    src: np.ndarray  # (N,) int64 rank
    dst: np.ndarray  # (N,) int64 rank
    nbytes: np.ndarray  # (N,) int64: bytes of the whole unit (a member's bytes times `count`)
    link: np.ndarray  # (N,) int8 index into LINKS
    dep: np.ndarray  # (N,) int64 index of the arrival a forward waits for, -1 when none
    count: np.ndarray  # (N,) int64 members (transfers) in the unit
    ranks: np.ndarray  # (R,) int64 the ranks that occur, ascending
    src_id: np.ndarray  # (N,) int64 index of `src` in `ranks`
    dst_id: np.ndarray  # (N,) int64 index of `dst` in `ranks`

    @classmethod
    def make(cls, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, link: np.ndarray, dep: np.ndarray,
             count: np.ndarray) -> _Columns:
        """The columns, with the dense rank ids derived from `src` and `dst`."""
        return cls(src, dst, nbytes, link, dep, count, *_dense_ids(src, dst))


COMPACT_ROWS = 4096
"""Plans with at least this many rows keep them as columns (`_Rows`): below it, the few objects cost the cyclic GC
less than the conversion costs planning."""


class _Rows(Sequence):
    """The rows of a `_Transfers` once planning is done: every field as a column, the boxes as numbers, and a
    `Unit` (with its `Box`es) built only when a row is read. A plan then holds no object per row, so the cyclic
    GC has nothing of it to scan (a 65,536-transfer plan added ~265k tracked objects, a third of a second per full
    pass, while it stayed alive).

    Reads as the list of `Unit`s it was built from: `len`, indexing (an int or a slice), iteration.
    """

    __slots__ = ("src", "dst", "nbytes", "link", "stage", "members", "dep", "_coords", "_start", "_ndim")

    def __init__(self, rows: Sequence[Unit], cols: _Columns) -> None:
        """`rows` as columns; `cols`: the plan's unit columns (rows first), whose numeric fields are reused. The
        three boxes of a row must have one shape (as a validated plan's do)."""
        n = len(rows)
        get = operator.itemgetter
        self.src, self.dst, self.link, self.dep = cols.src[:n], cols.dst[:n], cols.link[:n], cols.dep[:n]
        self.members: list[Members] = list(map(get(_FIELD["members"]), rows))  # shared tuples, few objects
        self.nbytes = cols.nbytes[:n] // np.maximum(cols.count[:n], 1)
        self.stage = np.fromiter(map(get(_FIELD["stage"]), rows), np.int64, n)
        shapes = list(map(_SHAPE, map(get(_FIELD["global_box"]), rows)))
        ndim = np.fromiter(map(len, shapes), np.int64, n)
        total = int(ndim.sum())
        flat = itertools.chain.from_iterable
        cols_ = [np.fromiter(flat(shapes), np.int64, total)]
        for box in ("src_box", "dst_box", "global_box"):  # offsets of each; shapes are the global box's
            cols_.append(np.fromiter(flat(map(_OFFSETS, map(get(_FIELD[box]), rows))), np.int64, total))
        self._ndim = ndim
        self._start = np.concatenate([[0], np.cumsum(ndim)[:-1]]) if n else np.zeros(0, np.int64)
        self._coords = cols_

    def __len__(self) -> int:
        return self.src.size

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self._row(k) for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        return self._row(i)

    def __iter__(self) -> Iterator[Unit]:
        return map(self._row, range(len(self)))

    def _row(self, i: int) -> Unit:
        a = int(self._start[i])
        b = a + int(self._ndim[i])
        shape, so, do, go = (tuple(c[a:b].tolist()) for c in self._coords)
        return _new_unit(Unit, (int(self.src[i]), int(self.dst[i]), Box._make(so, shape), Box._make(do, shape),
                                Box._make(go, shape), int(self.nbytes[i]), LINKS[self.link[i]], int(self.stage[i]),
                                self.members[i], int(self.dep[i])))


class _Transfers:
    """Every transfer unit of one plan, in plan order: first the ones emitted one at a time (`rows`), then the
    relay forwards of network arrivals, which are emitted a part at a time and kept as columns.

    A unit (`Unit`) moves the same boxes of each member tensor, `nbytes` per member. A whole-model plan forwards
    each arrival to every other needer of its domain (most of its transfers): those are kept per part, as a few
    flat lists (no tuple per forward), and the needers and their boxes as references to the lists the plan's
    geometry already holds (shared by every part cut from the same need) and the index of the one that received
    it: no object, and no list entry, per forward; the cyclic GC has almost nothing to scan.
    """

    __slots__ = ("rows", "p_src", "p_src_box", "p_box", "p_nbytes", "p_members", "p_dep", "p_count",
                 "p_needers", "p_dst_boxes", "p_skip", "_num_forwards", "_f_start", "_columns")

    def __init__(self) -> None:
        self.rows: list[Unit] | _Rows = []  # a list while planning, then columns (`compact`)
        # per forwarded part: the relay (sender), its box, the global box, bytes, members, arrival, forwards
        self.p_src: list[int] = []
        self.p_src_box: list[Box] = []
        self.p_box: list[Box] = []
        self.p_nbytes: list[int] = []
        self.p_members: list[Members] = []
        self.p_dep: list[int] = []
        self.p_count: list[int] = []
        # per forwarded part: every needer and where the box goes in its tensor (shared, read only), and which
        # needer is the relay (it gets no forward); the part's forwards go to the others, in order
        self.p_needers: list[Sequence[int]] = []
        self.p_dst_boxes: list[Sequence[Box]] = []
        self.p_skip: list[int] = []
        self._num_forwards = 0
        self._f_start: list[int] | None = None  # per part, its first forward (and the total at the end)
        self._columns: tuple[int, _Columns] | None = None  # (units when extracted, columns)

    def __len__(self) -> int:
        return len(self.rows) + self._num_forwards

    @property
    def num_parts(self) -> int:
        return len(self.p_count)

    def add_forwards(self, relay: int, relay_box: Box, needers: Sequence[int], dst_boxes: Sequence[Box], skip: int,
                     box: Box, nbytes: int, members: Members, dep: int) -> int:
        """Forward `box` (arrival `dep`, held by `relay` at `relay_box`) to every needer but number `skip`; a
        needer that is the relay itself (another place in its tensor) gets a local copy. Returns the NVLink bytes.

        `needers` and `dst_boxes` are kept by reference: the caller must not change them afterwards."""
        count = len(needers) - 1
        self.p_needers.append(needers)
        self.p_dst_boxes.append(dst_boxes)
        self.p_skip.append(skip)
        self.p_src.append(relay)
        self.p_src_box.append(relay_box)
        self.p_box.append(box)
        self.p_nbytes.append(nbytes)
        self.p_members.append(members)
        self.p_dep.append(dep)
        self.p_count.append(count)
        self._num_forwards += count
        self._f_start = None
        return nbytes * len(members) * (count + 1 - needers.count(relay))

    def compact(self) -> None:
        """Keep the rows as columns (`_Rows`) from now on, when there are at least `COMPACT_ROWS`: call once no
        more units are added and the plan is validated (a row's three boxes then share one shape)."""
        if isinstance(self.rows, list) and len(self.rows) >= COMPACT_ROWS:
            self.rows = _Rows(self.rows, self.columns())

    def row_members(self) -> Sequence[Members]:
        """The members of every row, in order."""
        rows = self.rows
        return rows.members if isinstance(rows, _Rows) else list(map(operator.itemgetter(_FIELD["members"]), rows))

    def targets(self, first: int, stop: int) -> tuple[list[int], list[Box]]:
        """The destination rank and box of every forward of parts `first..stop-1`, in plan order."""
        dsts: list[int] = []
        boxes: list[Box] = []
        for ns, bs, k in zip(self.p_needers[first:stop], self.p_dst_boxes[first:stop], self.p_skip[first:stop]):
            dsts.extend(ns[:k])
            dsts.extend(ns[k + 1:])
            boxes.extend(bs[:k])
            boxes.extend(bs[k + 1:])
        return dsts, boxes

    def _forward(self, k: int, j: int) -> Unit:
        """Forward `j` (counted over all forwards), of part `k`."""
        q = j - self._starts()[k]
        if q >= self.p_skip[k]:
            q += 1
        src, dst = self.p_src[k], self.p_needers[k][q]
        return _new_unit(Unit, (src, dst, self.p_src_box[k], self.p_dst_boxes[k][q], self.p_box[k], self.p_nbytes[k],
                                "local" if dst == src else "nvlink", 1, self.p_members[k], self.p_dep[k]))

    def _starts(self) -> list[int]:
        if self._f_start is None:
            self._f_start = [0, *itertools.accumulate(self.p_count)]
        return self._f_start

    def row(self, i: int) -> Unit:
        """Unit `i` in plan order."""
        n = len(self.rows)
        if i < n:
            return self.rows[i]
        j = i - n
        return self._forward(bisect.bisect_right(self._starts(), j) - 1, j)

    def __iter__(self) -> Iterator[Unit]:
        yield from self.rows
        yield from self.forwards(0, len(self.p_count))

    def forwards(self, first: int, stop: int) -> Iterator[Unit]:
        """The forward units of parts `first..stop-1`, in plan order."""
        starts = self._starts()
        for k in range(first, stop):
            for j in range(starts[k], starts[k + 1]):
                yield self._forward(k, j)

    def columns(self) -> _Columns:
        """The numeric fields of every unit, extracted once (again only if units were added since)."""
        if self._columns is None or self._columns[0] != len(self):
            self._columns = (len(self), self._extract())
        return self._columns[1]

    def _extract(self) -> _Columns:
        rows = self.rows
        n = len(rows)

        compact = isinstance(rows, _Rows)

        def col(name: str) -> np.ndarray:
            if compact:
                return getattr(rows, name)
            return np.fromiter(map(operator.itemgetter(_FIELD[name]), rows), np.int64, n)

        link = rows.link if compact else np.fromiter(
            map(_LINK_CODE.__getitem__, map(operator.itemgetter(_FIELD["link"]), rows)), np.int8, n)
        row_count = np.fromiter(map(len, self.row_members()), np.int64, n)
        count = np.asarray(self.p_count, dtype=np.int64)

        def per_forward(values: list[int]) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype=np.int64), count)

        f_src = per_forward(self.p_src)
        # every part's needers back to back, less the relay's own entry
        lens = count + 1
        flat = np.fromiter(itertools.chain.from_iterable(self.p_needers), np.int64, int(lens.sum()))
        keep = np.ones(flat.size, bool)
        keep[np.cumsum(lens) - lens + np.asarray(self.p_skip, dtype=np.int64)] = False
        f_dst = flat[keep]
        f_link = np.where(f_dst == f_src, _LOCAL, _LINK_CODE["nvlink"]).astype(np.int8)
        f_count = per_forward(list(map(len, self.p_members)))
        units = np.concatenate([row_count, f_count])
        return _Columns.make(np.concatenate([col("src"), f_src]), np.concatenate([col("dst"), f_dst]),
                             np.concatenate([col("nbytes"), per_forward(self.p_nbytes)]) * units,
                             np.concatenate([link, f_link]), np.concatenate([col("dep"), per_forward(self.p_dep)]),
                             units)


class TransferColumns(NamedTuple):
    """Every transfer of a plan as numeric columns, in plan order (entry i is `plan.transfers[i]`): what
    accounting over a whole plan reads, without building a `Transfer` (and its boxes) per entry.

    Attributes:
        src, dst: `(T,)` int64 global ranks.
        nbytes: `(T,)` int64 bytes of each transfer.
        link: `(T,)` int8 index into `LINKS` (`"local"`, `"nvlink"`, `"network"`).
        stage: `(T,)` int8, 0 or 1 (a relay forward).
        chunk: `(T,)` int64 chunk index.
        item: `(T,)` int64 index of the plan item.
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    link: np.ndarray
    stage: np.ndarray
    chunk: np.ndarray
    item: np.ndarray


def transfer_columns(units: _Transfers, cols: _Columns, chunks: np.ndarray) -> TransferColumns:
    """The per-transfer columns of `units` (one transfer per member of each unit, in member order).

    Args:
        units: the plan's transfer units; `cols` their columns (`units.columns()`); `chunks`: `(N,)` chunk per unit.

    Example: units `[u0 (members items 3, 4), u1 (item 5)]` give `item == [3, 4, 5]` and `src == [u0.src,
    u0.src, u1.src]`.
    """
    count = cols.count
    unit = np.repeat(np.arange(count.size), count)  # (T,) the unit of each transfer
    rows = units.row_members()
    row_items = [m[0] for ms in rows for m in ms]
    part_items = [m[0] for ms in units.p_members for m in ms]
    items = np.asarray(row_items + part_items, dtype=np.int64)
    # where each unit's members start in `items`: rows back to back, then each forward at its part's members
    row_start = np.cumsum(np.concatenate([[0], count[:len(rows)]]))[:-1]
    part_len = np.fromiter(map(len, units.p_members), np.int64, units.num_parts)
    part_start = len(row_items) + np.cumsum(np.concatenate([[0], part_len]))[:-1]
    start = np.concatenate([row_start, np.repeat(part_start, np.asarray(units.p_count, dtype=np.int64))])
    first = np.cumsum(np.concatenate([[0], count]))[:-1]  # (N,) each unit's first transfer
    within = np.arange(unit.size) - first[unit]
    per = cols.nbytes // np.maximum(count, 1)
    return TransferColumns(cols.src[unit], cols.dst[unit], per[unit], cols.link[unit],
                           (cols.dep[unit] >= 0).astype(np.int8), np.asarray(chunks, dtype=np.int64)[unit],
                           items[start[unit] + within])


def _dense_ids(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranks that occur, ascending, and each entry's index into them: `(ranks, src_id, dst_id)`."""
    if not src.size:
        return np.zeros(0, np.int64), src, dst
    present = np.zeros(int(max(src.max(), dst.max())) + 1, bool)
    present[src] = True
    present[dst] = True
    dense = np.cumsum(present) - 1
    return np.flatnonzero(present), dense[src], dense[dst]


def _unique_triples(a: np.ndarray, b: np.ndarray, c: np.ndarray, b_size: int,
                    c_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct `(a, b, c)` triples, as three arrays, for `0 <= a`, `0 <= b < b_size`, `0 <= c < c_size`."""
    if a.size and (int(a.max()) + 1) * b_size * c_size < 1 << 62:  # one int64 key per triple, then a plain sort
        key = np.sort((a * b_size + b) * c_size + c)
        key = key[np.r_[True, key[1:] != key[:-1]]]
        ab, c = np.divmod(key, c_size)
        a, b = np.divmod(ab, b_size)
        return a, b, c
    order = np.lexsort((c, b, a))
    a, b, c = a[order], b[order], c[order]
    first = np.r_[True, (a[1:] != a[:-1]) | (b[1:] != b[:-1]) | (c[1:] != c[:-1])] if a.size else np.zeros(0, bool)
    return a[first], b[first], c[first]


_CHUNK_GROW = 16
"""Chunks are added to the open-chunk bit sets at least this many at a time, and otherwise as many as there are
(doubling): a plan of one chunk does not pay for a thousand chunks per rank, and a plan of thousands grows a few
times. Which chunk a transfer takes does not depend on it."""


class _OpenChunks:
    """Per rank (dense ids 0..R-1): the chunks still open to new transfers, and the bytes used in each.

    The open set of a rank is one int whose bit `L - 1 - c` stands for chunk `c` (`L` chunks allocated), so the
    first chunk open on both ends of a transfer is the highest set bit of one AND, found by `int.bit_length`
    without a loop over chunks.
    """

    __slots__ = ("size", "open", "used", "_masks")

    def __init__(self, num_ranks: int) -> None:
        self.size = 0
        self.open = [0] * num_ranks
        self.used: list[list[int]] = [[] for _ in range(num_ranks)]
        self._masks: dict[int, int] = {}

    def grow(self, need: int) -> None:
        """Allocate chunks until there are more than `need`, all open."""
        g = max(need - self.size, 0) + max(_CHUNK_GROW, self.size)
        ones = (1 << g) - 1
        op = self.open
        for r in range(len(op)):
            op[r] = (op[r] << g) | ones
            self.used[r].extend([0] * g)
        self.size += g
        self._masks.clear()

    def from_chunk(self, m: int) -> int:
        """The bit mask of chunks >= `m` (allocating past `m` first)."""
        mk = self._masks.get(m)
        if mk is None:
            if m >= self.size:
                self.grow(m)
            mk = self._masks[m] = (1 << (self.size - m)) - 1
        return mk

    def place(self, src: list[int], nbytes: list[int], min_chunk: list[int], stops: list[int], dst: list[int],
              cap: int) -> list[int]:
        """First fit, in the given order: each transfer goes to the first chunk >= its `min_chunk` open on both
        ends where both still have room for it. A chunk is closed for a rank when a transfer of the size just
        placed would no longer fit (later transfers of a stage are no larger), or when one does not fit. A rank's
        first transfer in a chunk always fits (a box larger than `cap` has a chunk of its own).

        The transfers come in runs that share sender, size and earliest chunk (the forwards of one relayed box to
        the other needers of its domain): run `i` is transfers `stops[i - 1]..stops[i] - 1` (from 0), to `dst[j]`
        each, never the sender itself (local copies take no chunk room). The sender's open set and room are read
        once per run; how the transfers are grouped into runs does not change where they go."""
        op, used = self.open, self.used
        size = self.size
        out: list[int] = []
        append = out.append
        lo = 0
        for s, n, m, hi in zip(src, nbytes, min_chunk, stops):
            mk = self.from_chunk(m) if m else -1  # may grow the sets: read the size after
            size = self.size
            xs = op[s] & mk
            us = used[s]
            for d in dst[lo:hi]:
                x = xs & op[d]
                while True:
                    if not x:  # no chunk open on both ends yet: allocate more and look again
                        self.grow(size)
                        size = self.size
                        xs = op[s] & (self.from_chunk(m) if m else -1)
                        us = used[s]
                        x = xs & op[d]
                        continue
                    hb = x.bit_length() - 1  # the first chunk open on both ends is the highest common bit
                    c = size - 1 - hb
                    ud = used[d]
                    a = us[c] + n
                    b = ud[c] + n
                    fit_s = a <= cap or a == n  # room left, or the chunk is empty on this end
                    fit_d = b <= cap or b == n
                    if fit_s and fit_d:
                        break
                    bit = 1 << hb
                    if not fit_s:
                        op[s] ^= bit
                        xs ^= bit
                    if not fit_d:
                        op[d] ^= bit
                    x ^= bit  # closed on one end at least, so no longer common
                us[c] = a
                ud[c] = b
                if a + n > cap:
                    bit = 1 << hb
                    op[s] ^= bit
                    xs ^= bit
                if b + n > cap:
                    op[d] ^= 1 << hb
                append(c)
            lo = hi
        return out


def _assign_chunks(cols: _Columns, chunk_cap: int) -> np.ndarray:
    """Chunk index per raw transfer, shape (N,): send + receive bytes of a rank in a chunk stay within
    `chunk_cap`, and a relay forward goes at least `RELAY_CHUNK_LAG` chunks after its arrival.

    Arrivals and direct transfers (stage 0) are placed first, then forwards (stage 1), each largest first, by
    first fit (`_OpenChunks.place`): a chunk some rank left room in is filled by later, smaller transfers, so
    ranks dragged ahead by a busy peer do not leave holes. Local copies take no staging: they go in chunk 0, or
    with the forward they belong to after their arrival.
    """
    n = cols.src.size
    chunks = np.zeros(n, np.int64)
    if not n:
        return chunks
    src_id, dst_id = cols.src_id, cols.dst_id
    state = _OpenChunks(cols.ranks.size)
    forward = cols.dep >= 0
    for stage in (0, 1):
        sel = np.flatnonzero(forward) if stage else np.flatnonzero(~forward)
        min_chunk = chunks[cols.dep[sel]] + RELAY_CHUNK_LAG if stage else np.zeros(sel.size, np.int64)
        is_local = cols.link[sel] == _LOCAL
        chunks[sel[is_local]] = min_chunk[is_local]
        sel, min_chunk = sel[~is_local], min_chunk[~is_local]
        order = np.lexsort((sel, -cols.nbytes[sel]))  # largest first, then plan order
        sel, min_chunk = sel[order], min_chunk[order]
        s_sel, n_sel = src_id[sel], cols.nbytes[sel]
        # runs of one sender, size and earliest chunk (the forwards of one relayed box come as one)
        new_run = np.r_[True, (s_sel[1:] != s_sel[:-1]) | (n_sel[1:] != n_sel[:-1]) |
                        (min_chunk[1:] != min_chunk[:-1])] if sel.size else np.zeros(0, bool)
        first = np.flatnonzero(new_run)
        stops = np.r_[first[1:], sel.size].astype(np.int64)
        chunks[sel] = state.place(s_sel[first].tolist(), n_sel[first].tolist(), min_chunk[first].tolist(),
                                  stops.tolist(), dst_id[sel].tolist(), chunk_cap)
    return chunks
