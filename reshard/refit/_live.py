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

from typing import Any

import torch

Geometry = tuple[tuple[int, ...], torch.dtype, torch.device]


def geometry(t: torch.Tensor) -> Geometry:
    """What a plan fixes about a local tensor: its shape, dtype and device."""
    return tuple(t.shape), t.dtype, t.device


def changed(kind: str, name: str, rank: int, old: Geometry, new: Geometry) -> str | None:
    """The error for a registered tensor whose geometry differs from the plan's, or None when it does not."""
    diffs = [f"{what} {o} -> {n}" for what, o, n in zip(("local shape", "dtype", "device"), old, new) if o != n]
    if not diffs:
        return None
    return (f"{kind} {name!r} on rank {rank} changed since the plan was built: {', '.join(diffs)}; a refit's "
            "tensors keep their layout (build a new Refit for the new one)")


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
