"""One outcome per vLLM weight-transfer call, agreed by the engine's workers, raised so that vLLM's RPC layer stays
in step.

vLLM's multiprocess executor (`MultiprocExecutor.collective_rpc`) reads the workers' replies in worker order and
raises at the first failed one, leaving the later workers' replies queued: every later call then reads the
previous call's replies. So a failed call must fail on the *last* worker only. The backend's engine raises a failed
`init_weight_transfer_engine` / `update_weights` on every worker, with every worker's reason (`agree`:
fixed-size all-gathers over the engine's own tensor-parallel, then pipeline-parallel CPU groups, strings only:
nothing is unpickled), so vLLM ends the update session on every worker alike; `keep_in_step` wraps the worker's
weight-transfer calls so that only the last worker of the last stage then raises, for the engine's failures and for
vLLM's own precondition errors alike. (Under pipeline parallelism a failure raised by the last worker of every stage
left a stage's reply queued, and the next `generate` ended the engine.)
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 4096


def agree(error: BaseException | None) -> list[str | None]:
    """Every worker's outcome of this call (None: it succeeded), in worker order (`pp_rank * tp + tp_rank`, the
    order vLLM's executor reads the replies in), the same on every worker of the engine: all its pipeline stages
    and tensor-parallel ranks (one data-parallel rank's executor: each DP rank's engine reads its own replies)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    mine = None if error is None else describe(error)
    stage = gather_texts([mine], get_tp_group())
    return gather_texts(stage, get_pp_group())


def gather_texts(texts: list[str | None], group: Any) -> list[str | None]:
    """All-gather a list of texts (or None), the same length on every rank, over vLLM's `GroupCoordinator`
    `group`'s CPU group: the concatenation in group-rank order. Fixed-size buffers of bytes (each text cut to
    `MESSAGE_BYTES - 1`), so nothing is unpickled."""
    if group.world_size == 1:
        return list(texts)
    buf = torch.zeros(len(texts), MESSAGE_BYTES + 1, dtype=torch.uint8)
    for i, text in enumerate(texts):
        if text is None:
            continue
        raw = text.encode()[:MESSAGE_BYTES - 1]
        buf[i, 0] = 1
        if raw:
            buf[i, 1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(group.world_size)]
    torch.distributed.all_gather(out, buf, group=group.cpu_group)
    return [None if int(row[0]) == 0 else bytes(row[1:].tolist()).rstrip(b"\0").decode(errors="replace")
            for b in out for row in b]


def describe(error: BaseException) -> str:
    """`Type: message`; for an error without a message (a bare `assert`), where it was raised."""
    text = f"{type(error).__name__}: {error}"
    if str(error).strip():
        return text
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return text
    code = tb.tb_frame.f_code
    return f"{text}(raised at {code.co_filename}:{tb.tb_lineno} in {code.co_name})"


def is_last_worker() -> bool:
    """Whether this worker's reply is the last one vLLM's executor reads (the last tensor-parallel rank of the last
    pipeline stage)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return tp.rank_in_group == tp.world_size - 1 and pp.rank_in_group == pp.world_size - 1


def combined(outcomes: list[str | None], what: str) -> str:
    """One message naming every worker that failed and why."""
    failed = [(w, m) for w, m in enumerate(outcomes) if m is not None]
    return f"reshard vLLM backend: {what} failed on {len(failed)} of {len(outcomes)} worker(s):\n" + "\n".join(
        f"  worker {w}: {m}" for w, m in failed)


WORKER_CALLS = ("init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update", "update_weights",
                "finish_weight_update", "shutdown_weight_transfer_engine")


def keep_in_step(engine: Any) -> bool:
    """Make the vLLM worker creating `engine` (called from the engine's `__init__`) raise a failed weight-transfer
    call on its last worker only, whoever raised it: the engine (which raises on every worker, with every worker's
    reason) or vLLM's own checks (`finish_weight_update` without `start_weight_update`, `start_weight_update`
    twice, ...), which fail on every worker at once. Each of the worker's `WORKER_CALLS` is wrapped on the worker
    object (not its class): it runs vLLM's method, agrees the outcome with the other workers (`agree`), and the last
    worker raises, the others log and return. vLLM's refusal of a `finish_weight_update()` or `update_weights`
    after a failed `update_weights` (which ended the update session, as vLLM does) carries the failure's reason and
    names `start_weight_update()` as the next call; it is raised, not swallowed, so that the caller's
    `finish_weight_update(weight_version=...)` never labels the failed version as served. Returns False (with a
    warning) when no vLLM worker is found."""
    frame = sys._getframe(1)
    worker = None
    for _ in range(12):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if hasattr(candidate, "_weight_update_active") and callable(getattr(candidate, "update_weights", None)):
            worker = candidate
            break
        frame = frame.f_back
    if worker is None:
        logger.warning("reshard: the vLLM worker creating the weight-transfer engine was not found; with tensor "
                       "parallelism > 1 a failed call may put vLLM's RPC replies out of step")
        return False
    for name in WORKER_CALLS:
        original = getattr(worker, name, None)
        if original is not None and not hasattr(original, "__reshard_in_step__"):
            setattr(worker, name, _in_step(worker, name, original))
    return True


def _in_step(worker: Any, name: str, original: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        engine = getattr(worker, "weight_transfer_engine", None)
        active = bool(getattr(worker, "_weight_update_active", False))
        error: BaseException | None = None
        result = None
        try:
            result = original(*args, **kwargs)
        except BaseException as e:  # agreed below; raised by the last worker
            error = e
        outcomes = agree(error)
        if all(o is None for o in outcomes):
            return result
        if not is_last_worker():
            logger.error("reshard: %s failed (raised by the last worker): %s", name, outcomes)
            return None
        if error is not None and all(o == outcomes[-1] for o in outcomes):
            if name in ("update_weights", "finish_weight_update") and not active:
                failed = getattr(engine, "last_error", None)
                why = (f"the update session ended when update_weights failed ({failed})" if failed else
                       "no update session is open")
                raise RuntimeError(f"{error} (reshard: {why}; nothing was done and no version is set; next: "
                                   "start_weight_update())") from error
            raise error
        raise RuntimeError(combined(outcomes, name)) from error

    call.__reshard_in_step__ = True  # type: ignore[attr-defined]
    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


def gather_names(names: list[str], group: Any) -> list[list[str]]:
    """All-gather each rank's list of names over vLLM's `GroupCoordinator` `group` (its CPU group), in group-rank
    order: lengths first, then the newline-joined UTF-8 bytes padded to the longest (nothing is unpickled)."""
    if group.world_size == 1:
        return [list(names)]
    raw = "\n".join(names).encode()
    size = torch.tensor([len(raw)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(group.world_size)]
    torch.distributed.all_gather(sizes, size, group=group.cpu_group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if raw:
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(group.world_size)]
    torch.distributed.all_gather(out, buf, group=group.cpu_group)
    texts = [bytes(b[:int(s)].tolist()).decode() for b, s in zip(out, sizes)]
    return [t.split("\n") if t else [] for t in texts]
