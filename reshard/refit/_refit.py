"""`Refit`: whole-model weight sync from a trainer to an inference engine, each side declaring only its own layouts.

Runtime contract:
- Every rank of the group builds one `Refit` and registers what it holds: trainer ranks call `add_source`, inference
  ranks `add_destination`; a rank on both sides (colocated) calls both. Then every rank calls `run()`.
- The first `run()` exchanges layout metadata once over the group's control backend, checks names, shapes, dtypes
  and local tensors on every rank (any problem raises the same `ValueError` on every rank, before data moves),
  and builds one whole-model plan. Later `run()`s reuse it: each moves the current values of the registered
  tensors straight into the registered destination tensors.
- Registrations are live (see `reshard.refit._live`): every `run()` reads each DTensor's local tensor (and, for
  `add_module_sources`, the module's parameter) anew, follows a destination view to its base's new storage, and
  checks every local tensor's shape, dtype and device against the plan; a change raises a `ValueError` on every
  rank before any data moves, a new storage of the same layout is used. A later run has two all-rank control
  rounds: one agreement before data moves (the live check, which is also the plan handshake: it carries the
  executor's own checks of the local tensors) and the completion round after it.
- Many small tensors bound for one peer share one message and one pack per chunk: messages per rank pair depend
  on the chunk count, not on the number of tensors.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from reshard.comm import SNAPSHOTS, CommError, DeltaSession, Group, all_gather_json, execute
from reshard.comm._contract import as_timedelta
from reshard.planner import (
    DEFAULT_STAGING_BYTES,
    Layout,
    LayoutLike,
    LocalPlan,
    Plan,
    Topology,
    fuse,
    is_dtensor,
    relabel,
)
from reshard.refit import _facts
from reshard.refit._build import Built, build
from reshard.refit._live import Bound, live_errors, live_round, resolve
from reshard.refit._meta import Dest, Geometry, alias_names, geometry
from reshard.refit._metawire import exchange_metadata
from reshard.refit._names import NameMap
from reshard.refit._policy import Choice
from reshard.refit._rebind import rebind_error
from reshard.refit._replicas import replica_digests, replica_errors
from reshard.refit._report import RefitReport

logger = logging.getLogger(__name__)

POLICIES = ("auto", "reshard", "gather_broadcast")
PLANNINGS = ("auto", "global", "local")

LOCAL_PLANNING_RANKS = 512
"""`Refit(planning="auto")` plans rank-locally on groups of at least this many ranks: there the whole-model plan
takes every rank seconds and grows with the cluster (`perf/bench_scale.py`), below it the greedy balance is
cheap."""


class Refit:
    """Whole-model weight refit from a trainer to an inference engine over one group.

    Args:
        group: a `reshard.comm.Group` (default: `Group.world()`).
        name_map: trainer name -> inference (global tensor) name: a dict or a callable; default identity. A source
            the map does not cover, a destination nobody maps to, and a mapped name no destination declares are all
            errors, listed together, on every rank.
        ignore_sources: trainer names to leave out on purpose (e.g. MTP layers the engine does not serve).
        topology: NVLink domains, in group ranks.
        staging_bytes: staging memory per rank.
        relay: forward boxes over NVLink inside a destination domain (see `plan_many`).
        policy: `"auto"` (per weight, whichever the cost model says is faster), `"reshard"` or
            `"gather_broadcast"`; `policies` overrides it per trainer name.
        hardware: the cost model's link figures (`reshard.cost.Hardware`), default the H100 preset.
        planning: how the first run plans: `"global"`, every rank builds the whole-model plan (`plan_many`: the
            greedy balance, and `policy="auto"` models each weight on it), or `"local"`, each rank plans only its
            own part (`reshard.planner.plan_local`: time and memory grow with the rank's own transfers, not with
            the cluster; the same bytes per link kind; `auto` weights go by reshard). `"auto"` (default): `"local"`
            on groups of at least `local_planning_ranks` ranks. Every rank must plan the same way (the plan
            handshake refuses a mix).
        local_planning_ranks: the group size from which `planning="auto"` plans rank-locally (default: the value
            of `reshard.refit.LOCAL_PLANNING_RANKS` when this `Refit` is made).
        verify: check every received box against its sender's checksum.
        check_replicas: before every run, compare by hash the copies of each trainer box that its layout says are
            equal (TP replicas of a norm, sub-mesh copies); a difference raises a `ValueError` on every rank naming
            the weight, the box and the ranks, before data moves (see `reshard.refit._replicas`).
        timeout: seconds (or a timedelta) any wait for a peer may last.
        precision: per trainer name (a dict or a callable) or for all: `"same"` (dtypes must match), `"cast"`
            (cast to the engine's dtype while packing, bit-exact to torch) or `"fp8_block"` (the engine holds
            float8_e4m3fn weights with float32 scales per 128 x 128 block, registered with `scale=`; see
            `reshard.refit._fp8` for where quantization happens).
        delta: after the first run, send per transfer box only the elements whose bits changed since the last run
            that reached that destination (`execute(..., delta=...)`, see `reshard.comm._delta`); a destination
            that holds another version (reloaded, overwritten, a failed run) gets full boxes. FP8 destinations
            delta their quantized bytes and scales (quantized on the source) or the high-precision halo
            (quantized on the destination). Weights sent by gather-and-broadcast are sent whole. Not with
            `verify`.
        delta_snapshot: where the senders keep their snapshots: `"device"` or `"host"` (pinned CPU memory).
        delta_check: how a destination finds its bytes changed since it applied them (`DeltaSession.check`:
            `"checksum"` by default, which catches any change of a box's bytes; `"sum"` is cheaper and misses
            reorderings).
        name: a label for this refit in errors (`"policy"`, `"reference"`); every rank must give the same one. A
            refit's identity is agreed on at its first run (from every rank's random nonce, and the name), and every
            later run checks it: two refits run in a different order on some ranks refuse on every rank, naming both,
            before data moves. Refits with no name are told apart only after their first run.

    Example (the trainer and inference sides are different processes of one group):
        trainer rank:   refit.add_source("model.layers.0.mlp.up_proj.weight", dtensor)
        inference rank: refit.add_destination("model.layers.0.mlp.gate_up_proj.weight", local,
                                              [("model.layers.0.mlp.gate_proj.weight", gate_layout),
                                               ("model.layers.0.mlp.up_proj.weight", up_layout)])
        every rank:     refit.run()
    """

    def __init__(
        self,
        group: Any = None,
        *,
        name_map: NameMap = None,
        ignore_sources: Sequence[str] = (),
        topology: Topology | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        relay: bool = True,
        policy: str = "auto",
        policies: Mapping[str, str] | None = None,
        hardware: Any = None,
        verify: bool = False,
        timeout: Any = None,
        precision: str | Mapping[str, str] | Callable[[str], str] = "same",
        check_replicas: bool = False,
        delta: bool = False,
        delta_snapshot: str = "device",
        delta_check: str = "checksum",
        name: str | None = None,
        planning: str = "auto",
        local_planning_ranks: int | None = None,
    ) -> None:
        if planning not in PLANNINGS:
            raise ValueError(f"Refit: planning must be one of {PLANNINGS}, got {planning!r}")
        if policy not in POLICIES:
            raise ValueError(f"Refit: policy must be one of {POLICIES}, got {policy!r}")
        for n, p in (policies or {}).items():
            if p not in POLICIES:
                raise ValueError(f"Refit: policy of {n!r} must be one of {POLICIES}, got {p!r}")
        if not isinstance(delta, bool):
            raise TypeError(f"Refit: delta must be a bool, got {type(delta).__name__}")
        if delta and verify:
            raise ValueError("Refit: delta=True and verify=True cannot be combined (delta boxes carry checked headers "
                             "and versions; verify by checksums runs without delta)")
        if delta_snapshot not in SNAPSHOTS:
            raise ValueError(f"Refit: delta_snapshot must be one of {SNAPSHOTS}, got {delta_snapshot!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Refit: name must be a str or None, got {type(name).__name__}")
        self.delta = DeltaSession(snapshot=delta_snapshot, check=delta_check) if delta else None
        self.group = group if group is not None else Group.world()
        self.name = name
        ordinal = self.group.next_ordinal("refit")
        self.label = f"Refit {name!r}" if name is not None else f"the {_ordinal(ordinal)} Refit made on this group"
        """How errors name this refit."""
        self._nonce = secrets.token_hex(16)
        self.identity: str | None = None
        """Agreed at the first `run()` by every rank (a hash of every rank's nonce and the name); None before."""
        self.rank: int = self.group.rank
        self.name_map = name_map
        self.ignore_sources = frozenset(ignore_sources)
        self.topology = topology if topology is not None else Topology()
        self.staging_bytes = staging_bytes
        self.relay = relay
        self.policy = policy
        self.policies = dict(policies or {})
        threshold = _local_planning_ranks(local_planning_ranks)
        self.planning = planning if planning != "auto" else "local" if self.group.size >= threshold else "global"
        """How the first run plans: `"global"` or `"local"` (`planning="auto"` resolved on the group's size)."""
        self.hardware = hardware
        self.verify = verify
        self.check_replicas = check_replicas
        self.timeout = timeout
        self.precision = precision
        # what was registered: a DTensor (its local tensor is read at every run) or a plain tensor, which
        # `_follow` (kind, name) follows to its view base's new storage (see reshard.refit._live)
        self._sources: dict[str, tuple[Any, LayoutLike]] = {}
        self._dests: dict[str, tuple[torch.Tensor, Dest]] = {}
        self._scales: dict[str, torch.Tensor] = {}
        self._follow: dict[tuple[str, str], Bound] = {}
        self._coords: dict[str, list[int]] = {}  # DTensor sources: this process's coordinate in their mesh
        self._paths: dict[str, tuple[torch.nn.Module, str]] = {}  # add_module_sources: re-read at every run
        self._module_ties: dict[str, tuple[str, ...]] = {}  # add_module_sources: source -> its tied parameter names
        self._src_aliases: dict[str, tuple[str, ...]] = {}  # trainer name -> its other names (a tie)
        self._dst_aliases: dict[str, tuple[str, ...]] = {}  # inference global name -> its other names
        self._planned: dict[tuple[str, str], Geometry] = {}  # (kind, name) -> the geometry the plan was built for
        self._refusals: list[str] = []  # `refuse`: raised on every rank by the first run
        self._rebinds: dict[str, str] = {}  # update_source refused: raised by every run until a fitting rebind
        self._facts: list[tuple[str, dict]] = []  # declare_facts: (who, facts), agreed on by the first run
        self._before: list[Callable[[], None]] = []  # before_run: called at the start of every run
        self._built: Built | None = None

    _separate_handshake = False
    """True: a later run agrees twice before data moves, the live check and then `execute`'s own plan handshake
    (the older protocol, kept for `perf/bench_refit.py --rounds` to measure side by side)."""

    # ---- registration ----------------------------------------------------------------------------------------
    def add_source(self, name: str, tensor: Any, layout: LayoutLike | None = None, *,
                   aliases: Sequence[str] = ()) -> None:
        """Register a trainer weight held (in part) by this rank.

        Args:
            name: the trainer's name for it.
            tensor: a DTensor (its layout is read from it), or this rank's local tensor with `layout`.
            layout: the global layout, in group ranks, needed for a plain local tensor.
            aliases: other names of this same tensor in the trainer (a tie: `["lm_head.weight"]` for a tied
                embedding). The weight also feeds the inference tensors its aliases map to where nothing else
                does; see `reshard.refit._names` for the tie rules.

        A DTensor's mesh is in this process's own default-world ranks: every mesh position is mapped to the group
        rank of the process holding it (its coordinate travels with the metadata), so the group may number the
        trainer anywhere. DTensors of one weight on different sub-meshes (FSDP2 over each TP rank's own dp
        sub-mesh, HSDP, FSDP over `edp` for experts) are merged into one layout when they are disjoint whole
        copies; see `reshard.refit._sources`. So the plain loop registers a whole FSDP2 + TP model:

            for name, p in model.named_parameters():
                refit.add_source(name, p)

        A process outside a DTensor's mesh holds nothing of it and registers nothing.

        The registered object is kept, not its values: a DTensor's local tensor is read at every `run()` (so
        `module.to(...)` and a re-materialised local tensor are seen), a plain tensor is used as it is then. A
        parameter replaced in its module by a new object (`load_state_dict(assign=True)`) is not seen by this
        binding: register through `add_module_sources`, which re-reads the module's parameters at every run.
        """
        self._check_open(name)
        if name in self._sources:
            raise ValueError(f"Refit.add_source: {name!r} registered twice on rank {self.rank}")
        if aliases:
            self._src_aliases[name] = alias_names("add_source", name, aliases)
        if layout is None:
            if not is_dtensor(tensor):
                raise ValueError(f"Refit.add_source: {name!r} is a plain tensor; pass its layout too")
            coord = tensor.device_mesh.get_coordinate()
            if coord is None:  # a process outside the DTensor's mesh holds nothing of it (as DTensor says)
                logger.debug("Refit.add_source: %r: rank %d is outside its DTensor mesh; nothing to send", name,
                             self.rank)
                return
            layout = Layout.from_dtensor(tensor, name=name)
            # the mesh is in this process's own world ranks; the exchange maps it to group ranks by coordinate
            self._coords[name] = [int(c) for c in coord]
        else:
            self._follow[("source", name)] = Bound(tensor)
        self._sources[name] = (tensor, layout)

    def add_module_sources(self, module: torch.nn.Module, *, prefix: str = "",
                           ties: Mapping[str, Sequence[str]] | None = None) -> None:
        """Register every DTensor parameter of `module` under `prefix + name` (`module.named_parameters()`).

        Unlike `add_source(name, param)`, the registration follows the module, not the parameter objects: the
        parameters are looked up in the module again at every `run()`. A parameter replaced by a new object of the
        same layout (`load_state_dict(assign=True)`, `module.weight = nn.Parameter(...)`) is picked up and its new
        values sent; one of another layout (dtype, shape, placements, mesh) or a parameter gone from the module
        raises a `ValueError` on every rank, naming it, before data moves.

        Ties: a parameter under several names (a tied `lm_head`: `named_parameters(remove_duplicate=False)`) is
        registered once, under its first name, the others being its aliases (see `add_source`). The module's sharing
        is checked again at every run: a name that was tied and now holds a parameter of its own (untied, as after
        `module.lm_head.weight = nn.Parameter(...)`) has no registration in the plan, so it raises a `ValueError`
        on every rank naming both names, before data moves (build a new Refit to send it); names registered apart
        that became one parameter (re-tied) are each still read from the module, so each sends the shared values.

        Args:
            ties: more aliases, `prefix + name` -> other names the engine may hold it under (a tied `lm_head` the
                module does not have, by its config); never checked against the module.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Refit.add_module_sources: expected a torch.nn.Module, got {type(module).__name__}")
        first: dict[int, str] = {}
        tied: dict[str, list[str]] = {}
        params: dict[str, Any] = {}
        for pname, p in module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                tied[first[id(p)]].append(pname)
            else:
                first[id(p)], tied[pname], params[pname] = pname, [], p
        extra = dict(ties or {})
        unknown = sorted(set(extra) - {prefix + n for n in params})
        if unknown:
            raise ValueError(f"Refit.add_module_sources: ties names {unknown}, which the module does not hold")
        for pname, p in params.items():
            name = prefix + pname
            aliases = [prefix + a for a in tied[pname]]
            aliases += [a for a in extra.get(name, ()) if a not in aliases]
            self.add_source(name, p, aliases=aliases)
            if name in self._sources:
                self._paths[name] = (module, pname)
                if tied[pname]:
                    self._module_ties[name] = tuple(tied[pname])

    def follow(self, name: str, module: torch.nn.Module, pname: str) -> None:
        """Read registered source `name` from `module`'s parameter `pname` at every `run()`, as
        `add_module_sources` does: a parameter replaced by a new object that fits the registration (a DTensor of the
        same layout, or a plain tensor of the same local shape, dtype and device) is sent from the next run; one that
        does not fit, or a parameter gone from the module, raises a `ValueError` on every rank naming it, before
        data moves. For integrations that register a module's parameters under other names (several sources may
        follow one parameter: Megatron's fused `linear_qkv` is three).
        """
        self._check_open(name)
        if name not in self._sources:
            raise ValueError(f"Refit.follow: {name!r} is not a source registered on rank {self.rank}")
        if module.get_parameter(pname) is not self._sources[name][0]:
            raise ValueError(f"Refit.follow: source {name!r} on rank {self.rank} is not the module's parameter "
                             f"{pname!r}")
        self._paths[name] = (module, pname)

    def add_destination(
        self,
        name: str,
        tensor: torch.Tensor,
        layout: LayoutLike | Sequence[tuple[str, LayoutLike]],
        *,
        dim: int = 0,
        scale: torch.Tensor | None = None,
        placed: bool = False,
        aliases: Sequence[str] | Mapping[str, Sequence[str]] = (),
    ) -> None:
        """Register an inference-engine tensor that this rank holds, to be overwritten in place by `run()`.

        Args:
            name: the engine's name for the local tensor (e.g. `...qkv_proj.weight`).
            tensor: this rank's local tensor (the engine's own parameter: written in place, no extra copy).
            layout: its layout, when it holds one global tensor (named `name`, unless the layout has a name); or,
                for a fused tensor, the `(global_name, layout)` components in concatenation order along `dim`
                (vLLM's `qkv_proj`: q, k, v). Component layouts describe each global tensor's own sharding.
            placed: the component layouts are already in this local tensor's coordinates (as
                `reshard.integrations.fused.EngineTensor.fused()` gives them): registered as they are, not fused.
            aliases: other names of a global tensor in this engine (a tie: the engine's `lm_head.weight` is its
                `model.embed_tokens.weight`): a list for a tensor of one component, or component name -> list.
                A trainer weight under an alias writes the tensor; two trainer weights for one tied tensor are
                refused, naming both (see `reshard.refit._names`).
            scale: for an FP8 block-quantized weight (layout dtype `float8_e4m3fn`), this rank's local
                `weight_scale_inv` (float32), whose layout is derived from the weight's (see `scale_layout`).
        """
        self._check_open(name)
        if name in self._dests:
            raise ValueError(f"Refit.add_destination: {name!r} registered twice on rank {self.rank}")
        if isinstance(layout, LayoutLike):
            components: tuple[tuple[str, LayoutLike], ...] = ((layout.name or name, layout),)
        else:
            parts = list(layout)
            if not parts or not all(isinstance(p, tuple) and len(p) == 2 for p in parts):
                raise ValueError(f"Refit.add_destination: {name!r}: layout must be a Layout or a list of "
                                 "(global_name, layout) components")
            renamed = [relabel(lay, name=gname) for gname, lay in parts]
            fused = fuse(renamed, dim=dim) if len(renamed) > 1 and not placed else renamed
            components = tuple((gname, lay) for (gname, _), lay in zip(parts, fused))
        if aliases:
            per = dict(aliases) if isinstance(aliases, Mapping) else (
                {components[0][0]: aliases} if len(components) == 1 else None)
            if per is None or not set(per) <= {g for g, _ in components}:
                raise ValueError(f"Refit.add_destination: {name!r}: aliases must be a list (one component) or a "
                                 f"mapping from its components {[g for g, _ in components]} to lists, got {aliases!r}")
            for g, names in per.items():
                self._dst_aliases[g] = alias_names("add_destination", g, names)
        self._dests[name] = (tensor, Dest(name, components))
        self._follow[("destination", name)] = Bound(tensor)
        if scale is not None:
            self._scales[name] = scale
            self._follow[("scale of destination", name)] = Bound(scale)

    def declare_facts(self, facts: Mapping[str, Any], *, who: str) -> None:
        """Declare facts of the model this rank trains or serves that tensor shapes cannot show (heads, KV heads,
        head dim, experts, vocabulary, tie: `reshard.refit._facts.FACTS`, Hugging Face config names; None values
        are left out). The first `run()` compares every rank's declarations and raises a `ValueError` on every
        rank, naming each fact that differs, its values and who declared them, before any data moves.

        Args:
            facts: fact name -> value (int, or bool for `tie_word_embeddings`).
            who: the side and where the facts come from, for the error (`"trainer (Megatron TransformerConfig)"`).
        """
        self._check_open(who)
        entry = (who, _facts.checked(facts, who))
        if entry not in self._facts:  # one copy of a declaration made per registered tensor (`EngineTensor`)
            self._facts.append(entry)

    def before_run(self, fn: Callable[[], None]) -> None:
        """Call `fn()` on this rank at the start of every `run()`, before any registered tensor is read: an
        integration's way to bring its sources up to date (Megatron's deferred parameter all-gather). `fn` may run
        collectives of the trainer's own groups: every trainer rank registers the same hooks."""
        self._before.append(fn)

    def refuse(self, reason: str) -> None:
        """Record a problem this rank found in what it was asked to register or send (an integration's check of its
        own model, or of the tensors it binds for this step): the next `run()` raises a `ValueError` with it on every
        rank of the group, before data moves.

        A problem only one rank can see (a rank given another pipeline stage's model chunk, a stream that changed on
        one rank) then stops every rank, where raising on that rank alone would leave the others waiting for it.
        Before the first run, the refusal stays (every later run raises it too: the refit cannot be planned); after
        it, the run that raised it consumes it.
        """
        self._refusals.append(f"rank {self.rank}: {reason}")

    def update_source(self, name: str, tensor: Any) -> None:
        """Bind source `name` to `tensor` from the next `run()` on: a new object holding this step's values in the
        registered layout (a training engine's export makes new tensors at every step: casts, DTensors built around
        them).

        A plain source takes a plain tensor of the planned local shape, dtype and device (never a DTensor); a
        DTensor source a DTensor of the same layout at the same mesh coordinate (see `reshard.refit._rebind`). What
        does not fit binds nothing and is refused by every later run, on every rank before data moves, until a
        rebinding of that name fits (a retry never mixes two steps); a name never registered is refused at the next
        run (`refuse`). A source that follows its module (`add_module_sources`, `follow`) cannot be rebound
        (ValueError at once: a programming error on every rank alike).

        Args:
            name: the registered (trainer) name.
            tensor: the new local tensor, or DTensor, with this step's values.
        """
        if name in self._paths:
            raise ValueError(f"Refit.update_source: {name!r} follows its module's parameter (add_module_sources); "
                             "replace the parameter in the module instead")
        if name not in self._sources:
            self.refuse(f"update_source: {name!r} is not a registered source (registered: "
                        f"{len(self._sources)} names, e.g. {sorted(self._sources)[:3]}); a refit's sources are fixed "
                        "at registration")
            return
        _, layout = self._sources[name]
        e = rebind_error(name, tensor, layout, self._coords.get(name), self.rank, self._planned.get(("source", name)))
        if e:  # binds nothing, and every run raises it until a rebinding of this name fits (see _rebind)
            self._rebinds[name] = f"rank {self.rank}: update_source: {e}"
            return
        self._rebinds.pop(name, None)
        self._sources[name] = (tensor, layout)
        if name not in self._coords:
            self._follow[("source", name)] = Bound(tensor)

    def _check_open(self, name: str) -> None:
        if self._built is not None:
            raise ValueError(f"Refit: cannot register {name!r} after the first run(); build a new Refit")

    # ---- running ---------------------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan | LocalPlan:
        """The whole-model reshard plan (after the first `run()`); with rank-local planning, this rank's part."""
        if self._built is None:
            raise ValueError("Refit.plan: call run() first")
        return self._built.plan

    def run(self, *, agreed: bool = False, confirm: bool = True) -> RefitReport:
        """Move every registered weight's current values into the destinations. Every rank of the group calls it.

        Args:
            agreed: after the first run only: the caller has agreed with every rank, in a round of its own, that
                they all run this refit now. A later run agrees once before data moves either way: its live check
                is also the plan handshake (`reshard.refit._live.live_round`), so a later run has two all-rank
                rounds, that one and the completion round (none more with `agreed`; one fewer with `confirm=False`).
            confirm: end with the completion round (`execute(confirm=...)`); False when the caller confirms
                completion itself later (a rank then returns once its own part is done).
        """
        seconds = {"metadata": 0.0, "plan": 0.0, "transfer": 0.0}
        first = self._built is None
        if agreed and (first or self.delta is not None):
            raise ValueError(f"{self.label}: run(agreed=True) needs a plan every rank built and ran before (not the "
                             "first run) and no delta session")
        t0 = time.perf_counter()
        for fn in self._before:
            fn()
        srcs, dsts, scales, errors = resolve(self)
        if first:
            errors = self._refusals + list(self._rebinds.values()) + errors
            meta = exchange_metadata(self, srcs, dsts, scales, errors)
            # after the metadata, whose last rounds are broadcasts (a rank that sent the last table may be done
            # before the others received it): this all-rank round also brings every rank to `build` together, so a
            # refusal there is raised by each rank itself, not seen as a faster peer's fault in a wait
            _facts.agree(self.group, self.rank, self._facts, as_timedelta(self.timeout, default=self.group.timeout))
            t1 = time.perf_counter()
            self._built = build(self, meta)
            self._planned = {(kind, n): geometry(t) for kind, ts in (("source", srcs), ("destination", dsts),
                                                                      ("scale of destination", scales))
                             for n, t in ts.items()}
            seconds["metadata"] = t1 - t0
            seconds["plan"] = time.perf_counter() - t1
        b = self._built
        assert b is not None
        gate: Callable[[list[str]], None] | None = None
        gated: list[bool] = []
        if not first:
            # refused since the last run: raised by this one; a refused rebinding by every run until one fits
            errors, self._refusals = self._refusals + list(self._rebinds.values()) + errors, []
            errors = live_errors(self, srcs, dsts, scales, errors)

            def gate(local: list[str]) -> None:  # the one agreement before data moves (see `live_round`)
                gated.append(True)
                live_round(self, b, errors + local)
                if self.check_replicas:
                    self._check_replicas(b, srcs)

            if errors or self._separate_handshake:  # raises on every rank (the others join it in `execute`)
                gate([])
        elif self.check_replicas:
            self._check_replicas(b, srcs)
        t0 = time.perf_counter()
        src: list = [srcs.get(n) for n in b.source_names]
        dst: list = [dsts.get(n) for n in b.dest_names]
        dst += [scales.get(n) for n in b.scale_names]
        src += [None] * (b.num_src - len(src))
        dst += [None] * (b.num_dst - len(dst))
        for w in b.fp8:
            w.before(self.rank, src, dst)
        rep = None
        if b.plan.items:
            rep = execute(b.plan, self.rank, src, dst, self.group, verify=self.verify, timeout=self.timeout,
                          delta=self.delta, agreed=agreed if gated or gate is None else gate, confirm=confirm)
        if gate is not None and not gated:  # a rank outside the plan, or a plan of no items
            gate([])
        for w in b.fp8:
            w.after(self.rank, dst)
        for gb in b.gather_broadcast:
            gb.run(self, src, dst)
        seconds["transfer"] = time.perf_counter() - t0
        s = b.plan.stats
        report = RefitReport(seconds, s.network_bytes, s.nvlink_bytes, s.local_bytes,
                             sum(g.nbytes for g in b.gather_broadcast), len(b.choices), s.messages, first,
                             dict(b.choices))
        for link, st in getattr(rep, "links", {}).items():
            report.changed_fraction[link] = st.changed_fraction
            report.encoded_bytes[link] = st.encoded_bytes
            report.dense_bytes[link] = st.dense_bytes
        report.snapshot_bytes = getattr(rep, "snapshot_bytes", 0)
        report.execution = rep
        logger.debug("refit rank %d: %s", self.rank, report)
        return report

    def describe(self) -> str:
        """The per-weight choices and the whole-model plan's statistics."""
        b = self._built
        if b is None:
            return f"Refit(rank {self.rank}): {len(self._sources)} sources, {len(self._dests)} destinations, not run"
        lines = [f"Refit: {len(b.choices)} weights, {len(b.source_names)} source tensors, "
                 f"{len(b.dest_names)} destination tensors"]
        counts: dict[str, int] = {}
        for c in b.choices.values():
            counts[c] = counts.get(c, 0) + 1
        lines.append("  per-weight method: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        for name, choice in list(b.choices.items())[:50]:
            lines.append(f"    {name}: {choice.describe() if isinstance(choice, Choice) else choice}")
        if len(b.choices) > 50:
            lines.append(f"    ... {len(b.choices) - 50} more")
        lines.append(b.plan.describe(max_transfers=0))
        return "\n".join(lines)

    def _check_replicas(self, b: Built, srcs: dict[str, torch.Tensor]) -> None:
        mine = [self.rank, replica_digests(self.rank, b.source_layouts, srcs)]
        td = as_timedelta(self.timeout, default=self.group.timeout)
        gathered = all_gather_json(self.group, mine, timeout=td, what="refit replica check")
        for r, m in enumerate(gathered):
            if not (isinstance(m, list) and len(m) == 2 and m[0] == r and isinstance(m[1], list)
                    and all(isinstance(d, list) and len(d) == 4 and isinstance(d[0], str) for d in m[1])):
                raise CommError(f"refit replica check: rank {r} sent malformed digests: {str(m)[:200]}")
        errors = replica_errors([(r, d) for r, d in gathered])
        if errors:
            raise ValueError(f"Refit on rank {self.rank}: {len(errors)} replica mismatch(es), nothing was moved:\n  "
                             + "\n  ".join(errors))

    def _agreed_fingerprint(self, b: Built) -> str:
        """What every later run's agreement compares: the plan and this refit's identity, so that two refits of
        the same plan run in a different order on some ranks do not agree."""
        return hashlib.sha256(f"{b.plan.fingerprint}|{self.identity}".encode()).hexdigest()[:32]


def _local_planning_ranks(value: int | None) -> int:
    """`Refit(local_planning_ranks=...)`, or the exported `reshard.refit.LOCAL_PLANNING_RANKS` as it is now (read at
    each call, so that setting it takes effect)."""
    if value is None:  # the package, loaded by now (it imports this module), holds the name users set
        value = getattr(sys.modules.get("reshard.refit"), "LOCAL_PLANNING_RANKS", LOCAL_PLANNING_RANKS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Refit: local_planning_ranks must be an integer >= 1, got {value!r}")
    return value


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


