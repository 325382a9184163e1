"""A refit's metadata in O(what is distinct) (`reshard.refit._metawire`): records + each distinct table once.

Oracle: today's per-rank metadata (`registration`, the form `build` reads, unchanged from the all-gather of whole
registrations): splitting every rank's metadata, sending each distinct table once through a real JSON round trip,
and joining must give it back exactly, for meshes that are ranges and that are not, explicit (fused, padded)
layouts, DTensor coordinates, aliases and scales. Tampered or malformed parts are refused naming the sender.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from reshard.planner import Layout, Mesh, Topology, fuse, vocab_parallel_layout
from reshard.refit._build import build
from reshard.refit._metawire import (
    check_record,
    join_registrations,
    registration,
    split_registration,
    table_owners,
)
from reshard.refit._sources import source_layouts


def _cluster() -> list[dict]:
    """Trainer ranks 0-3 (two stages of two), engine ranks 4-7 (two TP2 replicas), as each rank registers."""
    stage0 = Layout((8, 6), Mesh([0, 1]), [Shard(0)], torch.float32, name="a")
    stage1 = Layout((5, 6), Mesh([3, 2]), [Shard(1)], torch.float32, name="b")  # mesh not a rising range
    dt = Layout((6, 4), Mesh([[0], [1]]), [Shard(0), Replicate()], torch.float32, name="d")  # a DTensor: coords
    q, k = (Layout((n, 6), Mesh([[4, 5], [6, 7]]), [Replicate(), Shard(0)], torch.bfloat16, name=nm)
            for n, nm in ((8, "q"), (4, "k")))
    fq, fk = fuse([q, k])
    vocab = vocab_parallel_layout(11, 6, [4, 5], pad_to=4, replicas=[[4, 5], [6, 7]], name="embed")
    no_alias = {"sources": {}, "dests": {}}
    metas = []
    for r in range(4):
        if r < 2:
            srcs, coords = {"a": stage0, "d": dt}, {"d": [r, 0]}
        else:
            srcs, coords = {"b": stage1}, {}
        aliases = {"sources": {"a": ["a_tied"]}, "dests": {}} if r < 2 else no_alias
        metas.append(registration(r, srcs, coords, {}, [], aliases, [f"rank {r} problem"] if r == 3 else [],
                                  ["fit", f"nonce{r}"]))
    for r in range(4, 8):
        dests = {"qk": [("q", fq), ("k", fk)], "embed": [("embed", vocab)]}
        metas.append(registration(r, {}, {}, dests, ["qk"], no_alias, [], [None, f"nonce{r}"]))
    return metas


def _wire(metas: list[dict]) -> tuple[list[dict], dict[str, object], int]:
    """What the round does, in one process: records (JSON), then each distinct table once (JSON)."""
    parts = [split_registration(m) for m in metas]
    records = [json.loads(json.dumps(rec)) for rec, _, _ in parts]
    for r, rec in enumerate(records):
        assert check_record(r, rec) is None
    by_digest = {rec["table"]: data for rec, _, data in parts}
    tables = {dg: json.loads(by_digest[dg]) for dg in table_owners(records)}
    return records, tables, sum(len(by_digest[dg]) for dg in tables)


def test_join_gives_back_every_ranks_metadata_with_each_distinct_table_sent_once() -> None:
    metas = _cluster()
    records, tables, _ = _wire(metas)
    # ranks 0-1, 2-3 and 4-7 registered the same tensors: three tables; coordinates and errors stay per rank
    assert len(tables) == 3
    assert {dg: owner for dg, (owner, _) in table_owners(records).items()} == {
        records[0]["table"]: 0, records[2]["table"]: 2, records[4]["table"]: 4}
    joined = join_registrations(records, tables)
    assert joined == json.loads(json.dumps(metas))
    assert joined[1]["sources"]["d"]["coord"] == [1, 0] and joined[1]["sources"]["a"]["coord"] is None


def test_a_sources_own_coordinate_that_differs_within_one_layout_survives() -> None:
    lay = Layout((4, 4), Mesh([[0], [1]]), [Shard(0), Replicate()], torch.float32)
    m = registration(0, {"x": lay, "y": lay, "z": lay}, {"x": [0, 0], "z": [1, 0]}, {}, [],
                     {"sources": {}, "dests": {}}, [], [None, "n"])
    records, tables, _ = _wire([m])
    assert join_registrations(records, tables) == json.loads(json.dumps([m]))


def test_what_a_rank_receives_grows_with_the_group_by_its_records_only() -> None:
    """Engine ranks of one TP64 mesh: today each sends the whole mesh's layouts (the all-gather pads to the widest);
    here the table crosses once and each further rank adds one record."""
    def engine(n: int) -> list[dict]:
        lay = Layout((4096, 64), Mesh(list(range(n))), [Shard(0)], torch.bfloat16)
        dests = {f"w{i}": [(f"w{i}", lay)] for i in range(20)}
        return [registration(r, {}, {}, dests, [], {"sources": {}, "dests": {}}, [], [None, "n" * 16])
                for r in range(n)]

    sizes = {}
    for n in (16, 64):
        metas = engine(n)
        records, tables, table_bytes = _wire(metas)
        assert len(tables) == 1 and join_registrations(records, tables) == json.loads(json.dumps(metas))
        widest_record = max(len(json.dumps(r)) for r in records)
        sizes[n] = (n * widest_record + table_bytes, n * max(len(json.dumps(m)) for m in metas))
    (new16, old16), (new64, old64) = sizes[16], sizes[64]
    assert new64 - new16 < 48 * 300  # ~48 more records of < 300 bytes: the table did not grow with the ranks
    assert old64 > 6 * old16  # today's grows faster than the ranks (each rank sends layouts listing every rank)
    assert new64 * 20 < old64


def test_a_tampered_or_malformed_table_or_record_is_refused_naming_its_sender() -> None:
    records, tables, _ = _wire(_cluster())
    dg = records[2]["table"]
    bad = dict(tables)
    bad[dg] = {**tables[dg], "scaled": ["extra"]}
    with pytest.raises(ValueError, match=f"rank 2's registration table does not match its digest {dg}"):
        join_registrations(records, bad)
    assert "rank 5 sent malformed metadata" in check_record(5, {**records[5], "extra": 1})
    assert "rank 5 sent malformed metadata" in check_record(5, {**records[5], "rank": 4})
    assert "rank 5 sent a malformed identity" in check_record(5, {**records[5], "identity": ["x"]})
    assert "rank 5 sent malformed metadata" in check_record(5, {**records[5], "coords": [["a", [0]]]})


def test_a_malformed_rank_range_is_refused() -> None:
    from reshard.refit._metawire import _expand

    enc = {"kind": "mesh", "mesh_shape": [2, 2], "ranks_range": [4, 1]}
    assert _expand(enc, "t")["ranks"] == [4, 5, 6, 7]
    for rng in ([4, 0], [4], "4-7", [4, 1.5]):
        with pytest.raises(ValueError, match="t: malformed ranks_range"):
            _expand({**enc, "ranks_range": rng}, "t")


def test_a_rank_with_many_errors_sends_the_first_ones_and_their_count() -> None:
    """A record stays small next to the others (the round refuses one that is not): 40 errors travel as 16 + 1."""
    m = registration(3, {}, {}, {}, [], {"sources": {}, "dests": {}}, [f"problem {i}" for i in range(40)],
                     [None, "n"])
    records, tables, _ = _wire([registration(r, {}, {}, {}, [], {"sources": {}, "dests": {}}, [], [None, "n"])
                                for r in range(3)] + [m])
    errors = join_registrations(records, tables)[3]["errors"]
    assert errors == [f"problem {i}" for i in range(16)] + ["... and 24 more problem(s) on rank 3"]


class _Options:
    """What `build` reads of a `Refit` (`BuildOptions`)."""

    rank = 0
    name_map = None
    ignore_sources = frozenset()
    precision = "same"
    policy = "reshard"
    policies: dict = {}
    topology = Topology(domain_size=2)
    relay = True
    staging_bytes = 1 << 20
    hardware = None
    planning = "global"
    delta = None


def _trainer_and_engine(engine_layouts: list) -> list[dict]:
    src = Layout((8, 6), Mesh([0, 1]), [Shard(0)], torch.float32, name="w")
    no_alias = {"sources": {}, "dests": {}}
    metas = [registration(r, {"w": src}, {}, {}, [], no_alias, [], [None, "n"]) for r in (0, 1)]
    return metas + [registration(r, {}, {}, {"w": [("w", lay)]}, [], no_alias, [], [None, "n"])
                    for r, lay in zip((2, 3, 4, 5), engine_layouts)]


def test_build_reads_shared_tables_as_it_reads_every_ranks_own_copy() -> None:
    """Oracle: the same metadata with no object shared between ranks (`copy.deepcopy` per rank), which `build` and
    `source_layouts` walk rank by rank: the same layouts, the same plan, the same errors in the same order."""
    engine = Layout((8, 6), Mesh([[2, 3], [4, 5]]), [Replicate(), Shard(1)], torch.float32, name="w")
    other = Layout((8, 6), Mesh([[2, 3], [4, 5]]), [Replicate(), Shard(0)], torch.float32, name="w")
    for lays in ([engine] * 4, [engine, other, engine, other]):
        records, tables, _ = _wire(_trainer_and_engine(lays))
        shared = join_registrations(records, tables)
        own = [copy.deepcopy(m) for m in shared]
        assert source_layouts(shared) == source_layouts(own)
        outcome = []
        for metas in (shared, own):
            try:
                outcome.append(build(_Options(), metas).plan.fingerprint)
            except ValueError as e:
                outcome.append(str(e))
        assert outcome[0] == outcome[1]
        if lays[1] is other:  # ranks 3 and 5 registered another layout than ranks 2 and 4
            assert "rank 3 differs from rank 2" in outcome[0] and "rank 5 differs from rank 2" in outcome[0]


def test_a_layout_disagreement_names_the_field_and_both_values() -> None:
    """Layouts that differ only in their `name` or their mesh axis names: the refusal says which field, and what
    each rank registered (the encoded layouts, compared by hand here), not only that ranks disagree."""
    mesh = [[2, 3], [4, 5]]
    engine = Layout((8, 6), Mesh(mesh, axis_names=("dp", "tp")), [Replicate(), Shard(1)], torch.float32, name="w")
    renamed = Layout((8, 6), Mesh(mesh, axis_names=("dp", "tp")), [Replicate(), Shard(1)], torch.float32,
                     name="w_engine")
    axes = Layout((8, 6), Mesh(mesh, axis_names=("replica", "shard")), [Replicate(), Shard(1)], torch.float32,
                  name="w")
    for other, field, a, b in ((renamed, "name", "'w'", "'w_engine'"),
                               (axes, "axis_names", "['dp', 'tp']", "['replica', 'shard']")):
        with pytest.raises(ValueError) as e:
            build(_Options(), _trainer_and_engine([engine, engine, engine, other]))
        want = (f"destination 'w': ranks disagree on its layout (rank 5 differs from rank 2): component 'w' field "
                f"{field}: rank 2 has {a}, rank 5 has {b}")
        assert want in str(e.value), str(e.value)
