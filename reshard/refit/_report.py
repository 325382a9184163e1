"""`RefitReport`: what one `Refit.run()` did (phase times, bytes per link kind, per-weight methods, delta figures)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RefitReport:
    """What one `run()` did.

    Attributes:
        seconds: per phase: `metadata` (exchange and checks), `plan`, `transfer` (0 for phases a cached run skips).
        network_bytes, nvlink_bytes, local_bytes: bytes the whole-model plan moves per link kind; with rank-local
            planning (`Refit(planning=...)`), what this rank receives (sum them over ranks for the whole model).
        gather_broadcast_bytes: bytes of the weights that went by gather-and-broadcast.
        num_tensors: destination global tensors written.
        messages: messages of the reshard plan (all ranks; with rank-local planning, those this rank receives).
        first_run: whether metadata was exchanged and the plan built in this run.
        choices: trainer name -> its method: `"reshard"`, `"gather_broadcast"` or an FP8 note. Under
            `policy="auto"` each is a `reshard.refit.Choice` (a `str`) carrying the modelled seconds and
            bytes of both methods (`.reshard_s`, `.gather_broadcast_s`, `.reshard_bytes`,
            `.gather_broadcast_bytes`).
        changed_fraction, encoded_bytes, dense_bytes: with `Refit(delta=True)`, per link kind (`"nvlink"`,
            `"network"`), what *this rank* sent in this run (sum them over ranks for the whole model): the fraction
            of elements sent as changed (DENSE boxes count whole), the payload bytes sent, and the bytes a full run
            sends. Empty without delta. Local copies are always full and not counted.
        snapshot_bytes: with delta, the size of this rank's snapshots of what it last sent.
        execution: this rank's `reshard.comm.ExecutionReport` of the plan (a `DeltaReport` with delta: wire bytes,
            state and size message bytes, raw messages, stale boxes); None when the plan moved nothing.
    """

    seconds: dict[str, float]
    network_bytes: int
    nvlink_bytes: int
    local_bytes: int
    gather_broadcast_bytes: int
    num_tensors: int
    messages: int
    first_run: bool
    choices: dict[str, str] = field(default_factory=dict)
    changed_fraction: dict[str, float] = field(default_factory=dict)
    encoded_bytes: dict[str, int] = field(default_factory=dict)
    dense_bytes: dict[str, int] = field(default_factory=dict)
    snapshot_bytes: int = 0
    execution: Any = None
