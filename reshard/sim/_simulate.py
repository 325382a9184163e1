"""The simulator: build the real whole-model plans in one process and time them on a modelled cluster."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from reshard.cost import (
    GatherBroadcast,
    Hardware,
    LinkLoads,
    LowerBound,
    Timing,
    gather_broadcast,
    get_hardware,
    link_time,
    lower_bound,
    plan_loads,
    relay_fill_s,
)
from reshard.models import ModelConfig, get_preset
from reshard.planner import DEFAULT_STAGING_BYTES, FP8, RELAY_CHUNK_LAG, Plan, PlanItem, Topology, plan_many, relabel
from reshard.planner._contract import Fp8Items
from reshard.sim._layouts import WeightLayouts, model_layouts
from reshard.sim._system import System, load_system

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class MethodResult:
    """One refit method's modelled cost.

    Attributes:
        method: `"reshard"`, `"direct p2p"`, `"gather+bcast"` or `"lower bound"`.
        seconds: modelled time.
        network_bytes, nvlink_bytes, local_bytes: bytes per link kind (each counted once).
        messages: point-to-point messages (None for the collective baseline and the bound).
        max_network_send, max_network_recv, max_nvlink_send, max_nvlink_recv: the busiest rank's bytes per link
            direction.
        bottleneck: which link set the time, in words.
        plan_seconds: wall time to build the plan here (None where no plan is built).
    """

    method: str
    seconds: float
    network_bytes: int
    nvlink_bytes: int
    local_bytes: int = 0
    messages: int | None = None
    max_network_send: int = 0
    max_network_recv: int = 0
    max_nvlink_send: int = 0
    max_nvlink_recv: int = 0
    bottleneck: str = ""
    plan_seconds: float | None = None


@dataclass(frozen=True)
class SimResult:
    """The simulator's answer for one model on one system and hardware.

    Attributes:
        model, system, hardware: the inputs (the system with its domain size filled in).
        num_tensors: weights planned.
        model_bytes: the model's size.
        methods: one `MethodResult` per method, reshard first.
        gather_broadcast: the baseline's details (per-stage times and bytes).
        lower: the lower bound's terms.
    """

    model: ModelConfig
    system: System
    hardware: Hardware
    num_tensors: int
    model_bytes: int
    methods: tuple[MethodResult, ...]
    gather_broadcast: GatherBroadcast | None = field(repr=False, default=None)
    lower: LowerBound | None = None

    def method(self, name: str) -> MethodResult:
        for m in self.methods:
            if m.method == name:
                return m
        raise KeyError(f"no method {name!r}; have {[m.method for m in self.methods]}")


def _max_load(loads: LinkLoads, link: str, direction: str) -> int:
    return max((b for k, b in loads.bytes.items() if k.link == link and k.direction == direction), default=0)


def _describe_bottleneck(t: Timing) -> str:
    if t.bottleneck is None:
        return "nothing moves"
    k = t.bottleneck
    return f"rank {k.rank} {k.link} {k.direction}: {t.bottleneck_bytes / 1e9:.2f} GB, {t.bottleneck_messages} msgs"


def _plan_result(method: str, p: Plan, hw: Hardware, plan_s: float, fill_s: float) -> MethodResult:
    loads = plan_loads(p)
    t = link_time(loads, hw, fill_s=fill_s)
    s = p.stats
    return MethodResult(
        method=method,
        seconds=t.seconds,
        network_bytes=s.network_bytes,
        nvlink_bytes=s.nvlink_bytes,
        local_bytes=s.local_bytes,
        messages=s.messages,
        max_network_send=_max_load(loads, "network", "send"),
        max_network_recv=_max_load(loads, "network", "recv"),
        max_nvlink_send=_max_load(loads, "nvlink", "send"),
        max_nvlink_recv=_max_load(loads, "nvlink", "recv"),
        bottleneck=_describe_bottleneck(t),
        plan_seconds=plan_s,
    )


def plan_items(layouts: list[WeightLayouts]) -> list[PlanItem]:
    """One `PlanItem` per weight, local tensor `i` on both sides."""
    return [PlanItem(w.train, w.gen, src_tensor=i, dst_tensor=i, name=w.spec.name) for i, w in enumerate(layouts)]


FP8_KINDS = frozenset({"column", "column_kv", "row", "q_a", "kv_a", "expert_w1", "expert_w2", "expert_w3",
                       "mtp_proj"})
"""The weights a DeepSeek-V3-style FP8 checkpoint quantizes (linear layers); embeddings, lm_head, norms and routers
stay in high precision."""


def fp8_plan_items(layouts: list[WeightLayouts]) -> list[PlanItem]:
    """Plan items of an `fp8_block` refit: linear weights become float8_e4m3fn on the inference side with
    per-128x128-block scales (quantized on the source when trainer shards are block-aligned, else on the
    destination from block halos, exactly as `Refit` does); the other weights move as they are."""
    n = len(layouts)
    items: list[PlanItem] = []
    extra_src, extra_dst, scale_dst = n, 2 * n, n
    for i, w in enumerate(layouts):
        if w.spec.kind in FP8_KINDS and len(w.spec.shape) >= 2:
            f = Fp8Items(w.spec.name, w.train, relabel(w.gen, dtype=FP8), i, i, scale_dst,
                          extra_src, extra_dst)
            scale_dst += 1
            extra_src += f.num_extra_src
            extra_dst += f.num_extra_dst
            items.extend(f.items)
        else:
            items.append(PlanItem(w.train, w.gen, src_tensor=i, dst_tensor=i, name=w.spec.name))
    return items


def simulate(
    model: str | ModelConfig,
    system: str | System,
    hardware: str | Hardware,
    *,
    domain_size: int | None = None,
    stack_experts: bool = True,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    direct: bool = True,
    fp8: bool = False,
) -> SimResult:
    """Plan a whole-model refit and model its time three ways, next to the lower bound.

    Args:
        model: a `ModelConfig` or a preset name (`reshard.models.PRESETS`).
        system: a `System`, a shipped M2N config name, a JSON path, or the command-line form.
        hardware: a `Hardware` or a preset name (`h100`, `gb200`, `gb300`).
        domain_size: GPUs per NVLink domain; default: the system's, else the hardware's.
        stack_experts: plan routed experts as `[E, ...]` tensors (same bytes, far fewer tensors).
        staging_bytes: the planner's staging budget per rank.
        direct: also plan and time direct point-to-point (no relays).
        fp8: also plan and time an `fp8_block` refit (`reshard fp8_block`): linear weights served as FP8 with
            block scales (see `fp8_plan_items`).

    Returns:
        A `SimResult` with methods `reshard`, `reshard fp8_block` (if `fp8`), `direct p2p` (if `direct`),
        `gather+bcast` and `lower bound`.
    """
    config = get_preset(model) if isinstance(model, str) else model
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    sys_ = load_system(system) if isinstance(system, str) else system
    dom = domain_size or sys_.domain_size or hw.domain_size
    sys_ = sys_.with_domain_size(dom)
    topo = Topology(domain_size=dom)

    t0 = time.perf_counter()
    layouts = model_layouts(config, sys_, stack_experts=stack_experts)
    items = plan_items(layouts)
    logger.info(
        "%s on %s: %d tensors, layouts in %.2fs", config.name, sys_.describe(), len(items), time.perf_counter() - t0
    )

    methods = []
    t0 = time.perf_counter()
    relay_plan = plan_many(items, topo, relay=True, staging_bytes=staging_bytes)
    plan_s = time.perf_counter() - t0
    fill = relay_fill_s(relay_plan, hw, chunk_lag=RELAY_CHUNK_LAG)
    methods.append(_plan_result("reshard", relay_plan, hw, plan_s, fill))
    if fp8:
        t0 = time.perf_counter()
        fp8_plan = plan_many(fp8_plan_items(layouts), topo, relay=True, staging_bytes=staging_bytes)
        methods.append(_plan_result("reshard fp8_block", fp8_plan, hw, time.perf_counter() - t0,
                                    relay_fill_s(fp8_plan, hw, chunk_lag=RELAY_CHUNK_LAG)))
    if direct:
        t0 = time.perf_counter()
        direct_plan = plan_many(items, topo, relay=False, staging_bytes=staging_bytes)
        methods.append(_plan_result("direct p2p", direct_plan, hw, time.perf_counter() - t0, 0.0))
    gb = gather_broadcast(((w.train, w.gen, w.stage) for w in layouts), hw, topo.domain)
    network = gb.network_bytes + gb.gather_network_bytes
    methods.append(MethodResult("gather+bcast", gb.seconds, network, gb.gather_bytes + gb.broadcast_bytes - network))
    lb = lower_bound(relay_plan, hw)
    methods.append(MethodResult("lower bound", lb.seconds, relay_plan.stats.network_lower_bound, 0))
    return SimResult(
        model=config,
        system=sys_,
        hardware=hw,
        num_tensors=len(items),
        model_bytes=sum(w.spec.nbytes for w in layouts),
        methods=tuple(methods),
        gather_broadcast=gb,
        lower=lb,
    )
