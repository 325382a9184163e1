"""A trainer rank's weight sync into a `vllm serve` server through reshard (no TRL import): every trainer rank
registers its own parameters' shards and sends them; trainer rank 0 also drives the server's HTTP routes.

Sources (`model_sources`), per parameter under TRL's vLLM name:
- a DTensor parameter (FSDP2): its local shard, as it is;
- a plain parameter every rank holds (DDP, one process): this rank's `Shard(0)` row block over the T trainer ranks
  (`reshard.integrations.trainer.stream_source`), so the replicated ranks split the sending and each byte leaves
  the trainer once;
- a `(local, reshard.Layout)` pair: as given (a sharding DTensor cannot describe).
A partitioned parameter (a DeepSpeed ZeRO-3 one) is read as its partition by TRL's trainer, through the trainer
side's partition kinds (`reshard.integrations.trainer.parameter_source`). Nothing is gathered. The first sync joins
the group (trainer ranks `0 .. T-1`, the server's workers after them) and plans; later syncs rebind the parameters
(the same storage, usually) and send.

A failed sync (the server restarted or unreachable, a trainer rank lost) raises on every trainer rank within
`timeout_s`; the server keeps its previous weights (its engine commits only a whole transfer), and the next sync
builds a new group, on the next port (`master_port + generation`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.integrations.trainer import stream_source
from reshard.integrations.trainer_link import TrainerLink, TrainerLinkInfo
from reshard.refit import RefitReport

logger = logging.getLogger(__name__)

__all__ = ["ShardSync", "SyncResult", "model_sources"]


def model_sources(named: Iterable[tuple[str, torch.Tensor]], rank: int, num_ranks: int) -> dict[str, Any]:
    """`{name: source}` of this trainer rank's parameters (see the module docstring); a name this rank sends
    nothing of (a scalar on a rank other than 0) is left out."""
    out = {}
    for name, p in named:
        if isinstance(p, tuple):  # already `(local shard, reshard.Layout)` (a ZeRO-3 partition, a custom sharding)
            out[name] = p
            continue
        src = stream_source(name, p.detach() if not hasattr(p, "placements") else p, None, rank, num_ranks)
        if src is not None:
            out[name] = src
    return out


@dataclass
class SyncResult:
    """What one sync did on this trainer rank.

    Attributes:
        seconds: wall time of the sync on this rank (registration, plan on the first one, transfer).
        bytes_sent: bytes this rank sent to the server's workers.
        first: whether this sync joined the group and planned.
        report: the `Refit` report of the run.
    """

    seconds: float
    bytes_sent: int
    first: bool
    report: RefitReport | None = field(default=None, repr=False)


class ShardSync:
    """One trainer rank's reshard link to a vLLM server.

    Args:
        rank, num_ranks: this trainer rank and the T trainer ranks.
        engine_world_size: the server's workers.
        master_address, master_port: where trainer rank 0 hosts the group's store (reachable by the server).
        client: trainer rank 0's `ServerClient` (None on the other ranks).
        timeout_s: seconds any wait for a peer may last (a dead peer's error comes within it).
        precision: `"cast"` (default: a float32 trainer into a bfloat16 server) or `"same"`.
        config: the model's Hugging Face config (`tie_word_embeddings` ties `lm_head.weight`).
    """

    def __init__(self, rank: int, num_ranks: int, engine_world_size: int, master_address: str, master_port: int,
                 *, client: Any = None, timeout_s: float = 300.0, precision: str = "cast", config: Any = None) -> None:
        self.rank, self.num_ranks, self.engine_world_size = rank, num_ranks, engine_world_size
        self.master_address, self.master_port = master_address, master_port
        self.client, self.timeout_s, self.precision, self.config = client, timeout_s, precision, config
        self.generation = 0
        self.link: TrainerLink | None = None

    def sync(self, named_params: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> SyncResult:
        """Send the current parameters (every trainer rank calls it, with the same names in the same order)."""
        t0 = time.perf_counter()
        source = model_sources(named_params(), self.rank, self.num_ranks)
        first = self.link is None
        try:
            if self.link is None:
                info = TrainerLinkInfo(
                    rank=self.rank, world_size=self.num_ranks, engine_world_size=self.engine_world_size,
                    master_address=self.master_address, master_port=self.master_port + self.generation,
                    prefix=f"reshard-trl/{self.generation}", timeout_s=self.timeout_s, precision=self.precision)
                self.link = TrainerLink.join(info, client=self.client, source=source, config=self.config,
                                             who="ReshardTrainer.trainer_init")
                self.link.names = list(source)
            else:
                self.link.rebind(list(source), source, what="parameters")
            report = self.link.send()
        except BaseException as e:
            self._fail(e)
            raise
        ex = report.execution
        return SyncResult(time.perf_counter() - t0, ex.bytes_sent if ex is not None else 0, first, report)

    def _fail(self, e: BaseException) -> None:
        logger.warning("reshard TRL sync failed on trainer rank %d (generation %d): %s: %s", self.rank,
                       self.generation, type(e).__name__, e)
        if self.link is not None:
            self.link.report_failure(e, "sync")
            try:
                self.link.close()
            except Exception:  # noqa: BLE001 - the group may be gone already; the original error is raised
                pass
        self.link = None
        self.generation += 1

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.link = None
