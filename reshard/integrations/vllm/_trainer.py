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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from reshard.comm import Group
from reshard.integrations.hf import model_facts
from reshard.integrations.trainer import is_megatron, prepare_source, register_source
from reshard.refit import PLANNINGS, NameMap, Refit, RefitReport

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
        delta: after the first update, send only the elements that changed since the last one (the engine gets
            the same); `send_weights(full=True)` sends one update whole.
        planning: `Refit`'s planning (`"auto"`, `"global"` or `"local"`: each rank plans only its own part; the
            engine gets the same).
        token: the group's job token (default: `RESHARD_TOKEN`); `engine_init_info()` then carries it to the
            engine workers.
        prefix: the group's namespace in the store (a fresh one per group when one store serves several).
        host_store: whether group rank 0 hosts the store (default); False when it is already served elsewhere
            (`reshard.comm.serve_store`), at `master_address:master_port`.
        comm_backend: `Group.rendezvous`'s `backend` on both sides: None (NCCL for CUDA tensors where every rank has
            CUDA, gloo for CPU tensors), `"gloo"`, `"nccl"`, or a registered test backend (`"reshard_nccl_rules"`);
            the engine gets the same.
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
    delta: bool = False
    token: str | None = field(default=None, repr=False)
    prefix: str = "reshard"
    host_store: bool = True
    planning: str = "auto"
    comm_backend: str | None = None

    def __post_init__(self) -> None:
        if self.trainer_ranks not in TRAINER_RANKS:
            raise ValueError(f"ReshardTrainerInitInfo: trainer_ranks must be one of {TRAINER_RANKS}, got "
                             f"{self.trainer_ranks!r}")
        if self.planning not in PLANNINGS:
            raise ValueError(f"ReshardTrainerInitInfo: planning must be one of {PLANNINGS}, got {self.planning!r}")
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
                "timeout_s": self.timeout_s, "precision": self.precision, "verify": self.verify,
                "delta": self.delta, "prefix": self.prefix, "planning": self.planning,
                **({"comm_backend": self.comm_backend} if self.comm_backend else {}),
                **({"token": self.token} if self.token else {})}


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
                     source: Weights | None = None, name_map: NameMap = None, ignore_sources: Sequence[str] = (),
                     ties: Mapping[str, Sequence[str]] | None = None, config: Any = None,
                     transposed: Sequence[str] | None = None) -> ReshardTrainer:
        """Join the group and register this rank's weights (see the module docstring for `client`).

        Args:
            init_info: this rank's init info.
            client: optional; on rank 0 it is told to initialize the engines' side, concurrently.
            source: HuggingFace name -> DTensor, or -> `(local tensor, reshard.Layout)`; or a module whose
                parameters are DTensors; or a Megatron-core `GPTModel` chunk (registered by
                `reshard.integrations.megatron.add_sources`, the real vocabulary from `config`'s `vocab_size`).
                One tensor under several names (a module's tied parameters, a `state_dict()`'s tied entries) is
                sent once, the other names being its aliases (`find_ties`). A module is followed, not its
                parameter objects (`Refit.add_module_sources`): a parameter replaced by one of the same layout is
                sent from the next `send_weights()`, one of another layout or an untied one is refused on every
                rank, naming it.
            name_map: trainer name -> the engine's (HuggingFace) name, a dict or a callable returning None for a
                name to leave out of the map (which is then an error unless ignored); default identity.
            ignore_sources: trainer names the engine does not serve, left out on purpose (an MTP head, a value
                head).
            ties: more ties, name -> its other names (`{"model.embed_tokens.weight": ["lm_head.weight"]}`), for
                a source that holds one of them only.
            config: the model's HuggingFace config (default: the module's `.config`): with
                `tie_word_embeddings`, a source that has the input embedding but no `lm_head.weight` ties the two.
                Its facts that shapes cannot show (heads, KV heads, head dim, experts, vocabulary, tie:
                `reshard.integrations.hf.model_facts`) are declared (`Refit.declare_facts`): an engine serving a
                model that differs in one is refused on every rank at the first send, naming it.
            transposed: trainer names of 2-D weights stored `[in, out]` (Hugging Face `Conv1D`: GPT-2's `c_attn`,
                `c_proj`, `c_fc`), which the engine holds `[out, in]`: registered as a transposed view (no copy).
                Default: a module source's `Conv1D` weights; none for a mapping.

        Raises:
            ValueError, TypeError (or what the registration raises): a mistake in the arguments or the source (a
                Megatron model without `vocab_size`, an unsupported layout, ...). It is raised after the group
                formed, and reported to the group first: every other rank (engine workers included) raises it,
                naming this rank, at its next wait on the group (within a fraction of a second), not at its timeout.
        """
        if not isinstance(init_info, ReshardTrainerInitInfo):
            raise TypeError(f"ReshardTrainer.trainer_init: init_info must be a ReshardTrainerInitInfo, got "
                            f"{type(init_info).__name__}")
        megatron = is_megatron(source)
        cfg = config if config is not None else None if megatron else getattr(source, "config", None)
        early: Exception | None = None  # a mistake in the arguments: raised after the group forms, on every rank
        facts = None
        try:
            weights, found = prepare_source(source, megatron, transposed, ties, config)
            facts = model_facts(cfg) if cfg is not None else None
        except (ValueError, TypeError) as e:
            early, weights, found = e, {}, {}
        sender = init_info.is_sender and client is not None  # the engines join even so: they learn the reason
        call = _Background(client.init_weight_transfer_engine, init_info.engine_init_info()) if sender else None
        group = _rendezvous(init_info)
        try:
            if call is not None:
                call.join()
            if early is not None:
                raise early
            refit = Refit(group, precision=init_info.precision, verify=init_info.verify,
                          timeout=init_info.timeout_s, name_map=name_map, ignore_sources=ignore_sources,
                          delta=init_info.delta, planning=init_info.planning)
            if facts is not None:
                refit.declare_facts(facts, who="trainer (its config)")
            register_source(refit, source, weights, found, megatron, config)
        except Exception as e:
            _fail(group, init_info, e)
            raise
        _FAILED.pop(_key(init_info), None)
        return cls(client=client, source=source, is_sender=init_info.is_sender, group=group, refit=refit,
                   info=init_info)

    def send_weights(self, *, full: bool = False) -> RefitReport:
        """Move the registered weights' current values into every engine worker (every trainer rank calls it).

        Args:
            full: with `delta`, send every box whole this time (pass the engine `update_info` `"full": true` too).
        """
        if full and self.refit.delta is not None:
            self.refit.delta.reset()
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


_FAILED: dict[tuple[str, int, str], Group] = {}
"""Groups whose `trainer_init` failed on this rank, by (address, port, prefix): kept open (a store hosted here keeps
serving the fault's reason to the other ranks) until the next `trainer_init` of the same group closes them."""


def _key(info: ReshardTrainerInitInfo) -> tuple[str, int, str]:
    return info.master_address, int(info.master_port), info.prefix


def _rendezvous(info: ReshardTrainerInitInfo) -> Group:
    """Join the group of `info` (closing one this rank kept from a failed `trainer_init` of the same group)."""
    stale = _FAILED.pop(_key(info), None)
    if stale is not None:
        stale.close()
    return Group.rendezvous(info.master_address, info.master_port, info.group_rank,
                            info.world_size + info.engine_world_size, timeout=info.timeout_s, prefix=info.prefix,
                            token=info.token, is_master=None if info.host_store else False,
                            backend=info.comm_backend)


def _fail(group: Group, info: ReshardTrainerInitInfo, error: Exception) -> None:
    """Tell every rank of `group` why `trainer_init` failed on this rank (their next wait on the group raises it
    within a poll, instead of waiting out the timeout); the group is kept open for them to read it (`_FAILED`)."""
    group.report_fault(group.rank, f"trainer rank {info.rank} (group rank {group.rank}): ReshardTrainer.trainer_init "
                                   f"failed: {type(error).__name__}: {error}")
    _FAILED[_key(info)] = group


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
