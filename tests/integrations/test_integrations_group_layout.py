"""`GroupLayout`, the one home of the group-rank arithmetic, against an independent enumeration of the group, and the
init infos that use it (the vLLM backend's both sides, the engine-neutral trainer link)."""

from __future__ import annotations

import itertools

import pytest

from reshard.integrations.group_layout import GroupLayout
from reshard.integrations.trainer_link import TrainerLinkInfo


def _enumerate(trainers: int, workers: int, replicas: int, first: bool) -> list[tuple]:
    """The group, rank by rank, as its docs say it is laid out: `("trainer", r)` or `("worker", replica, k)`."""
    t = [("trainer", r) for r in range(trainers)]
    e = [("worker", d, k) for d in range(replicas) for k in range(workers)]
    return t + e if first else e + t


@pytest.mark.parametrize(("trainers", "workers", "replicas", "where"),
                         list(itertools.product([1, 2, 3], [1, 2, 4], [1, 3], ["first", "last"])))
def test_every_rank_question_matches_the_enumerated_group(trainers: int, workers: int, replicas: int,
                                                          where: str) -> None:
    g = GroupLayout(trainers, workers, replicas, where)
    ranks = _enumerate(trainers, workers, replicas, where == "first")
    assert g.size == len(ranks)
    assert g.trainer_group_ranks() == [i for i, x in enumerate(ranks) if x[0] == "trainer"]
    assert g.engine_group_ranks() == [i for i, x in enumerate(ranks) if x[0] == "worker"]
    for i, x in enumerate(ranks):
        assert g.is_trainer(i) == (x[0] == "trainer")
        if x[0] == "trainer":
            assert g.trainer_rank(x[1]) == i
        else:
            assert g.worker_rank(x[1], x[2]) == i
            assert i in g.replica_ranks()[x[1]]
    assert g.replica_ranks() == [[i for i, x in enumerate(ranks) if x[:2] == ("worker", d)] for d in range(replicas)]
    assert not g.is_trainer(g.size) and not g.is_trainer(-1)


def test_the_docstring_example() -> None:
    g = GroupLayout(trainers=2, workers=2, replicas=2)
    assert (g.size, g.trainer_group_ranks(), g.replica_ranks(), g.worker_rank(1, 0)) == (6, [0, 1], [[2, 3], [4, 5]],
                                                                                          4)
    g = GroupLayout(trainers=2, workers=2, replicas=2, trainer_ranks="last")
    assert (g.replica_ranks(), g.trainer_group_ranks()) == ([[0, 1], [2, 3]], [4, 5])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"trainers": 0, "workers": 1}, "trainers must be an integer >= 1, got 0"),
    ({"trainers": True, "workers": 1}, "trainers must be an integer >= 1, got True"),
    ({"trainers": 1, "workers": 2.0}, "workers must be an integer >= 1, got 2.0"),
    ({"trainers": 1, "workers": 1, "replicas": -1}, "replicas must be an integer >= 1, got -1"),
    ({"trainers": 1, "workers": 1, "trainer_ranks": "middle"}, "trainer_ranks must be one of ('first', 'last'), "
                                                               "got 'middle'"),
])
def test_a_bad_combination_names_the_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="GroupLayout: " + message.replace("(", r"\(").replace(")", r"\)")):
        GroupLayout(**kwargs)


def test_a_rank_outside_the_group_is_refused() -> None:
    g = GroupLayout(2, 2, 2)
    with pytest.raises(ValueError, match=r"replica must be an integer in \[0, 2\), got 2"):
        g.worker_rank(2, 0)
    with pytest.raises(ValueError, match=r"worker must be an integer in \[0, 2\), got 3"):
        g.worker_rank(0, 3)
    with pytest.raises(ValueError, match=r"trainer rank must be an integer in \[0, 2\), got 2"):
        g.trainer_rank(2)
    with pytest.raises(AttributeError):
        g.trainers = 3  # frozen


@pytest.mark.parametrize("where", ["first", "last"])
def test_the_trainer_link_info_asks_the_layout(where: str) -> None:
    infos = [TrainerLinkInfo(rank=r, world_size=3, engine_world_size=4, trainer_ranks=where) for r in range(3)]
    expected = _enumerate(3, 4, 1, where == "first")
    assert [i.group_rank for i in infos] == [expected.index(("trainer", r)) for r in range(3)]
    assert {i.layout.size for i in infos} == {7}
    assert [i.is_sender for i in infos] == [True, False, False]
    with pytest.raises(ValueError, match=r"TrainerLinkInfo: rank must be an integer in \[0, 3\), got 3"):
        TrainerLinkInfo(rank=3, world_size=3)
    with pytest.raises(ValueError, match="TrainerLinkInfo: engine_world_size must be an integer >= 1, got 0"):
        TrainerLinkInfo(rank=0, engine_world_size=0)
