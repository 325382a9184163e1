"""Plan validation: a `PlanData` checked against itself and its layouts, as `Plan` does when built.

`_check_chunks`: one chunk per unit, relay forwards far enough after their arrivals, every rank's chunk within the
staging budget. `_validate`: boxes agree in shape and lie in bounds, every destination element is written exactly
once, and with relays the network bytes meet the lower bound. Both raise the one error of validation (`_invalid`).
(The bounds on what a plan may cost, `PlanLimits`, are checked in `_checks`.)
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Iterable, Sequence

import numpy as np

from reshard.planner._box import Box, intersect
from reshard.planner._chunks import _LOCAL, RELAY_CHUNK_LAG, Unit, _Columns
from reshard.planner._data import PlanData, UnitSpan
from reshard.planner._layout import _geometry_id
from reshard.planner._types import PIPELINE_DEPTH, PlanStats

_GBOX, _SRC_BOX, _DST_BOX, _DST = (operator.itemgetter(Unit._fields.index(f)) for f in
                                   ("global_box", "src_box", "dst_box", "dst"))
_SHAPE, _OFFSETS = operator.attrgetter("shape"), operator.attrgetter("offsets")
_UNBOUNDED = 1 << 62


def _repeat_each(values: Sequence[Any], counts: Sequence[int]) -> Iterable[Any]:
    """Each of `values` `counts[i]` times, in order."""
    return itertools.chain.from_iterable(map(itertools.repeat, values, counts))


def _expected_elements(layout: Any, rank: int) -> int:
    """Elements of `layout`'s pieces on `rank` (what the plan must write there)."""
    return sum(math.prod(piece.global_box.shape) for piece in layout.pieces(rank))


def _invalid(message: str) -> ValueError:
    """The one error of plan validation: a `PlanData` that contradicts itself or its layouts."""
    return ValueError(f"inconsistent plan: {message}")


def _check_chunks(data: PlanData, cols: _Columns, chunks: np.ndarray) -> None:
    """One chunk per unit; forwards at least `RELAY_CHUNK_LAG` chunks after their arrival; each rank's send plus
    receive bytes in a chunk within `staging_bytes // PIPELINE_DEPTH` (the planner cuts every box to fit)."""
    n = cols.src.size
    if chunks.shape != (n,) or (n and (chunks.dtype.kind not in "iu" or int(chunks.min()) < 0)):
        raise _invalid(f"chunks must be {n} non-negative integers (one per unit), got shape {chunks.shape} of "
                       f"{chunks.dtype}")
    fwd = np.flatnonzero(cols.dep >= 0)
    dep = cols.dep[fwd]
    if (dep >= fwd).any():
        i = int(fwd[np.argmax(dep >= fwd)])
        raise _invalid(f"unit {i} forwards arrival {int(cols.dep[i])}, which is not an earlier unit")
    early = chunks[fwd] < chunks[dep] + RELAY_CHUNK_LAG
    if early.any():
        i = int(fwd[np.argmax(early)])
        raise _invalid(f"unit {i} forwards in chunk {chunks[i]} the arrival of chunk {chunks[cols.dep[i]]}; expected "
                       f"at least {RELAY_CHUNK_LAG} chunks later (RELAY_CHUNK_LAG)")
    staged = np.flatnonzero(cols.link != _LOCAL)
    if not staged.size:
        return
    cap = data.staging_bytes // PIPELINE_DEPTH
    num_ranks = cols.ranks.size
    key = chunks[staged] * num_ranks
    nbytes = cols.nbytes[staged].astype(np.float64)
    # a rank's bytes in a chunk: what it sends plus what it receives (float64 sums are exact below 2**53 bytes)
    used = np.bincount(key + cols.src_id[staged], weights=nbytes, minlength=int(key.max()) + num_ranks)
    used += np.bincount(key + cols.dst_id[staged], weights=nbytes, minlength=used.size)
    over = used > cap
    if over.any():
        c, r = divmod(int(np.argmax(over)), num_ranks)
        raise _invalid(f"rank {int(cols.ranks[r])} moves {int(used[c * num_ranks + r])} bytes in chunk {c}, over "
                       f"staging_bytes // PIPELINE_DEPTH = {cap}")


def _overlap(boxes: Sequence[Box]) -> bool:
    """Whether two of `boxes` share an element: a sweep along dim 0, comparing only boxes whose dim-0 ranges
    overlap (a rank's boxes of one tensor are mostly slabs along dim 0)."""
    if not boxes[0].offsets:  # 0-d: every box is the one element
        return len(boxes) > 1
    boxes = sorted(boxes, key=lambda b: b.offsets)
    for i, a in enumerate(boxes):
        end = a.offsets[0] + a.shape[0]
        for j in range(i + 1, len(boxes)):  # indices, not a slice: a slice copies the rest on every step
            b = boxes[j]
            if b.offsets[0] >= end:
                break
            if intersect(a, b) is not None:
                return True
    return False


def _validate(data: PlanData, stats: PlanStats) -> None:
    """Checks from box arithmetic: boxes agree in shape and lie in bounds, every destination element is written
    exactly once, and with relays the network bytes meet the lower bound.

    `stats`: the plan's byte accounting (`Plan.stats`, computed from `data`). `data.planned`: where the units
    planned from scratch are; the others replay one of them (same geometry, same boxes), so checking the planned
    ones checks all, and the byte total (every unit's bytes sum to what the destinations need) catches a unit left
    out or added. None checks every unit.

    The per-box checks run on numpy columns of the boxes (one group per number of dims); only the (item, rank)
    pairs whose boxes overlap along dim 0 once sorted are checked box by box (`_overlap`).
    """
    s = stats
    spans = data.planned
    if s.total_bytes != s.needed_bytes:
        raise _invalid(f"the transfers write {s.total_bytes} bytes, but the destinations need {s.needed_bytes}")
    store = data.units
    num_rows = len(store.rows)
    if spans is None:
        spans = (UnitSpan(0, num_rows, 0, store.num_parts),)
        every_member = True
    else:
        # the members of a unit share its boxes and their geometry: the first member of each first unit stands
        # for all
        every_member = False
    starts = store._starts()
    num_items = len(data.items)
    # one entry per checked (unit, member): its item, destination rank and box; `where` finds the unit again
    items_of: list[int] = []
    dst_ranks: list[int] = []
    boxes: list[Box] = []
    where: list[int] = []
    for a, b, pa, pb in spans:
        rows = store.rows[a:b]
        g_shapes = list(map(_SHAPE, map(_GBOX, rows)))
        if g_shapes != list(map(_SHAPE, map(_SRC_BOX, rows))) or g_shapes != list(map(_SHAPE, map(_DST_BOX, rows))):
            u = next(u for u in rows if not u.global_box.shape == u.src_box.shape == u.dst_box.shape)
            raise _invalid(f"transfer shapes disagree: {u}")
        fa, fb = starts[pa], starts[pb]
        counts = store.p_count[pa:pb]
        part_shapes = list(map(_SHAPE, store.p_box[pa:pb]))
        f_dst, f_boxes = store.targets(pa, pb)
        if part_shapes != list(map(_SHAPE, store.p_src_box[pa:pb])) or \
                list(map(_SHAPE, f_boxes)) != list(_repeat_each(part_shapes, counts)):
            j = next(j for j in range(fa, fb) if not store.row(num_rows + j).global_box.shape ==
                     store.row(num_rows + j).src_box.shape == store.row(num_rows + j).dst_box.shape)
            raise _invalid(f"transfer shapes disagree: {store.row(num_rows + j)}")
        if every_member:
            for k, u in enumerate(rows, a):
                for m in u[8]:
                    items_of.append(m[0])
                    dst_ranks.append(u[1])
                    boxes.append(u[3])
                    where.append(k)
            for k, (ms, c) in enumerate(zip(store.p_members[pa:pb], counts), pa):
                for j in range(starts[k], starts[k] + c):
                    for m in ms:
                        items_of.append(m[0])
                        dst_ranks.append(f_dst[j - fa])
                        boxes.append(f_boxes[j - fa])
                        where.append(num_rows + j)
        else:
            items_of.extend(u[8][0][0] for u in rows)
            dst_ranks.extend(map(_DST, rows))
            boxes.extend(map(_DST_BOX, rows))
            where.extend(range(a, b))
            items_of.extend(_repeat_each([ms[0][0] for ms in store.p_members[pa:pb]], counts))
            dst_ranks.extend(f_dst)
            boxes.extend(f_boxes)
            where.extend(range(num_rows + fa, num_rows + fb))
    planned: set[int] | None = None if every_member else set(items_of)
    if items_of and not (0 <= min(items_of) and max(items_of) < num_items):
        k = next(k for k, i in enumerate(items_of) if not 0 <= i < num_items)
        raise _invalid(f"unit names item {items_of[k]}, but the plan has {num_items}: {store.row(where[k])}")
    # every (planned item, destination rank): its key, local shape and the elements it must receive, per geometry
    check_items = sorted(planned) if planned is not None else range(num_items)
    span = 1 + max([*dst_ranks, *(max(data.items[i].dst.ranks, default=0) for i in check_items)], default=0)
    geo: dict[int, tuple[np.ndarray, list[tuple[int, ...]], np.ndarray]] = {}
    table_keys, table_shapes, table_expected = [], [], []
    for i in check_items:
        dst = data.items[i].dst
        gid = _geometry_id(dst)
        g = geo.get(gid)
        if g is None:
            ranks = list(dst.ranks)
            g = geo[gid] = (np.asarray(ranks, np.int64), [tuple(dst.local_shape(r)) for r in ranks],
                            np.asarray([_expected_elements(dst, r) for r in ranks], np.int64))
        table_keys.append(g[0] + i * span)
        table_shapes.extend(g[1])
        table_expected.append(g[2])
    keys_t = np.concatenate(table_keys) if table_keys else np.zeros(0, np.int64)
    expected_t = np.concatenate(table_expected) if table_expected else np.zeros(0, np.int64)
    order_t = np.argsort(keys_t, kind="stable")
    sorted_t = keys_t[order_t]
    keys = np.asarray(items_of, np.int64) * span + np.asarray(dst_ranks, np.int64)
    pos = np.minimum(np.searchsorted(sorted_t, keys), max(sorted_t.size - 1, 0))
    found = sorted_t[pos] == keys if sorted_t.size else np.zeros(keys.size, bool)
    row = np.where(found, order_t[pos] if sorted_t.size else 0, -1)  # table row of each entry, -1: none
    max_nd = max(map(len, table_shapes), default=0)
    bound_t = np.fromiter(itertools.chain.from_iterable((*ls, *(_UNBOUNDED,) * (max_nd - len(ls))) for ls in
                                                        table_shapes), np.int64, len(table_shapes) * max_nd)
    bound_t = bound_t.reshape(len(table_shapes), max_nd)
    got = np.zeros(keys_t.size, np.int64)
    ndims = np.fromiter(map(len, map(_SHAPE, boxes)), np.int64, len(boxes))
    flat = itertools.chain.from_iterable
    suspects: list[int] = []  # table rows whose boxes may overlap
    for ndim in np.unique(ndims).tolist():
        sel = np.flatnonzero(ndims == ndim)
        rows_s = row[sel]
        if not ndim:  # 0-d: every box is the one element
            np.add.at(got, rows_s[rows_s >= 0], 1)
            continue
        sel_boxes = boxes if sel.size == len(boxes) else list(map(boxes.__getitem__, sel.tolist()))
        off = np.fromiter(flat(map(_OFFSETS, sel_boxes)), np.int64, sel.size * ndim).reshape(-1, ndim)
        ext = np.fromiter(flat(map(_SHAPE, sel_boxes)), np.int64, sel.size * ndim).reshape(-1, ndim)
        bound = np.full((sel.size, ndim), _UNBOUNDED, np.int64)
        known = rows_s >= 0
        width = min(ndim, max_nd)
        bound[known, :width] = bound_t[rows_s[known], :width]
        for k in np.flatnonzero(~known).tolist():  # a rank outside the item's destination ranks
            ls = tuple(data.items[items_of[sel[k]]].dst.local_shape(dst_ranks[sel[k]]))[:ndim]
            bound[k, :len(ls)] = ls
        bad = ((off < 0) | (off + ext > bound)).any(axis=1)
        if bad.any():
            k = int(sel[int(np.argmax(bad))])
            ls = data.items[items_of[k]].dst.local_shape(dst_ranks[k])
            raise _invalid(f"destination box out of bounds of local shape {ls}: {store.row(where[k])}")
        np.add.at(got, rows_s[known], ext[known].prod(axis=1))
        # sorted by (row, dim-0 start), boxes that start at or after the previous one's end cannot overlap
        order = np.lexsort((off[:, 0], rows_s))
        ids_s, start, stop = rows_s[order], off[order, 0], (off + ext)[order, 0]
        clash = (ids_s[1:] == ids_s[:-1]) & (start[1:] < stop[:-1]) & (ids_s[1:] >= 0)
        suspects.extend(np.unique(ids_s[1:][clash]).tolist())
    if ndims.size and (ndims == 0).any():
        counts = np.bincount(row[(ndims == 0) & (row >= 0)], minlength=keys_t.size)
        suspects.extend(np.flatnonzero(counts > 1).tolist())
    short = np.flatnonzero(got != expected_t)
    if short.size:
        k = int(short[0])
        i, r = divmod(int(keys_t[k]), span)
        raise _invalid(f"tensor {data.items[i].label!r}: rank {r} receives {int(got[k])} elements, expected "
                       f"{int(expected_t[k])}")
    if suspects:
        members: dict[int, list[Box]] = {k: [] for k in suspects}
        for b, k in zip(boxes, row.tolist()):
            if k in members:
                members[k].append(b)
        for k in sorted(members):
            if _overlap(members[k]):
                i, r = divmod(int(keys_t[k]), span)
                raise _invalid(f"tensor {data.items[i].label!r}: rank {r} receives some elements more than once")
    if data.relay and s.network_bytes != s.network_lower_bound:
        raise _invalid(f"network bytes {s.network_bytes} != lower bound {s.network_lower_bound} with relay")
