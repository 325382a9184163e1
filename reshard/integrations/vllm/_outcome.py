"""One outcome per vLLM engine call, agreed by the engine's workers, raised so that vLLM's RPC layer stays in step.

vLLM's multiprocess executor (`MultiprocExecutor.collective_rpc`) reads the workers' replies in worker order and
raises at the first failed one, leaving the later workers' replies queued: every later call then reads the
previous call's replies. So a failed `init_weight_transfer_engine` or `update_weights` must fail on the *last*
worker only. Every worker first learns every worker's outcome (a fixed-size all-gather over the engine's own
tensor-parallel CPU group, strings only: nothing is unpickled), so a failure on one worker (a re-processing error)
fails the call as surely as one on all (a refit error, which `Refit` raises on every rank); then the last worker
raises the combined reason and the others end the call as vLLM would have had they raised (`end_update`), and
return.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 4096


def agree(error: BaseException | None) -> list[str | None]:
    """Every worker's outcome of this call (None: it succeeded), in worker order, the same on every worker."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if tp.world_size == 1:
        return [mine]
    raw = b"" if mine is None else mine.encode()[:MESSAGE_BYTES - 1]
    buf = torch.zeros(MESSAGE_BYTES + 1, dtype=torch.uint8)
    buf[0] = 0 if mine is None else 1
    if raw:
        buf[1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(tp.world_size)]
    torch.distributed.all_gather(out, buf, group=tp.cpu_group)
    return [None if int(b[0]) == 0 else bytes(b[1:].tolist()).rstrip(b"\0").decode(errors="replace") for b in out]


def is_last_worker() -> bool:
    """Whether this worker's reply is the last one vLLM's executor reads (the last tensor-parallel rank)."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return tp.rank_in_group == tp.world_size - 1


def combined(outcomes: list[str | None], what: str) -> str:
    """One message naming every worker that failed and why."""
    failed = [(w, m) for w, m in enumerate(outcomes) if m is not None]
    return f"reshard vLLM backend: {what} failed on {len(failed)} of {len(outcomes)} worker(s):\n" + "\n".join(
        f"  worker {w}: {m}" for w, m in failed)


def end_update(engine: Any) -> None:
    """End the current weight-update session of the vLLM worker that called `engine` (what vLLM's
    `Worker.update_weights` does when the engine raises), for a worker that returns instead of raising."""
    frame = sys._getframe(1).f_back
    for _ in range(8):
        if frame is None:
            break
        worker = frame.f_locals.get("self")
        if getattr(worker, "weight_transfer_engine", None) is engine and hasattr(worker, "_weight_update_active"):
            worker._weight_update_active = False
            break
        frame = frame.f_back
    else:
        frame = None
    if frame is None:
        logger.warning("reshard: the calling vLLM worker was not found; its weight-update session stays open")
    engine.reset_weight_update_target()
