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
    ZERO_COPY_ENV: `RESHARD_ZERO_COPY=0` sends every message through staging (`execute(zero_copy=None)`).
"""

from reshard.comm._api import exchange_layouts, reshard, reshard_dtensor
from reshard.comm._delta import DeltaLinkStats, DeltaReport, DeltaSession
from reshard.comm._executor import ZERO_COPY_ENV, ChecksumError, execute
from reshard.comm._group import DEFAULT_TIMEOUT, CommError, Group
from reshard.comm._prepare import NUM_SLOTS, ExecutionReport, Staging
from reshard.comm._transfer import TransferHandle, transfer

__all__ = [
    "DEFAULT_TIMEOUT",
    "NUM_SLOTS",
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
    "exchange_layouts",
    "execute",
    "reshard",
    "reshard_dtensor",
    "transfer",
]
