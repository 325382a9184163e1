"""The engine-neutral trainer side: one trainer rank's link to the engines of a refit group.

Every engine backend's trainer side is the same two thirds: join the group (`GroupLayout` says where this rank
sits), register this rank's weights (`reshard.integrations.trainer`: sources, ties, model kinds) with the model's
facts, run the `Refit` on each update, and on a failure tell every rank of the group why, so none waits out its
timeout. `TrainerLink` is that; an engine backend adds only how its engines are told (an `EngineClient`) and its
init info's wire format (`TrainerLinkInfo.engine_init_info()`, which the reshard engine side reads).

Life cycle, per trainer rank (trainer rank 0 also drives the engines through `client`, where it has one):

    link = TrainerLink.join(info, client=client, source=model)   # client.init_weight_transfer_engine, concurrently
    link.send()       # client.start_weight_update; update_weights concurrently with the transfer; finish
    link.rebind(names, source)   # a later update's new tensors under the registered names (a stream that changed
                                 # is refused on every rank)
    link.close()

`reshard.integrations.vllm.ReshardTrainer` wraps it as vLLM's trainer-side engine; TRL's and verl's syncs use it
directly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from reshard.comm import CommError, Group
from reshard.integrations.group_layout import TRAINER_RANKS, GroupLayout
from reshard.integrations.model_config import model_facts
from reshard.integrations.trainer import model_kind, prepare_source, register_source
from reshard.refit import PLANNINGS, NameMap, Refit, RefitReport

__all__ = ["EngineClient", "TrainerLink", "TrainerLinkInfo", "Weights"]

Weights = Mapping[str, Any] | torch.nn.Module


class EngineClient(Protocol):
    """How trainer rank 0 tells the engines what to do (vLLM's `VLLMWeightSyncClient`, TRL's server client): init
    (once per group), then per update start, update (blocks until the engines received it), finish."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any: ...

    def start_weight_update(self) -> Any: ...

    def update_weights(self, update_info: dict[str, Any]) -> Any: ...

    def finish_weight_update(self) -> Any: ...


@dataclass
class TrainerLinkInfo:
    """One trainer rank's part in a refit group (every trainer rank passes its own `rank`).

    Attributes:
        rank: this trainer rank (`0 .. world_size-1`); rank 0 drives the engines.
        master_address, master_port: the group's TCP store, hosted by group rank 0.
        world_size: the number of trainer ranks.
        engine_world_size: the number of engine workers (replicas x TP x PP).
        trainer_ranks: `"first"` (trainer group ranks `0 .. T-1`) or `"last"` (after every engine rank).
        timeout_s: seconds any wait for a peer may last.
        precision: `Refit`'s precision, `"same"` or `"cast"` (the engine gets the same).
        verify: check every received box against its sender's checksum.
        delta: after the first update, send only the elements that changed since the last one (the engine gets
            the same); `send(full=True)` sends one update whole.
        token: the group's job token (default: `RESHARD_TOKEN`); `engine_init_info()` then carries it to the
            engine workers.
        prefix: the group's namespace in the store (a fresh one per group when one store serves several).
        host_store: whether group rank 0 hosts the store (default); False when it is already served elsewhere
            (`reshard.comm.serve_store`), at `master_address:master_port`.
        planning: `Refit`'s planning (`"auto"`, `"global"` or `"local"`; the engine gets the same).
        comm_backend: `Group.rendezvous`'s `backend` on both sides (None: NCCL for CUDA tensors where every rank has
            CUDA, gloo for CPU tensors).
    """

    master_address: str = "127.0.0.1"
    master_port: int = 29600
    world_size: int = 1
    engine_world_size: int = 1
    trainer_ranks: str = "first"
    timeout_s: float = 300.0
    precision: str = "same"
    verify: bool = False
    delta: bool = False
    token: str | None = field(default=None, repr=False)
    prefix: str = "reshard"
    host_store: bool = True
    planning: str = "auto"
    comm_backend: str | None = None
    rank: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        who = type(self).__name__
        if self.trainer_ranks not in TRAINER_RANKS:
            raise ValueError(f"{who}: trainer_ranks must be one of {TRAINER_RANKS}, got {self.trainer_ranks!r}")
        if self.planning not in PLANNINGS:
            raise ValueError(f"{who}: planning must be one of {PLANNINGS}, got {self.planning!r}")
        for what in ("world_size", "engine_world_size"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{who}: {what} must be an integer >= 1, got {v!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"{who}: rank must be an integer in [0, {self.world_size}), got {self.rank!r}")

    @property
    def is_sender(self) -> bool:
        """Whether this rank drives the engines (trainer rank 0)."""
        return self.rank == 0

    @property
    def layout(self) -> GroupLayout:
        """The group's ranks (the engine workers as one replica: the trainer side does not see their split)."""
        return GroupLayout(self.world_size, self.engine_world_size, 1, self.trainer_ranks)

    @property
    def group_rank(self) -> int:
        """This trainer rank's rank in the group."""
        return self.layout.trainer_rank(self.rank)

    def engine_init_info(self) -> dict[str, Any]:
        """The `init_info` dict of the engines' `init_weight_transfer_engine` (every engine worker gets the same)."""
        return {"master_address": self.master_address, "master_port": self.master_port,
                "trainer_world_size": self.world_size, "trainer_ranks": self.trainer_ranks,
                "timeout_s": self.timeout_s, "precision": self.precision, "verify": self.verify,
                "delta": self.delta, "prefix": self.prefix, "planning": self.planning,
                **({"comm_backend": self.comm_backend} if self.comm_backend else {}),
                **({"token": self.token} if self.token else {})}


class TrainerLink:
    """One trainer rank's joined link (build it with `TrainerLink.join`).

    Attributes:
        refit: the trainer's `Refit` (its plan after the first `send()`).
        group: the rendezvous group spanning trainer and engine ranks.
        info: this rank's `TrainerLinkInfo`; client: the `EngineClient` rank 0 drives (or None).
        names: the registered source names, in registration order (what `rebind` compares a later stream with).
    """

    def __init__(self, *, client: EngineClient | None, group: Group, refit: Refit, info: TrainerLinkInfo,
                 names: Sequence[str]) -> None:
        self.client, self.group, self.refit, self.info = client, group, refit, info
        self.names = list(names)

    @property
    def drives(self) -> bool:
        """Whether this rank tells the engines what to do (trainer rank 0 with a client)."""
        return self.info.is_sender and self.client is not None

    @classmethod
    def join(cls, info: TrainerLinkInfo, *, client: EngineClient | None = None, source: Weights | None = None,
             name_map: NameMap = None, ignore_sources: Sequence[str] = (),
             ties: Mapping[str, Sequence[str]] | None = None, config: Any = None,
             transposed: Sequence[str] | None = None, who: str = "TrainerLink.join") -> TrainerLink:
        """Join the group and register this rank's weights (the arguments are `ReshardTrainer.trainer_init`'s).

        A mistake in the arguments or the source is raised after the group formed, and reported to the group
        first: every other rank (engine workers included) raises it, naming this rank, at its next wait.
        """
        kind = model_kind(source)
        cfg = config if config is not None else None if kind is not None else getattr(source, "config", None)
        early: Exception | None = None  # a mistake in the arguments: raised after the group forms, on every rank
        facts = None
        try:
            weights, found = prepare_source(source, kind, transposed, ties, config)
            facts = model_facts(cfg) if cfg is not None else None
        except (ValueError, TypeError) as e:
            early, weights, found = e, {}, {}
        drive = info.is_sender and client is not None  # the engines join even so: they learn the reason
        call = Background(client.init_weight_transfer_engine, info.engine_init_info()) if drive else None
        group = _rendezvous(info)
        try:
            if call is not None:
                call.join()
            if early is not None:
                raise early
            refit = Refit(group, precision=info.precision, verify=info.verify, timeout=info.timeout_s,
                          name_map=name_map, ignore_sources=ignore_sources, delta=info.delta, planning=info.planning)
            if facts is not None:
                refit.declare_facts(facts, who="trainer (its config)")
            register_source(refit, source, weights, found, kind, config)
        except Exception as e:
            _fail(group, info, e, who)
            raise
        _FAILED.pop(_key(info), None)
        return cls(client=client, group=group, refit=refit, info=info, names=list(weights))

    def send(self, *, full: bool = False) -> RefitReport:
        """Move the registered weights' current values into every engine worker (every trainer rank calls it).

        Args:
            full: with `delta`, send every box whole this time.
        """
        if full and self.refit.delta is not None:
            self.refit.delta.reset()
        drive = self.drives
        if drive:
            self.client.start_weight_update()
        call = Background(self.client.update_weights, {}) if drive else None
        try:
            report = self.refit.run()
        finally:
            if call is not None:
                call.join()
        if drive:
            self.client.finish_weight_update()
        return report

    def rebind(self, names: Sequence[str], source: Mapping[str, Any], what: str = "stream") -> None:
        """Bind a later update's tensors (`source`: name -> tensor or `(local, layout)`, None: sends none of it)
        to the registered names (`Refit.update_source`). `names` other than the registered ones (`self.names`, in
        order) are refused on every rank of the group before data moves, at the next `send()`, naming them."""
        names = list(names)
        if names != self.names:
            registered = set(self.names)
            gone = [n for n in self.names if n not in source]
            new = [n for n in names if n not in registered]
            self.refit.refuse(f"the trainer's {what} changed since the group was built: missing {gone[:5]}, new "
                              f"{new[:5]}{'' if gone or new else ' (same names, another order)'}; the next sync "
                              "builds a new group")
        registered = set(self.names)
        for name in names:
            v = source.get(name)
            if v is not None and name in registered:
                self.refit.update_source(name, v[0] if isinstance(v, tuple) else v)

    def report_failure(self, error: BaseException, what: str) -> None:
        """Tell every rank of the group that `what` failed here (a `CommError` came from the group: not repeated);
        a group already gone is ignored (the caller raises `error` itself)."""
        if isinstance(error, CommError):
            return
        g = self.group
        try:
            g.report_fault(g.rank, f"trainer rank {self.info.rank}: {what} failed: {type(error).__name__}: {error}")
        except Exception:  # noqa: BLE001 - the group may be gone already
            pass

    def close(self) -> None:
        """Leave the group."""
        self.group.close()


_FAILED: dict[tuple[str, int, str], Group] = {}
"""Groups whose `join` failed on this rank, by (address, port, prefix): kept open (a store hosted here keeps serving
the fault's reason to the other ranks) until the next `join` of the same group closes them."""


def _key(info: TrainerLinkInfo) -> tuple[str, int, str]:
    return info.master_address, int(info.master_port), info.prefix


def _rendezvous(info: TrainerLinkInfo) -> Group:
    """Join the group of `info` (closing one this rank kept from a failed `join` of the same group)."""
    stale = _FAILED.pop(_key(info), None)
    if stale is not None:
        stale.close()
    return Group.rendezvous(info.master_address, info.master_port, info.group_rank, info.layout.size,
                            timeout=info.timeout_s, prefix=info.prefix, token=info.token,
                            is_master=None if info.host_store else False, backend=info.comm_backend)


def _fail(group: Group, info: TrainerLinkInfo, error: Exception, who: str) -> None:
    """Tell every rank of `group` why `join` failed on this rank (their next wait on the group raises it within a
    poll, instead of waiting out the timeout); the group is kept open for them to read it (`_FAILED`)."""
    group.report_fault(group.rank, f"trainer rank {info.rank} (group rank {group.rank}): {who} failed: "
                                   f"{type(error).__name__}: {error}")
    _FAILED[_key(info)] = group


class Background:
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
