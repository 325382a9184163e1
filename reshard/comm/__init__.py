"""Process groups, the transfer primitive and the pipelined executor: where data moves.

Exports:
    Group: a process group whose ranks plans use; `Group.world()` or `Group.rendezvous(host, port, rank, size)`.
    transfer, TransferHandle: post the sends and receives of one step together; `wait()` on the handle.
    execute, ExecutionReport, Staging: run one rank's part of a (multi-tensor) plan, chunk by chunk.
    reshard: execute a one-tensor plan on local tensors.
    reshard_dtensor, exchange_layouts: reshard DTensors on their own meshes; a side may be None on ranks not on it.
    CommError, ChecksumError: a peer failed or timed out; a received box failed verification.
    DEFAULT_TIMEOUT, NUM_SLOTS: the default wait timeout and the pipeline depth.
    DeltaSession, DeltaReport, DeltaLinkStats: delta runs (`execute(..., delta=session)`): after the first run only
        the changed elements of each box move; the session keeps snapshots and versions, the report what was sent.
    SNAPSHOTS: where a `DeltaSession` may keep its snapshots (`"device"`, `"host"`), the default first.
    ZERO_COPY_ENV: `RESHARD_ZERO_COPY=0` sends every message through staging (`execute(zero_copy=None)`).

For integrations that run their own protocol on a group (e.g. `reshard.integrations.verl`):
    all_gather_json: every rank gets every rank's JSON-able value (one collective round over the control backend).
    agree: every rank of a set agrees that all hold the same plan fingerprint and none has an error, else the same
        error is raised on all (what differs is named).
    broadcast_bytes: one rank's bytes on every rank (one broadcast over the control backend, a tree, not a star).
    as_timedelta: a timeout in seconds or a `timedelta`, checked, as a `timedelta`.
    serve_store: a TCP store bound to one address, on which `Group.rendezvous(..., is_master=False)` calls meet.
    is_loopback: whether an address is a loopback one (where `Group.rendezvous` accepts no token).
    TOKEN_ENV: `RESHARD_TOKEN`, the environment variable `Group.rendezvous` reads when given no `token=`.
"""

from reshard.comm._api import exchange_layouts, reshard, reshard_dtensor
from reshard.comm._delta_session import SNAPSHOTS, DeltaLinkStats, DeltaReport, DeltaSession
from reshard.comm._executor import ZERO_COPY_ENV, ChecksumError, execute
from reshard.comm._group import DEFAULT_TIMEOUT, CommError, Group, as_timedelta
from reshard.comm._handshake import agree, all_gather_json, broadcast_bytes
from reshard.comm._prepare import NUM_SLOTS, ExecutionReport, Staging
from reshard.comm._rendezvous import TOKEN_ENV, is_loopback, serve_store
from reshard.comm._transfer import TransferHandle, transfer

__all__ = [
    "DEFAULT_TIMEOUT",
    "NUM_SLOTS",
    "SNAPSHOTS",
    "TOKEN_ENV",
    "ZERO_COPY_ENV",
    "ChecksumError",
    "CommError",
    "DeltaLinkStats",
    "DeltaReport",
    "DeltaSession",
    "ExecutionReport",
    "Group",
    "Staging",
    "TransferHandle",
    "agree",
    "all_gather_json",
    "as_timedelta",
    "broadcast_bytes",
    "exchange_layouts",
    "execute",
    "is_loopback",
    "reshard",
    "reshard_dtensor",
    "serve_store",
    "transfer",
]
