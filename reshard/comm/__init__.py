"""Process groups, the transfer primitive and the pipelined executor: where data moves.

Exports:
    Group: a process group whose ranks plans use; `Group.world()` or `Group.rendezvous(host, port, rank, size)`.
    transfer, TransferHandle: post the sends and receives of one step together; `wait()` on the handle.
    execute, ExecutionReport: run one rank's part of a (multi-tensor) plan, chunk by chunk.
    reshard: execute a one-tensor plan on local tensors.
    reshard_dtensor, exchange_layouts: reshard DTensors on their own meshes; a side may be None on ranks not on it.
    CommError, ChecksumError: a peer failed or timed out; a received box failed verification.
    DEFAULT_TIMEOUT: the default wait timeout.
    DeltaSession, DeltaReport, DeltaLinkStats: delta runs (`execute(..., delta=session)`): after the first run only
        the changed elements of each box move; the session keeps snapshots and versions, the report what was sent.
    SNAPSHOTS: where a `DeltaSession` may keep its snapshots (`"device"`, `"host"`), the default first.
    CHECKS, fingerprint: how a delta receiver checks its boxes (`DeltaSession(check=...)`: `"checksum"`, `"sum"`,
        `"none"`), and the fingerprint of a box's bytes for one of them.

For integrations that run their own protocol on a group (e.g. `reshard.integrations.verl`):
    all_gather_json: every rank gets every rank's JSON-able value (one collective round over the control backend).
    agree: every rank of a set agrees that all hold the same plan fingerprint and none has an error, else the same
        error is raised on all (what differs is named).
    serve_store: a TCP store bound to one address, on which `Group.rendezvous(..., is_master=False)` calls meet.
    is_loopback: whether an address is a loopback one (where `Group.rendezvous` accepts no token).
    TOKEN_ENV: `RESHARD_TOKEN`, the environment variable `Group.rendezvous` reads when given no `token=`.

What only sibling packages use is in `reshard.comm._contract`.
"""

from reshard.comm._api import exchange_layouts, reshard, reshard_dtensor
from reshard.comm._delta_session import SNAPSHOTS, DeltaLinkStats, DeltaReport, DeltaSession
from reshard.comm._executor import ChecksumError, execute
from reshard.comm._fingerprint import CHECKS, fingerprint
from reshard.comm._group import DEFAULT_TIMEOUT, CommError, Group
from reshard.comm._handshake import agree, all_gather_json
from reshard.comm._prepare import ExecutionReport
from reshard.comm._rendezvous import TOKEN_ENV, is_loopback, serve_store
from reshard.comm._transfer import TransferHandle, transfer

__all__ = [
    "CHECKS",
    "DEFAULT_TIMEOUT",
    "SNAPSHOTS",
    "TOKEN_ENV",
    "ChecksumError",
    "CommError",
    "DeltaLinkStats",
    "DeltaReport",
    "DeltaSession",
    "ExecutionReport",
    "Group",
    "TransferHandle",
    "agree",
    "all_gather_json",
    "exchange_layouts",
    "execute",
    "fingerprint",
    "is_loopback",
    "reshard",
    "reshard_dtensor",
    "serve_store",
    "transfer",
]
