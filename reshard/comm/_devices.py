"""Devices at rendezvous: every rank's data device agreed over the control backend, two ranks on one device refused,
and NCCL-style communicators bound to their device and connected eagerly.

Why eagerly: on NCCL, a communicator's first operation, if it is a coalesced batch, needs every rank of the group to
take part ("otherwise it will lead to unexpected hang issues", torch's `batch_isend_irecv`). A rank with nothing to
send or receive in a refit (a replica the planner never picks as a source) never posts, and its peers would block
in the communicator's creation. Connected at rendezvous, where every rank is present, no later batch depends on
which ranks post.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import socket
from typing import Any

import torch

from reshard.comm._errors import CommError

logger = logging.getLogger(__name__)

WATCHDOG_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""NCCL's watchdog setting. reshard sets it to `2` (abort the communicator, keep the process) when it is unset, before
creating an NCCL backend: torch's default (`3`) tears the process down when an operation outlives the group's
timeout, which would take a vLLM worker down with a dead trainer instead of leaving it on its previous weights."""

WATCHDOG_MARGIN = datetime.timedelta(seconds=60)
"""How much later than reshard's own deadline NCCL's watchdog fires: reshard's deadline names the culprit and aborts
the communicator first."""

EAGER = True
"""Whether `Group.rendezvous` connects NCCL-style backends eagerly (tests turn it off to show the hang it prevents)."""

_TYPES = {"cpu": 0, "cuda": 1}


def follows_nccl(pg: Any) -> bool:
    """Whether `pg` obeys NCCL's contract (NCCL itself, or a backend whose `nccl_rules` says so on CPU tensors):
    batches are coalesced, completion is polled, the communicator is aborted on a fault."""
    return bool(getattr(pg, "nccl_rules", False)) or type(pg).__name__ == "ProcessGroupNCCL"


def data_device(data: dict[str, Any]) -> torch.device | None:
    """The device this rank's NCCL-style data backend is bound to (None: gloo only, no device to agree on)."""
    if "cuda" in data:
        return torch.device("cuda", torch.cuda.current_device())
    cpu = data.get("cpu")
    if cpu is not None and follows_nccl(cpu):
        return cpu.current_device()
    return None


def _host_id() -> int:
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:7], "big")


def check_devices(control: Any, rank: int, world_size: int, device: torch.device | None, label: str,
                  timeout: datetime.timedelta, *, unable: bool = False) -> list[tuple[str, int]]:
    """All-gather each rank's `(device type, index)` over `control`; `[(type, index)]` by rank (`("cpu", -1)`:
    gloo only; `("none", -1)`: the rank was asked for NCCL and has no CUDA, `unable`).

    Raises:
        ValueError: two ranks on one host are bound to one device (on every rank, naming both).
        CommError: the all-gather failed (a peer died).
    """
    kind = -2 if unable else -1 if device is None else _TYPES[device.type]
    mine = torch.tensor([_host_id(), kind,
                         -1 if device is None or device.index is None else device.index], dtype=torch.int64)
    outs = [torch.empty(3, dtype=torch.int64) for _ in range(world_size)]
    try:
        control.allgather([outs], [mine]).wait(timeout)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError on timeouts and closed connections
        raise CommError(f"rank {rank} of {label}: the device exchange failed: {e}") from e
    names = {v: k for k, v in _TYPES.items()}
    seen: dict[tuple[int, int, int], int] = {}
    for r, t in enumerate(outs):
        host, kind, index = (int(x) for x in t.tolist())
        if kind < 0:
            continue
        other = seen.setdefault((host, kind, index), r)
        if other != r:
            raise ValueError(f"rank {rank} of {label}: ranks {other} and {r} are both bound to {names[kind]}:{index} "
                             "on one host; NCCL refuses two ranks on one device: give each rank its own device "
                             "(torch.cuda.set_device(local_rank) before the rendezvous)")
    names[-1], names[-2] = "cpu", "none"
    return [(names[int(t[1])], int(t[2]) if int(t[1]) >= 0 else -1) for t in outs]


def connect_eagerly(pg: Any, device: torch.device) -> None:
    """Bind `pg` to `device` and create its communicator now (every rank of the group calls this together)."""
    if not EAGER:
        return
    if hasattr(pg, "bound_device_id") and device.type == "cuda":
        try:
            pg.bound_device_id = device
        except (AttributeError, TypeError):  # a torch without a settable binding: eager connect binds it too
            logger.debug("cannot set bound_device_id", exc_info=True)
    pg.eager_connect_single_device(device)


def set_watchdog() -> None:
    """Set `WATCHDOG_ENV` to `2` unless the user chose a value (see `WATCHDOG_ENV`)."""
    if WATCHDOG_ENV not in os.environ:
        os.environ[WATCHDOG_ENV] = "2"
        logger.info("%s unset: set to 2 (a timed-out NCCL operation aborts its communicator, not the process)",
                    WATCHDOG_ENV)
