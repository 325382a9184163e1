"""`ReshardWeightTransferEngine`: the engine side of the `reshard` vLLM weight-transfer backend.

Runtime contract (vLLM drives it; see `docs/vllm.md`):
- `init_transfer_engine(info)` runs on every worker: it joins the trainer's `Group.rendezvous` as group rank
  `rank_offset + dp_index * world_size + rank` (vLLM's convention), the trainer's ranks coming first
  (`rank_offset = trainer_world_size`) or after every engine rank (`rank_offset = 0`).
- Under pipeline parallelism the stages first exchange their parameter names (over vLLM's pipeline group), so each
  name's layout spans exactly the stages holding it; expert-parallel layers are laid out per EP rank (`_layouts`).
- It then reads the live model's layouts (`engine_targets`) and registers every loaded parameter as a `Refit`
  destination (the live parameter itself, or a loader-format buffer for a layer whose quantization method
  post-processes its weights); a parameter no rule covers is a `ValueError` naming it, raised here. The first
  `update_weights` plans the whole model once; every call then moves the trainer's current
  weights, each byte once, and re-runs post-processing where the layer needs it, copying the result into the
  storage the forward reads. `last_report` is that update's `RefitReport`, with `seconds["process"]` the time
  spent re-processing.
- A failed `init_weight_transfer_engine` or `update_weights` fails on every worker with every worker's reason (so
  vLLM ends the update session on every worker alike) and is raised by the engine's last worker only (agreed over
  all its stages), as are vLLM's own refusals of these calls, so vLLM's RPC replies stay in step
  (`reshard.integrations.vllm._outcome`);
  `last_error` keeps the reason on every worker. A failed init also writes its reason as the group's verdict, so
  the trainer ranks' next `send_weights()` raises it at once. A failed transfer (any refit error, a dead trainer
  rank) leaves the forward on the previous weights: re-processing, the step that changes what the forward reads,
  runs only after the whole transfer succeeded.
- Updates come in phases (`ReshardUpdateInfo.phase`): `"stage"` starts the transfer in a background thread into
  buffers the forward does not read (loader-format buffers, copies of the norms) and returns, so the engine keeps
  serving; `"commit"` waits for it, then re-processes and copies into the live tensors; `"full"` (the default) is
  both in one call. Pausing generation around a commit or a full update is the caller's (vLLM's
  `pause_generation` / `/pause`). With `delta`, updates after the first send only changed elements into the
  buffers, which still hold the last update; a failed update resets that state, so the next one is full. Which
  phase may come next is one state machine (`reshard.integrations.engine_side.Updates`, `update_state`): a
  call it cannot honour is refused before anything is touched, naming the state and the valid next call; a new
  `init_weight_transfer_engine` or a shutdown drops a stage (never committing it into another group's buffers).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from reshard.comm import Group
from reshard.integrations.engine_side import Refused, Updates, declare_engine_facts, stop
from reshard.integrations.group_layout import TRAINER_RANKS, GroupLayout
from reshard.integrations.vllm._layouts import Target, engine_targets, parameter_names
from reshard.integrations.vllm._outcome import agree, combined, gather_names, keep_in_step
from reshard.integrations.vllm._process import reprocess_layer
from reshard.refit import PLANNINGS, Refit, RefitReport

logger = logging.getLogger(__name__)


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    """What every engine worker needs to join the trainer's group (`ReshardTrainerInitInfo.engine_init_info()`).

    Attributes:
        master_address, master_port: the group's TCP store (hosted by group rank 0).
        trainer_world_size: the number of trainer ranks in the group.
        trainer_ranks: `"first"` (trainer ranks `0 .. T-1`, engine ranks after) or `"last"`.
        rank_offset: the first engine rank in the group; default from `trainer_ranks`. Given, it must agree.
        engines, engine_index: several engines of one shape (the same model, TP and DP size) refit by one trainer
            group, as separate rollout replicas are: `engines` of them, this one the `engine_index`-th (its ranks
            follow the earlier engines' ranks). Each byte crosses to each engine once; default one engine.
        token: the group's job token (default: `RESHARD_TOKEN` in the worker's environment); never logged.
        prefix: the group's namespace in the store (the trainer's `ReshardTrainerInitInfo.prefix`).
        timeout_s: seconds any wait for a peer may last.
        precision: `Refit`'s precision (`"same"` or `"cast"`), the same on both sides.
        verify: check every received box against its sender's checksum.
        experts: `"stacked"` (the trainer sends `...mlp.experts.gate_proj.weight` `[E, I, H]`, as a HuggingFace
            MoE holds them) or `"per_expert"` (`...mlp.experts.{e}.gate_proj.weight` `[I, H]`, as Megatron's export
            names them; expert-parallel engines only).
        delta: after the first update, only the elements that changed since the last update cross the wire
            (`Refit(delta=True)`), into loader-format buffers that still hold the last update; the same on both
            sides. Not with `verify`.
        planning: `Refit`'s planning (`"auto"`, `"global"` or `"local"`), the same on both sides.
        comm_backend: `Group.rendezvous`'s `backend`, the same on both sides (the trainer's
            `ReshardTrainerInitInfo.comm_backend`). Default: None on a CUDA worker (NCCL where every rank has CUDA;
            with CPU trainer processes the group moves data over gloo and the worker stages its CUDA tensors
            through pinned host memory), gloo on a CPU worker. `"gloo"` on both sides: host staging for trainers
            that hold their weights on CPU in GPU processes (FSDP2 with CPU offload). Not with `delta`.
    """

    master_address: str
    master_port: int
    trainer_world_size: int
    trainer_ranks: str = "first"
    rank_offset: int | None = None
    timeout_s: float = 300.0
    precision: str = "same"
    verify: bool = False
    delta: bool = False
    engines: int = 1
    engine_index: int = 0
    token: str | None = field(default=None, repr=False)
    prefix: str = "reshard"
    experts: str = "stacked"
    planning: str = "auto"
    comm_backend: str | None = None

    def __post_init__(self) -> None:
        if self.experts not in ("stacked", "per_expert"):
            raise ValueError(f"reshard init_info: experts must be 'stacked' or 'per_expert', got {self.experts!r}")
        if self.planning not in PLANNINGS:
            raise ValueError(f"reshard init_info: planning must be one of {PLANNINGS}, got {self.planning!r}")
        if isinstance(self.engines, bool) or not isinstance(self.engines, int) or self.engines < 1:
            raise ValueError(f"reshard init_info: engines must be an integer >= 1, got {self.engines!r}")
        if isinstance(self.engine_index, bool) or not isinstance(self.engine_index, int) \
                or not 0 <= self.engine_index < self.engines:
            raise ValueError(f"reshard init_info: engine_index must be an integer in [0, {self.engines}), got "
                             f"{self.engine_index!r}")
        if self.token is not None and not isinstance(self.token, str):
            raise ValueError("reshard init_info: token must be a string or null")
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ValueError(f"reshard init_info: prefix must be a non-empty string, got {self.prefix!r}")
        if self.trainer_ranks not in TRAINER_RANKS:
            raise ValueError(f"reshard init_info: trainer_ranks must be one of {TRAINER_RANKS}, got "
                             f"{self.trainer_ranks!r}")
        if not isinstance(self.trainer_world_size, int) or self.trainer_world_size < 1:
            raise ValueError(f"reshard init_info: trainer_world_size must be an integer >= 1, got "
                             f"{self.trainer_world_size!r}")
        expected = GroupLayout(self.trainer_world_size, 1, trainer_ranks=self.trainer_ranks).engine_offset
        if self.rank_offset is not None and self.rank_offset != expected:
            raise ValueError(f"reshard init_info: rank_offset {self.rank_offset} disagrees with trainer_ranks="
                             f"{self.trainer_ranks!r} and trainer_world_size={self.trainer_world_size} "
                             f"(expected {expected})")
        self.rank_offset = expected


PHASES = ("full", "stage", "commit")


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """Per-update info (the plan is built once).

    Attributes:
        version: the update's weight version (logged, and kept as `staged_version` / `live_version`).
        phase: `"full"` (transfer, then commit, in this call: the engine must not generate meanwhile),
            `"stage"` (start the transfer into the loader-format buffers and return at once: the engine keeps
            generating from its live weights) or `"commit"` (wait for the staged transfer, then re-process and copy
            into the live weights: pause generation around this call).
        full: with `delta`, send every box whole this time (as the trainer's `send_weights(full=True)`).
    """

    version: str | None = None
    phase: str = "full"
    full: bool = False

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"reshard update_info: phase must be one of {PHASES}, got {self.phase!r}")


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """vLLM `WeightTransferEngine` that refits the live model in place with reshard (see the module docstring)."""

    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:  # noqa: ANN001  (vLLM's signature)
        super().__init__(config, vllm_config, device, model)
        self.group: Group | None = None
        self.refit: Refit | None = None
        self.targets: list[Target] = []
        self.stages: dict[str, list[int]] | None = None  # under PP: parameter name -> the stages holding it
        self.last_report: RefitReport | None = None
        self.last_error: str | None = None  # the last failed call's reason, every worker's (the last one raises it)
        self.updates = Updates("reshard vLLM backend")  # the update state machine: the stage in flight, the versions
        self._info: ReshardInitInfo | None = None
        self.in_step = keep_in_step(self)  # vLLM's own refusals of a worker call are raised by the last worker only

    @property
    def live_version(self) -> str | None:
        """The version the forward reads (None: the checkpoint vLLM loaded; see `reshard.integrations.engine_side`)."""
        return self.updates.live_version

    @property
    def staged_version(self) -> str | None:
        """The version a stage in flight or landed holds (None: nothing staged)."""
        return self.updates.staged_version

    @property
    def update_state(self) -> str:
        """`"idle"`, `"staging"`, `"staged"`, `"committing"` or `"failed"` (see `reshard.integrations.engine_side`)."""
        return self.updates.state

    # ---- vLLM's lifecycle --------------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        self._release("init_weight_transfer_engine was called again")  # a new group: the old one's stage is dropped
        error: BaseException | None = None
        try:
            self._init(init_info)
        except BaseException as e:  # agreed with the other workers below
            error = e
        outcomes = agree(error)
        if any(o is not None for o in outcomes):
            message = combined(outcomes, "init_weight_transfer_engine")
            if self.group is not None:  # the trainer ranks wait in the group: they hear this reason, not a timeout
                self.group.report_fault(self.group.rank, message)
                self._release(message)
            self.last_error = message
            raise RuntimeError(message) from error

    def _init(self, init_info: ReshardInitInfo) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        pc = self.parallel_config
        world = pc.world_size
        rank = get_pp_group().rank_in_group * get_tp_group().world_size + get_tp_group().rank_in_group
        self.stages = self._stages()  # a collective of every stage: before anything one worker alone can fail
        dp_index = getattr(pc, "data_parallel_index", pc.data_parallel_rank)
        layout = GroupLayout(init_info.trainer_world_size, world, init_info.engines * pc.data_parallel_size,
                             init_info.trainer_ranks)  # every engine's DP replicas, engine by engine
        replica = init_info.engine_index * pc.data_parallel_size + dp_index
        size, group_rank = layout.size, layout.worker_rank(replica, rank)
        self.engine_ranks = layout.engine_group_ranks()
        self.replicas = layout.replica_ranks()
        logger.info("reshard: worker %d of replica %d joins %s:%d as group rank %d of %d", rank, replica,
                    init_info.master_address, init_info.master_port, group_rank, size)
        self.group = Group.rendezvous(init_info.master_address, init_info.master_port, group_rank, size,
                                      backend=init_info.comm_backend or (None if self.device.type == "cuda"
                                                                         else "gloo"),
                                      timeout=init_info.timeout_s, prefix=init_info.prefix, token=init_info.token)
        self._info = init_info
        self.refit = self._build_refit()  # a parameter the refit cannot reach fails here, naming it

    def _stages(self) -> dict[str, list[int]] | None:
        """Under pipeline parallelism, parameter name -> the stages holding it (every stage's names, gathered over
        the pipeline group: a stage holds its own layers, and what its `named_parameters()` says besides)."""
        from vllm.distributed.parallel_state import get_pp_group

        pp = get_pp_group()
        if pp.world_size == 1:
            return None
        stages: dict[str, list[int]] = {}
        for stage, names in enumerate(gather_names(parameter_names(self.model), pp)):
            for n in names:
                stages.setdefault(n, []).append(stage)
        return stages

    def start_weight_update(self) -> None:
        if self.group is None:
            raise RuntimeError("reshard vLLM backend: call init_weight_transfer_engine before start_weight_update")

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        if self.group is None or self.refit is None:
            raise Refused("reshard vLLM backend: update_weights before init_weight_transfer_engine (or after "
                          "shutdown_weight_transfer_engine). Next: init_weight_transfer_engine, then "
                          "start_weight_update()")
        phase = update_info.phase
        if phase in ("full", "stage"):
            if update_info.full and self.refit.delta is not None and self.updates.state in ("idle", "failed"):
                self.refit.delta.reset()
            stage = self.updates.begin(self.refit, update_info.version, phase)
            if stage is None:  # staging: the transfer runs in the background
                return
        else:
            stage = self.updates.take(self.refit, update_info.version)
        report = self.updates.commit(stage, self.reprocess)  # a failed transfer raises before the commit
        self.last_report = report
        logger.info("reshard: update %s on group rank %d: transfer %.1f ms, re-processing %.1f ms, %d network bytes "
                    "planned", stage.version, self.group.rank, 1e3 * report.seconds["transfer"],
                    1e3 * report.seconds["process"], report.network_bytes)
        logger.debug("reshard: update %s: %s", stage.version, report)

    def update_weights(self, update_info: dict) -> None:
        error: BaseException | None = None
        try:
            self.receive_weights(self.parse_update_info(update_info))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except BaseException as e:  # agreed with the other workers below
            error = e
            # a refusal (or a bad update_info) touched nothing: a stage in flight keeps running, with its delta state
            if not isinstance(e, Refused) and self.updates.state not in ("staging", "staged"):
                self.updates.fail()
                if self.refit is not None and self.refit.delta is not None:
                    self.refit.delta.reset()  # what the buffers hold is unknown now: the next update is full
        outcomes = agree(error)
        self.last_error = None
        if any(o is not None for o in outcomes):
            self.last_error = message = combined(outcomes, "update_weights")
            raise RuntimeError(message + "\n(the update session has ended on every worker, as vLLM ends it when "
                               "update_weights raises; next: start_weight_update())") from error

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        self._release("shutdown_weight_transfer_engine was called")

    def _release(self, why: str) -> None:
        """Leave the group: a stage in flight or landed is dropped (its thread ends with the closed group's error,
        within `STOP_JOIN_S`); the live version stays (the forward still reads it)."""
        stage = self.updates.drop(why)
        group, self.group, self.refit = self.group, None, None
        if group is not None:
            if stage is not None and stage.running:  # the stage's waits poll the group's verdict: they end now
                group.report_fault(group.rank, f"reshard vLLM backend: the engine dropped its stage: {why}")
            group.close()
        stop(stage)

    # ---- reshard ------------------------------------------------------------------------------------------------
    def _build_refit(self) -> Refit:
        assert self.group is not None and self._info is not None
        pp = 1 if self.stages is None else self.parallel_config.pipeline_parallel_size
        self.targets = engine_targets(self.model, self.replicas, self.stages, pp,
                                      per_expert=self._info.experts == "per_expert")
        refit = Refit(self.group, precision=self._info.precision, verify=self._info.verify,
                      timeout=self._info.timeout_s, delta=self._info.delta, planning=self._info.planning)
        aliases: dict[str, list[str]] = {}
        for t in self.targets:
            if t.alias_of is not None:
                aliases.setdefault(t.alias_of, []).append(t.components[0][0])
        for t in self.targets:
            if t.alias_of is None:
                tied = {t.components[0][0]: aliases[t.name]} if t.name in aliases else ()
                if t.view is not None:  # experts one by one: boxes of the buffer's 2-D view, already placed
                    refit.add_destination(t.name, t.tensor.view(t.view), t.components, placed=True, aliases=tied)
                else:
                    refit.add_destination(t.name, t.tensor, t.components, dim=t.dim, aliases=tied)
        served = self.model_config  # vLLM serves the text model's config of a multimodal one
        declare_engine_facts(refit, getattr(served, "hf_text_config", None) or getattr(served, "hf_config", None),
                             who="engine (the config vLLM serves)")
        logger.info("reshard: %d engine tensors registered (%d re-processed after each update, %d tied)",
                    len(self.targets), sum(t.processed for t in self.targets), len(aliases))
        return refit

    def reprocessed_layers(self) -> list[str]:
        """The names of the layers whose `quant_method.process_weights_after_loading` every update re-runs (their
        forward reads tensors made from the loader-format buffers reshard writes; which of those tensors the
        forward shows depends on the processor: see `docs/vllm.md`)."""
        return sorted({t.module_name for t in self.targets if t.processed})

    def committed_layers(self) -> list[str]:
        """The names of the layers whose forward tensors a commit writes: the re-processed ones, and those whose
        staged copy (norms) it copies into the live parameter."""
        return sorted({t.module_name for t in self.targets if t.processed or t.live is not None})

    def reprocess(self) -> None:
        """Commit the written buffers: copy the staged tensors of layers without post-processing (norms) into the
        live ones, and re-run post-processing of every layer whose loader-format tensors were written."""
        for t in self.targets:
            if t.live is not None and t.alias_of is None:
                t.live.copy_(t.tensor)
        layers: dict[int, tuple[str, torch.nn.Module, dict]] = {}
        for t in self.targets:
            if t.processed:
                entry = layers.setdefault(id(t.module), (t.module_name, t.module, {}))
                entry[2][t.param_name] = (t.tensor, t.loader_attrs)
        for name, module, loader in layers.values():
            reprocess_layer(module, loader, name)
