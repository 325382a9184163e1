"""Live registrations: what `Refit` reads at every `run()`, and the check that it still fits the plan.

`Refit` keeps what the user registered, not a snapshot of it, and resolves it to a local tensor at every run:

- a DTensor (an `nn.Parameter` or not): its local tensor, read at run time (`to_local()`), so `module.to(...)`,
  `torch.utils.swap_tensors` and a re-materialised local tensor are seen;
- a parameter registered through `Refit.add_module_sources(module)`: the module's parameter of that name, re-read
  at run time, so a parameter replaced in its module (`load_state_dict(assign=True)`) is seen too;
- a plain tensor: the tensor itself (so `.data` swaps on it are seen); a *view* (as an engine's fused tensor
  registered through `EngineTensor.register` is) is followed through its base: when the base moved to new storage
  (`param.data = new`), the view is rebuilt on the new storage with the same offset and strides.

A plain `Refit.add_source(name, param)` binds that parameter object: a parameter replaced in its module by a new
object is not seen (register through `add_module_sources`, or build a new `Refit`). Every run compares each
resolved tensor's local shape, dtype and device with what the plan was built for: a new storage of the same
geometry is used as it is (the executor prepares its copies for the new addresses), anything else is an error
naming the tensor, the rank and the old and new values, raised on every rank before any data moves.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from reshard.comm import agree
from reshard.comm._contract import as_timedelta
from reshard.refit._build import Built
from reshard.refit._meta import LayoutLike, changed, geometry
from reshard.refit._rebind import rebind_error

logger = logging.getLogger(__name__)

def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Bound:
    """A registered plain tensor, followed through its view base when the base moves to new storage.

    Attributes:
        tensor: the tensor to read or write now.
        base: the tensor it views (`tensor._base` at registration), or None.
    """

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        base = getattr(tensor, "_base", None) if isinstance(tensor, torch.Tensor) else None
        self.base: torch.Tensor | None = base
        if base is not None:
            self._base_geometry = (tuple(base.shape), base.stride(), base.dtype, base.device)
            self._offset = tensor.storage_offset() - base.storage_offset()

    def current(self, kind: str, name: str, rank: int) -> tuple[Any, str | None]:
        """The tensor to use now, and an error when it cannot be followed."""
        t, b = self.tensor, self.base
        if b is None or _storage(b) == _storage(t):
            return t, None
        now = (tuple(b.shape), b.stride(), b.dtype, b.device)
        if now != self._base_geometry:
            old = self._base_geometry
            return t, (f"{kind} {name!r} on rank {rank} is a view of a tensor that was replaced since registration "
                       f"(shape {old[0]} -> {now[0]}, strides {old[1]} -> {now[1]}, dtype {old[2]} -> {now[2]}, "
                       f"device {old[3]} -> {now[3]}); the view cannot be rebuilt on it, register the new tensor "
                       "with a new Refit")
        with torch.no_grad():
            self.tensor = b.detach().as_strided(t.shape, t.stride(), b.storage_offset() + self._offset)
        return self.tensor, None


def dtensor_local(obj: Any) -> torch.Tensor:
    """A DTensor's local tensor as it is now (no autograd node)."""
    with torch.no_grad():
        return obj.to_local()


def resolve(refit: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[str]]:
    """The local tensors to use now (sources, destinations, scales by name), and this rank's errors."""
    errors: list[str] = []
    srcs: dict[str, Any] = {}
    for name, (obj, layout) in list(refit._sources.items()):
        path = refit._paths.get(name)
        if path is not None:
            module, pname = path
            try:
                now = module.get_parameter(pname)
            except AttributeError as e:
                errors.append(f"source {name!r} on rank {refit.rank}: its module no longer has parameter "
                              f"{pname!r} ({e})")
                continue
            untied = _untied(refit, name, module, pname, now)
            if untied:
                errors.append(untied)
                continue
            if now is not obj:
                e = _adopt(refit, name, now, layout)
                if e:
                    errors.append(e)
                    continue
                obj = now
        if name in refit._coords:
            srcs[name] = dtensor_local(obj)
        else:
            srcs[name] = _current(refit, "source", name, obj, errors)
            if srcs[name] is not obj:  # followed to new storage: keep the registration current
                refit._sources[name] = (srcs[name], layout)
    dsts = {n: _current(refit, "destination", n, t, errors) for n, (t, _) in refit._dests.items()}
    scales = {n: _current(refit, "scale of destination", n, t, errors) for n, t in refit._scales.items()}
    for n, (t, d) in list(refit._dests.items()):
        if dsts[n] is not t:  # followed to new storage: keep the registration current
            refit._dests[n] = (dsts[n], d)
    refit._scales.update(scales)
    return srcs, dsts, scales, errors


def _current(refit: Any, kind: str, name: str, tensor: Any, errors: list[str]) -> Any:
    """A registered plain tensor as it is now (followed to its view base's new storage), appending errors."""
    bound = refit._follow.get((kind, name))
    if bound is None or bound.tensor is not tensor:  # not registered through add_* (set directly)
        return tensor
    now, e = bound.current(kind, name, refit.rank)
    if e:
        errors.append(e)
    return now


def _untied(refit: Any, name: str, module: torch.nn.Module, pname: str, now: Any) -> str | None:
    """Why source `name`'s tied names (registered as its aliases) are no longer its parameter, or None."""
    gone = []
    for alias in refit._module_ties.get(name, ()):
        try:
            other = module.get_parameter(alias)
        except AttributeError:
            other = None
        if other is not now:
            gone.append(alias)
    if not gone:
        return None
    return (f"source {name!r} on rank {refit.rank}: its module's parameters {gone} were tied to {pname!r} when "
            f"registered (sent as its aliases) and are now parameters of their own (untied or removed): the "
            "plan has no registration for their values, so nothing is sent rather than the tied values. Build a "
            "new Refit for the module's new sharing (ReshardTrainer: trainer_init again, with the engine's "
            "init_weight_transfer_engine)")


def _adopt(refit: Any, name: str, now: Any, layout: LayoutLike) -> str | None:
    """Take `now`, the parameter that replaced source `name` in its module, if it fits its registration (the
    same checks as `update_source`: see `reshard.refit._rebind`)."""
    _, pname = refit._paths[name]
    e = rebind_error(name, now, layout, refit._coords.get(name), refit.rank, refit._planned.get(("source", name)))
    if e:
        return (f"source {name!r} on rank {refit.rank}: its module's parameter {pname!r} was replaced by one of "
                f"another layout or kind: {e}")
    logger.debug("Refit: rank %d: source %r: its module's parameter %r was replaced; using the new one",
                 refit.rank, name, pname)
    refit._sources[name] = (now, layout)
    if name not in refit._coords:
        refit._follow[("source", name)] = Bound(now)
    return None


def live_errors(refit: Any, srcs: dict[str, Any], dsts: dict[str, Any], scales: dict[str, Any],
                errors: list[str]) -> list[str]:
    """`errors` and this rank's registered tensors that no longer fit the plan (local: no message)."""
    errors = list(errors)
    for kind, ts in (("source", srcs), ("destination", dsts), ("scale of destination", scales)):
        for n, t in ts.items():
            if not isinstance(t, torch.Tensor):
                errors.append(f"{kind} {n!r} on rank {refit.rank}: expected a torch.Tensor, got "
                              f"{type(t).__name__}")
                continue
            e = changed(kind, n, refit.rank, refit._planned[(kind, n)], geometry(t))
            if e:
                errors.append(e)
    return errors


def live_round(refit: Any, b: Built, errors: list[str]) -> None:
    """The steady run's one agreement before data moves, over every rank of the group: return on every rank when
    all hold this refit's plan (`Refit._agreed_fingerprint`: the plan's fingerprint and the refit's identity) and
    none has errors, else raise the same `ValueError` on every rank, naming each rank's errors.

    `Refit.run` passes it to `execute(agreed=...)` with the executor's own checks of this rank's tensors (memory
    shared between destinations, staging), so it is also the plan handshake: a steady run's only other all-rank
    round is the completion round at its end. The handshake's other input, the device type on the wire, is fixed by
    every tensor's device, which `live_errors` compares with the plan's.
    """
    if refit.group.size > 1:
        td = as_timedelta(refit.timeout, default=refit.group.timeout)
        fp = refit._agreed_fingerprint(b)
        described = [("refit", f"{refit.label} (identity {str(refit.identity)[:12]})"),
                     ("refit plan", b.plan.fingerprint)]
        agree(refit.group, list(range(refit.group.size)), fp, errors, lambda: described, timeout=td,
              what="refit live check", failure="Refit: registered tensors changed since the plan was "
              "built, nothing was moved")
    elif errors:
        raise ValueError(f"Refit on rank {refit.rank}: registered tensors changed, nothing was moved:\n  "
                         + "\n  ".join(errors))
