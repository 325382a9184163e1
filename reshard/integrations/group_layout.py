"""Where every rank sits in a trainer-and-engines group: the one home of the group-rank arithmetic.

A refit group spans T trainer ranks and R engine replicas of W workers each (an engine replica is one data-parallel
copy of the served model: TP x PP workers). The trainer ranks come first (group ranks `0 .. T-1`, the engines'
after them) or last (after every engine worker); replica `r`'s worker `k` is group rank
`engine_offset + r * W + k`, engine by engine (vLLM's convention: `rank_offset + dp_index * world_size + rank`).

Example (T = 2, R = 2 replicas of W = 2 workers, trainers first): group size 6; trainers at `[0, 1]`; replica 0 at
`[2, 3]`, replica 1 at `[4, 5]`; `worker_rank(1, 0)` is 4. With `trainer_ranks="last"`: replicas at `[0, 1]` and
`[2, 3]`, trainers at `[4, 5]`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TRAINER_RANKS", "GroupLayout"]

TRAINER_RANKS = ("first", "last")
"""Where the trainer ranks sit in the group: before every engine worker, or after them."""


def _count(value: object, field: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"GroupLayout: {field} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class GroupLayout:
    """The ranks of one refit group (frozen; validated on construction).

    Attributes:
        trainers: T, the trainer ranks.
        workers: W, the workers of one engine replica (TP x PP; a caller that does not know the split passes every
            engine worker with `replicas=1`).
        replicas: R, the engine replicas (every engine's data-parallel replicas, engine by engine).
        trainer_ranks: `"first"` (trainer group ranks `0 .. T-1`) or `"last"` (after every engine worker).

    Raises:
        ValueError: a count that is not an integer >= 1, or `trainer_ranks` not in `TRAINER_RANKS` (naming the
            field and the value).
    """

    trainers: int
    workers: int
    replicas: int = 1
    trainer_ranks: str = "first"

    def __post_init__(self) -> None:
        _count(self.trainers, "trainers", 1)
        _count(self.workers, "workers", 1)
        _count(self.replicas, "replicas", 1)
        if self.trainer_ranks not in TRAINER_RANKS:
            raise ValueError(f"GroupLayout: trainer_ranks must be one of {TRAINER_RANKS}, got {self.trainer_ranks!r}")

    @property
    def engine_workers(self) -> int:
        """Every engine worker of the group (`replicas * workers`)."""
        return self.replicas * self.workers

    @property
    def size(self) -> int:
        """The group's size (`trainers + engine_workers`)."""
        return self.trainers + self.engine_workers

    @property
    def engine_offset(self) -> int:
        """The first engine worker's group rank (T when the trainers come first, else 0)."""
        return self.trainers if self.trainer_ranks == "first" else 0

    @property
    def trainer_offset(self) -> int:
        """The first trainer rank's group rank (0 when the trainers come first, else `engine_workers`)."""
        return 0 if self.trainer_ranks == "first" else self.engine_workers

    def trainer_rank(self, rank: int) -> int:
        """Trainer rank `rank`'s group rank."""
        _index(rank, "trainer rank", self.trainers)
        return self.trainer_offset + rank

    def worker_rank(self, replica: int, worker: int) -> int:
        """The group rank of `replica`'s `worker`-th worker."""
        _index(replica, "replica", self.replicas)
        _index(worker, "worker", self.workers)
        return self.engine_offset + replica * self.workers + worker

    def trainer_group_ranks(self) -> list[int]:
        """The trainer ranks' group ranks, in trainer-rank order."""
        return [self.trainer_offset + r for r in range(self.trainers)]

    def engine_group_ranks(self) -> list[int]:
        """Every engine worker's group rank, replica by replica."""
        return [self.engine_offset + i for i in range(self.engine_workers)]

    def replica_ranks(self) -> list[list[int]]:
        """Each replica's workers' group ranks (`[replica][worker]`)."""
        ranks = self.engine_group_ranks()
        return [ranks[r * self.workers:(r + 1) * self.workers] for r in range(self.replicas)]

    def is_trainer(self, group_rank: int) -> bool:
        """Whether `group_rank` is a trainer rank of this group."""
        return self.trainer_offset <= group_rank < self.trainer_offset + self.trainers


def _index(value: object, field: str, bound: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
        raise ValueError(f"GroupLayout: {field} must be an integer in [0, {bound}), got {value!r}")
