"""How a plan stores its transfers: rows kept as numeric columns (`_Rows`) read back as the very units they were
built from, forwards kept per part read back as their units, placement in runs equals placement one by one, and
the column-wise validation still refuses tampered boxes (the negative controls).

The reference for the column store is the list of `Unit`s the planner built (the representation it replaces);
for placement in runs it is placing the same transfers one at a time (the rule itself is checked against a plain
statement of it in `test_planner_chunks.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from reshard import Layout, Mesh, Topology, clear_plan_cache, plan, plan_many
from reshard.planner import Box, Plan, PlanItem, _chunks
from reshard.planner._chunks import _OpenChunks, _Rows, _Transfers


def layout(shape: tuple[int, ...], ranks: list[int], dims: tuple[int, ...], placements: list,
           dtype: torch.dtype = torch.float32) -> Layout:
    return Layout(shape, Mesh(torch.tensor(ranks).reshape(dims)), placements, dtype)


def mixed_items() -> list[PlanItem]:
    """1-D, 2-D and 3-D tensors, replicas (relay forwards) and a rank on both sides (local copies)."""
    a1 = layout((24,), list(range(4)), (4,), [Shard(0)])
    b1 = layout((24,), list(range(2, 8)), (3, 2), [Replicate(), Shard(0)])
    a2 = layout((12, 10), list(range(8)), (2, 4), [Replicate(), Shard(0)])
    b2 = layout((12, 10), list(range(4, 12)), (4, 2), [Replicate(), Shard(1)])
    a3 = layout((4, 6, 8), list(range(4)), (2, 2), [Shard(0), Shard(2)])
    b3 = layout((4, 6, 8), list(range(6, 12)), (2, 3), [Replicate(), Shard(1)])
    return [PlanItem(a1, b1, 0, 0, "v"), PlanItem(a2, b2, 1, 1, "w"), PlanItem(a3, b3, 2, 2, "x"),
            PlanItem(a2, b2, 3, 3, "w2")]


def build(compact_rows: int, **kwargs) -> Plan:
    old = _chunks.COMPACT_ROWS
    try:
        _chunks.COMPACT_ROWS = compact_rows
        clear_plan_cache()
        return plan_many(mixed_items(), Topology(domain_size=4), staging_bytes=1024, min_split_bytes=16, **kwargs)
    finally:
        _chunks.COMPACT_ROWS = old
        clear_plan_cache()


def test_compact_rows_read_back_as_the_units() -> None:
    listed, compact = build(1 << 30), build(0)
    assert isinstance(listed._raw.rows, list) and isinstance(compact._raw.rows, _Rows)
    assert len(compact._raw.rows) > 20 and compact._raw.num_parts > 0  # rows and forwards both occur
    assert list(compact._raw) == list(listed._raw)
    assert compact._raw.rows[3:9] == listed._raw.rows[3:9] and compact._raw.rows[-1] == listed._raw.rows[-1]
    assert compact.transfers == listed.transfers
    assert compact.fingerprint == listed.fingerprint and compact.stats == listed.stats
    for a, b in zip(compact.transfer_columns(), listed.transfer_columns()):
        assert np.array_equal(a, b)
    for r in listed.ranks:
        assert compact.for_rank(r) == listed.for_rank(r)
    # the same data builds the same plan again from its columns
    again = Plan(dataclasses.replace(compact._data))
    assert again.fingerprint == compact.fingerprint and again.transfers == compact.transfers


def test_compact_rows_negative_control() -> None:
    """A changed coordinate is read back changed: the comparison above can fail."""
    listed = build(1 << 30)
    rows = _Rows(listed._raw.rows, listed._raw.columns())
    assert list(rows) == listed._raw.rows
    rows._coords[1][0] += 1  # the first row's source offset along its first dim
    assert rows[0] != listed._raw.rows[0] and rows[0].src_box.offsets[0] == listed._raw.rows[0].src_box.offsets[0] + 1
    assert list(rows)[1:] == listed._raw.rows[1:]
    with pytest.raises(IndexError):
        rows[len(rows)]


def test_forwards_read_back_per_part() -> None:
    """Each forward goes to a needer other than the relay, in needer order; the column of destinations agrees with
    the units built one at a time (hand-checked on the worked example: rank 2 forwards rows 0:2 to rank 3 and rank
    3 rows 2:4 to rank 2)."""
    p = plan(layout((4, 4), [0, 1], (2,), [Shard(0)]), layout((4, 4), [2, 3], (2,), [Replicate()]),
             Topology(domain_size=2))
    fw = [u for u in p._raw if u.dep >= 0]
    assert [(u.src, u.dst, u.global_box) for u in fw] == [(2, 3, Box((0, 0), (2, 4))), (3, 2, Box((2, 0), (2, 4)))]
    units = list(p._raw)
    cols = p._raw.columns()
    assert cols.dst.tolist() == [u.dst for u in units] and cols.src.tolist() == [u.src for u in units]
    dsts, boxes = p._raw.targets(0, p._raw.num_parts)
    assert dsts == [u.dst for u in fw] and boxes == [u.dst_box for u in fw]


def tampered_part(p: Plan, part: int, needer: int, box: Box) -> Plan:
    units = p._data.units
    out = _Transfers()
    for name in ("rows", "p_src", "p_src_box", "p_box", "p_nbytes", "p_members", "p_dep", "p_count", "p_needers",
                 "p_skip"):
        setattr(out, name, list(getattr(units, name)))
    out._num_forwards = units._num_forwards
    out.p_dst_boxes = [list(b) for b in units.p_dst_boxes]
    out.p_dst_boxes[part][needer] = box
    return Plan(dataclasses.replace(p._data, units=out))


def test_a_forward_aimed_at_arrived_rows_is_refused() -> None:
    """Negative control for forwards: rank 3 gets rows 2:4 over the network; aiming the forward of rows 0:2 there
    too keeps the element count and writes rows 2:4 twice."""
    p = plan(layout((4, 4), [0, 1], (2,), [Shard(0)]), layout((4, 4), [2, 3], (2,), [Replicate()]),
             Topology(domain_size=2))
    k = next(k for k in range(p._raw.num_parts) if p._raw.p_src[k] == 2)
    needer = list(p._raw.p_needers[k]).index(3)
    with pytest.raises(ValueError, match="rank 3 receives some elements more than once"):
        tampered_part(p, k, needer, Box((2, 0), (2, 4)))
    with pytest.raises(ValueError, match="out of bounds"):
        tampered_part(p, k, needer, Box((3, 0), (2, 4)))


def test_overlapping_column_blocks_are_refused() -> None:
    """Boxes side by side along dim 1 start at the same row, so the dim-0 sweep cannot clear them and the exact
    check runs: untampered they pass; one block moved over its neighbour (same element count) is refused."""
    src = layout((4, 8), [0, 1, 2, 3], (4,), [Shard(1)])
    dst = layout((4, 8), [4, 5], (2,), [Shard(0)])
    p = plan(src, dst)  # rank 4 receives rows 0:2 as four column blocks of 2
    rows = [i for i, u in enumerate(p._raw.rows) if u.dst == 4]
    assert sorted(p._raw.rows[i].dst_box.offsets for i in rows) == [(0, 0), (0, 2), (0, 4), (0, 6)]
    units = _Transfers()
    units.rows = list(p._raw.rows)
    i = next(i for i in rows if p._raw.rows[i].dst_box.offsets == (0, 2))
    units.rows[i] = units.rows[i]._replace(dst_box=Box((0, 0), (2, 2)))
    with pytest.raises(ValueError, match="rank 4 receives some elements more than once"):
        Plan(dataclasses.replace(p._data, units=units))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_placement_does_not_depend_on_runs(seed: int) -> None:
    """Random runs (sender, size, earliest chunk, 1-8 receivers), as forwards come, placed as runs and one
    transfer at a time: the same chunks (the rule itself is checked against a plain statement of it in
    `test_planner_chunks.py`)."""
    rng = np.random.default_rng(seed)
    num_runs, cap = 300, 100
    src = rng.integers(0, 6, num_runs).tolist()
    size = rng.choice([0, 10, 30, 45, 60, 100, 130], num_runs).tolist()  # 130: a box larger than a chunk
    earliest = rng.integers(0, 40, num_runs).tolist()
    lengths = rng.integers(1, 9, num_runs)
    stops = np.cumsum(lengths).tolist()
    senders = np.repeat(src, lengths)
    dst = ((senders + rng.integers(1, 6, senders.size)) % 6).tolist()  # never the sender (a local copy)
    n = len(dst)
    one = _OpenChunks(6).place(senders.tolist(), np.repeat(size, lengths).tolist(),
                               np.repeat(earliest, lengths).tolist(), list(range(1, n + 1)), dst, cap)
    runs = _OpenChunks(6).place(src, size, earliest, stops, dst, cap)
    assert runs == one
    assert max(one) > _chunks._CHUNK_GROW  # the sets grew while placing
