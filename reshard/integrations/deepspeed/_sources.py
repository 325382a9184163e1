"""A DeepSpeed model registered as `Refit` sources from this rank's own partitions, nothing gathered.

ZeRO-3 keeps, per parameter, `param.ds_tensor`: the flattened elements `[r * ps, min((r + 1) * ps, n))` of the
weight (`n = ds_numel`, `ps = ceil(n / W)` over the `W` ranks of `ds_process_group`, `r = ds_zero_partition_rank`),
padding (uninitialised) after them. `param.data`, `shape` and `numel()` say nothing (`[0]`, or whole between a
forward and the next release): only `ds_shape`, `ds_numel` and `ds_tensor` are read. Each parameter is a
`FlatRangeLayout` with this rank's range at its refit group rank; its local tensor is the range's window over
`ds_tensor`'s storage (`_window`: a view where it fits, a copy refreshed before every run otherwise). Parameters
DeepSpeed keeps whole (`ds_persist`, below `stage3_param_persistence_threshold`) are sent from their partitions too,
so each byte leaves the trainer once. ZeRO-0/1/2 (whole parameters on every data-parallel rank) are cut by the same
rule from `param.data`, a view of whole rows (no copy).

Before every run, each parameter is looked up in the module again: one replaced by a new object (or whose
partition moved to new storage) that fits its registration (the same global shape and dtype, and under ZeRO-3 the
same partition) is read from then on; one that does not is refused on every rank, naming it, before data moves.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.integrations.deepspeed._window import Window, refresh, window_of
from reshard.integrations.model_config import model_facts, trainer_name
from reshard.integrations.trainer import config_ties
from reshard.planner import FlatRangeLayout
from reshard.refit import Refit

logger = logging.getLogger(__name__)

__all__ = ["add_sources", "partition_source"]


@dataclass
class _Entry:
    """One registered parameter: where it is in the module, its range, and the window registered for it."""

    name: str
    pname: str
    param: torch.Tensor
    shape: tuple[int, ...]
    start: int
    stop: int
    window: Window


def add_sources(refit: Refit, engine: Any, *, names: Callable[[str], str] | Mapping[str, str] | None = None,
                ) -> list[str]:
    """Register this rank's partitions of a DeepSpeed model as `refit` sources under Hugging Face names.

    Call it on every trainer rank, after `deepspeed.initialize` (or on a module built under `deepspeed.zero.Init`)
    and before the first `refit.run()`; every run sends the partitions' current values (the optimizer writes them in
    place). Under ZeRO-3 nothing is gathered: each rank sends its own `ds_tensor` ranges, the padding never read.

    Args:
        refit: the `Refit`; this rank's ranges are declared at its group rank.
        engine: a `DeepSpeedEngine` (ZeRO stage 0-3), or a module whose parameters are ZeRO-3 partitioned.
        names: parameter name -> source name (a callable or a mapping); default `hf.trainer_name` (the Hugging
            Face name, wrappers' prefixes stripped).

    Returns:
        The source names this rank registered, sorted (a rank whose ranges of a small tensor are all padding
        registers nothing for it).

    Raises:
        NotImplementedError: on every rank (the config is global), naming the feature: MiCS or hpZ (hierarchical
            partitions), parameter offload to NVMe, ZeRO++ quantized weights, a model-parallel `mpu`.
        TypeError: not a DeepSpeed engine or module.

    A partition that breaks the rule above (its size, its rank or world, a non-1-D tensor) is recorded with
    `refit.refuse`: the first run raises it on every rank, naming the parameter, before data moves.
    """
    module = engine.module if _is_engine(engine) else engine
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"deepspeed.add_sources: expected a DeepSpeedEngine or a torch.nn.Module, got "
                        f"{type(engine).__name__}")
    params = list(module.named_parameters(remove_duplicate=False))
    zero3 = any(hasattr(p, "ds_tensor") for _, p in params)
    _check_features(engine, params, zero3)
    rename = _renamer(names)
    dp_rank, dp_world = (0, 1) if zero3 else _data_parallel(engine)
    first: dict[int, str] = {}
    ties: dict[str, list[str]] = {}
    entries: list[_Entry] = []
    problems: list[str] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for pname, p in params:
        name = rename(pname)
        if id(p) in first:
            ties.setdefault(first[id(p)], []).append(name)
            continue
        first[id(p)] = name
        got = _partition(pname, p) if zero3 else _whole(p, dp_rank, dp_world)
        if isinstance(got, str):
            problems.append(got)
            continue
        shape, part, start, stop = got
        shapes[name] = shape
        if start < stop:
            entries.append(_Entry(name, pname, p, shape, start, stop, window_of(part, shape, start, stop)))
    ties = config_ties(shapes, ties, getattr(module, "config", None))
    for e in entries:
        layout = FlatRangeLayout(e.shape, e.window.tensor.dtype, {refit.rank: (e.start, e.stop)}, name=e.name)
        refit.add_source(e.name, e.window.tensor, layout, aliases=ties.get(e.name, ()))
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):
        refit.declare_facts(model_facts(config), who="trainer (DeepSpeed model's Hugging Face config)")
    refit.before_run(lambda: _refresh(refit, module, entries, zero3, dp_rank, dp_world))
    for p in problems:
        refit.refuse(f"deepspeed.add_sources: {p}")
    copies = sum(not e.window.view for e in entries)
    logger.debug("deepspeed.add_sources: rank %d registered %d parameters (ZeRO-%s), %d as refreshed copies",
                 refit.rank, len(entries), 3 if zero3 else "0/1/2", copies)
    return sorted(e.name for e in entries)


def partition_source(name: str, param: torch.Tensor, rank: int) -> tuple[torch.Tensor, FlatRangeLayout] | None:
    """One ZeRO-3 parameter as a `(local window, FlatRangeLayout)` source declared at group rank `rank`, for
    integrations that build their sources anew at every sync (TRL's `GRPOTrainer`): the window is a view of
    `ds_tensor`'s storage where it fits, else a copy of this step's values. None where this rank's range is only
    padding.

    Raises:
        ValueError: `param` is not a ZeRO-3 parameter, or its partition breaks ZeRO-3's rule (naming it).
    """
    got = _partition(name, param)
    if isinstance(got, str):
        raise ValueError(f"deepspeed.partition_source: {got}")
    shape, part, start, stop = got
    if start >= stop:
        return None
    window = window_of(part, shape, start, stop)
    return window.tensor, FlatRangeLayout(shape, part.dtype, {rank: (start, stop)}, name=name)


def _is_engine(engine: Any) -> bool:
    return hasattr(engine, "zero_optimization_stage") and hasattr(engine, "module")


def _renamer(names: Callable[[str], str] | Mapping[str, str] | None) -> Callable[[str], str]:
    if names is None:
        return trainer_name
    if isinstance(names, Mapping):
        return lambda n: names.get(n, trainer_name(n))
    return names


def _check_features(engine: Any, params: list[tuple[str, torch.Tensor]], zero3: bool) -> None:
    """Raise `NotImplementedError` for a DeepSpeed feature whose partitions this cannot read (every rank: the
    config, and each parameter's partition kind, are the same on every rank)."""
    why = []
    first = params[0][0] if params else "<no parameters>"
    if _is_engine(engine):
        cfg = getattr(getattr(engine, "_config", None), "zero_config", None)
        if getattr(getattr(engine, "_config", None), "mics_shard_size", -1) > 0:
            why.append((first, "MiCS (hierarchical partitions: mics_shard_size)"))
        if (getattr(cfg, "zero_hpz_partition_size", 1) or 1) > 1:
            why.append((first, "hpZ (hierarchical partitions: zero_hpz_partition_size)"))
        offload = getattr(cfg, "offload_param", None)
        if offload is not None and str(getattr(offload, "device", "none")).endswith("nvme"):
            why.append((first, "parameter offload to NVMe (offload_param.device = nvme)"))
        if getattr(cfg, "zero_quantized_weights", False):
            why.append((first, "ZeRO++ quantized weights (zero_quantized_weights)"))
        if not zero3 and getattr(engine, "mpu", None) is not None:
            why.append((first, "model parallelism through an mpu (parameters are then not whole on each rank)"))
    for pname, p in params:
        if not hasattr(p, "ds_tensor"):
            continue
        if getattr(p, "ds_secondary_tensor", None) is not None or (getattr(p, "ds_secondary_tensor_num_of_groups", 1)
                                                                    or 1) > 1:
            why.append((pname, "hpZ (a secondary partition)"))
            break
        if str(getattr(p.ds_tensor, "final_location", "")).endswith("nvme"):
            why.append((pname, "parameter offload to NVMe"))
            break
    if why:
        raise NotImplementedError("deepspeed.add_sources: not supported: " + "; ".join(
            f"parameter {p!r}: {w}" for p, w in why))


def _partition(pname: str, p: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor, int, int] | str:
    """`(global shape, ds_tensor, start, stop)` of a ZeRO-3 parameter, or the problem with its partition."""
    if not hasattr(p, "ds_tensor"):
        return f"parameter {pname!r} is not ZeRO-3 partitioned (no ds_tensor) while others are"
    shape = tuple(int(s) for s in p.ds_shape)
    n, world, rank = int(p.ds_numel), int(p.ds_zero_partition_world_size), int(p.ds_zero_partition_rank)
    part = p.ds_tensor
    ps = -(-n // world) if world else 0
    if n != math.prod(shape) or part is None or part.dim() != 1 or part.numel() != ps or not 0 <= rank < world:
        return (f"parameter {pname!r}: its partition breaks ZeRO-3's rule (ds_shape {shape}, ds_numel {n}, rank "
                f"{rank} of {world}: expected a 1-D ds_tensor of ceil({n} / {world}) = {ps} elements, got "
                f"{None if part is None else tuple(part.shape)})")
    return shape, part, min(rank * ps, n), min((rank + 1) * ps, n)


def _data_parallel(engine: Any) -> tuple[int, int]:
    """This rank and the data-parallel ranks that hold whole parameters (ZeRO-0/1/2), which split the sending."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0, 1
    group = getattr(engine, "data_parallel_group", None) if _is_engine(engine) else None
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _whole(p: torch.Tensor, rank: int, world: int) -> tuple[tuple[int, ...], torch.Tensor, int, int]:
    """`(shape, this rank's range of the flat data, start, stop)` of a parameter every data-parallel rank holds
    whole: rank `rank`'s share
    by ZeRO-3's rule, so each byte is sent by one rank."""
    data = p.detach()
    shape, n = tuple(data.shape), data.numel()
    ps = -(-n // world)
    flat = data.reshape(-1) if data.is_contiguous() else data.contiguous().reshape(-1)
    start, stop = min(rank * ps, n), min((rank + 1) * ps, n)
    return shape, flat[start:stop], start, stop


def _refresh(refit: Refit, module: torch.nn.Module, entries: list[_Entry], zero3: bool, dp_rank: int,
             dp_world: int) -> None:
    """Before a run: follow replaced parameters and moved partitions, refresh the copied windows."""
    for e in entries:
        try:
            p = module.get_parameter(e.pname)
        except AttributeError:
            refit.refuse(f"deepspeed.add_sources: parameter {e.pname!r} (source {e.name!r}) is gone from the model")
            continue
        got = _partition(e.pname, p) if zero3 else _whole(p, dp_rank, dp_world)
        if isinstance(got, str) or got[0] != e.shape or got[2:] != (e.start, e.stop) or (
                got[1].dtype != e.window.tensor.dtype):
            what = got if isinstance(got, str) else (
                f"global shape {got[0]}, range [{got[2]}, {got[3]}), {got[1].dtype}")
            refit.refuse(f"deepspeed.add_sources: parameter {e.pname!r} (source {e.name!r}) was replaced by one "
                         f"that does not fit its registration (global shape {e.shape}, range [{e.start}, {e.stop}), "
                         f"{e.window.tensor.dtype}): {what}; build a new Refit to send it")
            continue
        part = got[1]
        if p is not e.param or (e.window.view and _base_ptr(part) != _base_ptr(e.window.tensor)):
            e.param, e.window = p, window_of(part, e.shape, e.start, e.stop)  # a copy is filled as it is made
            refit.update_source(e.name, e.window.tensor)
        else:
            refresh(e.window, part)


def _base_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
