"""`ReshardTrainer`: the trainer side of the `reshard` vLLM weight-transfer backend.

Every trainer rank registers the weights it holds, with their layouts (DTensors, or local tensors with a
`reshard.Layout`), under their HuggingFace names; fused engine tensors (`qkv_proj`, `gate_up_proj`) and padded
vocabularies are the engine's business. `send_weights()` moves the current values: each engine rank receives
exactly its shard, once, and no full tensor is gathered.

Two ways to drive vLLM:
- with a `client` (vLLM's `VLLMWeightSyncClient`: an `LLM`, an HTTP client, a Ray actor handle), trainer rank 0
  calls `init_weight_transfer_engine` / `start_weight_update` / `update_weights` / `finish_weight_update` itself,
  concurrently with the transfer;
- without one, the caller makes those calls on the engine while every trainer rank calls `trainer_init` and
  `send_weights`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from reshard.comm import Group
from reshard.refit import Refit, RefitReport

try:  # vLLM's base classes, where vLLM is installed (the trainer may live in an environment without it)
    from vllm.distributed.weight_transfer.base import TrainerInitInfo as _InitBase
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine as _EngineBase
except ImportError:  # pragma: no cover - exercised only without vLLM
    @dataclass
    class _InitBase:  # type: ignore[no-redef]
        backend: ClassVar[str]
        rank: int = field(kw_only=True)

        @property
        def is_sender(self) -> bool:
            return self.rank == 0

    class _EngineBase:  # type: ignore[no-redef]
        def __init__(self, *, client: Any = None, source: Any = None, is_sender: bool = True) -> None:
            self.client, self.source, self.is_sender = client, source, is_sender

TRAINER_RANKS = ("first", "last")


@dataclass
class ReshardTrainerInitInfo(_InitBase):
    """Trainer-side init info of the `reshard` backend (every trainer rank passes its own `rank`).

    Attributes:
        master_address, master_port: the group's TCP store, hosted by group rank 0.
        world_size: the number of trainer ranks.
        engine_world_size: the number of engine workers (data-parallel replicas x TP x PP).
        trainer_ranks: `"first"` (trainer group ranks `0 .. T-1`) or `"last"` (after every engine rank).
        timeout_s: seconds any wait for a peer may last.
        precision: `Refit`'s precision, `"same"` or `"cast"` (the engine gets the same).
        verify: check every received box against its sender's checksum.
    """

    backend: ClassVar[str] = "reshard"

    master_address: str = "127.0.0.1"
    master_port: int = 29600
    world_size: int = 1
    engine_world_size: int = 1
    trainer_ranks: str = "first"
    timeout_s: float = 300.0
    precision: str = "same"
    verify: bool = False

    def __post_init__(self) -> None:
        if self.trainer_ranks not in TRAINER_RANKS:
            raise ValueError(f"ReshardTrainerInitInfo: trainer_ranks must be one of {TRAINER_RANKS}, got "
                             f"{self.trainer_ranks!r}")
        for what in ("world_size", "engine_world_size"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ReshardTrainerInitInfo: {what} must be an integer >= 1, got {v!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ReshardTrainerInitInfo: rank must be an integer in [0, {self.world_size}), got "
                             f"{self.rank!r}")

    @property
    def group_rank(self) -> int:
        """This trainer rank's rank in the group."""
        return self.rank if self.trainer_ranks == "first" else self.engine_world_size + self.rank

    def engine_init_info(self) -> dict[str, Any]:
        """The `init_info` dict for vLLM's `init_weight_transfer_engine` (every engine worker gets the same)."""
        return {"master_address": self.master_address, "master_port": self.master_port,
                "trainer_world_size": self.world_size, "trainer_ranks": self.trainer_ranks,
                "timeout_s": self.timeout_s, "precision": self.precision, "verify": self.verify}


Weights = Mapping[str, Any] | torch.nn.Module


class ReshardTrainer(_EngineBase):
    """Trainer-side engine of the `reshard` backend; build it with `ReshardTrainer.trainer_init(...)`.

    Attributes:
        refit: the trainer's `Refit` (its plan after the first `send_weights()`).
        group: the rendezvous group spanning trainer and engine ranks.
    """

    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, group: Group, refit: Refit,
                 info: ReshardTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group, self.refit, self.info = group, refit, info

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: Any = None,
                     source: Weights | None = None) -> ReshardTrainer:
        """Join the group and register this rank's weights (see the module docstring for `client`).

        Args:
            init_info: this rank's init info.
            client: optional; on rank 0 it is told to initialize the engines' side, concurrently.
            source: HuggingFace name -> DTensor, or -> `(local tensor, reshard.Layout)`; or a module whose
                parameters are DTensors.
        """
        if not isinstance(init_info, ReshardTrainerInitInfo):
            raise TypeError(f"ReshardTrainer.trainer_init: init_info must be a ReshardTrainerInitInfo, got "
                            f"{type(init_info).__name__}")
        weights = _weights(source)
        sender = init_info.is_sender and client is not None
        call = _Background(client.init_weight_transfer_engine, init_info.engine_init_info()) if sender else None
        group = Group.rendezvous(init_info.master_address, init_info.master_port, init_info.group_rank,
                                 init_info.world_size + init_info.engine_world_size, timeout=init_info.timeout_s)
        if call is not None:
            call.join()
        refit = Refit(group, precision=init_info.precision, verify=init_info.verify, timeout=init_info.timeout_s)
        for name, w in weights.items():
            if isinstance(w, tuple):
                refit.add_source(name, w[0], w[1])
            else:
                refit.add_source(name, w)
        return cls(client=client, source=source, is_sender=init_info.is_sender, group=group, refit=refit,
                   info=init_info)

    def send_weights(self) -> RefitReport:
        """Move the registered weights' current values into every engine worker (every trainer rank calls it)."""
        drive = self.is_sender and self.client is not None
        if drive:
            self.client.start_weight_update()
        call = _Background(self.client.update_weights, {}) if drive else None
        try:
            report = self.refit.run()
        finally:
            if call is not None:
                call.join()
        if drive:
            self.client.finish_weight_update()
        return report

    def shutdown(self) -> None:
        self.group.close()


def _weights(source: Weights | None) -> dict[str, Any]:
    if source is None:
        raise ValueError("ReshardTrainer.trainer_init: pass source= (name -> DTensor or (local, Layout), or a "
                         "module with DTensor parameters)")
    if isinstance(source, torch.nn.Module):
        return dict(source.named_parameters())
    if not isinstance(source, Mapping):
        raise TypeError(f"ReshardTrainer.trainer_init: source must be a mapping or a torch.nn.Module, got "
                        f"{type(source).__name__}")
    return dict(source)


class _Background:
    """Run `fn(*args)` in a thread (a blocking control-plane call that must overlap the transfer)."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # re-raised in join()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error
